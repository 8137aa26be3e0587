"""KV cache dtype alignment: attention gets the compute dtype, and no precision stock keeps is lost.

What breaks (every transformers release from 4.55.0 on; nothing upstream aligns
dtypes; covered from 4.55.0 on): a KV cache whose dtype differs from the states the model writes
to it. A float32 ``StaticCache`` (user-built, reused from a float32 run, or allocated by generate
under ``torch.autocast``) meets bfloat16 states and ``StaticLayer.update`` fails in
``index_copy_`` ("self and source expected to have the same dtype"); a ``DynamicCache`` or
``EncoderDecoderCache`` prefilled in float32, then decoded in bfloat16, hands attention float32
keys and values for a bfloat16 query: SDPA "Expected query, key, and value to have the same
dtype", eager "expected scalar type ... but found ...", FlashAttention-2 "query and key must have
the same dtype".

Policy (mode ``align``, the default). The target dtype is the dtype of the incoming
``key_states``, i.e. the query's compute dtype: what attention would get with no cache at all.
1. Read side, every cache updated through ``Cache.update``: the keys handed back are cast to it
   when they differ (the values too, when they come in the keys' dtype), with a one-time
   :class:`overlay.guard.KVCacheDtypeWarning` naming the layer and the two dtypes.
2. Write side, only static layers (fixed buffers, whose in-place writes refuse another dtype):
   the new states are cast to the buffer's dtype, after the layer's own lazy initialisation; a
   narrowing write warns that PRECISION IS LOST. Dynamic layers are left alone on write:
   ``torch.cat`` promotes the cache to the wider dtype, exactly as stock.
3. Cross-attention caches (``EncoderDecoderCache``, read directly by the models): layer ``i`` is
   converted once, in place, by the same decoder layer's self-attention ``Cache.update`` whenever
   that update is not on the fast path.
4. Under ``torch.autocast`` dtypes are autocast's business: only the write into a static layer is
   cast (stock would fail in ``index_copy_``), nothing is reported.
``check`` raises :class:`overlay.guard.CacheDtypeError` exactly where ``align`` would warn; ``off``
passes everything through as stock.

Limits: not covered are a layer's ``update`` called directly (``DynamicCache(ddp_cache_data)``,
dynamic layers only), other direct reads of cached tensors (Mllama's cross-attention layers:
``attention-guard`` aligns them), caches that override ``Cache.update`` without calling it
(OLMo-Hybrid's on 5.13.x, the paged cache of continuous batching) and quantized layers; a
cross-attention cache whose self-attention cache already holds states in the compute dtype is not
converted (3). Out of scope: models that keep some projections in float32 (model precision).

Cost: one replacement, ``Cache.update``, stock's own body with two dtype comparisons in front (no
wrapper frame); when dtypes agree, no copy, no kernel, no graph break. Under callgrind, per layer
and decode step: 100-280 instructions less than stock on 5.13.0-5.24.0, about 1,100-1,650 more
per dynamic update on 4.56.0-5.3.0, about 1,300 more per static update on 4.55.4. A fresh
layer's first update (prefill) takes the slow path only where it could change something
(:func:`_first_update_is_plain`).

The full account (every case, the modes, the costs, the variants): docs/patches/kv-cache-dtype.md.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from overlay import guard
from overlay.patch import Target, fingerprint, wraps
from overlay.releases import patch_with_release_facts

MODULE = "transformers.cache_utils"
PATCH_ID = "kv-cache-dtype"
#: Attribute set on an EncoderDecoderCache's self-attention cache: its cross-attention cache.
CROSS_ATTR = "_attn_overlay_cross_attention_cache"


# -- the fast paths: one Cache.update replacement per shape of stock's ----------------------------
# Each is stock's own body for the common case (layer there, dtypes agree) with the dtype checks in
# front, written out in full for its shape: a shared helper would add a Python frame per layer and
# step (about 300 instructions), the whole budget. Anything else goes to the slow path.


def _replace_cache_update(original, variant):
    """``Cache.update`` with the dtype checks in front (see the module docstring): the fast path
    of the variant's shape (``variant["fast_path"]``), around what the slow path needs to know."""
    static = _static_layers(original.__globals__, variant)
    return variant["fast_path"](original, static, _dynamic_layer(original.__globals__))


