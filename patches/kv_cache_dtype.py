"""KV cache dtype alignment: attention gets the compute dtype, and no precision stock keeps is lost.

What breaks (every transformers 5.x release up to 5.24.0 at least; nothing upstream aligns dtypes):
a KV cache whose dtype differs from the states the model writes to it.

- A user-built ``StaticCache`` early-initialised in float32 (or reused from a float32 run) passed
  to a bfloat16 model: ``StaticLayer.update`` fails in ``index_copy_`` ("self and source expected
  to have the same dtype").
- A ``DynamicCache`` prefilled in float32 (a shared prompt prefix computed once), then bfloat16
  decoding: ``torch.cat`` promotes the cache to float32, and attention then gets a bfloat16 query
  with float32 key/value: SDPA "Expected query, key, and value to have the same dtype", eager
  "expected scalar type ... but found ...", FlashAttention-2 "query and key must have the same
  dtype" (its integration only casts float32 *queries*).
- The same with an ``EncoderDecoderCache``: after the first step encoder-decoder models read the
  cross-attention cache directly (``cross_attention_cache.layers[i].keys``), never through
  ``Cache.update``, so a float32 cross-attention cache meets a bfloat16 query.
- ``torch.autocast`` around ``generate()`` with a static cache: rotary embeddings make keys
  float32 while values stay bfloat16; 5.13.0-5.23.0 allocate the value cache in the key dtype
  (``index_copy_`` error); 5.24.0 allocates each in its own dtype, but with ``prefill_chunk_size``
  generate initialises the cache early in the model's dtype (float32) and the bfloat16 values
  fail the same way.

Policy (mode ``align``, the default; ``strict`` and ``off`` below). The target dtype is the
dtype of the incoming ``key_states``, i.e. the query's compute dtype: it is what attention would
get with no cache at all (the no-cache forward is the ground truth every cache must reproduce), it
comes out of the same projections as the query in the same forward, and the query is never cached
so it cannot be stale.

1. Read side, every cache updated through ``Cache.update``: the keys handed back are cast to the
   dtype of the incoming ``key_states`` when they differ, the values to the dtype of the incoming
   ``value_states`` when they differ and those come in the keys' dtype (outside autocast, values
   in another dtype than keys and query are a model-precision matter: left as on stock). A
   one-time :class:`overlay.guard.KVCacheDtypeWarning` names the layer, the two dtypes and the
   cost (a transient copy of that layer's cache per step).
2. Write side, only where stock cannot store the states: static layers (``StaticLayer``,
   ``StaticSlidingWindowLayer`` and every subclass) hold fixed buffers (their addresses are what
   ``torch.compile``/cudagraphs and exported programs hold), and their in-place writes
   (``index_copy_``, ``index_put_``) refuse another dtype, so the new states are cast to the
   buffer's dtype there, after the layer's own lazy initialisation (run first, exactly as the
   layer's ``update`` would, so the layer picks its dtypes as it always did). The sliding layer's
   two ``torch.cat`` branches (a window filling up or overflowing in one update) work on stock and
   are left as stock. A widening cast (bfloat16 states into a float32 buffer) is exact and silent;
   the read side reports the copy. A narrowing one (float32 states into a bfloat16 buffer: a
   float32 model, or ``model.float()``, with a kept bfloat16 static cache) rounds every new
   state: a second warning says that PRECISION IS LOST, not only that a copy is made, and how to
   keep it (build the cache in the compute dtype). Under autocast, narrowing to the autocast dtype
   loses nothing attention would not drop anyway and is silent.
   Dynamic layers are left alone on write: ``torch.cat`` promotes the cache to the wider dtype,
   which loses nothing, and that is exactly what stock does. (This patch used to cast writes to
   the cache's dtype instead: a float32 model continuing a bfloat16 prefix had its own new keys
   and values rounded to bfloat16. Measured against stock over 20 greedy tokens, Llama/Qwen3 with
   hidden 32/2 layers and 256/4 layers: max |logit| drift 9e-5 to 1.2e-3, i.e. 2e-4 to 1e-3 of
   the largest logit, tokens unchanged on these random models but not guaranteed on real ones.
   Now the drift is 0: bit-identical to stock, ``tests/test_patch_kv_cache_dtype_robustness.py``.)
3. Cross-attention caches (``EncoderDecoderCache``): the cache patch cannot see the direct reads,
   so it aligns the cross-attention layer where it can see the compute dtype: in the same decoder
   layer's self-attention ``Cache.update``, which runs right before the cross-attention reads.
   Whenever that update is not on the fast path (its layer is new, or its dtypes differ from the
   incoming states), cross-attention layer ``i`` is converted once, in place, to the dtype of the
   incoming states (a narrowing conversion drops the wider copy: stock fails here, and attention
   computes in the narrower dtype anyway; the warning says so). This makes a float32-prefilled
   ``EncoderDecoderCache`` work with a bfloat16 decoder on encoder-decoder models whose decoder
   layer runs its self-attention update before its cross-attention read (all of them in 5.x),
   inline attention included: tested (tokens equal to the all-bfloat16 reference, kv-cache-dtype
   alone, stock failing) on T5 and MVP in the suite, and on MT5, UMT5, LongT5, Bart, MBart, Marian,
   Pegasus, Blenderbot, BlenderbotSmall, M2M100, PLBart, LED, BigBirdPegasus and NLLB-MoE on
   5.13.0 and 5.18.0 by a one-off sweep. Exact limit: a
   cross-attention cache whose dtype differs while its self-attention cache already holds states
   in the compute dtype (the two were filled by different models, or ``cross_attention_cache``
   was reassigned after the ``EncoderDecoderCache`` was built) is not converted; models that
   dispatch attention through ``AttentionInterface`` are still aligned by ``attention-guard``.
4. Under ``torch.autocast`` on the states' device, dtypes are autocast's business, as in the
   attention guard: nothing is cast on read and nothing is reported, only the write into a static
   layer is cast (stock would fail in ``index_copy_``). E.g. generate's default dynamic cache under
   autocast on 5.13.0-5.23.x allocates values in the keys' float32 and ``torch.cat`` promotes the
   bfloat16 values: stock generates, and so does the overlay, same tokens, no warning.

Either half alone is not enough for static caches: casting on write only returns a float32 cache
to a bfloat16 query; casting on read only never gets past ``index_copy_``.

What it costs: one replacement, ``Cache.update``, which is stock's own body (5.13.0-5.24.0 share
it when offloading is off) with two dtype comparisons in front: no wrapper frame, no re-packing of
``*args``/``**kwargs`` beyond what stock does, no layer wrapper. When dtypes agree, nothing else
runs: no copy, no kernel (tests count aten ops with a TorchDispatchMode), and under
``torch.compile`` every branch is decided at trace time (dtypes are guarded), so no graph break
and no recompilation. Offloaded caches take the slow path every step (a few hundred ns, next to
the tensor moves). When dtypes differ: one cast of the new states on write (static layers), one
cast of the layer's returned cache per step on read, and ``overlay.report.record`` counts it
(outside compiled regions). The warnings are skipped inside compiled regions (emitting them would
break the graph); the eager prefill that precedes compiled decoding reports the same mismatch.

Modes: ``strict`` raises :class:`overlay.guard.CacheDtypeError` (an ``AttentionInputError``)
naming the layer, the cache tensor and the incoming tensor exactly where ``align`` would warn
(a cast on read, a static buffer in another dtype than the compute dtype, a rounding write, a
cross-attention conversion), before anything is written where it can; it never raises where
``align`` is silent (dynamic promotion, exact widening writes, autocast). ``off`` passes
everything through as stock transformers does. ``tests/test_patch_kv_cache_dtype_properties.py``
checks these against stock with hypothesis.

Coverage and limits: every cache updated through ``Cache.update`` (all decoder and
encoder-decoder models of 5.x, every attention implementation, eager included), every layer class
(including modeling-file layers such as DeepSeek-V4's and Unlimited-OCR's), offloaded caches, and
the cross-attention caches of ``EncoderDecoderCache`` as described in 3. Not covered: a layer's
``update`` called directly, bypassing ``Cache.update`` (in 5.13.0-5.24.0 only
``DynamicCache(ddp_cache_data)`` does so, with dynamic layers, which need no write side); other
direct reads of cached tensors (Mllama's cross-attention layers kept in the decoder's own cache:
its attention goes through ``AttentionInterface``, so ``attention-guard`` aligns it); caches
defined in modeling files that override ``Cache.update`` without calling it (e.g. OLMo-Hybrid's
on 5.13.x) and the paged cache of continuous batching; quantized layers keep their own dtypes.
Out of scope: models that keep some projections in float32 while others run in bfloat16 (e.g. a
``qk_norm`` kept in float32 makes q/k float32 and v bfloat16 and then fails in ``o_proj``): that
is a model-precision issue, not the cache's.
"""

