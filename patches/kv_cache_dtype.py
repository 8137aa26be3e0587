"""KV cache dtype alignment: the cache stores in its own dtype, attention gets the compute dtype.

What breaks (every transformers 5.x release up to 5.24.0 at least; nothing upstream aligns dtypes):
a KV cache whose dtype differs from the states the model writes to it.

- A user-built ``StaticCache`` early-initialised in float32 (or reused from a float32 run) passed
  to a bfloat16 model: ``StaticLayer.update`` fails in ``index_copy_`` ("self and source expected
  to have the same dtype").
- A ``DynamicCache`` prefilled in float32 (a shared prompt prefix computed once), then bfloat16
  decoding: ``torch.cat`` silently promotes the cache to float32, and attention then gets a
  bfloat16 query with float32 key/value: SDPA "Expected query, key, and value to have the same
  dtype", eager "expected scalar type ... but found ...", FlashAttention-2 "query and key must
  have the same dtype" (its integration only casts float32 *queries*).
- ``torch.autocast`` around ``generate()`` with a static cache: rotary embeddings make keys
  float32 while values stay bfloat16; 5.13.0-5.23.0 allocate the value cache in the key dtype
  (``index_copy_`` error); 5.24.0 allocates each in its own dtype, but with ``prefill_chunk_size``
  generate initialises the cache early in the model's dtype (float32) and the bfloat16 values
  fail the same way.

Policy (what this patch does, in mode ``align``, the default; see ``overlay/guard.py``):

1. On write, incoming states are stored in the cache's dtype. Each layer's ``update`` first runs
   the layer's own lazy initialisation (exactly what the original does first, so the layer picks
   its dtypes as it always did), then casts ``key_states`` / ``value_states`` to the dtype of the
   layer's ``keys`` / ``values`` when they differ. ``index_copy_`` no longer fails, and ``torch.cat``
   no longer silently promotes (and thereby re-types) the stored cache.
2. On read, ``Cache.update`` hands back keys and values in the dtype of the incoming
   ``key_states`` / ``value_states`` -- only cast when they differ -- with a one-time
   :class:`overlay.guard.KVCacheDtypeWarning` naming the layer and the two dtypes.

Either half alone is not enough: casting on write only returns a float32 cache to a bfloat16
query; casting on read only never gets past ``index_copy_``.

Why the dtype of the incoming states, which is the query's compute dtype, is the right target:
it is what attention would have received with no cache at all (the no-cache forward is the ground
truth every cache must reproduce), it is produced by the same projections as the query in the
same forward, and the query itself is never cached so it cannot be stale. The model's dtype is
the wrong target: under autocast the model is float32 while attention computes in bfloat16 (and
keys come out of rotary embeddings in float32 while values stay bfloat16, which is why keys and
values are aligned separately). The cache's dtype is the wrong target too: it is whatever the
cache was built with (a previous run, a float32 prefix model), and re-typing the stored cache
instead would lose the precision of a float32 prefix and break the static addresses that
``torch.compile``/cudagraphs and exported programs hold on static caches.

What it costs:
- dtypes already match (the normal case): a few dtype comparisons per layer and step; no copy,
  no kernel (tests count the copies with a TorchDispatchMode), and under ``torch.compile`` every
  branch is decided at trace time (dtype is guarded), so no graph break and no recompilation.
- dtypes differ: one cast of the new states on write (a few tokens), and one cast of the layer's
  whole returned cache on every read -- a transient buffer the size of that layer's cache in the
  compute dtype, plus the memory traffic, per layer and step. That is the price of a cache built in
  the wrong dtype; the warning says so once and how to avoid it (build the cache in the compute
  dtype). The warning is skipped inside compiled regions (emitting it would break the graph); the
  eager prefill that precedes compiled decoding reports the same mismatch.

Modes: ``strict`` raises :class:`overlay.guard.AttentionInputError` (a ``CacheDtypeError``)
naming the layer, the cache tensor and the incoming tensor instead of casting; ``off`` passes
everything through as stock transformers does.

Coverage and limits: every model that writes its cache through ``Cache.update`` (all decoder
and encoder-decoder models in 5.x, every attention implementation, eager included), with the
write-side cast for ``DynamicLayer``, ``DynamicSlidingWindowLayer``, ``StaticLayer`` and
``StaticSlidingWindowLayer`` and their subclasses that keep those ``update`` methods (indexed and
linear-attention hybrid layers). Quantized layers (``QuantizedLayer``, ``Fp8QuantizedLayer``)
and caches defined in modeling files that override ``update`` without calling ``Cache.update``
are not aligned on write. Out of scope: models that keep some projections in float32 while
others run in bfloat16 (e.g. a ``qk_norm`` kept in float32 makes q/k float32 and v bfloat16 and
then fails in ``o_proj``): that is a model-precision issue, not the cache's.
"""

from __future__ import annotations

from overlay import guard
from overlay.patch import Patch, Target, wraps

