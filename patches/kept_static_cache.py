"""A static cache kept on the model across ``generate()`` calls is rebuilt when the model moved,
or when a failed call left it half-initialised.

Up to 5.14.1 ``generate()`` keeps the static cache on the model (``self._cache``):
``GenerationMixin._get_cache`` on 4.55 - 5.0.0, ``GenerationMixin._prepare_static_cache`` (the
same logic, renamed) on 5.1.0 - 5.14.1. It builds a new cache only when the batch size, the
maximum length or offloading change (4.55: the cache class); otherwise it resets the old one and
hands it back. Two bugs follow; 5.15.0 builds a new static cache on every call (fixed upstream).

1. The model moved (4.55.4 - 5.14.1). After ``model.to(device)`` or ``model.to(torch.bfloat16)``
   a static ``generate()`` writes into the old cache, still on the host or in float32:
   ``index_copy_(): self, index and source expected to be in the same device`` (4.56 on),
   ``index_copy_(): self and source expected to have the same dtype``, or on 4.55 (whose layers
   cast on write) SDPA's ``Expected query, key, and value to have the same dtype``.
2. A failed call poisons the model (4.56.2 - 5.12.1). The layers allocate their tensors, and set
   ``max_batch_size``, on their first write; a static ``generate()`` that fails before every
   layer was written once (an id outside the vocabulary, an out-of-memory error or Ctrl-C in the
   prefill) leaves the kept cache half-initialised, and every later static ``generate()`` fails
   in the reuse check until the model is reloaded:
   ``AttributeError: 'StaticLayer' object has no attribute 'max_batch_size'``.

Policy: the replacement wraps the original (no copied code), the same wrapper for both functions.
Before calling it, it drops ``self._cache`` when the model's device or dtype differs from those
the kept cache was built for (stamped on the cache when the wrapped function hands it out; an
unstamped cache is judged by its first allocated layer's keys), or (4.56.2 - 5.12.1) when any
self-attention layer its reuse check reads was never fully initialised, as the release tells it.
The release's own code then builds a fresh cache exactly as on a first call. When the kept cache
is fine the original runs untouched and hands back the same cache object, so the reuse that
spares ``torch.compile`` a recompilation is kept.

Limits: a cache passed in by the user (``past_key_values=``) is theirs, never kept on the model,
and never touched. The device check is skipped for a model spread over several devices; a cache
built under autocast may be rebuilt once (what 5.15.0 does on every call anyway).

Cost: reading ``self.device`` and ``self.dtype`` once per ``generate()`` call, on 4.55 binding the
call's arguments, and on 4.56.2 - 5.12.1 a look at each cache layer's attributes; nothing per
decoding step.

The full account (each release, the stamp, how it is tested): docs/patches/kept-static-cache.md.
"""

from __future__ import annotations

import inspect

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

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


def _checked_layers(cache):
    """The layers the release's reuse check reads: the cache's own, or the self-attention half of an
    ``EncoderDecoderCache`` (of the cross-attention half it reads only the length, fixed at build)."""
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", None)
    return layers if isinstance(layers, list) else []


def _placement_from_tensors(model, cache):
    """(device or None, dtype) of the first allocated layer's keys; None when none is allocated."""
    for layer in _layers_of(cache):
        keys = getattr(layer, "keys", None)
        if hasattr(keys, "device") and getattr(layer, "is_initialized", True):
            device_map = getattr(model, "hf_device_map", None)
            spread = isinstance(device_map, dict) and len(set(device_map.values())) > 1
            return (None if spread else keys.device), keys.dtype
    return None


# How a release tells a kept layer is whole (``Variant.params["layer_ready"]``): what its reuse
# check (``Cache.max_batch_size`` reads ``max_batch_size`` from every layer) and ``reset()`` need.


def _tensors_allocated(layer) -> bool:
    """4.56: a layer gets ``max_batch_size`` and its two tensors on its first write; no flag."""
    return hasattr(layer, "max_batch_size") and getattr(layer, "values", None) is not None


def _flagged_initialised(layer) -> bool:
    """4.57 - 5.12: attention layers set ``is_initialized`` once their tensors exist;
    linear-attention layers (5.5+) have no such flag, only the ``max_batch_size`` the check reads."""
    return hasattr(layer, "max_batch_size") and getattr(layer, "is_initialized", True)


def _model_dtype(model):
    """``model.dtype``, except on 5.0.0rc1, whose ``dtype`` answers ``model._dtype`` (set at
    construction) while it is set: a model cast afterwards (``model.to(torch.bfloat16)``) still says
    float32 there, so read its weights as the other releases do."""
    if model.__dict__.get("_dtype") is not None:
        return next(p.dtype for p in model.parameters() if p.is_floating_point())
    return model.dtype