def _replace_any_cache_kwargs_update(original, static, dynamic_layer):
    """5.4.0 on: ``Cache.update(key_states, value_states, layer_idx, *args, **kwargs)``."""
    dynamic_layers = _dynamic_layer_classes(original.__globals__)

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
        # as in stock (whose ``while`` loop appends nothing for it). A layer not initialised yet
        # holds ``keys = None``, whose ``.dtype`` raises AttributeError: the slow path too.
        try:
            layer = self.layers[layer_idx]
            if self.offloading:
                fast = False
            elif type(layer) is dynamic_layer:  # three dtype reads (see _dynamic_layer)
                dtype = key_states.dtype
                fast = layer.keys.dtype is dtype and (
                    (cached := layer.values.dtype) is dtype or cached is value_states.dtype
                )
            else:
                fast = layer.keys.dtype is key_states.dtype and layer.values.dtype is value_states.dtype
        except AttributeError:  # once per layer and call: see _first_update_is_plain
            fast = _first_update_is_plain(self, layer_idx, key_states, value_states, dynamic_layers, static)
        except (TypeError, IndexError):
            fast = False
        if fast:
            # The layer's update with the arguments stock passes it. The two shapes transformers
            # uses are spelled out (none, up to 5.23; ``kwargs=kwargs`` from 5.24), so that the call
            # is a plain one: ``f(*args, **kwargs)`` costs CPython ~1,500 more instructions per
            # call (a new eval loop), and binds exactly the same arguments.
            if not args:
                if not kwargs:
                    return layer.update(key_states, value_states)
                if len(kwargs) == 1 and "kwargs" in kwargs:
                    return layer.update(key_states, value_states, kwargs=kwargs["kwargs"])
            return layer.update(key_states, value_states, *args, **kwargs)
        return _slow_update(original, static, self, key_states, value_states, layer_idx, args, kwargs)

    return update


def _replace_named_cache_kwargs_update(original, static, dynamic_layer):
    """4.56.0-5.3.0: stock's signature, ``(key_states, value_states, layer_idx, cache_kwargs=None)``,
    and its layer call, ``layer.update(key_states, value_states, cache_kwargs)``, spelled out.

    The same fast path as :func:`_replace_cache_update`'s (stock's body, which 4.56.0 on
    share), but these releases' models always pass ``cache_kwargs`` (positionally), which the
    generic ``*args, **kwargs`` signature would re-pack on every call. Nothing is re-packed here to
    save, so the ``.dtype`` reads (about 420 instructions each under callgrind, torch 2.13; three
    for a ``DynamicLayer``, :func:`_dynamic_layer`) are the whole cost; for a ``StaticLayer`` (the
    layer of every full-attention model's static cache) they are not made at all: its own
    ``update`` refuses states in another dtype (:data:`REFUSING_STATIC_UPDATES`), so once the slow
    path has seen the layer's buffers in the states' dtypes (:data:`OWN_WRITE_CHECK`) the layer is
    called directly, and a refusal sends the update to the slow path, which casts.
    """
    dynamic_layers = _dynamic_layer_classes(original.__globals__)
    refusing_layer = _layer_refusing_other_dtypes(original.__globals__)
    dynamo_compiling = getattr(getattr(sys.modules.get("torch"), "compiler", None), "is_dynamo_compiling", None)
    if dynamo_compiling is None:  # a torch without it: every layer takes the dtype reads
        refusing_layer, dynamo_compiling = None, bool

    @wraps(original)
    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        own_check = fast = False
        try:  # the checks only, as in _replace_cache_update
            layer = self.layers[layer_idx]
            if not self.offloading:
                # Under dynamo a refused write on fake tensors cannot be caught in the graph: there
                # the dtypes are compared (decided at trace time), as for every other layer.
                kind = type(layer)
                if kind is refusing_layer and not dynamo_compiling():
                    # Set by the slow path, which every layer takes first (AttributeError until then).
                    own_check = layer._attn_overlay_own_write_checks_dtype
                elif kind is dynamic_layer:  # three dtype reads (see _dynamic_layer)
                    dtype = key_states.dtype
                    fast = layer.keys.dtype is dtype and (
                        (cached := layer.values.dtype) is dtype or cached is value_states.dtype
                    )
                else:
                    fast = layer.keys.dtype is key_states.dtype and layer.values.dtype is value_states.dtype
        except AttributeError:  # once per layer and call: see _first_update_is_plain
            fast = _first_update_is_plain(self, layer_idx, key_states, value_states, dynamic_layers)
        except (TypeError, IndexError):
            pass
        if own_check:
            try:
                return layer.update(key_states, value_states, cache_kwargs)
            except RuntimeError:
                if not _dtypes_differ(layer, key_states, value_states):
                    raise  # the layer's own error, unchanged, raised once (as on stock)
        elif fast:
            return layer.update(key_states, value_states, cache_kwargs)
        result = _slow_update(original, static, self, key_states, value_states, layer_idx, (cache_kwargs,), {})
        if refusing_layer is not None and not dynamo_compiling():
            _mark_own_write_check(self, layer_idx, refusing_layer, key_states, value_states)
        return result

    return update


