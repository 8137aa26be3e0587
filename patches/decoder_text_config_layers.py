"""T5-family configs give the caches the decoder's layer count, so a deeper decoder generates.

What breaks (4.57 and later; no release fixes it): a T5-style model whose decoder has more
layers than its encoder (``T5Config(num_layers=2, num_decoder_layers=3)``; MT5, UMT5, LongT5,
Switch Transformers and Pop2Piano configs name it the same way) fails in plain
``model.generate()``, with ``cache_implementation="static"`` and (except on 5.0.0rc0 - 5.0.x,
where the model grows its default cache layer by layer) with the default cache::

    IndexError: list index out of range

raised in ``Cache.update`` at ``self.layers[layer_idx]``: the cache has fewer layers than the
decoder. With fewer decoder than encoder layers it generates, with a cache larger than needed.
4.55.x grew its caches layer by layer and generated.

The cause: the caches are sized from ``config.get_text_config(decoder=True).num_hidden_layers``.
For a flat encoder-decoder config that call returns a copy in which every ``decoder_*`` entry
replaces its encoder counterpart (BART's ``decoder_layers`` becomes ``num_hidden_layers``), but
T5's decoder depth is ``num_decoder_layers``, which does not start with ``decoder``, while
``num_hidden_layers`` maps to ``num_layers``, the *encoder's* depth. So the decoder's config says
it has the encoder's layers.

What the replacement does: it wraps ``get_text_config``; when the original returns the flat
config's decoder copy (``decoder=True``, not ``self`` and not one of ``self``'s sub-configs) and
that copy has a ``num_decoder_layers`` other than its ``num_hidden_layers``, it sets the copy's
``num_hidden_layers`` to ``num_decoder_layers``, as the original does for ``decoder_layers``.
The config itself and any shared sub-config are never changed; a config for which the original
returns ``self`` (decoder-only models: nearly every call) costs one identity comparison.

Limits: 4.56.x is out of this patch's range: there the caches read the depth of the *whole*
config (``get_text_config()``, the encoder's), for BART as for T5, and ``encoder-decoder-cache-depth``
lets them grow to the decoder's; 4.57 made them ask for the decoder text config, the call this
patch completes (``docs/patches/decoder-text-config-layers.md`` tells both). Code that reads
``config.num_hidden_layers`` of the model's own config for the decoder
(rather than the decoder text config) is not changed; none was found on the cache paths of the
affected releases. ``transformers.configuration_utils`` names the class ``PretrainedConfig`` up
to 4.57 and ``PreTrainedConfig`` from 5.0 (the old name an alias): one target each.

Tested (``tests/patches/decoder_text_config_layers/``): tiny T5 with 2 encoder and 3 decoder
layers, default and static cache, greedy and beam search: stock raises the IndexError, the
overlay generates the ids of the same weights run without a cache (``use_cache=False``, which
never sizes a cache); equal and shallower decoders and BART give stock's ids.
"""

from __future__ import annotations

import sys

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "decoder-text-config-layers"
MODULE = "transformers.configuration_utils"
ACTION = "gave a decoder text config its num_decoder_layers"


def _record() -> None:
    torch = sys.modules.get("torch")  # a config can be read in a process without torch
    if torch is None or not torch.compiler.is_compiling():
        report.record(PATCH_ID, ACTION)


def make_get_text_config(original, variant):
    import inspect

    signature = inspect.signature(original)

    def completed(self, text_config):
        decoder_layers = getattr(text_config, "num_decoder_layers", None)
        if decoder_layers is None or getattr(text_config, "num_hidden_layers", None) == decoder_layers:
            return text_config
        # A sub-config (``config.decoder``, ``text_config``) is shared with its parent: not ours to
        # change. The flat branch's copy is a new object no attribute of ``self`` holds.
        if any(value is text_config for value in vars(self).values()):
            return text_config
        text_config.num_hidden_layers = decoder_layers
        _record()
        return text_config

    if tuple(signature.parameters) == ("self", "decoder", "encoder"):
        # Every release's own parameters (4.57 - 5.25): the mask builders call it at every decoding
        # step without arguments, so the frame takes them as they are (no *args/**kwargs re-packing)
        # and a call that does not ask for the decoder returns at the first test.
        @wraps(original)
        def get_text_config(self, decoder=None, encoder=None):
            text_config = original(self, decoder, encoder)
            if not decoder or encoder or text_config is self:
                return text_config
            return completed(self, text_config)

        return get_text_config

    @wraps(original)
    def get_text_config(self, *args, **kwargs):
        text_config = original(self, *args, **kwargs)
        if text_config is self:
            return text_config
        asked = signature.bind(self, *args, **kwargs)
        asked.apply_defaults()
        if not asked.arguments.get("decoder") or asked.arguments.get("encoder"):
            return text_config
        return completed(self, text_config)

    return get_text_config


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="T5-family configs give the caches the decoder's layer count (num_decoder_layers)",
    errors=("IndexError: list index out of range",),
    why=(
        "get_text_config(decoder=True) of a flat encoder-decoder config maps decoder_layers onto "
        "num_hidden_layers but not T5's num_decoder_layers, so the caches get the encoder's depth."
    ),
    upstream="none: no transformers release up to {newest_release} maps num_decoder_layers",
    targets=(
        Target(
            module=MODULE,
            qualname="PreTrainedConfig.get_text_config",
            replace=make_get_text_config,
            optional=True,
        ),
        Target(
            module=MODULE,
            qualname="PretrainedConfig.get_text_config",
            replace=make_get_text_config,
            optional=True,
            unless="PreTrainedConfig.get_text_config",
        ),
    ),
)
