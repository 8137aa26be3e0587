"""Chunked attention (Llama 4) counts each left-padded row's chunks from its first token.

4.55.0 - 4.55.4, Llama 4 (``attention_chunk_size``; the only model of 4.55.x with chunked attention
layers): in a left-padded batch whose context is longer than one chunk (prompt or decoding), the
padded rows generate other tokens than the same rows alone. No error. ``chunked_overlay`` puts ``q``
and ``kv`` in one chunk when ``kv // chunk_size == q // chunk_size``, counted from column 0 of the
batch, so a row padded by ``p`` tokens has its chunk boundaries ``p`` tokens early. 4.56.0 (#40324)
counts from each row's first token: ``(x - left_padding[b]) // chunk_size``, the left padding
being ``(attention_mask.cumsum(-1) == 0).sum(-1)`` of the 2D mask.

Policy: the target is ``chunked_causal_mask_function``, looked up in ``masking_utils`` by the
release's ``create_chunked_causal_mask`` on every call. ``create_chunked_causal_mask`` itself is
reached through names bound at import, which the engine's swap does not reach:
``LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING`` (the static-cache masks ``generate()`` builds ahead) and
``modeling_llama4``'s import. Called from that function (its code object, checked), the
replacement reads the call's ``attention_mask`` (the 2D boolean one), ``kv_length`` and
``kv_offset`` from the caller's frame and returns 4.56.0's mask function (chunks from each row's
first token, and causal), built with the release's ``and_masks``; padding, the sdpa/eager/flex
builders and the sdpa ``is_causal`` skip stay the release's. It returns the release's own function
with no 2D mask, with a context within one chunk (a 2D mask, which spans every position, no wider
than a chunk, or ``kv_length + kv_offset <= chunk_size`` in Python ints: every position in chunk 0
either way), for any other caller, and while torch.compile traces. Without left padding the mask
is the release's, element for element. Built only where ``create_chunked_causal_mask`` is the code
it reads (the variant's ``caller`` fingerprint) and on torch >= 2.6 (4.55's mask builders vmap
without the batch dimension before): else "failed".

Limits: torch < 2.6 (4.56.0 keeps the old mask there too); a mask built inside a torch.compile'd
region (a compiled forward with a dynamic cache; ``generate()``'s own compilation with a static
cache builds its masks outside, in eager). Flash attention 2 keeps no chunk pattern (it raises
beyond one chunk, as upstream) and the export path's ``sdpa_mask_without_vmap`` keeps its own,
without left padding, as upstream does. Flex attention: its block mask is built and checked in
the tests (without torch.compile), the attention itself not run (4.55.4's flex fails on the CPU).

Cost: nothing for models without chunked attention (only ``create_chunked_causal_mask`` calls it).
For Llama 4, once per chunked mask, i.e. once per decoding step (with a static cache in
``prepare_inputs_for_generation``; the forward reuses it): a frame lookup and a read of the
caller's locals, about 5 us (measured on the test CPU). Beyond one chunk, 4.56.0's mask function:
three small kernels on the (batch, seen tokens) mask (cumsum, ==, sum), and in the vmapped mask
build a batch index and two subtractions more per element, which about doubles the release's mask
build (measured on the test CPU, a decoding step of 2 rows: 2.5 - 3.9 ms stock, 5.9 - 10.2 ms
patched, 6.0 - 7.7 ms for 4.57.6's own fixed mask, which pays it within one chunk too); one
``overlay.report`` count (not whether a row was padded: that needs a device sync). No host sync.

The full account: docs/patches/chunked-attention-left-padding.md.
"""

from __future__ import annotations

import inspect
import sys

from overlay import report
from overlay.patch import Target, fingerprint, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "chunked-attention-left-padding"
MODULE = "transformers.masking_utils"
QUALNAME = "chunked_causal_mask_function"
#: The function whose call this patch reads (its local ``attention_mask``, ``kv_length``, ``kv_offset``).
CALLER = "create_chunked_causal_mask"
ACTION = "counted the chunks of a chunked attention mask from each row's first token"


def left_padding_tokens(attention_mask):
    """The number of padding tokens before each row's first token, from a 2D mask (4.56.0's way)."""
    return (attention_mask.cumsum(dim=-1) == 0).sum(dim=-1)


def chunks_from_first_token(chunk_size: int, left_padding):
    """Upstream's ``chunked_overlay(chunk_size, left_padding)`` (4.56.0): positions in one chunk,
    counted from each row's first token."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return (kv_idx - left_padding[batch_idx]) // chunk_size == (q_idx - left_padding[batch_idx]) // chunk_size

    return inner_mask


def make_mask_function(original, variant):
    namespace = original.__globals__  # transformers.masking_utils itself: what the original looks up
    caller = namespace.get(CALLER)
    caller = inspect.unwrap(caller) if callable(caller) else None
    found = fingerprint(caller) if caller is not None else None
    if found != variant["caller"]:
        raise ValueError(
            f"{MODULE}:{CALLER} is not the code this patch reads (sha256 {(found or 'none')[:12]}); not patched"
        )
    if not namespace.get("_is_torch_greater_or_equal_than_2_6", False):
        raise ValueError(
            "needs torch >= 2.6: the mask builders of this release vmap a chunked mask function without the "
            "batch dimension on older torch (transformers 4.56.0 keeps the old mask there too)"
        )
    caller_code = caller.__code__
    and_masks = namespace["and_masks"]
    causal_mask_function = namespace["causal_mask_function"]

    @wraps(original)
    def chunked_causal_mask_function(chunk_size):
        import torch

        if torch.compiler.is_compiling():
            return original(chunk_size)
        frame = sys._getframe(1)
        try:
            if frame.f_code is not caller_code:
                return original(chunk_size)
            call = frame.f_locals
            attention_mask, kv_length, kv_offset = call.get("attention_mask"), call.get("kv_length"), call.get("kv_offset")
        finally:
            del frame
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
            return original(chunk_size)
        if attention_mask.shape[-1] <= chunk_size or (
            isinstance(kv_length, int) and isinstance(kv_offset, int) and kv_length + kv_offset <= chunk_size
        ):
            return original(chunk_size)  # one chunk holds every position, counted either way
        left_padding = left_padding_tokens(attention_mask)
        report.record(PATCH_ID, ACTION)
        return and_masks(chunks_from_first_token(chunk_size, left_padding), causal_mask_function)

    return chunked_causal_mask_function


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="output",
    title="Chunked attention (Llama 4) counts each left-padded row's chunks from its first token",
    errors=(
        "(no error) a left-padded batch on Llama 4 (attention_chunk_size) longer than one chunk: the padded "
        "rows generate other tokens than the same rows alone",
    ),
    why=(
        "On 4.55.x chunked_overlay counts the chunks from column 0 of the batch (kv // chunk_size == "
        "q // chunk_size), so a row left-padded by p tokens has its chunk boundaries p tokens early."
    ),
    upstream="huggingface/transformers#40324 (chunks counted from each row's first token), in {fixed_in}",
    targets=(
        Target(
            module=MODULE,
            qualname=QUALNAME,
            variants={
                "counts_from_column_zero": {"caller": "d96b7666967b150953be0594f55c9410482faf3c7f85de3722e5740747761818"},
            },
            replace=make_mask_function,
        ),
    ),
)