def _replace_processed_cache_update(original, static, dynamic_layer):
    """4.55.x: ``Cache.update`` is ``@apply_processors`` around ``append_new_layers`` and ``layer.update``.

    Stock runs, in this order: the cache processor's ``pre_update`` (when ``cache_processor`` is
    set), ``self.append_new_layers(layer_idx)``, the layer's ``update(key_states, value_states,
    cache_kwargs)``, the processor's ``post_update``. The fast path is that sequence for a cache
    without a processor, whose layer ``layer_idx`` stores exactly the incoming dtypes: the
    processor check (``None``), the same ``append_new_layers`` call, the same layer call; only
    the decorator's wrapper frame is gone. A cache with a processor (``OffloadedCache``,
    ``OffloadedStaticCache``, the quantized caches, a user's ``CacheProcessor``) always takes the
    slow path, which calls the original, hooks included: no hook is ever skipped, and the write
    side casts before ``pre_update`` sees the states (offloading moves layers, never states; the
    quantized processor only works after the update).
    """

    @wraps(original)
    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        # Only the checks are inside ``try``: an error raised by append_new_layers or by the
        # layer's own update reaches the caller as on stock, and runs once. An object without
        # ``cache_processor`` goes to the original, which raises stock's AttributeError.
        try:
            plain = self.cache_processor is None
        except AttributeError:
            plain = False
        if plain:
            # Stock's first statement when no processor is set (appends layers up to layer_idx).
            self.append_new_layers(layer_idx)
            try:
                layer = self.layers[layer_idx]
                if type(layer) is dynamic_layer:  # three dtype reads (see _dynamic_layer)
                    dtype = key_states.dtype
                    fast = layer.keys.dtype is dtype and (
                        (cached := layer.values.dtype) is dtype or cached is value_states.dtype
                    )
                else:
                    fast = layer.keys.dtype is key_states.dtype and layer.values.dtype is value_states.dtype
            except (AttributeError, TypeError, IndexError):
                fast = False
            if fast:
                return layer.update(key_states, value_states, cache_kwargs)
        # (A plain cache's layers are appended already: the original's own append is a no-op.)
        return _slow_update(original, static, self, key_states, value_states, layer_idx, (cache_kwargs,), {})

    return update


# -- what the fast paths read: the dynamic layer, the static layer that checks itself -------------


#: ``StaticLayer.update`` as 4.56.0-5.3.0 ship it (fingerprints, as for patch targets): lazy
#: initialisation (in the states' dtypes, so a fresh layer never mismatches), then the new states
#: written with ``index_copy_`` (``index_put_`` where that is not implemented), keys first. Both
#: refuse states in another dtype than the buffer (``RuntimeError``) before writing anything, and
#: nothing else changes before the writes, so a refused update can run again: at worst the keys
#: were written (they matched) and are written once more, the same states at the same positions.
#: Not listed, so compared dtype by dtype: 4.55.x (the layer casts on write, stock stores the
#: mismatch) and 5.4.0 on (``cumulative_length`` advances before the writes; a refused update
#: could not run again).
REFUSING_STATIC_UPDATES = {
    "8abf13e57d9119b41d1dc18782d710343bc0a988c6eda877228919b7f6ea042d": "4.56.0-4.56.2",
    "f5314eb96f772655621b66d8cd51ddbf30fcd5c1122cb1b0e15e785b4c4eeb96": "4.57.0-5.0.0rc1",
    "fda39c0bf3324208347f4a9968a341ac1e7b55b2513c1f02932f78bdf08b5fab": "5.0.0rc2",
    "e728f21c1f151f9441f2c516d5708f45c74614f83cb359ce1a2cc4f03f9bdc2c": "5.0.0rc3-5.3.0",
}

