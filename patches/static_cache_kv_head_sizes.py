"""A static cache layer stores keys and values each in its own head size (DeepSeek-V2/V3, and LongCat-Flash
by its code: ``qk_nope_head_dim + qk_rope_head_dim`` keys, ``v_head_dim`` values).

What breaks (4.55.0 - 5.0.0rc1): ``generate(..., cache_implementation="static")`` (or a ``StaticCache``
passed as ``past_key_values``) on a model whose key and value head sizes differ fails at the first
write of the first attention layer, in ``StaticLayer.update``::

    RuntimeError: index_copy_(): Source/destination tensor must have same slice shapes. Destination
    slice shape: 1 4 24 at dimension 2 and source slice shape: 1 4 12 at dimension 0.

The cause: one head size for both buffers. 4.56.0 - 5.0.0rc1 allocate a layer lazily from the keys
alone (``lazy_initialization(key_states)``: the values get the keys' head size); 4.55.x allocates
both in ``StaticLayer.__init__`` from ``config.head_dim``, which DeepSeek sets to
``qk_rope_head_dim`` (there the keys fail first). Upstream (5.0.0rc2) passes the value states to
``lazy_initialization``, which sizes the values by them.

What the replacement does (one target, ``StaticLayer.update``, wrapping the original), outside
torch.compile: it initialises the layer as the release's own ``update`` would (4.56.x: ``keys is
None``; 4.57.x - 5.0.0rc1: ``is_initialized``; 4.55.x: allocated already). Then, whoever allocated
the buffers (``kv-cache-dtype`` may do it before the layer's ``update``), each buffer whose last size
is not the head size of the states written to it is reallocated in that size, with the layer's own
batch, heads, length, dtype and device (and a static address), only while the layer holds no token:
such a buffer cannot have been written. Then the original runs, unchanged. Equal head sizes never
reach the reallocation.

Cost: on each static layer's first write only, two shape comparisons (and, where it reallocates, two
``any()``, a device sync, and the new buffers); the layer then calls the release's ``update`` directly
(its bound method, set on the layer), so decoding runs no wrapper. One ``overlay.report`` count per
layer reallocated.

Not covered: a layer that holds tokens (a cache filled by another model) keeps stock's error; under
torch.compile (a compiled prefill, ``torch.export`` with ``early_initialization``, which sizes
both buffers from one ``head_dim``, upstream's fix included) nothing changes; sliding-window layers
(their own ``update``; no model with both ships in these releases); a head count that differs from
the allocation (tensor parallelism: ``static-cache-tp-heads``).

Tested (``tests/patches/static_cache_kv_head_sizes/``): tiny random DeepSeek-V3 (sdpa, eager) and V2
(one prompt, a left-padded batch; generate's cache and a user's): stock raises the error, the overlay
gives the dynamic cache's ids (and ``use_cache=False``'s), also with a compiled decode; Llama is
unchanged. Account: docs/patches/static-cache-kv-head-sizes.md.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "static-cache-kv-head-sizes"
MODULE = "transformers.cache_utils"
ACTION = "sized a static cache layer's buffers by the key and value head sizes written to it"
BUFFERS = ("keys", "values")


# -- what differs between releases: when the release's own update initialises the layer -------------


def _allocated_by_constructor(layer) -> bool:
    """4.55.x: ``StaticLayer.__init__`` allocates both buffers (``config.head_dim``)."""
    return False


def _keys_none(layer) -> bool:
    """4.56.x: ``if self.keys is None: self.lazy_initialization(key_states)``."""
    return layer.keys is None


def _not_initialized(layer) -> bool:
    """4.57.0 - 5.0.0rc1: ``if not self.is_initialized: self.lazy_initialization(key_states)``."""
    return not layer.is_initialized


def _resize_empty_buffers(layer, key_states, value_states) -> bool:
    """Reallocate each buffer whose head size is not that of the states written to it, when the layer
    holds no token; True when it did."""
    import torch

    wrong = [
        (name, states.shape[-1])
        for name, states in zip(BUFFERS, (key_states, value_states), strict=True)
        if isinstance(getattr(layer, name, None), torch.Tensor)
        and getattr(layer, name).dim() == states.dim()
        and getattr(layer, name).shape[-1] != states.shape[-1]
    ]
    if not wrong or any(getattr(layer, name).any() for name in BUFFERS):
        return False  # nothing to do, or a layer that holds tokens: the original says what is wrong
    for name, head_size in wrong:
        old = getattr(layer, name)
        new = old.new_zeros((*old.shape[:-1], head_size))
        torch._dynamo.mark_static_address(new)
        setattr(layer, name, new)
        if name == "keys" and hasattr(layer, "head_dim"):
            layer.head_dim = head_size
    return True


def make_update(original, variant):
    needs_initialisation = variant["needs_initialisation"]

    @wraps(original)
    def update(self, key_states, value_states, *args, **kwargs):
        import torch

        if not torch.compiler.is_compiling() and key_states is not None and value_states is not None:
            if needs_initialisation(self):
                self.lazy_initialization(key_states)  # the original's own first statement
            if _resize_empty_buffers(self, key_states, value_states):
                report.record(PATCH_ID, ACTION)
            # A layer's head sizes are settled by its first write: from then on this layer calls the
            # release's update directly, so the decoding loop pays nothing for the check.
            self.__dict__["update"] = original.__get__(self, type(self))
        return original(self, key_states, value_states, *args, **kwargs)

    return update


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="A static cache stores keys and values in their own head sizes (DeepSeek-V2/V3: qk_head_dim != v_head_dim)",
    errors=("RuntimeError: index_copy_(): Source/destination tensor must have same slice shapes.",),
    why=(
        "StaticLayer allocates its values with the keys' head size (lazily from the key states; on the oldest "
        "releases both from config.head_dim), so a model whose value heads differ from its key heads cannot "
        "write to it."
    ),
    upstream="fixed in {fixed_in}: StaticLayer.lazy_initialization takes the value states (sizes the values by them)",
    targets=(
        Target(
            module=MODULE,
            qualname="StaticLayer.update",
            defaults={"needs_initialisation": _not_initialized},
            variants={
                # Buffers allocated by the constructor, from config.head_dim.
                "allocated_by_constructor": {"needs_initialisation": _allocated_by_constructor},
                # `if self.keys is None: self.lazy_initialization(key_states)`.
                "initialised_when_keys_none": {"needs_initialisation": _keys_none},
                # `if not self.is_initialized: self.lazy_initialization(key_states)`.
                "initialised_from_keys": {},
            },
            replace=make_update,
        ),
    ),
)
