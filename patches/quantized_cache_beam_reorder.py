"""Beam search reorders a quantized cache's quantized states too.

What breaks: ``model.generate(..., num_beams=N, cache_implementation="quantized")`` (N >= 2, any
``cache_config``, default ``residual_length`` included) fails at the first beam reorder:
``IndexError: index out of range in self``. ``QuantizedLayer`` inherits ``reorder_cache`` from
``CacheLayerMixin``, which reorders ``keys`` / ``values`` only: for a quantized layer those are the
residual (unquantized) part, an empty 1-D tensor right after the prefill (the prefill goes straight
into the quantized states), hence the error; and the quantized states, which hold the prompt and,
after each flush, the generated tokens, are never reordered with the beams.

Upstream (5.19.0, huggingface/transformers#48700): ``QuantizedLayer.reorder_cache`` reorders the
residual when it holds anything and defers the quantized states' reorder to the next ``update``,
which dequantizes them anyway (no lossy quantization round trip); several reorders in a row are
composed; a flush re-quantizes in beam order and clears it.

What the replacement does, the same way (two targets, wrapping the originals; only layer classes
of ``transformers.cache_utils``): ``reorder_cache`` (set on ``QuantizedLayer``) keeps the pending
beam order on the layer, composed with one already pending, and reorders the residual when it is
not empty; ``QuantizedLayer.update``, while an order is pending, lends the call a ``_dequantize``
that returns the states in that order, and clears it when the call re-quantized them (a flush).
An order pending for quantized states that were since replaced otherwise is dropped. Cost: none
without beam search (one dictionary lookup per layer per step); with it, two ``index_select`` per
layer per step on the dequantized states, as in 5.19.0.

Not covered: ``reset()`` of a quantized cache (4.56 - 5.18 keep its quantized states: see
dynamic-cache-reset). 4.55's quantized caches are other classes (not affected in this way).

Tested (``tests/patches/quantized_cache_beam_reorder/``, needs optimum-quanto; without it the
engine's status and the layer-level order are checked with a stand-in quantizer): tiny Llama, beam
search with a quantized cache: stock raises the error above, the overlay generates; with a
residual longer than the generation (nothing re-quantized) it gives the dynamic cache's beam ids.
At the layer level, what ``update`` returns after a reorder is the dequantized states in beam order.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "quantized-cache-beam-reorder"
MODULE = "transformers.cache_utils"
#: On a layer: (the pending beam order, the quantized keys it applies to).
_PENDING = "_attn_overlay_pending_beam_idx"


def _known_layer(layer) -> bool:
    return type(layer).__module__ == MODULE


def make_reorder(original, variant):
    @wraps(original)
    def reorder_cache(self, beam_idx):
        if not _known_layer(self):
            return original(self, beam_idx)
        quantized = getattr(self, "_quantized_keys", None)
        if quantized is None:  # nothing written yet
            return original(self, beam_idx)
        pending = self.__dict__.get(_PENDING)
        if pending is not None and pending[1] is quantized:
            order = pending[0].index_select(0, beam_idx.to(pending[0].device))
        else:
            order = beam_idx.clone()
        self.__dict__[_PENDING] = (order, quantized)
        if self.keys is not None and self.keys.numel() > 0:  # the residual, when it holds anything
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))
        report.record_outside_compile(PATCH_ID, "reordered the quantized states with the beams")
        return None

    return reorder_cache


def make_update(original, variant):
    @wraps(original)
    def update(self, key_states, value_states, *args, **kwargs):
        pending = self.__dict__.get(_PENDING)
        if pending is None:
            return original(self, key_states, value_states, *args, **kwargs)
        order, quantized = pending
        if quantized is not self._quantized_keys:  # replaced since: the order is not theirs
            del self.__dict__[_PENDING]
            return original(self, key_states, value_states, *args, **kwargs)
        dequantize = self._dequantize

        def dequantize_in_beam_order(qtensor):
            states = dequantize(qtensor)
            return states.index_select(0, order.to(states.device))

        own = self.__dict__.get("_dequantize")  # one set on the instance, kept
        self._dequantize = dequantize_in_beam_order
        try:
            return original(self, key_states, value_states, *args, **kwargs)
        finally:
            if own is None:
                del self._dequantize
            else:
                self._dequantize = own
            if self._quantized_keys is not quantized:  # flushed: re-quantized in beam order
                self.__dict__.pop(_PENDING, None)

    return update


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="Beam search with a quantized cache reorders its quantized states with the beams",
    errors=("IndexError: index out of range in self",),
    why=(
        "QuantizedLayer inherits CacheLayerMixin.reorder_cache, which reorders only the residual keys and "
        "values (an empty 1-D tensor after the prefill) and never the quantized states."
    ),
    upstream="huggingface/transformers#48700 (QuantizedLayer.reorder_cache, deferred to update), in {fixed_in}",
    targets=(
        Target(
            module=MODULE,
            qualname="QuantizedLayer.reorder_cache",
            inherited_from=f"{MODULE}:CacheLayerMixin.reorder_cache",
            replace=make_reorder,
            optional=True,
        ),
        Target(
            module=MODULE,
            qualname="QuantizedLayer.update",
            replace=make_update,
            optional=True,
        ),
    ),
)