#: Set in a refusing static layer's ``__dict__`` by the slow path (read by the fast path as the
#: attribute ``layer._attn_overlay_own_write_checks_dtype``): True when its buffers were in the
#: states' dtypes (the layer's own write is the check from then on), False when not (every update
#: goes to the slow path, without a refusal, i.e. an exception, per decode step).
OWN_WRITE_CHECK = "_attn_overlay_own_write_checks_dtype"


def _dynamic_layer(namespace):
    """The release's ``DynamicLayer`` (exactly that class, not its subclasses), or None.

    Its fast-path test reads three dtypes instead of four (about 420 instructions each) when the
    cached values are in the dtype of the incoming *keys*: cached keys in the incoming keys' dtype
    and cached values in that same dtype pass without reading the incoming values' dtype. A dynamic
    layer has no write side (its ``torch.cat`` promotes, as on stock), so the test only has to say
    whether the slow path would change what is handed back, and with keys and values cached in the
    keys' dtype it never does: the keys come back in that dtype; the values too when the incoming
    values share it, and when they do not (autocast, or a model computing values in another dtype)
    the slow path leaves the values alone as well. Cached values in another dtype than the keys
    are compared with the incoming values, as in the four-read test (under autocast 5.24.0 on
    allocate them in the values' dtype). Where the two tests differ the cache already holds the
    keys' dtype, and the one thing skipped is the cross-attention conversion of an
    ``EncoderDecoderCache``, within the limit the module docstring states (point 3: a
    self-attention cache that already holds the compute dtype).

    The test is written out in each ``Cache.update`` replacement rather than called: a helper
    would add a Python frame (about 300 instructions), most of what the saved read is worth.
    """
    layer_class = namespace.get("DynamicLayer")
    return layer_class if isinstance(layer_class, type) else None


def _dynamic_layer_classes(namespace):
    """The release's ``DynamicLayer`` and ``DynamicSlidingWindowLayer`` (those classes exactly, as
    many as it ships): layers that initialise themselves from their first states and concatenate
    (see :func:`_first_update_is_plain`)."""
    sliding = namespace.get("DynamicSlidingWindowLayer")
    return tuple(layer_class for layer_class in (_dynamic_layer(namespace), sliding) if isinstance(layer_class, type))


def _first_update_is_plain(cache, layer_idx, key_states, value_states, dynamic_layers, static=None):
    """Whether the first update of a fresh layer may skip the slow path: it would call the original
    and change nothing. The fast path then calls the layer directly.

    Reached only where the fast path's dtype reads raised ``AttributeError``, which a fresh layer's
    ``keys = None`` does: once per layer and generate() call, at prefill, where the slow path cost
    about 29,000 (dynamic) and 41,000 (static) instructions more than stock per layer (5.18.0).

    - A ``DynamicLayer`` or ``DynamicSlidingWindowLayer`` (``dynamic_layers``: exactly those
      classes; the sliding one holds the sliding layers of Gemma 3's and other ``layer_types``
      models' default cache) initialises itself from the incoming states and concatenates, so what
      it hands back has the keys' dtype, and its values the values' dtype or the keys'
      (``torch.cat`` promotes): the slow path's read side, which acts only on keys not in the
      incoming keys' dtype and on values when the incoming values share the keys' dtype, finds
      nothing; a dynamic layer has no write side. Nothing is read for it here.
    - A static layer (``static``: 5.4.0 on only, whose ``StaticLayer`` does not check its own writes;
      4.56 - 5.3's does, and its first update goes to the slow path, which records that) is
      initialised here as the slow path initialises it (the layer's own lazy initialisation, the
      first statement of its ``update``), then its buffers' dtypes are compared with the states',
      as at every later step: equal, the slow path would warn, cast and report nothing.

    Either way a cache with a cross-attention cache to align (:data:`CROSS_ATTR`) keeps the slow
    path, as does anything else: a missing ``layers`` or ``offloading``, an initialised layer, a
    layer this very update appends (lazily replicated caches), a subclass of those classes.
    """
    try:
        layer = cache.layers[layer_idx]
        if cache.offloading is not False or getattr(cache, CROSS_ATTR, None) is not None:
            return False
        if layer.keys is not None:
            return False
        if type(layer) in dynamic_layers:
            # 4.57.0 on set ``is_initialized`` with ``keys``; 4.56.x has no such flag, and its own
            # update tests ``keys is None``, as done above.
            return getattr(layer, "is_initialized", False) is False
        if static is None or static.layer_class is None or not isinstance(layer, static.layer_class):
            return False
        static.initialise(layer, key_states, value_states)
        return layer.keys.dtype is key_states.dtype and layer.values.dtype is value_states.dtype
    except Exception:  # noqa: BLE001 - anything odd is the slow path's
        return False


