"""The repetition penalty leaves a left-padded row's padding out, as upstream does now.

What breaks: ``generate(..., repetition_penalty=1.3)`` on a left-padded batch gives the padded
rows other tokens than the same rows generated alone. No error. ``generate()`` builds
``RepetitionPenaltyLogitsProcessor(penalty)``, which penalises every token id in each row of
``input_ids``, the padding columns included: the pad token (often the eos token, so padded rows
also stop later) counts as already said in every padded row, and only there.

Upstream (the release after the last affected one, no pull request found):
``GenerationMixin._get_logits_processor`` reads each row's left padding from the attention mask
(``decoder_attention_mask`` for encoder-decoder models) and passes it as a per-row
``prompt_ignore_length`` (a tensor), which ``RepetitionPenaltyLogitsProcessor`` learned to take.

What the replacement does: it wraps ``_get_logits_processor``. When generate() built a
``RepetitionPenaltyLogitsProcessor`` itself (not one the caller passed) and the 2D mask has left
padding in some row, that processor is swapped for a copy whose class subclasses the release's
and whose ``__call__`` first overwrites each row's padding columns with the row's first real
token, then runs the release's own ``__call__``. The penalty applies once per distinct token, so
a row is penalised for exactly the tokens it holds, as when it runs alone or on the fixed release;
the scores of rows without padding are the release's, bit for bit. Where the mask has one row per
prompt but the processor sees several (beam search and ``num_return_sequences`` on releases that
build the processors before expanding the inputs), each row's padding is repeated for its copies.

Not changed: a batch without left padding, a call without a 2D mask (``inputs_embeds`` only, a 4D
mask), a penalty of 1.0, a ``RepetitionPenaltyLogitsProcessor`` the caller builds or passes in
``logits_processor`` (the class itself is not patched), right padding (as upstream: only leading
padding is ignored). Models whose ``_get_logits_processor`` does not call the mixin's (Pocket TTS)
and continuous batching build their own processors, unchanged.

Cost: nothing unless ``repetition_penalty`` is set. With it, once per generate() call, a small
reduction of the mask and one host sync (does any row have padding?); with left padding, at the
call's first decoding step a ``gather``, a ``max`` (one more host sync), an ``arange`` and a
``minimum`` that give each row's padding columns and its first real token, then per decoding
step (the first included) one out-of-place ``scatter`` of those few values into the step's ids
(the prompt's columns do not change within a call; a ``scatter`` costs less than the
``index_put`` of the same positions), and one ``overlay.report`` count per generate() call.
Under ``torch.compile`` (no host sync) every step builds the ids with a ``where`` instead.

Tested (``tests/patches/repetition_penalty_padding/``); the full account:
docs/patches/repetition-penalty-padding.md.
"""

from __future__ import annotations

import copy

from overlay import report
from overlay.patch import Target, argument_reader, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "repetition-penalty-padding"
MODULE = "transformers.generation.utils"
#: The attribute the swapped processor keeps each row's left-padding length in (a 1D long tensor).
PADDING_ATTRIBUTE = "_attn_overlay_left_padding"
#: What the first step prepares for the rest of the call: (rows, prompt width, a (rows, widest
#: padding) scatter index and its values: each row's padding columns and its first real token).
PREPARED_ATTRIBUTE = "_attn_overlay_prepared_padding"

_subclasses: dict[type, type] = {}