from __future__ import annotations

from overlay import guard
from overlay.patch import Patch, Target, wraps

MODULE = "transformers.cache_utils"
PATCH_ID = "kv-cache-dtype"
#: Attribute set on an EncoderDecoderCache's self-attention cache: its cross-attention cache.
CROSS_ATTR = "_attn_overlay_cross_attention_cache"


def _replace_cache_update(original, variant):
    """``Cache.update`` with the dtype checks in front (see the module docstring)."""
    static_layer = original.__globals__.get("StaticLayer")
    sliding_layer = original.__globals__.get("StaticSlidingWindowLayer")
    static = (static_layer, sliding_layer, getattr(sliding_layer, "update", None))

    @wraps(original)
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # The fast path is stock's own body for a non-offloaded cache whose layer ``layer_idx``
        # exists (the stock ``while len(self.layers) <= layer_idx`` then appends nothing), is
        # initialised, and stores exactly the incoming dtypes. Anything else (a new or lazily
        # appended layer, offloading, another dtype, an odd object) goes to ``_slow_update``,
        # which calls the original. Only the checks are inside ``try`` (free in CPython 3.11+):
        # an error raised by the layer's own update must reach the caller, never run it twice.
        # Indexing, not ``len()``: a ``layer_idx`` past the end (IndexError) is the slow path's,
        # where stock appends layers or raises its own error; a negative one indexes from the end,
        # as in stock (whose ``while`` loop appends nothing for it).
        try:
            fast = (
                not self.offloading
                and (keys := (layer := self.layers[layer_idx]).keys) is not None
                and keys.dtype is key_states.dtype
                and layer.values.dtype is value_states.dtype
            )
        except (AttributeError, TypeError, IndexError):
            fast = False
        if fast:
            return layer.update(key_states, value_states, *args, **kwargs)
        return _slow_update(original, static, self, key_states, value_states, layer_idx, args, kwargs)

    return update