def _layer_refusing_other_dtypes(namespace):
    """The release's ``StaticLayer`` when its ``update`` is one of :data:`REFUSING_STATIC_UPDATES`,
    else None (unknown code: its layers are compared dtype by dtype, as every other layer)."""
    layer_class = namespace.get("StaticLayer")
    own_update = vars(layer_class).get("update") if isinstance(layer_class, type) else None
    try:
        known = own_update is not None and fingerprint(own_update) in REFUSING_STATIC_UPDATES
    except (OSError, TypeError, AttributeError):  # no source to read: not recognised
        known = False
    return layer_class if known else None


def _dtypes_differ(layer, key_states, value_states):
    """Whether a layer's buffers and the incoming states differ in dtype (False for non-tensors)."""
    try:
        return layer.keys.dtype is not key_states.dtype or layer.values.dtype is not value_states.dtype
    except AttributeError:
        return False


def _mark_own_write_check(cache, layer_idx, refusing_layer, key_states, value_states):
    """After the slow path: whether layer ``layer_idx``'s own write may stand for the dtype check."""
    try:
        layer = cache.layers[layer_idx]
    except (AttributeError, TypeError, IndexError):
        return
    if type(layer) is refusing_layer and getattr(layer, "keys", None) is not None:
        layer.__dict__[OWN_WRITE_CHECK] = not _dtypes_differ(layer, key_states, value_states)


# -- the slow path: every update the fast path does not take ---------------------------------------


def _slow_update(original, static, cache, key_states, value_states, layer_idx, args, kwargs):
    import torch

    mode = guard._mode
    tensor = torch.Tensor
    if mode == guard.OFF or not (isinstance(key_states, tensor) and isinstance(value_states, tensor)):
        return original(cache, key_states, value_states, layer_idx, *args, **kwargs)
    compiling = torch.compiler.is_compiling()
    # What this one update changed, counted as one call by overlay.report (never while compiling).
    done = None if compiling else []
    autocast_dtype = _autocast_dtype(key_states)
    layer = _layer(cache, layer_idx)

    # Write side: only where a static layer writes in place (index_copy_/index_put_ refuse another
    # dtype); dynamic layers and the torch.cat branches of sliding ones promote, exactly like stock.
    write_k, write_v = key_states, value_states
    static_layer, _, initialise, casting = static
    if static_layer is not None and isinstance(layer, static_layer):
        # The first statement of every layer's update: the layer picks its dtypes as always.
        initialise(layer, key_states, value_states)
        if autocast_dtype is None:
            # Reported when first seen, whichever branch this update takes (check mode raises here).
            _report_static_mismatch(layer, layer_idx, key_states, value_states, mode, compiling)
        if type(layer).update in casting:
            # 4.55: the layer's own update casts the states to its buffers' dtype, so stock stores them:
            # nothing is cast here; a narrowing write is reported (check mode raises) as where the overlay casts.
            _to_buffer(layer, layer_idx, "keys", key_states, mode, autocast_dtype, compiling, done, cast=False)
            _to_buffer(layer, layer_idx, "values", value_states, mode, autocast_dtype, compiling, done, cast=False)
        elif _writes_in_place(layer, static, key_states.shape[-2]):
            write_k = _to_buffer(layer, layer_idx, "keys", key_states, mode, autocast_dtype, compiling, done)
            write_v = _to_buffer(layer, layer_idx, "values", value_states, mode, autocast_dtype, compiling, done)

    # The cross-attention cache of the same decoder layer, read directly right after this update.
    cross = getattr(cache, "__dict__", {}).get(CROSS_ATTR)
    if cross is not None and autocast_dtype is None:
        _align_cross_layer(cross, layer_idx, key_states, value_states, mode, compiling, done)

    keys, values = original(cache, write_k, write_v, layer_idx, *args, **kwargs)

    # Read side: the compute dtype, except under autocast (autocast casts in the kernels, as on stock).
    if autocast_dtype is None:
        if isinstance(keys, tensor) and keys.dtype is not key_states.dtype:
            keys = _hand_back(cache, layer, layer_idx, "keys", keys, key_states, mode, compiling, done)
        # Values only when they come in the keys' dtype: outside autocast, values in another dtype than
        # the keys (and the query) are a model-precision matter that attention rejects as on stock.
        if (
            isinstance(values, tensor)
            and values.dtype is not value_states.dtype
            and value_states.dtype is key_states.dtype
        ):
            values = _hand_back(cache, layer, layer_idx, "values", values, value_states, mode, compiling, done)
    if done:
        from overlay import report

        report.record(PATCH_ID, *done)
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
        if mode == guard.CHECK:
            raise guard.CacheDtypeError(layer, which, stored, states, layer_idx)
        if not compiling:
            guard.warn_cache_cast_once(layer_idx, layer, which, stored.dtype, states.dtype)


