"""ExecuTorch seq2seq export: allocate the decoder's static cache in the model's dtype, not float32.

What breaks: ``transformers.integrations.executorch.Seq2SeqLMDecoderExportableModuleWithStaticCache``
(used by ``Seq2SeqLMExportableModule``, the T5/Whisper-style export recipe, and by
optimum-executorch, which pins transformers 5.0.0rc1) allocates its ``StaticCache`` with a
hard-coded ``torch.float32``. A bfloat16 (or float16) model then writes bfloat16 states into
float32 buffers: ``index_copy_(): self and source expected to have the same dtype, but got (self)
Float and (source) BFloat16`` on the first decoder step, eagerly or while ``torch.export`` traces
it. On 4.55 the cache's ``update`` casts the states to its own float32 first, so the write
succeeds and the float32 keys reach T5's attention instead: ``expected scalar type BFloat16 but
found Float``.

Code shapes (one fingerprint each, all the same bug, one replacement for all; which release ships
which is in ``patches/releases.json``):

- 4.55: ``StaticCache(config, max_batch_size, max_cache_len, device="cpu",
  dtype=torch.float32)``; the layers allocate their tensors in ``StaticLayer.__init__``.
- 4.56 - 5.3: ``early_initialization(batch, heads, head_dim, torch.float32, model_device)``
  through ``StaticLayer.lazy_initialization`` (one argument on 4.56-4.57, two since 5.0: a
  difference in ``cache_utils`` that this target's fingerprint cannot see).
- 5.4 - 5.5.0: sliding-window layers swapped for ``StaticLayer(layer.max_cache_len)`` and
  ``cumulative_length_{i}`` buffers registered too.
- from 5.5.1 (two fingerprints, the second from 5.23.0): ``StaticLayer(max_static_cache_length)`` and
  ``get_head_shapes(config)`` (per-layer head shapes possible).

No variant parameters: what the replacement touches (each layer's ``keys`` / ``values`` /
``dtype`` and the module's ``key_cache_{i}`` / ``value_cache_{i}`` buffers) is the same in every
shape above, so the variants are labels only.

Fix: wrap ``__init__``. After the original has built the cache and registered its buffers, every
cache layer whose tensors are not in the model's dtype (the decoder weights' dtype: 5.0.0rc1's
``model.dtype`` still says float32 for a model cast to bfloat16 after construction) gets new zero tensors of the same shapes
on the same device in the model's dtype (what the release's own allocation does, with static
addresses marked as it marks them; done here rather than through ``lazy_initialization``, whose
signature changed under one fingerprint of this target), the layer's ``dtype`` follows, and the
module's ``key_cache_{i}`` / ``value_cache_{i}`` buffers are re-registered to the new tensors.
``cumulative_length`` buffers (5.4+), shapes and devices are untouched.

Why the model's dtype here, when ``kv-cache-dtype`` follows the query's: this module exists to be
exported, and an exported program runs without autocast, so the model's dtype *is* the compute
dtype; the buffers become part of the exported program, which is exactly where a float32 copy of
a bfloat16 model's cache would cost twice the memory plus a cast per step. (With only
``kv-cache-dtype`` active the float32 cache would run, but with those costs baked into the program.)

Cost: at construction only, and only when the model is not float32: the float32 buffers are
allocated by the original ``__init__`` and dropped right after (a transient float32 cache). Nothing
changes at run time, and a float32 model is left exactly as before.

Not covered: 4.55's hard-coded ``device="cpu"`` for the cache (a model on an accelerator gets a
host cache there, stock and patched alike); releases before 4.55.
"""

from __future__ import annotations

from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

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

    # The dtype of the decoder's weights, which the states it writes have (no autocast in an exported
    # program): not ``model.dtype``, which 5.0.0rc1 answers from construction (``_dtype``), so a
    # model cast to bfloat16 afterwards still says float32 there.
    dtype = next((p.dtype for p in module.decoder.parameters() if p.is_floating_point()), None)
    if dtype is None:
        return
    reallocated = None
    for i, layer in enumerate(module.static_cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or (keys.dtype == dtype and values.dtype == dtype):
            continue
        # What every release's own allocation does (StaticLayer.__init__ on 4.55,
        # lazy_initialization since 4.56), in the model's dtype: same shapes and device, zeros,
        # static addresses marked. Not through lazy_initialization itself: its signature changed
        # (one argument on 4.56-4.57, two since 5.0) under one fingerprint of this target.
        layer.keys = torch.zeros(keys.shape, dtype=dtype, device=keys.device)
        layer.values = torch.zeros(values.shape, dtype=dtype, device=values.device)
        layer.dtype = dtype
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)
        module.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
        module.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
        reallocated = keys.dtype
    if reallocated is not None and not torch.compiler.is_compiling():
        from overlay import report

        report.record(PATCH_ID, f"allocated the export cache in {dtype} instead of {reallocated}")


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="ExecuTorch seq2seq export allocates its static cache in the model's dtype",
    errors=(
        "index_copy_(): self and source expected to have the same dtype, but got (self) Float and (source) BFloat16",
        # 4.55: the cache casts the states to float32 on write; T5's attention matmul then fails.
        "expected scalar type BFloat16 but found Float",
    ),
    why=(
        "Seq2SeqLMDecoderExportableModuleWithStaticCache.__init__ allocates its StaticCache with a hard-coded "
        "torch.float32, so a bfloat16/float16 decoder writes its states into float32 buffers."
    ),
    upstream="none: transformers up to {newest_release} hard-codes torch.float32 there",
    targets=(
        Target(
            module=MODULE,
            qualname="Seq2SeqLMDecoderExportableModuleWithStaticCache.__init__",
            replace=_replace_init,
        ),
    ),
)