MODULE = "transformers.cache_utils"


def _replace_layer_update(original):
    """Write side: store incoming states in the layer's dtype (after the layer's own lazy init)."""

    @wraps(original)
    def update(self, key_states, value_states, *args, **kwargs):
        mode = guard.get_mode()
        if mode != guard.OFF and key_states is not None and value_states is not None:
            if not self.is_initialized:
                # The first statement of every wrapped original; running it here lets the layer
                # choose its dtypes as it always does before we compare against them.
                self.lazy_initialization(key_states, value_states)
            key_states = _in_store_dtype(self, "keys", key_states, mode)
            value_states = _in_store_dtype(self, "values", value_states, mode)
        return original(self, key_states, value_states, *args, **kwargs)

    return update


def _in_store_dtype(layer, which, incoming, mode):
    stored = getattr(layer, which, None)
    if stored is None or incoming.dtype == stored.dtype:
        return incoming
    if mode == guard.STRICT:
        raise guard.CacheDtypeError(layer, which, stored, incoming)
    return incoming.to(stored.dtype)


def _replace_cache_update(original):
    """Read side: hand back keys/values in the dtype of the incoming states, casting only when needed."""
    import torch

    is_compiling = torch.compiler.is_compiling

    @wraps(original)
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        mode = guard.get_mode()
        if mode == guard.OFF or key_states is None or value_states is None:
            return original(self, key_states, value_states, layer_idx, *args, **kwargs)
        if mode == guard.STRICT:
            try:
                keys, values = original(self, key_states, value_states, layer_idx, *args, **kwargs)
            except guard.CacheDtypeError as err:
                if err.layer_idx is not None:
                    raise
                raise err.for_layer(layer_idx) from None
        else:
            keys, values = original(self, key_states, value_states, layer_idx, *args, **kwargs)
        if keys is not None and keys.dtype != key_states.dtype:
            keys = _hand_back(self, layer_idx, "keys", keys, key_states, mode, is_compiling)
        if values is not None and values.dtype != value_states.dtype:
            values = _hand_back(self, layer_idx, "values", values, value_states, mode, is_compiling)
        return keys, values

    return update


def _hand_back(cache, layer_idx, which, returned, incoming, mode, is_compiling):
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if isinstance(layers, list) and layer_idx < len(layers) else cache
    if mode == guard.STRICT:
        raise guard.CacheDtypeError(layer, which, returned, incoming, layer_idx)
    if not is_compiling():
        guard.warn_cache_cast_once(layer_idx, layer, which, returned.dtype, incoming.dtype)
    return returned.to(incoming.dtype)


PATCH = Patch(
    id="kv-cache-dtype",
    title="KV cache stores in its own dtype and hands attention the compute dtype",
    errors=(
        "index_copy_(): self and source expected to have the same dtype, but got (self) Float and (source) BFloat16",
        "Expected query, key, and value to have the same dtype, but got query.dtype: c10::BFloat16 "
        "key.dtype: float and value.dtype: float instead.",
        "expected scalar type BFloat16 but found Float",
        "query and key must have the same dtype",
    ),
    why=(
        "Cache layers allocate from the first states they see (or from early_initialization's dtype) and "
        "never reconcile later writes: StaticLayer.index_copy_ refuses another dtype, DynamicLayer's torch.cat "
        "promotes the whole cache, and Cache.update hands attention whatever the cache holds, so a cache built "
        "in float32 (user-built, a float32 prefix, generate's early init under autocast) meets a bfloat16 query."
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
            qualname="DynamicLayer.update",
            originals={
                "3fe48b1632f14c258c9aed556a3bcb1e3786bcf54eb53990369944ba54c453f7": "5.13.0-5.24.0",
            },
            replace=_replace_layer_update,
        ),
        Target(
            module=MODULE,
            qualname="DynamicSlidingWindowLayer.update",
            originals={
                "efb11932177e383c572d6eab903a9e54a115d6274071fd670349b591c2f4b4d8": "5.13.0-5.14.1",
                "84f9dc6160a97068ce06189c7eafbfc2133f584dd7859548152976ac4fa4fed2": "5.15.0-5.17.0",
                "63d4e10e3d3d61a1c29c9e76c290e460d0e4189d83c4ea3e81e4c5f956464617": "5.18.0-5.24.0",
            },
            replace=_replace_layer_update,
        ),
        Target(
            module=MODULE,
            qualname="StaticLayer.update",
            originals={
                "ee4886d3398efef610b76c1e6a8e30e642bd15b6e3c3365ab532efdfd38c8965": "5.13.0-5.24.0",
            },
            replace=_replace_layer_update,
        ),
        Target(
            module=MODULE,
            qualname="StaticSlidingWindowLayer.update",
            originals={
                "e292f922e791d7160e09319d1078485767d16317957675238959bdf90408016b": "5.13.0-5.24.0",
            },
            replace=_replace_layer_update,
        ),
    ),
)
