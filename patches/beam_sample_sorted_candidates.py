"""Beam sampling ranks the candidates it samples by score, as upstream does now.

What breaks: ``generate(do_sample=True, num_beams=N)`` returns other sequences (and lower
``sequences_scores``) than upstream's fixed release gives for the same seed. No error, and with
default settings: every beam-sampling run that ends at ``max_new_tokens`` or at an eos token.

Cause: ``GenerationMixin._get_top_k_continuations`` samples ``K = beams_to_keep`` candidates with
``torch.multinomial`` and keeps them in the order drawn, while beam search treats their positions
as ranks: only the first ``num_beams`` positions (``top_num_beam_mask``) may finish a hypothesis.
So at the step that ends a hypothesis (eos, or the last token allowed) the first ``num_beams``
candidates *drawn* finish, not the ``num_beams`` best: a better candidate drawn later is dropped,
a worse one drawn first is returned. The choice of the running beams (a ``topk`` over all K) does
not depend on the order, except between candidates of exactly equal score.

Upstream (the release after the last affected one; no pull request found): the sampled candidates
are sorted by accumulated log-probability, descending (``sort``, then the indices gathered in
that order), before the beams and tokens are read from them.

What the replacement does: it wraps ``_get_top_k_continuations``. With ``do_sample=False`` it
returns the release's result unchanged. With sampling it sorts the returned log-probabilities the
way upstream sorts them (``sort(dim=-1, descending=True)``) and gathers the candidates' sequences
and beam indices in that order: each candidate is the same (token, beam, sequence) as before, so
the result is upstream's, and the random draws are the same (sorting draws nothing). For a fixed
seed the overlay gives the fixed release's sequences and scores.

Cost: with sampling only, per decoding step one sort of ``batch x K`` scores and two gathers
along the candidates (the running sequences, ``batch x K x max_length``, are copied once more
per step; upstream sorts before building them). A generate() call that cannot sample (``do_sample``
False by keyword, or in every config it can start from: ``needed_by_call``) runs the release's own
method at every step; otherwise the wrapper's parameters are the release's own (4.55 - 5.13 and
5.18 shapes: the release's function is called with plain keywords, no ``*args``/``**kwargs``
re-packing; any other shape: a generic wrapper and one dictionary look-up).
``overlay.report`` counts each sorted step, never while compiling.

Tested (``tests/patches/beam_sample_sorted_candidates/``); the full account:
docs/patches/beam-sample-sorted-candidates.md.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, argument_reader, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "beam-sample-sorted-candidates"
MODULE = "transformers.generation.utils"


#: The releases' two parameter lists (every loop passes them all by keyword): 4.55 - 5.13 with
#: ``vocab_size``; 5.18 without it and with ``**kwargs``. Another list gets the generic wrapper.
_WITH_VOCAB_SIZE = ("self", "accumulated_log_probs", "running_sequences", "running_beam_indices", "cur_len",
                    "decoder_prompt_len", "do_sample", "beams_to_keep", "num_beams", "vocab_size", "batch_size")
_WITHOUT_VOCAB_SIZE = tuple(name for name in _WITH_VOCAB_SIZE if name != "vocab_size") + ("kwargs",)


def _call_can_sample(model, args, kwargs):
    """``needed_by_call``: whether this generate() call can sample. A ``do_sample`` keyword decides
    (generate() sets it on the call's config); otherwise any config the call can start from that
    samples (the ``generation_config`` passed, keyword or second positional, or the model's) counts."""
    if "do_sample" in kwargs:
        return bool(kwargs["do_sample"])
    passed = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    return bool(getattr(passed, "do_sample", False) or getattr(model.generation_config, "do_sample", True))


def _sorted(self, result):
    """Upstream's sort (the fixed release), applied to the same sampled candidates."""
    topk_log_probs, topk_running_sequences, topk_running_beam_indices = result
    topk_log_probs, order = topk_log_probs.sort(dim=-1, descending=True)
    topk_running_sequences = self._gather_beams(topk_running_sequences, order)
    topk_running_beam_indices = self._gather_beams(topk_running_beam_indices, order)
    report.record_outside_compile(PATCH_ID, "sorted the sampled beam candidates by score")
    return topk_log_probs, topk_running_sequences, topk_running_beam_indices


def _replace_get_top_k_continuations(original, variant):
    import inspect

    names = tuple(inspect.signature(original).parameters)
    # Per beam-search step: a wrapper whose parameters are the release's own calls the release's
    # function with plain keywords (no ``*args``/``**kwargs`` re-packing, about half the frame's
    # cost), and decides from ``do_sample``, a parameter, before anything else.
    if names == _WITH_VOCAB_SIZE:

        @wraps(original)
        def _get_top_k_continuations(self, accumulated_log_probs, running_sequences, running_beam_indices, cur_len,
                                     decoder_prompt_len, do_sample, beams_to_keep, num_beams, vocab_size,
                                     batch_size):
            result = original(self, accumulated_log_probs=accumulated_log_probs, running_sequences=running_sequences,
                              running_beam_indices=running_beam_indices, cur_len=cur_len,
                              decoder_prompt_len=decoder_prompt_len, do_sample=do_sample,
                              beams_to_keep=beams_to_keep, num_beams=num_beams, vocab_size=vocab_size,
                              batch_size=batch_size)
            return _sorted(self, result) if do_sample else result

        return _get_top_k_continuations

    if names == _WITHOUT_VOCAB_SIZE:

        @wraps(original)
        def _get_top_k_continuations(self, accumulated_log_probs, running_sequences, running_beam_indices, cur_len,
                                     decoder_prompt_len, do_sample, beams_to_keep, num_beams, batch_size, **kwargs):
            if kwargs:
                result = original(self, accumulated_log_probs, running_sequences, running_beam_indices, cur_len,
                                  decoder_prompt_len, do_sample, beams_to_keep, num_beams, batch_size, **kwargs)
            else:
                result = original(self, accumulated_log_probs=accumulated_log_probs,
                                  running_sequences=running_sequences, running_beam_indices=running_beam_indices,
                                  cur_len=cur_len, decoder_prompt_len=decoder_prompt_len, do_sample=do_sample,
                                  beams_to_keep=beams_to_keep, num_beams=num_beams, batch_size=batch_size)
            return _sorted(self, result) if do_sample else result

        return _get_top_k_continuations

    argument = argument_reader(original)

    @wraps(original)
    def _get_top_k_continuations(self, *args, **kwargs):
        # Decided before the call, from the flag every release's loop passes by keyword: greedy
        # beam search goes straight to the release's own function (one dictionary look-up).
        if not (kwargs["do_sample"] if "do_sample" in kwargs else argument(args, kwargs, "do_sample")):
            return original(self, *args, **kwargs)
        return _sorted(self, original(self, *args, **kwargs))

    return _get_top_k_continuations


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="output",
    title="Beam sampling ranks the candidates it samples by score",
    errors=(
        "(no error) generate(do_sample=True, num_beams=N) returns other sequences and lower sequences_scores "
        "than the fixed release for the same seed: the first num_beams candidates drawn finish, not the best",
    ),
    why=(
        "Beam sampling keeps its sampled candidates in the order drawn, while beam search lets only the first "
        "num_beams positions finish a hypothesis."
    ),
    upstream=(
        "fixed in {fixed_in}: GenerationMixin._get_top_k_continuations sorts the sampled candidates by score "
        "(no pull request found)"
    ),
    targets=(
        Target(
            module=MODULE,
            qualname="GenerationMixin._get_top_k_continuations",
            replace=_replace_get_top_k_continuations,
            needed_by_call=_call_can_sample,
        ),
    ),
)