def _slow_update(original, static, cache, key_states, value_states, layer_idx, args, kwargs):
    import torch

    mode = guard._mode
    tensor = torch.Tensor
    if mode == guard.OFF or not (isinstance(key_states, tensor) and isinstance(value_states, tensor)):
        return original(cache, key_states, value_states, layer_idx, *args, **kwargs)
    compiling = torch.compiler.is_compiling()
    autocast_dtype = _autocast_dtype(key_states)
    layer = _layer(cache, layer_idx)

    # Write side: only where a static layer writes in place (index_copy_/index_put_ refuse another
    # dtype); dynamic layers and the torch.cat branches of sliding ones promote, exactly like stock.
    write_k, write_v = key_states, value_states
    static_layer = static[0]
    if static_layer is not None and isinstance(layer, static_layer):
        if not layer.is_initialized:
            # The first statement of every layer's update: the layer picks its dtypes as always.
            layer.lazy_initialization(key_states, value_states)
        if autocast_dtype is None:
            # Reported when first seen, whichever branch this update takes (strict raises here).
            _report_static_mismatch(layer, layer_idx, key_states, value_states, mode, compiling)
        if _writes_in_place(layer, static, key_states.shape[-2]):
            write_k = _to_buffer(layer, layer_idx, "keys", key_states, mode, autocast_dtype, compiling)
            write_v = _to_buffer(layer, layer_idx, "values", value_states, mode, autocast_dtype, compiling)

    # The cross-attention cache of the same decoder layer, read directly right after this update.
    cross = getattr(cache, "__dict__", {}).get(CROSS_ATTR)
    if cross is not None and autocast_dtype is None:
        _align_cross_layer(cross, layer_idx, key_states, value_states, mode, compiling)

    keys, values = original(cache, write_k, write_v, layer_idx, *args, **kwargs)

    # Read side: the compute dtype, except under autocast (autocast casts in the kernels, as on stock).
    if autocast_dtype is None:
        if isinstance(keys, tensor) and keys.dtype is not key_states.dtype:
            keys = _hand_back(cache, layer, layer_idx, "keys", keys, key_states, mode, compiling)
        # Values only when they come in the keys' dtype: outside autocast, values in another dtype than
        # the keys (and the query) are a model-precision matter that attention rejects as on stock.
        if (
            isinstance(values, tensor)
            and values.dtype is not value_states.dtype
            and value_states.dtype is key_states.dtype
        ):
            values = _hand_back(cache, layer, layer_idx, "values", values, value_states, mode, compiling)
    return keys, values


