"""generate() leaves the caller's ``cache_config`` dict as it was (quantized cache).

What breaks: ``model.generate(..., cache_implementation="quantized", cache_config=cfg)`` changes
the caller's own dict ``cfg``: ``_prepare_cache_for_generation`` pops ``"backend"`` out of it and
adds ``"config"`` (the model's text config), because generate() keeps the dict it was given as
``generation_config.cache_config`` (its deep copy of the generation config gets ``cache_config``
from the keyword arguments as it is). So the next ``generate()`` with the same ``cfg`` silently
builds its cache with the default backend (``"quanto"``) instead of the one asked for
(``"hqq"``), or fails where optimum-quanto is not installed (``ImportError: You need to install
optimum-quanto ...``); and ``cfg`` used with another model builds that model's cache from the
first model's config (a model with more layers: ``IndexError: list index out of range``, seen on
4.57.6 and 5.18.0). A first call that fails (backend not installed) has already changed the dict too.

Upstream (5.19.0): ``_prepare_cache_for_generation`` works on ``copy.deepcopy`` of the dict.

What the replacement does: it wraps ``_prepare_cache_for_generation``. For a quantized cache with
a dict ``cache_config`` it lends the call a deep copy of the dict as
``generation_config.cache_config`` and puts the caller's dict back when the call returns (or
raises), so the original pops from the copy, exactly what 5.19.0 does; every other cache is the
original's call alone. Cost: one deep copy of a small dict (with the model config in it, where
the caller put one) per generate() call with a quantized cache, before decoding. It records in
``overlay.report`` the calls where the original would have changed the dict.

Not covered: 4.55.x reads the backend without popping it (not affected). A ``GenerationConfig``
object passed as ``generation_config=`` is deep-copied by generate() on every release (its dict
was never changed).

Tested (``tests/patches/quantized_cache_config_copy/``): tiny Llama, a ``cache_config`` dict
reused for a second generate() call and with a second model (other layer count): stock changes
the dict, the overlay leaves it equal to what the caller wrote; with optimum-quanto installed the
second calls give the ids of a fresh dict (the control); without it, the dict is checked after the
backend's ImportError. Longer account: docs/patches/quantized-cache-config-copy.md.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "quantized-cache-config-copy"
MODULE = "transformers.generation.utils"


def _replace_prepare_cache(original, variant):
    @wraps(original)
    def _prepare_cache_for_generation(self, generation_config, *args, **kwargs):
        given = generation_config.cache_config
        if generation_config.cache_implementation != "quantized" or not isinstance(given, dict):
            return original(self, generation_config, *args, **kwargs)
        import copy

        # The original pops "backend" from (and adds "config" to) the dict it finds here: give it
        # a copy, as 5.19.0+ does, and the caller's dict back afterwards.
        generation_config.cache_config = copy.deepcopy(given)
        try:
            return original(self, generation_config, *args, **kwargs)
        finally:
            generation_config.cache_config = given
            if "backend" in given or "config" not in given:
                report.record(PATCH_ID, "kept the caller's cache_config unchanged")

    return _prepare_cache_for_generation


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="both",
    title="generate() with a quantized cache leaves the caller's cache_config dict unchanged",
    errors=(
        "(no error) a cache_config dict reused for another generate(cache_implementation=\"quantized\") call "
        "silently uses the default backend (quanto): the first call popped \"backend\" from it",
        "ImportError: You need to install optimum-quanto in order to use KV cache quantization with "
        "optimum-quanto backend.",
        "IndexError: list index out of range",
    ),
    why=(
        "_prepare_cache_for_generation pops \"backend\" from generation_config.cache_config and adds "
        "\"config\", and that dict is the very one the caller passed to generate()."
    ),
    upstream="fixed in {fixed_in}: _prepare_cache_for_generation deep-copies cache_config (no pull request found)",
    targets=(
        Target(
            module=MODULE,
            qualname="GenerationMixin._prepare_cache_for_generation",
            replace=_replace_prepare_cache,
        ),
    ),
)
