"""On a machine with an Intel XPU, SDPA keeps the causal mask of a multi-token query over a cache.

What breaks (4.55.0 - 4.57.6, where ``torch.xpu.is_available()``): assisted decoding
(``assistant_model=``), prompt lookup (``prompt_lookup_num_tokens=``) and chunked prefill
(``prefill_chunk_size``) with SDPA generate other tokens than plain greedy decoding. No error. Their
multi-token queries over a non-empty cache lose the causal mask: ``_ignore_causal_mask_sdpa``
skips it on XPU machines whenever the query's first columns of the 2D mask hold no padding
(``padding_mask[:, :query_length].all()``), without asking whether the query starts at key 0. SDPA
then applies ``is_causal=True``, which aligns query ``i`` with key ``i`` (top-left): each new token
sees the first keys of the cache instead of its own prefix. The rule reads the machine
(``_is_torch_xpu_available``, set at import), not the tensors' device: a model on the CPU of an XPU
machine is affected too.

Upstream: 5.0.0rc0 moves the XPU rule into ``_can_skip_causal_mask_xpu``, which also requires the 2D
mask to be empty past the query (a first prefill; that narrower rule is upstream-fixes row 10, made
exact in 5.14.0 by passing the query's offset); the releases this patch covers have neither.

What the replacement does: it wraps ``_ignore_causal_mask_sdpa`` (looked up in ``masking_utils`` by
the SDPA mask builders on every call) and keeps the release's answer, except where only the XPU rule
skips: a query of more than one token that is not as long as the keys. There it answers "keep the
mask", as the CUDA and CPU rule does, and the builders make the explicit causal mask.

Limits: a first prefill into a static cache on an XPU machine (empty cache, keys longer than the
query) also gets the explicit mask where the release used ``is_causal``: the same attention, without
that kernel shortcut (5.14.0 keeps it, knowing the offset; these releases do not pass it). Flash,
flex and eager attention build no such skip.

Cost: one Python call and two integer comparisons per mask built (once per forward, not per layer):
about 0.15 us per decoding step (figure 7 of ``scripts/bench``). Tested (``tests/patches/xpu_sdpa_mask_skip/``) with the
release's XPU flag set on the CPU; the full account: docs/patches/xpu-sdpa-mask-skip.md.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "xpu-sdpa-mask-skip"
MODULE = "transformers.masking_utils"
ACTION = "kept the causal mask of a multi-token query over a cache (XPU rule)"


def _replace_ignore_causal_mask_sdpa(original, variant):
    @wraps(original)
    # The release's own signature (one code shape, 4.55.0 - 4.57.6): no *args packing per call.
    def _ignore_causal_mask_sdpa(padding_mask, query_length, kv_length, kv_offset, local_attention_size=None):
        skip = original(padding_mask, query_length, kv_length, kv_offset, local_attention_size)
        if skip and query_length != 1 and kv_length != query_length:
            # Only the XPU rule skips here; is_causal would align the query with the first keys.
            report.record_outside_compile(PATCH_ID, ACTION)
            return False
        return skip

    return _ignore_causal_mask_sdpa


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="output",
    title="On an XPU machine, SDPA keeps the causal mask of a multi-token query over a cache",
    errors=(
        "(no error) on a machine with an Intel XPU, generate() with assistant_model, "
        "prompt_lookup_num_tokens or prefill_chunk_size gives other tokens than plain greedy decoding",
    ),
    why=(
        "masking_utils._ignore_causal_mask_sdpa skips the mask on XPU machines for any multi-token query "
        "whose first mask columns hold no padding, so SDPA's top-left is_causal runs over a non-empty cache."
    ),
    upstream=(
        "fixed in {fixed_in}: the XPU rule moves to _can_skip_causal_mask_xpu and requires a mask empty past "
        "the query (made exact later by huggingface/transformers#47019)"
    ),
    targets=(
        Target(module=MODULE, qualname="_ignore_causal_mask_sdpa", replace=_replace_ignore_causal_mask_sdpa),
    ),
)