def make_replacement(original, variant):
    device_argument = variant["device_argument"]
    layer_ready = variant["layer_ready"]
    signature = inspect.signature(original) if device_argument is not None else None

    @wraps(original)
    def kept_static_cache(self, *args, **kwargs):
        if device_argument is None:  # the release builds the cache on the model's device
            now = (self.device, _model_dtype(self))
        else:  # 4.55: on the device it is given (the inputs')
            now = (signature.bind(self, *args, **kwargs).arguments[device_argument], _model_dtype(self))
        kept = self.__dict__.get("_cache")
        if kept is not None:
            built_for = getattr(kept, STAMP, None) or _placement_from_tensors(self, kept)
            if built_for is not None and (
                (built_for[0] is not None and built_for[0] != now[0]) or built_for[1] != now[1]
            ):
                action = f"rebuilt a kept static cache for {now[0]} / {now[1]}"
            elif layer_ready is not None and not all(layer_ready(layer) for layer in _checked_layers(kept)):
                action = "rebuilt a kept static cache a failed generate() left half-initialised"
            else:
                action = None
            if action is not None:
                # Slow path: the release's own code builds a fresh cache, as on a first call.
                del self.__dict__["_cache"]
                report.record_outside_compile(PATCH_ID, action)
        cache = original(self, *args, **kwargs)
        try:
            setattr(cache, STAMP, now)
        except AttributeError:  # a cache class with __slots__: judged by its tensors next time
            pass
        return cache

    return kept_static_cache


#: 4.55: ``_get_cache(..., device, model_kwargs)`` builds the cache's tensors at once, on ``device``,
#: in the model's dtype: nothing is ever half-built.
EAGER = {"device_argument": "device", "layer_ready": None}
#: 4.56 - 5.12: layers allocate on their first write; the reuse check reads every layer.
LAZY_ALLOCATED = {"device_argument": None, "layer_ready": _tensors_allocated}
LAZY_FLAGGED = {"device_argument": None, "layer_ready": _flagged_initialised}
#: 5.13 - 5.14: the reuse check skips layers never written (``Cache.batch_size``), and they
#: initialise on their next write: a half-initialised cache is fine there.
TOLERANT = {"device_argument": None, "layer_ready": None}


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title=(
        "A static cache kept across generate() calls is rebuilt when the model's device or dtype changed, "
        "or when a failed call left it half-initialised"
    ),
    errors=(
        "index_copy_(): self, index and source expected to be in the same device, but got (self) cpu, "
        "(index) cpu, and (source) cuda:0",
        # 4.56 - 5.3: the write positions come from generate(), on the model's device.
        "index_copy_(): self, index and source expected to be in the same device, but got (self) cpu, "
        "(index) cuda:0, and (source) cuda:0",
        "index_copy_(): self and source expected to have the same dtype, but got (self) Float and (source) BFloat16",
        # 4.55: the layers cast the new states to the cache's dtype on write; SDPA then fails.
        "Expected query, key, and value to have the same dtype, but got query.dtype: c10::BFloat16 "
        "key.dtype: float and value.dtype: float instead.",
        "AttributeError: 'StaticLayer' object has no attribute 'max_batch_size'",
    ),
    why=(
        "Up to 5.14.1 generate() keeps the static cache on the model across calls and rebuilds it only when "
        "the batch size, maximum length or offloading change, so after model.to(device) or .to(dtype) the "
        "next call writes into the old cache on the old device, in the old dtype, and (4.56 - 5.12) a call "
        "that failed before each layer's first write leaves layers uninitialised that every later call trips on."
    ),
    upstream=(
        "fixed in {fixed_in} (GenerationMixin._prepare_static_cache builds a new cache per call); "
        "the half-initialised cache since 5.13.0 (the reuse check reads Cache.batch_size)"
    ),
    targets=(
        Target(
            module=MODULE,
            qualname="GenerationMixin._get_cache",
            variants={"eager": EAGER, "lazy_allocated": LAZY_ALLOCATED, "lazy_flagged": LAZY_FLAGGED},
            replace=make_replacement,
            optional=True,
        ),
        Target(
            module=MODULE,
            qualname="GenerationMixin._prepare_static_cache",
            variants={"lazy_flagged": LAZY_FLAGGED, "tolerant": TOLERANT},
            replace=make_replacement,
            optional=True,
        ),
    ),
    doctor=("kept-static-cache",),
)
