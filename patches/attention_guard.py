"""A guard at the attention entry: q, k, v must go together, or the error says which one does not.

What breaks: when query, key and value reach an attention kernel on different devices, in
different dtypes or with incompatible shapes, the user gets a raw kernel error from deep inside
torch ("Expected all tensors to be on the same device ...", "Expected query, key, and value to
have the same dtype ...", "expected scalar type ... but found ...", "query and key must have the
same dtype", a matmul shape error) that names neither the layer nor the tensor at fault.

Where the guard sits, and why: every attention layer in 5.x that dispatches through the
attention registry calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
eager_attention_forward)`` right before calling the kernel with ``(module, query, key, value,
...)``. ``get_interface`` is the one place that sees both the registered kernels (sdpa,
flash_attention_2/3/4, flex_attention, paged variants, anything registered by users or kernels
hub) *and* each model's own ``eager_attention_forward`` (passed as ``default``): wrapping the
registry's entries instead would miss eager, which is why the dtype fix itself lives in
``Cache.update`` (patch ``kv-cache-dtype``) and this guard only validates. The replacement wraps
what ``get_interface`` returns in a small function that runs
:func:`overlay.guard.check_attention_inputs` and then calls the kernel.

Coverage, honestly: the modeling files of 326 of the 500 model folders of 5.18.0 (357 of 532 in
5.24.0) dispatch this way, every current decoder LLM among them (Llama, Qwen*, Gemma*, Mistral,
...). Not covered: models that index ``ALL_ATTENTION_FUNCTIONS[...]`` directly (SAM-family vision
models, one Qwen2.5-Omni branch) and the 24 models of 5.18.0 that use a KV cache but write their
attention inline (XLM, ProphetNet, LED, MPT, ...). There the cache side (``kv-cache-dtype``) still
aligns dtypes; only the named error for device/shape problems is missing.

Behaviour per mode (``ATTN_OVERLAY_ATTENTION_GUARD`` / ``overlay.guard.set_mode``):
``align`` (default) casts key/value to the query's dtype if they still differ (after the cache
patch they normally do not) and raises :class:`overlay.guard.AttentionInputError` on device or
shape problems; ``strict`` raises on any of them, dtype included; ``off`` returns the kernel
unwrapped. Under autocast dtypes are left to autocast (see ``overlay/guard.py``).

Cost: when everything agrees, a handful of attribute comparisons per attention call; no copy,
no kernel; under ``torch.compile`` the checks are decided at trace time (no graph break).
"""

from __future__ import annotations

from overlay import guard
from overlay.patch import Patch, Target, wraps

MODULE = "transformers.modeling_utils"


def _guarded(function, attn_implementation):
    """``function`` with the attention-entry check in front of it."""

    @wraps(function)
    def guarded_attention(module, query, key, value, *args, **kwargs):
        query, key, value = guard.check_attention_inputs(
            query, key, value, module=module, attn_implementation=attn_implementation
        )
        return function(module, query, key, value, *args, **kwargs)

    return guarded_attention


def _replace_get_interface(original):
    # One wrapper per (kernel, implementation name), built once: get_interface runs on every
    # attention call of every layer, and building a wrapper each time would cost more than the check.
    wrappers: dict = {}

    @wraps(original)
    def get_interface(self, attn_implementation, default):
        function = original(self, attn_implementation, default)
        if function is None or guard.get_mode() == guard.OFF:
            return function
        key = (function, attn_implementation)
        guarded = wrappers.get(key)
        if guarded is None:
            guarded = wrappers[key] = _guarded(function, attn_implementation)
        return guarded

    return get_interface


PATCH = Patch(
    id="attention-guard",
    title="Attention entry guard: q, k, v on one device, one dtype, compatible shapes (named errors)",
    errors=(
        "Expected all tensors to be on the same device, but found at least two devices",
        "Expected query, key, and value to have the same dtype",
        "expected scalar type BFloat16 but found Float",
        "query and key must have the same dtype",
    ),
    why=(
        "Attention kernels validate their inputs themselves, deep inside torch, with messages that name "
        "neither the layer nor the tensor at fault; nothing in transformers checks q, k, v where they meet."
    ),
    upstream="none: no transformers release up to 5.24.0 validates attention inputs at dispatch",
    affected=">=5.13.0",
    fixed_in=None,
    targets=(
        Target(
            module=MODULE,
            qualname="AttentionInterface.get_interface",
            originals={
                "a9d96a2a90be43b1c335d52304ae8e3efb2ab6c8dfce0251df7c840d0215fc85": "5.13.0-5.18.0",
                "5c12a08a6f62f3b6695d5c2bf2d2f1fe40fb26475c9ceb03fa21841fe3ababdc": "5.19.0-5.24.0",
            },
            replace=_replace_get_interface,
        ),
    ),
)
