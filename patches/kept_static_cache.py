"""A static cache kept on the model across ``generate()`` calls is rebuilt when the model moved.

What breaks (transformers 5.13.0 - 5.14.1): ``GenerationMixin._prepare_static_cache`` keeps the
static cache on the model (``self._cache``, "will persist across calls") and builds a new one only
when the batch size, the maximum length or offloading change; otherwise it resets the old one and
hands it back. A model that generated once with ``cache_implementation="static"`` on the host (or
in float32) and is then moved with ``model.to(device)`` (or ``model.to(torch.bfloat16)``) generates
again into the old cache, whose tensors are still on the host (or in float32)::

    RuntimeError: index_copy_(): self, index and source expected to be in the same device, but got
    (self) cpu, (index) cpu, and (source) fakeaccel:0
    RuntimeError: index_copy_(): self and source expected to have the same dtype, but got (self)
    Float and (source) BFloat16

(With ``kv-cache-dtype`` active the dtype case runs, but casts the whole float32 cache for the
bfloat16 query on every step.) 5.15.0 builds a new static cache on every call (and keeps only the
largest length, to avoid recompilations), so the stale cache cannot come back there: its code is
recorded as "fixed". The same kept-cache code is in 5.0.0 - 5.12.1 (without the chunked-prefill
early initialisation, so another fingerprint); the overlay does not cover releases before 5.13.0.

What the replacement does: it wraps the original (no copied code). Before calling it, it compares
the model's device and dtype with those the kept cache was built for, and when they differ it
drops ``self._cache``, so that the release's own code builds a fresh cache exactly as it does on a
first call (lazy or early initialisation, encoder-decoder caches, offloading: all as shipped).
When they agree the original runs untouched and hands back the same cache object, so the reuse
that spares ``torch.compile`` a recompilation is kept. The cache it returns is stamped with the
model's device and dtype (an attribute on the cache object). A kept cache without a stamp (built
before the overlay was applied in this process) is judged by its initialised layers: the first
layer's keys must be on the model's device, in the model's dtype (the device check is skipped for
a model spread over several devices, where layers legitimately live on different ones; a cache
built under autocast may be rebuilt once, which is what 5.15.0 does on every call anyway).

Cost: reading ``self.device`` and ``self.dtype`` (the first parameter) once per ``generate()``
call; nothing per decoding step.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Patch, Target, wraps

PATCH_ID = "kept-static-cache"
MODULE = "transformers.generation.utils"

#: Attribute set on every static cache the wrapped function hands out: (device, dtype) of the
#: model it was built (or last reused) for.
STAMP = "_attn_overlay_built_for"


def _layers_of(cache):
    """Every cache layer of a kept cache: a ``StaticCache``'s, or both halves of an ``EncoderDecoderCache``."""
    for part in (cache, getattr(cache, "self_attention_cache", None), getattr(cache, "cross_attention_cache", None)):
        layers = getattr(part, "layers", None)
        if isinstance(layers, list):
            yield from layers


def _placement_from_tensors(model, cache):
    """(device or None, dtype) of the first initialised layer's keys; None when none is initialised."""
    for layer in _layers_of(cache):
        keys = getattr(layer, "keys", None)
        if getattr(layer, "is_initialized", False) and keys is not None and hasattr(keys, "device"):
            device_map = getattr(model, "hf_device_map", None)
            spread = isinstance(device_map, dict) and len(set(device_map.values())) > 1
            return (None if spread else keys.device), keys.dtype
    return None


def make_replacement(original, variant):
    @wraps(original)
    def _prepare_static_cache(self, *args, **kwargs):
        now = (self.device, self.dtype)
        kept = self.__dict__.get("_cache")
        if kept is not None:
            built_for = getattr(kept, STAMP, None) or _placement_from_tensors(self, kept)
            if built_for is not None and (
                (built_for[0] is not None and built_for[0] != now[0]) or built_for[1] != now[1]
            ):
                # Slow path: the release's own code builds a fresh cache, as on a first call.
                del self.__dict__["_cache"]
                report.record_outside_compile(PATCH_ID, f"rebuilt a kept static cache for {now[0]} / {now[1]}")
        cache = original(self, *args, **kwargs)
        try:
            setattr(cache, STAMP, now)
        except AttributeError:  # a cache class with __slots__: judged by its tensors next time
            pass
        return cache

    return _prepare_static_cache



PATCH = Patch(
    id=PATCH_ID,
    title="A static cache kept across generate() calls is rebuilt when the model's device or dtype changed",
    errors=(
        "index_copy_(): self, index and source expected to be in the same device, but got (self) cpu, "
        "(index) cpu, and (source) cuda:0",
        "index_copy_(): self and source expected to have the same dtype, but got (self) Float and (source) BFloat16",
    ),
    why=(
        "Up to 5.14.1 generate() keeps the static cache on the model across calls and rebuilds it only when "
        "the batch size, maximum length or offloading change, so after model.to(device) or .to(dtype) the "
        "next call writes into the old cache on the old device, in the old dtype."
    ),
    upstream="fixed in transformers 5.15.0 (GenerationMixin._prepare_static_cache builds a new cache per call)",
    affected=">=5.13.0,<5.15.0",
    fixed_in="5.15.0",
    targets=(
        Target(
            module=MODULE,
            qualname="GenerationMixin._prepare_static_cache",
            originals={
                "a325910db6113caa8e5a8865630759e8ec44a09f4020b1d37186155daced271c": "5.13.0-5.14.1",
            },
            fixed={
                "aa2c8b5252e1e65d424369b249a43dd78d0f4b1f9f89baa7e1a3476e7001a266": "5.15.0-5.24.0",
            },
            replace=make_replacement,
        ),
    ),
)
