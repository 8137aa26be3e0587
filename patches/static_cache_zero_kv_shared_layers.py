"""A ``StaticCache`` for a config with ``num_kv_shared_layers = 0`` (Gemma 4's default; Gemma 3n set
to 0) gets a layer for every layer, instead of none.

What breaks (4.56.0 - 5.9.0): Gemma 4 (5.5.0 on; ``Gemma4ForCausalLM``, ``Gemma4ForConditionalGeneration``,
text config default 0) and Gemma 3n (``Gemma3nForCausalLM`` and the multimodal model, whose
``Gemma3nTextConfig`` defaults to 15) with ``num_kv_shared_layers=0``, with ``generate(...,
cache_implementation="static")`` or a ``StaticCache(config=model.config, max_cache_len=...)`` the
user builds, fail at the first attention layer's write (``Cache.update``)::

    keys, values = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
    IndexError: list index out of range

The cause: from 4.56.0 ``StaticCache.__init__`` drops the last ``num_kv_shared_layers`` layer types
(layers that read another layer's keys and values need no cache) whenever the text config *has*
the attribute: ``layer_types[: -config.num_kv_shared_layers]``; for 0 that is ``layer_types[:0]``,
and the cache has no layers. 4.55.x reads no such attribute in ``cache_utils`` (no bug). Upstream
(#46235, 5.10.1; there is no 5.10.0) slices only when the value is above 0.

What the replacement does (one target, ``StaticCache.__init__``, wrapping the original): it reads
the text config as the original does (``get_text_config(decoder=True)``; on 4.56.x, the variant
says, ``get_text_config()``). Unless its ``num_kv_shared_layers`` is an integer 0 (``False``
counts, as in the slice) it calls the original with the very arguments it was given, so the
release's behaviour stays as it is (a positive value keeps dropping the shared layers). For 0 it
passes the text config through a read-only view that hides that one attribute: the original's
``hasattr`` is then false, it skips the slice, and the rest of the release's own code runs (layer
types, sliding, chunked and linear-attention layers, offloading): the fixed release's behaviour
without copying the function, for each of its five shapes (4.56.x; 4.57.x; 5.0.0 - 5.4.0; 5.5.0 -
5.7.0, linear-attention layers; 5.8.0 - 5.9.0, a registry of sliding types). The original keeps no
reference to the config (the fingerprints pin code that only reads it).

Cost: one ``get_text_config`` call and one attribute read per ``StaticCache`` built, one count in
``overlay.report`` when the view is used; nothing per generated token.

Not covered: ``DynamicCache(config=...)`` has the same slice (4.56.0 - 5.13.1), but an empty layer
list makes it append full-attention dynamic layers as they are written: no error, the same tokens
(the tests' reference), only sliding layers keep their whole history (memory, not output). A
negative ``num_kv_shared_layers`` keeps the release's behaviour.

Tested (``tests/patches/static_cache_zero_kv_shared_layers/``): tiny random Gemma 4 (5.5.0 on)
and ``Gemma3nForCausalLM`` with 0: stock raises the ``IndexError``, the overlay gives the dynamic cache's ids,
one cache layer per layer type; Gemma 3n with 2 and Llama give stock's ids and layers. On a user's
machine: ``python -m overlay.doctor --scenario zero-kv-shared-static-cache``.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "static-cache-zero-kv-shared-layers"
MODULE = "transformers.cache_utils"
SHARED = "num_kv_shared_layers"
ACTION = "built every layer of a static cache whose config sets num_kv_shared_layers=0"


class _WithoutSharedLayerCount:
    """A text config as ``StaticCache.__init__`` reads it, without ``num_kv_shared_layers``: every
    other attribute is the config's own (read through, never copied); ``get_text_config`` is the
    view itself (the original calls it first, on what it was given)."""

    __slots__ = ("_config",)

    def __init__(self, config):
        object.__setattr__(self, "_config", config)

    def get_text_config(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        if name == SHARED:
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_config"), name)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only")


def _shares_no_layer(text_config) -> bool:
    """The original's slice ``layer_types[:-n]`` is empty because ``n`` is 0 (an int or a bool)."""
    shared = getattr(text_config, SHARED, None)
    return isinstance(shared, int) and shared == 0


def make_init(original, variant):
    # The text config the original reads: `config.get_text_config(decoder=True)` from 4.57.0,
    # `config.get_text_config()` on 4.56.x (which also looks for a `text_encoder` sub-config).
    text_config_kwargs = {"decoder": True} if variant["decoder_text_config"] else {}

    @wraps(original)
    def static_cache_init(self, *args, **kwargs):
        in_kwargs = "config" in kwargs
        config = kwargs["config"] if in_kwargs else (args[0] if args else None)
        get_text_config = getattr(config, "get_text_config", None)
        if get_text_config is None:  # not a config: the original says what is wrong
            return original(self, *args, **kwargs)
        try:
            text_config = get_text_config(**text_config_kwargs)
        except Exception:  # (the original raises it again, from its own line)
            return original(self, *args, **kwargs)
        if not _shares_no_layer(text_config):
            return original(self, *args, **kwargs)
        view = _WithoutSharedLayerCount(text_config)
        if in_kwargs:
            kwargs = {**kwargs, "config": view}
        else:
            args = (view, *args[1:])
        result = original(self, *args, **kwargs)
        report.record_outside_compile(PATCH_ID, ACTION)
        return result

    return static_cache_init


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="StaticCache builds its layers for num_kv_shared_layers=0 (Gemma 4, Gemma 3n set to 0) instead of none",
    errors=("IndexError: list index out of range",),
    why=(
        "From 4.56.0 to 5.9.0 StaticCache.__init__ slices layer_types[:-config.num_kv_shared_layers] whenever "
        "the config has that attribute, and layer_types[:-0] is empty: a static cache for Gemma 4, or for "
        "Gemma 3n with num_kv_shared_layers=0, has no layers."
    ),
    upstream="huggingface/transformers#46235 (slice only when num_kv_shared_layers > 0), in {fixed_in}",
    targets=(
        Target(
            module=MODULE,
            qualname="StaticCache.__init__",
            defaults={"decoder_text_config": True},
            variants={
                # `config.get_text_config()` (no decoder=True); SlidingWindowLayer, ChunkedSlidingLayer.
                "text_config": {"decoder_text_config": False},
                # `get_text_config(decoder=True)`; the slice is the same in every later shape
                # (annotations, linear-attention layers, a registry of sliding layer types).
                "decoder_text_config": {},
            },
            replace=make_init,
        ),
    ),
    doctor=("zero-kv-shared-static-cache",),
)
