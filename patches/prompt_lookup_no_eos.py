"""Prompt lookup decoding works for models without an end-of-sequence token.

What breaks: ``model.generate(..., prompt_lookup_num_tokens=N)`` on a model whose generation config
has no ``eos_token_id`` (and none passed to ``generate()``) raises as soon as the prompt lookup
finds an n-gram match, in the prompt or in what the model generated so far (a repeated phrase is
enough), with default settings otherwise: ``TypeError: isin() received an invalid combination of
arguments - got (Tensor, NoneType), ...``. ``PromptLookupCandidateGenerator.get_candidates`` cuts
the candidate tokens at the first end-of-sequence token with ``torch.isin(chosen_ids,
self.eos_token_id)`` (``isin_mps_friendly`` up to 5.0.0), and generate() hands it
``generation_config._eos_token_tensor``, which is ``None`` when no eos token is set.

Upstream (5.13.0, huggingface/transformers#46790) skips that cut when ``eos_token_id`` is ``None``.

What the replacement does: it wraps ``get_candidates``. With an eos token it calls the original
with the same arguments and does nothing else (one attribute read per decoding step). Without
one, it lends the generator, for that call only, an empty tensor of token ids as its eos tokens:
``isin`` then finds no eos token and nothing is cut, which is exactly what the fixed release does;
the attribute is ``None`` again when the call returns (or raises). Cost on that path: one empty
tensor per call. It records in ``overlay.report`` only the calls that found candidates (the ones
stock would have failed in).

Not covered: other candidate generators (assisted decoding with an assistant model reads the
assistant's own eos tokens; not part of this bug). Prompt lookup supports batch size 1 only, on
every release.

Tested (``tests/patches/prompt_lookup_no_eos/``): tiny Llama and Qwen 3 without an eos token, a
prompt with a repeated phrase and a random one, greedy: stock raises the ``TypeError`` above;
the overlay gives the same ids as greedy decoding without prompt lookup (what 5.13.0+ gives);
models with an eos token are unchanged. Longer account: docs/patches/prompt-lookup-no-eos.md.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "prompt-lookup-no-eos"
MODULE = "transformers.generation.candidate_generator"


def _replace_get_candidates(original, variant):
    @wraps(original)
    def get_candidates(self, input_ids, *args, **kwargs):
        if self.eos_token_id is not None:
            # Every decoding step of prompt lookup. The calls the releases make are spelled out
            # (``(input_ids)``; 5.0.x ``(input_ids, is_first_iteration)``): a plain call runs in the
            # same eval loop, ``f(*args, **kwargs)`` costs CPython about 1,500 instructions more.
            if not kwargs:
                if not args:
                    return original(self, input_ids)
                if len(args) == 1:
                    return original(self, input_ids, args[0])
            return original(self, input_ids, *args, **kwargs)
        # No eos token: an empty set of eos ids makes the release's isin() find none, so no
        # candidate is cut, as in 5.13.0+ (which skips the cut when eos_token_id is None).
        self.eos_token_id = input_ids.new_empty(0)
        try:
            candidates = original(self, input_ids, *args, **kwargs)
        finally:
            self.eos_token_id = None
        if candidates[0].shape[-1] > input_ids.shape[-1]:
            # Candidates were found: stock reached isin(..., None) and raised here.
            report.record_outside_compile(PATCH_ID, "looked up candidates without an eos token")
        return candidates

    return get_candidates


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="Prompt lookup decoding (prompt_lookup_num_tokens) works for models without an eos token",
    errors=(
        "TypeError: isin() received an invalid combination of arguments - got (Tensor, NoneType), "
        "but expected one of:",
    ),
    why=(
        "PromptLookupCandidateGenerator.get_candidates cuts its candidates at the first eos token with "
        "torch.isin(chosen_ids, eos_token_id), and generate() passes None there when no eos token is set."
    ),
    upstream="huggingface/transformers#46790 (the eos cut is skipped without an eos token), in {fixed_in}",
    targets=(
        Target(
            module=MODULE,
            qualname="PromptLookupCandidateGenerator.get_candidates",
            replace=_replace_get_candidates,
        ),
    ),
)
