"""4.56.x: an encoder-decoder model whose decoder is deeper than its encoder generates.

What breaks (4.56.0 - 4.56.2): a T5 or BART with more decoder than encoder layers
(``T5Config(num_layers=2, num_decoder_layers=3)``, ``BartConfig(encoder_layers=2,
decoder_layers=3)``) fails in plain ``model.generate()``, in beam search and with
``cache_implementation="static"``::

    IndexError: list index out of range

raised in ``Cache.update`` at ``self.layers[layer_idx]``: the cache was built with the encoder's
number of layers. With fewer decoder than encoder layers it generates (the extra layers are never
filled, a static layer allocates nothing until then).

The cause: 4.56 builds every cache from the config up front, and the depth is decided in three
places, none of which asks for the decoder's. ``DynamicCache.__init__`` (both halves of the
default ``EncoderDecoderCache``) reads ``config.get_text_config().num_hidden_layers``: the whole
flat config, whose ``num_hidden_layers`` is the encoder's (T5's ``num_layers``, BART's
``encoder_layers``). ``StaticCache.__init__`` reads the same, and ``_get_cache`` hands it the
decoder copy of the config for self-attention (right for BART, the encoder's depth for T5, whose
``num_decoder_layers`` that copy does not map) and the *encoder* copy for cross-attention (the
encoder's depth for both; BART's ``decoder_layers`` is deleted from that copy). 4.55 grew its
caches layer by layer; 4.57 sizes both halves from ``get_text_config(decoder=True)`` (for T5 that
needs ``decoder-text-config-layers``).

What the replacement does: it wraps both constructors. When the config is an encoder-decoder one
and the cache it built has uniform plain layers (all ``DynamicLayer``, or all ``StaticLayer`` of
one ``max_cache_len``), it gives the cache stock's own lazy growth (``layer_class_to_replicate``):
``Cache.update`` appends a layer like the others when the decoder asks for one past the end, as
4.55 did. The layers the config asked for stay as they are; nothing else changes, and where stock
generates, the growth is never reached. It costs nothing per step (stock's own check on a lazily
built cache), and one type check per layer when a cache is built.

Limits: caches with sliding, chunked or quantized layers, decoder-only configs and caches built
without a config are left as they are (none of them takes the encoder's depth). A bare
``DynamicCache`` passed to an encoder-decoder model (``cache_implementation="dynamic"``) fails on
4.56 for another reason, with any depths. ``StaticCache.__init__`` is also
``static-cache-zero-kv-shared-layers``' target on 4.56: the engine layers the two.

Tested (``tests/patches/encoder_decoder_cache_depth/``): tiny T5 and BART with deeper, equal and
shallower decoders, default and static caches, greedy and beam search: stock raises the
IndexError on 4.56, the overlay gives the ids of the same weights without a cache. The long
account: ``docs/patches/decoder-text-config-layers.md``.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "encoder-decoder-cache-depth"
MODULE = "transformers.cache_utils"
ACTION = "grew an encoder-decoder cache to the decoder's depth"


class _OneMoreLayer:
    """A cache's ``layer_class_to_replicate``: builds one more layer like the cache's own (a plain
    class and its arguments, so the cache still pickles and deep-copies) and records the growth."""

    __slots__ = ("kind", "arguments")

    def __init__(self, kind, arguments):
        self.kind, self.arguments = kind, arguments

    def __call__(self):
        report.record_outside_compile(PATCH_ID, ACTION)
        return self.kind(**self.arguments)

    def __repr__(self):
        return f"{type(self).__name__}({self.kind.__name__}, {self.arguments})"


def _layer_factory(layers):
    """One more layer like ``layers``, where they are all of one plain kind; else ``None``."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    if not layers:
        return None
    kind = type(layers[0])
    if kind is DynamicLayer and all(type(layer) is DynamicLayer for layer in layers):
        return _OneMoreLayer(kind, {})
    if kind is StaticLayer and all(
        type(layer) is StaticLayer and layer.max_cache_len == layers[0].max_cache_len for layer in layers
    ):
        return _OneMoreLayer(kind, {"max_cache_len": layers[0].max_cache_len})
    return None


def make_init(original, variant):
    import inspect

    signature = inspect.signature(original)

    @wraps(original)
    def cache_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # Built from the config's depth, with nothing to grow it (stock grows only caches built
        # without layers); decoder-only configs name their depth: left as they are.
        if getattr(self, "layer_class_to_replicate", True) is not None:
            return
        config = signature.bind_partial(self, *args, **kwargs).arguments.get("config")
        if not getattr(config, "is_encoder_decoder", False):
            return
        factory = _layer_factory(self.layers)
        if factory is not None:
            self.layer_class_to_replicate = factory

    return cache_init


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="Encoder-decoder caches grow to the decoder's depth (T5, BART with a deeper decoder)",
    errors=("IndexError: list index out of range",),
    why=(
        "4.56 sizes DynamicCache and StaticCache from config.get_text_config().num_hidden_layers, the "
        "encoder's depth in a flat encoder-decoder config, and the cross-attention StaticCache from the "
        "encoder's config."
    ),
    upstream=(
        "{fixed_in} sizes the caches from get_text_config(decoder=True) (T5's num_decoder_layers: "
        "decoder-text-config-layers)"
    ),
    targets=(
        Target(module=MODULE, qualname="DynamicCache.__init__", replace=make_init),
        Target(module=MODULE, qualname="StaticCache.__init__", replace=make_init),
    ),
)
