"""ExecuTorch seq2seq export: allocate the decoder's static cache in the model's dtype, not float32.

What breaks: ``transformers.integrations.executorch.Seq2SeqLMDecoderExportableModuleWithStaticCache``
(used by ``Seq2SeqLMExportableModule``, the T5/Whisper-style export recipe) early-initialises its
``StaticCache`` with a hard-coded ``torch.float32``. A bfloat16 (or float16) model then writes
bfloat16 states into float32 buffers: ``index_copy_(): self and source expected to have the same
dtype, but got (self) Float and (source) BFloat16`` on the first decoder step, eagerly or while
``torch.export`` traces it.

Fix: wrap ``__init__``. After the original has built the cache and registered its buffers, every
cache layer whose buffers are not in the model's dtype is re-initialised through the layer's own
``lazy_initialization`` (same batch, heads, length and head dims, the model's dtype, same device;
it re-marks the static addresses) and the module's ``key_cache_{i}`` / ``value_cache_{i}``
buffers are re-registered to the new tensors. ``cumulative_length`` buffers are untouched.

Why the model's dtype here, when ``kv-cache-dtype`` follows the query's: this module exists to be
exported, and an exported program runs without autocast, so the model's dtype *is* the compute
dtype; the buffers become part of the exported program, which is exactly where a float32 copy of
a bfloat16 model's cache would cost twice the memory plus a cast per step. (With only
``kv-cache-dtype`` active the float32 cache would run, but with those costs baked into the program.)

Cost: at construction only, and only when the model is not float32: the float32 buffers are
allocated by the original ``__init__`` and dropped right after (a transient float32 cache). Nothing
changes at run time, and a float32 model is left exactly as before.
"""

from __future__ import annotations

from overlay.patch import Patch, Target, wraps

PATCH_ID = "executorch-cache-dtype"
MODULE = "transformers.integrations.executorch"


def _replace_init(original, variant):
    @wraps(original)
    def __init__(self, model, *args, **kwargs):
        original(self, model, *args, **kwargs)
        _realloc_cache_in_model_dtype(self, model)

    return __init__


def _realloc_cache_in_model_dtype(module, model):
    import torch

    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return
    reallocated = None
    for i, layer in enumerate(module.static_cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or (keys.dtype == dtype and values.dtype == dtype):
            continue
        batch, heads, _, k_head_dim = keys.shape
        v_head_dim = values.shape[-1]
        device = keys.device
        layer.keys = layer.values = None
        layer.is_initialized = False
        # The layer's own allocation path: dtypes from the (empty) states, static addresses re-marked.
        layer.lazy_initialization(
            torch.empty((batch, heads, 0, k_head_dim), dtype=dtype, device=device),
            torch.empty((batch, values.shape[1], 0, v_head_dim), dtype=dtype, device=device),
        )
        module.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
        module.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
        reallocated = keys.dtype
    if reallocated is not None and not torch.compiler.is_compiling():
        from overlay import report

        report.record(PATCH_ID, f"allocated the export cache in {dtype} instead of {reallocated}")


PATCH = Patch(
    id=PATCH_ID,
    title="ExecuTorch seq2seq export allocates its static cache in the model's dtype",
    errors=(
        "index_copy_(): self and source expected to have the same dtype, but got (self) Float and (source) BFloat16",
    ),
    why=(
        "Seq2SeqLMDecoderExportableModuleWithStaticCache.__init__ calls StaticCache.early_initialization with a "
        "hard-coded torch.float32, so a bfloat16/float16 decoder writes its states into float32 buffers."
    ),
    upstream="none: transformers up to 5.24.0 hard-codes torch.float32 there",
    affected=">=5.13.0",
    fixed_in=None,
    targets=(
        Target(
            module=MODULE,
            qualname="Seq2SeqLMDecoderExportableModuleWithStaticCache.__init__",
            originals={
                "7a0fd4f32efde8c251a1e22ed9abe3403b3a054a50c1366309d23c814d70eb44": "5.13.0-5.22.2",
                "ea7b87b769ebea4d34c0486333e211797e4c7da49229903a86daec844514d4b8": "5.23.0-5.24.0",
            },
            replace=_replace_init,
        ),
    ),
)