def _writes_in_place(layer, static, kv_length):
    """Whether this update writes the states into the static layer's buffers in place.

    ``StaticLayer.update`` always does (``index_copy_``). A sliding layer's own ``update`` does in
    some branches only: the variant's ``sliding_layers`` rule for it says which (see
    :func:`_static_layers`); its other branches concatenate (``torch.cat`` promotes) and copy back
    (``copy_`` casts), which works on stock and must stay as stock. A layer class with an
    ``update`` of its own is assumed to write in place.
    """
    rule = static.in_place_rules.get(type(layer).update)
    return True if rule is None else rule(layer, kv_length)


class StaticLayers(NamedTuple):
    """What the slow path knows of a release's static layers (read once, when the replacement is built)."""

    layer_class: Any  # the release's StaticLayer
    in_place_rules: dict  # a sliding layer class's own ``update`` -> whether this write is in place
    initialise: Any  # the layers' lazy initialisation, as their own ``update`` runs it
    casting: frozenset  # the own ``update`` of each layer class that casts to its buffers' dtype itself


def _static_layers(namespace, variant):
    """What the slow path needs to know about a release's static layers, from the variant:
    :class:`StaticLayers`.

    ``variant["sliding_layers"]`` names the sliding layer classes of the releases that share this
    ``Cache.update`` and the rule of each class's *own* ``update``; a named class that does not
    define ``update`` itself (4.57's deprecated ``SlidingWindowLayer``, which inherits
    ``StaticSlidingWindowLayer``'s) or that this release does not ship adds nothing, so one table
    describes every release of the variant. Read once, when the replacement is built.
    """
    rules = {}
    for name, rule in variant["sliding_layers"].items():
        own_update = vars(namespace.get(name, object)).get("update")
        if own_update is not None:
            rules[own_update] = rule
    casting = frozenset(
        own_update
        for own_update in (vars(namespace.get(name, object)).get("update") for name in variant["casts_on_write"])
        if own_update is not None
    )
    return StaticLayers(namespace.get("StaticLayer"), rules, variant["initialise"], casting)


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


def _to_buffer(layer, layer_idx, which, incoming, mode, autocast_dtype, compiling, done, cast=True):
    """Write side of a static layer: the incoming states in the buffer's dtype. ``cast=False``: the
    layer's own update casts them (4.55), so only the checks run and the states go on as they are.
    ``done`` (``None`` while compiling) collects what the update changed, for overlay.report."""
    stored = getattr(layer, which, None)
    if stored is None or stored.dtype is incoming.dtype:
        return incoming
    narrows = _narrows(stored.dtype, incoming.dtype, autocast_dtype)
    # A widening cast is exact and silent in every mode (the read side reports what it costs).
    if narrows and mode == guard.CHECK:
        raise guard.CacheDtypeError(layer, which, stored, incoming, layer_idx)
    if narrows and not compiling:
        guard.warn_cache_rounding_once(layer_idx, layer, which, stored.dtype, incoming.dtype)
    if not cast:
        return incoming
    if done is not None:
        done.append(f"stored {incoming.dtype} {which} in a {stored.dtype} static cache")
    return incoming.to(stored.dtype)


def _hand_back(cache, layer, layer_idx, which, returned, incoming, mode, compiling, done):
    """Read side: what the cache hands back, in the dtype of the incoming states."""
    if mode == guard.CHECK:
        raise guard.CacheDtypeError(layer if layer is not None else cache, which, returned, incoming, layer_idx)
    if not compiling:
        guard.warn_cache_cast_once(layer_idx, layer if layer is not None else cache, which, returned.dtype, incoming.dtype)
        done.append(f"cast {returned.dtype} cache {which} for {incoming.dtype} attention")
    return returned.to(incoming.dtype)


