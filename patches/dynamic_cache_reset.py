"""``DynamicCache.reset()`` empties the dynamic layers, so a reset cache generates like a fresh one.

What breaks (4.55.0 - 5.17.0): a user keeps one ``DynamicCache`` (or an ``EncoderDecoderCache`` of
two) across ``generate()`` calls and calls ``cache.reset()`` between them. ``reset()`` zeroes the
layers' key and value tensors but keeps them, while a dynamic layer grows by concatenation and
counts what it holds by their length. So after ``reset()`` ``get_seq_length()`` still gives the old
length, and the next call puts the new prompt after that many zero entries, which attention reads
(sliding layers, 4.56+, reset their count to 0 but keep the zeros). No error in the common case,
other tokens than a fresh cache gives; errors only where the stale entries do not fit the new call:

- a batch of another size: ``RuntimeError: Sizes of tensors must match except in dimension 2.
  Expected size 1 but got size 2 for tensor number 1 in the list.`` (any affected release);
- (4.55.0 - 5.2.0) a prompt no longer than what the cache held before: the cache positions left for
  it are empty, ``IndexError: index -1 is out of bounds for dimension 0 with size 0``;
- (4.55.x) ``reset()`` of a cache never written (``DynamicCache().reset()``, e.g. a reset before
  every call): ``AttributeError: 'NoneType' object has no attribute 'zero_'``.

The cause: ``CacheLayerMixin.reset`` is written for static layers (fixed-size buffers, a separate
write position) and dynamic layers inherit it. Upstream (PR #48809, in 5.18.0) gives
``DynamicLayer`` its own ``reset`` that drops the tensors, so the next write initialises the layer
again, and drops ``DynamicIndexedLayer``'s indexer keys the same way.

What the replacement does (two targets, wrapping the originals):

- ``DynamicLayer.reset`` (inherited from ``CacheLayerMixin`` on the affected releases; the
  replacement is set on ``DynamicLayer``, so static layers keep zeroing their buffers, which is
  right for them) first forgets the layer's tensors, then calls the original for what else it
  resets. How a release forgets is the variant's ``forget``: 4.56 drops them (``None``: the next
  write initialises the layer), 4.57+ also clears ``is_initialized``, as 5.18.0 does; the original
  then skips its zeroing (nothing is allocated) and still resets the ``cumulative_length`` of
  sliding and quantized layers. 4.55.x has no lazy initialisation and its offloading processor
  moves every layer's tensors on each write, so there the tensors become empty ones on the same
  device, in the same dtype (the state 4.55's own quantized processor leaves a layer's residual in;
  the next write concatenates onto it, whatever its batch size), and the original, whose only work
  is the zeroing, is not called (``original_after``).
- ``DynamicIndexedLayer.reset`` (5.11.0 - 5.17.0, sparse-attention models: DeepSeek V3.2, GLM MoE
  DSA) drops the indexer keys the same way (they grow by concatenation too), then calls the
  original, whose ``super().reset()`` is the dynamic layer's above; without it the main states
  would start afresh and the indexer keys not, out of step with each other.

Only layers of classes defined in ``transformers.cache_utils`` are changed: a subclass defined
elsewhere may hold more states that grow with the keys (DeepSeek V4's HCA layer and MiniMax M3
VL's sparse layer do, up to 5.17.0; upstream's fix drops theirs in their own modules), and dropping
only the main tensors would leave those out of step: such layers keep the release's own ``reset``.

Cost: a few attribute writes per layer per ``reset()``, and one count in ``overlay.report`` for
each layer that held tensors; nothing on the generation path, and no zeroing of the old tensors.
Not covered: the DeepSeek V4 and MiniMax M3 VL layers above (other modules); 4.55's quantized
caches (their processor keeps the quantized states itself, and ``reset()`` leaves them). Read from
the code, not run: 4.55's offloaded cache (it needs a GPU) and the quantized layers of 4.56+ (they
need optimum-quanto or HQQ).

Tested (``tests/patches/dynamic_cache_reset/test_patch_dynamic_cache_reset.py``): tiny Llama, Gemma 3 (a sliding layer) and T5
(self- and cross-attention layers), a cache used, reset and used again for a longer prompt, a batch
of two and a shorter prompt: stock gives other ids than a fresh cache (or raises the errors above),
the overlay gives the fresh cache's ids and ``get_seq_length() == 0`` after ``reset()``. A fresh
cache, a static cache's ``reset()`` and a dynamic layer class of another module are the same with
and without the overlay; at the layer level the indexed layer's indexer keys start afresh too.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "dynamic-cache-reset"
MODULE = "transformers.cache_utils"


# How a release makes a dynamic layer forget its tensors (``Variant.params["forget"]``), so that its
# next write starts it afresh; each says whether the layer held any (what the report counts).


def _emptied_in_place(layer) -> bool:
    """4.55: empty tensors on the layer's device, in its dtype (``None`` would break the
    offloading processor, which moves every layer's tensors; a layer never written stays ``None``)."""
    if layer.keys is None:
        return False
    layer.keys, layer.values = layer.keys.new_empty(0), layer.values.new_empty(0)
    return True


