"""``prefix_allowed_tokens_fn`` with sampling and several return sequences sees each row's own prompt.

What breaks: ``generate(..., do_sample=True, num_return_sequences=n, prefix_allowed_tokens_fn=fn)``
calls ``fn(batch_id, sent)`` with batch ids past the batch: ``IndexError: list index out of range``
(or whatever ``fn`` raises) in a function that indexes per prompt, or, when ``fn`` does not fail,
a second sample constrained by the next prompt's rule. ``generate()`` builds
``PrefixConstrainedLogitsProcessor(fn, num_beams)`` (4.55.x: ``num_beams // num_beam_groups``),
and the processor numbers its rows ``batch_id = row // _num_beams``; sampling has ``num_beams=1``
but ``batch x n`` rows, so row ``r`` is called prompt ``r`` instead of prompt ``r // n``.

Upstream (the release after the last affected one, no pull request found):
``GenerationMixin._get_logits_processor`` builds the processor with
``max(num_beams, num_return_sequences)``, the number of rows each prompt has. The processor class
is unchanged.

What the replacement does: it wraps ``_get_logits_processor``. When the generation config asks
for more return sequences than beams (sampling: beam search requires ``num_return_sequences <=
num_beams``, greedy search and assisted decoding one sequence) and generate() built the
``PrefixConstrainedLogitsProcessor`` itself (its ``_prefix_allowed_tokens_fn`` is the
``prefix_allowed_tokens_fn`` argument, and it is not a processor the caller passed in
``logits_processor``), that processor is swapped for a copy whose ``_num_beams`` is
``num_return_sequences``: what the fixed release passes. The processor's own ``__call__`` then
hands each prompt's rows their prompt's id, as on the fixed release.

Not changed: beam search (group beam search on 4.55.x too) and ``num_return_sequences=1``, where
the release already passes the rows per prompt; a ``PrefixConstrainedLogitsProcessor`` the caller
builds or passes (the class is not patched); generate() calls without ``prefix_allowed_tokens_fn``.
Models whose ``_get_logits_processor`` does not call the mixin's and continuous batching build
their own processors, unchanged.

Cost: none without ``prefix_allowed_tokens_fn``; with it and more return sequences than beams,
one shallow copy of the processor and one ``overlay.report`` count per generate() call. No host
sync, nothing per decoding step.

It wraps the same target as ``repetition-penalty-padding``; the engine layers the two.

Tested (``tests/patches/prefix_constrained_return_sequences/``); the full account:
docs/patches/prefix-constrained-return-sequences.md.
"""

from __future__ import annotations

import copy

from overlay import report
from overlay.patch import Target, argument_reader, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "prefix-constrained-return-sequences"
MODULE = "transformers.generation.utils"


def _replace_get_logits_processor(original, variant):
    argument = argument_reader(original)

    @wraps(original)
    def _get_logits_processor(self, *args, **kwargs):
        processors = original(self, *args, **kwargs)

        prefix_allowed_tokens_fn = argument(args, kwargs, "prefix_allowed_tokens_fn")
        if prefix_allowed_tokens_fn is None:
            return processors
        generation_config = argument(args, kwargs, "generation_config")
        num_beams = getattr(generation_config, "num_beams", None) or 1
        num_return_sequences = getattr(generation_config, "num_return_sequences", None) or 1
        if num_return_sequences <= num_beams:  # the release passes each prompt's rows already
            return processors
        from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

        passed = list(argument(args, kwargs, "logits_processor") or ())
        for index, processor in enumerate(processors):
            if (
                type(processor) is PrefixConstrainedLogitsProcessor
                and processor._prefix_allowed_tokens_fn is prefix_allowed_tokens_fn
                and not any(processor is theirs for theirs in passed)
                and processor._num_beams != num_return_sequences
            ):
                swapped = copy.copy(processor)
                swapped._num_beams = num_return_sequences  # max(num_beams, num_return_sequences), as upstream
                processors[index] = swapped
                report.record_outside_compile(PATCH_ID, "prefix constraint numbered by return sequences")
                break
        return processors

    return _get_logits_processor


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="both",
    title="prefix_allowed_tokens_fn with sampling and num_return_sequences sees each row's own prompt",
    errors=(
        "IndexError: list index out of range (in prefix_allowed_tokens_fn, called by "
        "PrefixConstrainedLogitsProcessor, with do_sample=True and num_return_sequences > 1)",
        "(no error) generate(prefix_allowed_tokens_fn=..., do_sample=True, num_return_sequences=N): a "
        "sample of one prompt is constrained by another prompt's rule",
    ),
    why=(
        "generate() builds PrefixConstrainedLogitsProcessor with num_beams rows per prompt, so with "
        "sampling and several return sequences it numbers every row as a prompt of its own."
    ),
    upstream=(
        "fixed in {fixed_in}: GenerationMixin._get_logits_processor builds PrefixConstrainedLogitsProcessor "
        "with max(num_beams, num_return_sequences) (no pull request found)"
    ),
    targets=(
        Target(
            module=MODULE,
            qualname="GenerationMixin._get_logits_processor",
            replace=_replace_get_logits_processor,
        ),
    ),
)