def _align_cross_layer(cross, layer_idx, key_states, value_states, mode, compiling, done):
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
        if mode == guard.CHECK:
            raise guard.CacheDtypeError(layer, which, stored, states, layer_idx, cache="cross-attention cache")
        converted = stored.to(dtype)
        setattr(layer, which, converted)
        if not compiling:
            if getattr(layer, "is_compileable", False):
                # A static layer: its new buffer keeps a static address for torch.compile/cudagraphs.
                torch._dynamo.mark_static_address(converted)
            narrows = torch.promote_types(stored.dtype, dtype) != dtype
            guard.warn_cross_cache_cast_once(layer_idx, layer, which, stored.dtype, dtype, narrows)
            done.append(f"converted {stored.dtype} cross-attention cache {which} to {dtype}")


# -- EncoderDecoderCache.__init__: where a cross-attention cache is found -------------------------


def _replace_encoder_decoder_init(original, variant):
    """``EncoderDecoderCache.__init__`` that tells the self-attention cache its cross-attention cache."""

    @wraps(original)
    def __init__(self, *args, **kwargs):
        # 4.55 names its two caches (``self_attention_cache``, ``cross_attention_cache``; its own
        # ``from_legacy_cache`` passes them by name); 4.56 on take ``*caches``.
        original(self, *args, **kwargs)
        # A plain reference (no cycle: the parent holds both, the self cache holds the cross one):
        # deepcopy/pickle of the parent keep it pointing at the copied cross-attention cache.
        holder = getattr(self.self_attention_cache, "__dict__", None)
        if holder is not None:
            holder[CROSS_ATTR] = self.cross_attention_cache

    return __init__


# The sliding layer classes of each variant's releases, with the rule of each class's own update.
# 4.55: ChunkedSlidingLayer's update writes in place (index_copy_) while the window has room, as 4.56's;
# StaticLayer and SlidingWindowLayer cast the states to their buffers' dtype first (``_CASTS_4_55``).
# -- what differs between releases (the variants' parameters) ----------------------------------
# Lazy initialisation, exactly as the first statement of that release's static layer ``update``.


def _initialise_keys_and_values(layer, key_states, value_states):
    """5.0.0 on: ``if not self.is_initialized: self.lazy_initialization(key_states, value_states)``."""
    if not layer.is_initialized:
        layer.lazy_initialization(key_states, value_states)


def _allocated_by_constructor(layer, key_states, value_states):
    """4.55.x: no lazy initialisation; ``StaticLayer.__init__`` allocates the buffers."""


def _initialise_from_keys(layer, key_states, value_states):
    """4.56.x-5.0.0rc2: ``lazy_initialization(key_states)`` (values take the keys' dtype and shape;
    5.0.0rc2: ``(key_states, value_states)``),
    when ``keys is None`` (4.56's test; 4.57's ``is_initialized`` is set with ``keys``, by
    ``lazy_initialization`` only, so it is the same test there)."""
    if layer.keys is None:
        # 5.0.0rc2 ships this Cache.update (one fingerprint with 4.56 - 5.0.0rc1) beside the
        # two-argument lazy_initialization of 5.0.0rc3 on: read the layer's own method, once per layer.
        import inspect

        if len(inspect.signature(layer.lazy_initialization).parameters) > 1:
            layer.lazy_initialization(key_states, value_states)
        else:
            layer.lazy_initialization(key_states)


# Whether a sliding layer's own ``update`` writes in place (index_copy_/index_put_ refuse another
# dtype) for ``kv_length`` new states; elsewhere it concatenates and ``copy_``s (works on stock).


def _window_in_place(current, room, kv_length):
    # full: one token is written with index_put_, more are concatenated; not full: index_copy_
    # while the window has room, concatenated when this update overflows it.
    if current >= room:
        return kv_length == 1
    return current + kv_length <= room


def _window_writes(layer, kv_length):
    """``StaticSlidingWindowLayer.update``, 5.4.0 on: its length as a Python int is ``cumulative_length_int``."""
    return _window_in_place(layer.cumulative_length_int, layer.max_cache_len, kv_length)