def padding_aware_class(base: type) -> type:
    """The subclass of the release's ``RepetitionPenaltyLogitsProcessor`` (``base``) whose
    ``__call__`` leaves out each row's left padding (built once per base class)."""
    cls = _subclasses.get(base)
    if cls is not None:
        return cls

    def __call__(self, input_ids, scores):
        prepared = getattr(self, PREPARED_ATTRIBUTE, None)
        if prepared is not None:
            shape = input_ids.shape
            if shape[0] == prepared[0] and shape[1] >= prepared[1]:
                # Every later step of the call: the prompt's columns do not change within a call
                # (beam reordering moves rows among copies of one prompt), so one out-of-place
                # scatter of the first step's (index, values) gives the first step's formula again.
                return base.__call__(self, input_ids.scatter(1, prepared[2], prepared[3]), scores)
        padding = getattr(self, PADDING_ATTRIBUTE, None)
        if padding is not None and input_ids.dim() == 2:
            import torch

            rows = input_ids.shape[0]
            if padding.shape[0] != rows and rows % padding.shape[0] == 0:
                # The processors were built before the inputs were expanded (beams, return
                # sequences): each prompt's rows are consecutive copies of it.
                padding = padding.repeat_interleave(rows // padding.shape[0])
            if padding.shape[0] == rows:
                padding = padding.to(input_ids.device)
                setattr(self, PADDING_ATTRIBUTE, padding)  # expanded and moved once
                first_token = input_ids.gather(1, padding[:, None])
                if torch.compiler.is_compiling():
                    # Traced: no host sync, the mask formula at every step.
                    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
                    input_ids = torch.where(columns[None, :] < padding[:, None], first_token, input_ids)
                else:
                    # Once per call (this processor is the call's own copy), one host sync: the
                    # widest padding. Row r writes its first real token into columns
                    # 0 .. padding[r] - 1 and, for the columns left over up to the widest
                    # padding, into column padding[r] itself (which holds that token already).
                    width = int(padding.max())
                    index = torch.minimum(
                        torch.arange(width, device=input_ids.device)[None, :], padding[:, None]
                    )
                    values = first_token.expand(rows, width)  # a view: scatter reads any strides
                    input_ids = input_ids.scatter(1, index, values)
                    setattr(self, PREPARED_ATTRIBUTE, (rows, input_ids.shape[1], index, values))
        return base.__call__(self, input_ids, scores)

    __call__.__doc__ = base.__call__.__doc__
    name = "LeftPaddingAware" + base.__name__
    cls = type(name, (base,), {"__call__": __call__, "__module__": __name__, "__doc__": base.__doc__})
    cls = _subclasses.setdefault(base, cls)  # one class per base, even when two threads race here
    globals()[name] = cls
    return cls


def left_padding(mask):
    """Each row's count of leading zeros in a 2D mask (0 for a row without any token, as upstream):
    the column of its first nonzero entry, which ``argmax`` returns (the first of equal maxima);
    a row of zeros gives column 0. Three ops, once per call."""
    return (mask != 0).long().argmax(-1)


def _replace_get_logits_processor(original, variant):
    argument = argument_reader(original)

    @wraps(original)
    def _get_logits_processor(self, *args, **kwargs):
        processors = original(self, *args, **kwargs)
        generation_config = argument(args, kwargs, "generation_config")
        penalty = getattr(generation_config, "repetition_penalty", None)
        if penalty is None or penalty == 1.0:
            return processors
        import torch

        if torch.compiler.is_compiling():
            return processors

        model_kwargs = argument(args, kwargs, "model_kwargs") or {}
        is_encoder_decoder = getattr(self.config, "is_encoder_decoder", False)
        mask = model_kwargs.get("decoder_attention_mask" if is_encoder_decoder else "attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[-1] == 0:
            return processors
        from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

        passed = list(argument(args, kwargs, "logits_processor") or ())
        for index, processor in enumerate(processors):
            if (
                type(processor) is RepetitionPenaltyLogitsProcessor
                and not any(processor is mine for mine in passed)
                and not processor.prompt_ignore_length
            ):
                padding = left_padding(mask)
                if not bool(padding.any()):  # the one host sync: no padding, nothing to change
                    return processors
                swapped = copy.copy(processor)
                swapped.__class__ = padding_aware_class(RepetitionPenaltyLogitsProcessor)
                setattr(swapped, PADDING_ATTRIBUTE, padding)
                processors[index] = swapped
                report.record_outside_compile(PATCH_ID, "left padding left out of the repetition penalty")
                break
        return processors

    return _get_logits_processor


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="output",
    title="The repetition penalty leaves each row's left padding out",
    errors=(
        "(no error) generate(repetition_penalty=...) on a left-padded batch: the padded rows generate "
        "other tokens than the same rows alone (the pad token, often eos, is penalised)",
    ),
    why=(
        "generate() builds RepetitionPenaltyLogitsProcessor without the attention mask, so it penalises "
        "every token id in input_ids, the left padding of padded rows included."
    ),
    upstream=(
        "fixed in {fixed_in}: GenerationMixin._get_logits_processor passes each row's left padding to "
        "RepetitionPenaltyLogitsProcessor as prompt_ignore_length (no pull request found)"
    ),
    targets=(
        Target(
            module=MODULE,
            qualname="GenerationMixin._get_logits_processor",
            replace=_replace_get_logits_processor,
        ),
    ),
)