def _dropped(layer) -> bool:
    """4.56: a layer whose keys are ``None`` initialises itself on its next write."""
    held = layer.keys is not None
    layer.keys = layer.values = None
    return held


def _dropped_and_flagged(layer) -> bool:
    """4.57+: the same, and ``is_initialized`` (what the next write and the original read) cleared."""
    held = layer.is_initialized
    layer.keys = layer.values = None
    layer.is_initialized = False
    return held


def _known_layer(layer) -> bool:
    """A layer class of ``transformers.cache_utils`` itself, whose states this patch knows."""
    return type(layer).__module__ == MODULE


def make_layer_reset(original, variant):
    forget = variant["forget"]
    original_after = variant["original_after"]

    @wraps(original)
    def dynamic_layer_reset(self):
        if not _known_layer(self):
            return original(self)
        if forget(self):
            report.record(PATCH_ID, "emptied a reset dynamic cache layer")
        if original_after:
            return original(self)
        return None

    return dynamic_layer_reset


def make_indexer_reset(original, variant):
    @wraps(original)
    def indexed_layer_reset(self):
        if _known_layer(self):
            held = self.is_indexer_initialized
            self.indexer_keys = None
            self.is_indexer_initialized = False
            if held:
                report.record(PATCH_ID, "emptied a reset indexer key cache")
        # super().reset() inside is the dynamic layer's reset (the other target); the indexer's
        # zeroing is skipped now that nothing is allocated.
        return original(self)

    return indexed_layer_reset


#: 4.55: no lazy initialisation; the original only zeroes the tensors (and fails on a layer never
#: written), so it has nothing left to do.
EMPTIED = {"forget": _emptied_in_place, "original_after": False}
#: 4.56: the original skips layers whose keys are ``None`` and resets ``cumulative_length``.
DROPPED = {"forget": _dropped, "original_after": True}
#: 4.57 - 5.17: the same, keyed on ``is_initialized`` (5.4+: ``cumulative_length`` may be a tensor).
DROPPED_AND_FLAGGED = {"forget": _dropped_and_flagged, "original_after": True}


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="both",
    title="DynamicCache.reset() empties the cache, so a cache reused after reset() generates like a fresh one",
    errors=(
        "(no error) generate() with a DynamicCache reused after cache.reset() gives other tokens than with a "
        "fresh cache; cache.get_seq_length() still returns the old length",
        "RuntimeError: Sizes of tensors must match except in dimension 2. Expected size 1 but got size 2 "
        "for tensor number 1 in the list.",
        "IndexError: index -1 is out of bounds for dimension 0 with size 0",
        "AttributeError: 'NoneType' object has no attribute 'zero_'",
    ),
    why=(
        "Up to 5.17.0 dynamic cache layers inherit CacheLayerMixin.reset, which zeroes the key and value "
        "tensors but keeps them, while a dynamic layer grows by concatenation and counts its length from "
        "them: the next generate() appends the new prompt after the stale zero entries."
    ),
    upstream="huggingface/transformers#48809 (DynamicLayer.reset drops the tensors), in {fixed_in}",
    targets=(
        Target(
            module=MODULE,
            qualname="DynamicLayer.reset",
            variants={"emptied": EMPTIED, "dropped": DROPPED, "dropped_and_flagged": DROPPED_AND_FLAGGED},
            inherited_from=f"{MODULE}:CacheLayerMixin.reset",
            replace=make_layer_reset,
        ),
        Target(
            module=MODULE,
            qualname="DynamicIndexedLayer.reset",
            replace=make_indexer_reset,
            optional=True,
        ),
    ),
)