def _layer(cache, layer_idx):
    """Layer ``layer_idx`` after appending lazily replicated layers exactly as ``Cache.update`` does."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return None
    replicate = getattr(cache, "layer_class_to_replicate", None)
    if replicate is not None:
        while len(layers) <= layer_idx:
            layers.append(replicate())
    try:
        return layers[layer_idx]
    except (IndexError, TypeError):
        return None


def _report_static_mismatch(layer, layer_idx, key_states, value_states, mode, compiling):
    """A static layer whose buffers are not in the compute dtype: the read side will cast (see ``_hand_back``)."""
    for which, states in (("keys", key_states), ("values", value_states)):
        if which == "values" and value_states.dtype is not key_states.dtype:
            continue  # values in another dtype than the keys: not aligned on read (see _slow_update)
        stored = getattr(layer, which, None)
        if stored is None or stored.dtype is states.dtype:
            continue
        if mode == guard.STRICT:
            raise guard.CacheDtypeError(layer, which, stored, states, layer_idx)
        if not compiling:
            guard.warn_cache_cast_once(layer_idx, layer, which, stored.dtype, states.dtype)


def _writes_in_place(layer, static, kv_length):
    """Whether this update writes the states into the static layer's buffers in place.

    ``StaticLayer.update`` always does (``index_copy_``). ``StaticSlidingWindowLayer.update`` (one
    code in 5.13.0-5.24.0) does while the window has room (``index_copy_``) and when it is full and
    one token comes (``index_put_``); its two other branches concatenate (``torch.cat`` promotes)
    and copy back (``copy_`` casts), which works on stock and must stay as stock. A layer class with
    its own ``update`` is assumed to write in place.
    """
    _, sliding_layer, sliding_update = static
    if sliding_layer is None or not isinstance(layer, sliding_layer) or type(layer).update is not sliding_update:
        return True
    current, room = layer.cumulative_length_int, layer.max_cache_len
    if current >= room:
        return kv_length == 1
    return current + kv_length <= room


def _autocast_dtype(states):
    """The autocast dtype when autocast is enabled for the states' device, else None."""
    import torch

    device_type = states.device.type
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # devices autocast does not know (meta, lazy, ...): no autocast there
        return None


def _narrows(stored_dtype, incoming_dtype, autocast_dtype):
    """Whether storing ``incoming_dtype`` states as ``stored_dtype`` loses precision attention would use."""
    import torch

    if torch.promote_types(stored_dtype, incoming_dtype) == stored_dtype:
        return False  # widening (or equal): exact
    return not (autocast_dtype is not None and stored_dtype == autocast_dtype)


def _to_buffer(layer, layer_idx, which, incoming, mode, autocast_dtype, compiling):
    """Write side of a static layer: the incoming states in the buffer's dtype."""
    stored = getattr(layer, which, None)
    if stored is None or stored.dtype is incoming.dtype:
        return incoming
    narrows = _narrows(stored.dtype, incoming.dtype, autocast_dtype)
    # A widening cast is exact and silent in every mode (the read side reports what it costs).
    if narrows and mode == guard.STRICT:
        raise guard.CacheDtypeError(layer, which, stored, incoming, layer_idx)
    if not compiling:
        if narrows:
            guard.warn_cache_rounding_once(layer_idx, layer, which, stored.dtype, incoming.dtype)
        from overlay import report

        report.record(PATCH_ID, f"stored {incoming.dtype} {which} in a {stored.dtype} static cache")
    return incoming.to(stored.dtype)


