"""``encoder_repetition_penalty`` with beams or return sequences penalises each row by its own prompt.

What breaks: ``generate(..., encoder_repetition_penalty=p)`` with ``num_beams > 1`` or
``num_return_sequences > 1`` gives other tokens than upstream's fixed release. No error.
``generate()`` builds ``EncoderRepetitionPenaltyLogitsProcessor`` from the unexpanded prompt
(``batch`` rows) while the scores it processes have one row per beam or return sequence
(``batch x n`` rows). ``torch.gather``/``scatter`` silently use the first ``batch`` rows of the
scores: row ``i`` gets prompt ``i``'s penalty (prompt 0's second beam gets prompt 1's tokens), and
the last ``batch x (n - 1)`` rows get none. A batch of one with beams favours its prompt tokens in
beam 0 only.

Upstream (the release after the last affected one; no pull request found):
``EncoderRepetitionPenaltyLogitsProcessor.__call__`` repeats each prompt's ids for its rows
(``repeat_interleave(scores rows // prompt rows)``) when the scores have more rows than the ids.

What the replacement does: it wraps that ``__call__``. When the scores have no more rows than the
ids (greedy or sampling with one sequence, or a processor built with expanded ids) it calls the
release's own ``__call__``: the same scores, bit for bit. Otherwise it runs upstream's three lines
with the ids repeated as upstream repeats them. Like upstream's fix, it also covers a processor the
caller builds and passes in ``logits_processor``.

Cost: per decoding step, one comparison of two row counts. With more score rows, the repeated ids
are built once per processor and row count (cached on the processor, keyed by the ids tensor), so
each step adds only that cache look-up to upstream's own gather and scatter; one
``overlay.report`` count per processor (per generate() call), never while compiling.

Not changed: calls whose scores have no more rows than the ids, and the penalty itself. 4.x's
group beam search (it calls the processors per group, ``batch x group size`` rows) gets the same
rule as every other mode: row ``r`` belongs to prompt ``r // (rows // prompts)``.

Tested (``tests/patches/encoder_repetition_penalty_rows/``); the full account:
docs/patches/encoder-repetition-penalty-rows.md.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "encoder-repetition-penalty-rows"
MODULE = "transformers.generation.logits_process"
#: Where the replacement caches ``(ids tensor, score rows, repeated ids)`` on the processor.
CACHE_ATTRIBUTE = "_attn_overlay_expanded_encoder_ids"


def _replace_call(original, variant):
    @wraps(original)
    def __call__(self, input_ids, scores):
        ids = self.encoder_input_ids
        rows = scores.shape[0]
        if rows <= ids.shape[0]:
            return original(self, input_ids, scores)
        import torch

        cached = self.__dict__.get(CACHE_ATTRIBUTE)
        if cached is not None and cached[0] is ids and cached[1] == rows:
            expanded = cached[2]
        else:
            expanded = ids.repeat_interleave(rows // ids.shape[0], dim=0)
            if not torch.compiler.is_compiling():
                self.__dict__[CACHE_ATTRIBUTE] = (ids, rows, expanded)
                report.record(PATCH_ID, "repeated the prompt ids for each beam or return sequence")
        # Upstream's body (5.19.0), with the repeated ids.
        score = torch.gather(scores, 1, expanded)
        score = torch.where(score < 0, score * self.penalty, score / self.penalty)
        return scores.scatter(1, expanded, score)

    return __call__


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="output",
    title="encoder_repetition_penalty with beams or return sequences penalises each row by its own prompt",
    errors=(
        "(no error) generate(encoder_repetition_penalty=..., num_beams=N) or num_return_sequences=N: "
        "beams and return sequences other than the first prompt's first get another prompt's penalty or none",
    ),
    why=(
        "generate() builds EncoderRepetitionPenaltyLogitsProcessor from the unexpanded prompt ids, and its "
        "gather and scatter silently touch only the first batch rows of the expanded scores."
    ),
    upstream=(
        "fixed in {fixed_in}: EncoderRepetitionPenaltyLogitsProcessor.__call__ repeats the prompt ids for "
        "the beams' rows (no pull request found)"
    ),
    targets=(
        Target(
            module=MODULE,
            qualname="EncoderRepetitionPenaltyLogitsProcessor.__call__",
            replace=_replace_call,
        ),
    ),
)
