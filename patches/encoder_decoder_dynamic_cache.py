"""An encoder-decoder model generates with ``cache_implementation="dynamic"`` (4.55 - 4.56).

What breaks: ``model.generate(..., cache_implementation="dynamic")`` (4.56: ``"dynamic_full"``
too) on T5, BART, MBart, Whisper and the other encoder-decoder models fails at the first decoding
step, greedy or beam search, at any depth::

    UnboundLocalError: cannot access local variable 'is_updated' where it is not associated with a value

raised in the model's cross-attention (e.g. ``T5Attention.forward``). ``generate()`` without
``cache_implementation`` works.

The cause: ``_prepare_cache_for_generation`` builds an ``EncoderDecoderCache`` (a self-attention
and a cross-attention cache) only on its default path. For an explicit ``"dynamic"`` (and
``"dynamic_full"``, ``"offloaded"``) it builds a bare ``DynamicCache`` (4.55: ``OffloadedCache``
for ``"offloaded"``) whatever the model, and the models' attention reads ``is_updated`` only when
it was handed an ``EncoderDecoderCache``. (``"offloaded"`` needs a GPU: not run here.)

Upstream (4.57): at the end of the function, a cache it built for a model that needs a
cross-attention cache (``config.is_encoder_decoder`` or ``encoder_outputs`` given) and that is
not an ``EncoderDecoderCache`` becomes the self-attention half of one, with a new
``DynamicCache`` as the cross-attention half.

What the replacement does: it wraps ``_prepare_cache_for_generation`` (on 4.56 also the target
of ``quantized-cache-config-copy``: the engine layers the two) and does the same after the
original returns, only for a cache the original built (none was in ``model_kwargs`` before: a
cache the caller passed is left as it is, as upstream's early return leaves it). The
cross-attention half is a ``DynamicCache()`` without a config: it grows layer by layer to the
decoder's depth and never slides (a cross-attention cache holds the whole encoder output). Cost:
one ``dict`` lookup and one ``isinstance`` per generate() call, before decoding; it records in
``overlay.report`` the calls where it built the pair.

Not covered: a bare ``DynamicCache`` the caller passes as ``past_key_values`` to an
encoder-decoder model fails the same way on every release, 4.57 included (upstream leaves it to
the caller too). Static caches (``_get_cache`` builds the pair) and the quantized cache (refused
for encoder-decoder models) never took this path.

Tested (``tests/patches/encoder_decoder_dynamic_cache/``): tiny T5 and BART, greedy and beam
search: stock raises the UnboundLocalError on 4.55.x and 4.56.x; with the overlay the ids equal
the default cache's and ``use_cache=False``'s; 4.57.1 on reports fixed upstream and generates.
Longer account: docs/patches/encoder-decoder-dynamic-cache.md.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "encoder-decoder-dynamic-cache"
MODULE = "transformers.generation.utils"
ACTION = "paired the dynamic cache with a cross-attention cache"
CACHE_NAME = "past_key_values"  # the name the function uses for every model with cross-attention


def _replace_prepare_cache(original, variant):
    @wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        given = model_kwargs.get(CACHE_NAME)
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        built = model_kwargs.get(CACHE_NAME)
        if given is not None or built is None:
            return result
        if not (self.config.is_encoder_decoder or model_kwargs.get("encoder_outputs") is not None):
            return result
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        if not isinstance(built, EncoderDecoderCache):
            # What 4.57 does after building any cache; a config-less cross-attention half grows to
            # the decoder's depth (the 4.56 config one takes the encoder's: another patch's bug).
            model_kwargs[CACHE_NAME] = EncoderDecoderCache(built, DynamicCache())
            report.record(PATCH_ID, ACTION)
        return result

    return _prepare_cache_for_generation


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="generate(cache_implementation=\"dynamic\") works for encoder-decoder models (T5, BART, Whisper)",
    errors=(
        "UnboundLocalError: cannot access local variable 'is_updated' where it is not associated with a value",
    ),
    why=(
        "_prepare_cache_for_generation builds a bare DynamicCache for an explicit cache_implementation=\"dynamic\" "
        "even for an encoder-decoder model, whose cross-attention reads is_updated only from an EncoderDecoderCache."
    ),
    upstream=(
        "fixed in {fixed_in}: _prepare_cache_for_generation wraps any cache it built for a model with "
        "cross-attention in an EncoderDecoderCache (no pull request found)"
    ),
    targets=(
        Target(
            module=MODULE,
            qualname="GenerationMixin._prepare_cache_for_generation",
            replace=_replace_prepare_cache,
        ),
    ),
)