def _hand_back(cache, layer, layer_idx, which, returned, incoming, mode, compiling):
    """Read side: what the cache hands back, in the dtype of the incoming states."""
    if mode == guard.STRICT:
        raise guard.CacheDtypeError(layer if layer is not None else cache, which, returned, incoming, layer_idx)
    if not compiling:
        guard.warn_cache_cast_once(layer_idx, layer if layer is not None else cache, which, returned.dtype, incoming.dtype)
        from overlay import report

        report.record(PATCH_ID, f"cast {returned.dtype} cache {which} for {incoming.dtype} attention")
    return returned.to(incoming.dtype)


def _align_cross_layer(cross, layer_idx, key_states, value_states, mode, compiling):
    """Convert cross-attention layer ``layer_idx`` (read directly by the models) to the compute dtype, once."""
    layers = getattr(cross, "layers", None)
    if not isinstance(layers, list) or not 0 <= layer_idx < len(layers):
        return
    layer = layers[layer_idx]
    import torch

    for which, states in (("keys", key_states), ("values", value_states)):
        stored, dtype = getattr(layer, which, None), states.dtype
        if not isinstance(stored, torch.Tensor) or stored.dtype is dtype or stored.numel() == 0:
            continue
        if mode == guard.STRICT:
            raise guard.CacheDtypeError(layer, which, stored, states, layer_idx, cache="cross-attention cache")
        converted = stored.to(dtype)
        setattr(layer, which, converted)
        if not compiling:
            if getattr(layer, "is_compileable", False):
                # A static layer: its new buffer keeps a static address for torch.compile/cudagraphs.
                torch._dynamo.mark_static_address(converted)
            narrows = torch.promote_types(stored.dtype, dtype) != dtype
            guard.warn_cross_cache_cast_once(layer_idx, layer, which, stored.dtype, dtype, narrows)
            from overlay import report

            report.record(PATCH_ID, f"converted {stored.dtype} cross-attention cache {which} to {dtype}")


def _replace_encoder_decoder_init(original, variant):
    """``EncoderDecoderCache.__init__`` that tells the self-attention cache its cross-attention cache."""

    @wraps(original)
    def __init__(self, *caches):
        original(self, *caches)
        # A plain reference (no cycle: the parent holds both, the self cache holds the cross one):
        # deepcopy/pickle of the parent keep it pointing at the copied cross-attention cache.
        holder = getattr(self.self_attention_cache, "__dict__", None)
        if holder is not None:
            holder[CROSS_ATTR] = self.cross_attention_cache

    return __init__


PATCH = Patch(
    id=PATCH_ID,
    title="KV cache hands attention the compute dtype; static caches store in their own dtype",
    errors=(
        "index_copy_(): self and source expected to have the same dtype, but got (self) Float and (source) BFloat16",
        "Expected query, key, and value to have the same dtype, but got query.dtype: c10::BFloat16 "
        "key.dtype: float and value.dtype: float instead.",
        "expected scalar type BFloat16 but found Float",
        "query and key must have the same dtype",
    ),
    why=(
        "Cache layers keep the dtype they were first built in and never reconcile later states with it, so "
        "a cache built in float32 (user-built, a float32 prefix, generate's early init under autocast) meets "
        "bfloat16 states and a bfloat16 query."
    ),
    upstream="none: no transformers release up to 5.24.0 aligns KV cache dtypes",
    affected=">=5.13.0",
    fixed_in=None,
    targets=(
        Target(
            module=MODULE,
            qualname="Cache.update",
            originals={
                "679ec869a03c94506ac836f8ebb49419af008974a65f450096ec608ebdfa34c7": "5.13.0-5.19.0",
                "7f41008b39efeecc1e320035d7b10642f1562c7466514cd05136cf6fc451d6e6": "5.20.0-5.24.0",
            },
            replace=_replace_cache_update,
        ),
        Target(
            module=MODULE,
            qualname="EncoderDecoderCache.__init__",
            originals={
                "75023ce759abbc1f191173f5f5c1342c2a24fe5e668bb7dec085635850bdc581": "5.13.0-5.24.0",
            },
            replace=_replace_encoder_decoder_init,
        ),
    ),
    doctor=("cache-dtype-static", "cache-dtype-prefix"),
)