def _window_writes_int_length(layer, kv_length):
    """``StaticSlidingWindowLayer.update``, 4.57.x-5.3.0: ``cumulative_length`` is a Python int."""
    return _window_in_place(layer.cumulative_length, layer.max_cache_len, kv_length)


def _rolling_window_writes(layer, kv_length):
    """4.56's ``SlidingWindowLayer.update``: a prefill longer than the window is ``copy_``-ed (and the
    states returned as they came); any other update is written with ``index_copy_`` (not full) or
    ``index_put_`` into a rolled copy (full)."""
    return kv_length <= layer.max_cache_len


def _chunked_window_writes(layer, kv_length):
    """4.56's ``ChunkedSlidingLayer.update``: ``index_copy_`` while the window has room; once full,
    or when this update overflows it, ``torch.cat`` then ``copy_``."""
    current, room = layer.cumulative_length, layer.max_cache_len
    return current < room and current + kv_length <= room


_SLIDING_4_55 = {"ChunkedSlidingLayer": _chunked_window_writes}
_CASTS_4_55 = ("StaticLayer", "SlidingWindowLayer")
# 4.56 on: Cache.update calls the layer itself (no CacheProcessor hooks) and no layer casts on write.
_FROM_4_56 = {"casts_on_write": ()}
_NAMED_CACHE_KWARGS = {"fast_path": _replace_named_cache_kwargs_update}  # 4.56.0-5.3.0: (..., cache_kwargs=None)
_ANY_ARGUMENTS = {"fast_path": _replace_any_cache_kwargs_update}  # 5.4.0 on: Cache.update(..., *args, **kwargs)
_SLIDING_4_56_TO_4_57 = {
    "SlidingWindowLayer": _rolling_window_writes,  # 4.56 (4.57: a deprecated alias, no update of its own)
    "ChunkedSlidingLayer": _chunked_window_writes,  # 4.56 (4.57: the same)
    "StaticSlidingWindowLayer": _window_writes_int_length,  # 4.57
}
_SLIDING_5_0_TO_5_3 = {"StaticSlidingWindowLayer": _window_writes_int_length}
_SLIDING_FROM_5_4 = {"StaticSlidingWindowLayer": _window_writes}


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="KV cache hands attention the compute dtype; static caches store in their own dtype",
    errors=(
        "index_copy_(): self and source expected to have the same dtype, but got (self) Float and (source) BFloat16",
        "Expected query, key, and value to have the same dtype, but got query.dtype: c10::BFloat16 "
        "key.dtype: float and value.dtype: float instead.",
        "expected scalar type BFloat16 but found Float",
        "expected scalar type Float but found BFloat16",
        "query and key must have the same dtype",
    ),
    why=(
        "Cache layers keep the dtype they were first built in and never reconcile later states with it, so "
        "a cache built in float32 (user-built, a float32 prefix, generate's early init under autocast) meets "
        "bfloat16 states and a bfloat16 query."
    ),
    upstream="none: no transformers release up to {newest_release} aligns KV cache dtypes",
    targets=(
        Target(
            module=MODULE,
            qualname="Cache.update",
            variants={
                # @apply_processors (CacheProcessor hooks) around append_new_layers / layer.update.
                "cache_processors": {
                    "fast_path": _replace_processed_cache_update,
                    "casts_on_write": _CASTS_4_55,
                    "initialise": _allocated_by_constructor,
                    "sliding_layers": _SLIDING_4_55,
                },
                # One Cache.update body: append replicated layers / offload / layer.update / offload.
                "initialised_from_keys": {**_FROM_4_56, **_NAMED_CACHE_KWARGS, "initialise": _initialise_from_keys,
                                          "sliding_layers": _SLIDING_4_56_TO_4_57},
                "named_cache_kwargs": {**_FROM_4_56, **_NAMED_CACHE_KWARGS, "initialise": _initialise_keys_and_values,
                                       "sliding_layers": _SLIDING_5_0_TO_5_3},
                "any_cache_kwargs": {**_FROM_4_56, **_ANY_ARGUMENTS, "initialise": _initialise_keys_and_values,
                                     "sliding_layers": _SLIDING_FROM_5_4},
            },
            replace=_replace_cache_update,
        ),
        Target(
            module=MODULE,
            qualname="EncoderDecoderCache.__init__",
            replace=_replace_encoder_decoder_init,
        ),
    ),
    doctor=("cache-dtype-static", "cache-dtype-prefix"),
)
