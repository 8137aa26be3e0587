"""prefix-constrained-return-sequences: with sampling and several return sequences, each row is
constrained by its own prompt's ``prefix_allowed_tokens_fn`` rule.

Reproduced for real on the CPU, in this process, with a tiny random Llama: two prompts of six
tokens (no padding), ``do_sample=True, num_return_sequences=2``, each prompt allowed its own
eight token ids (disjoint). A function that indexes its rules per prompt (``RULES[batch_id]``)
raises stock's ``IndexError`` on the affected releases; a tolerant one (``RULES[batch_id %
prompts]``) shows the wrong constraint: prompt 0's second sample draws from prompt 1's tokens.

Controls: (1) the same sampled call with the processor the fixed release builds
(``PrefixConstrainedLogitsProcessor(fn, num_return_sequences)``) passed by the caller instead:
the same rows, the same random draws, so the patched ids must equal it exactly; the fixed
release's stock equals it too (asserted in its lane). (2) Each prompt alone with its rule,
``top_k=1`` (the sample is the best allowed token, so the draws do not depend on the batch): the
patched batch gives each prompt's alone ids. Where stock works the patch changes nothing: beam
search, one return sequence, a processor the caller passes. With ``repetition_penalty`` and
left padding too, both overlay patches on one target give the alone runs.
"""

from __future__ import annotations

import functools

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest
from tests._kit import covered_module

PATCH = PatchUnderTest("prefix_constrained_return_sequences")
pytestmark = covered_module(PATCH)

PROMPT_LENGTH = 6
MAX_NEW_TOKENS = 6
SEQUENCES = 2
#: Each prompt's allowed token ids (disjoint, none of them the eos token 2 or the pad token 0).
RULES = [list(range(10, 18)), list(range(40, 48))]
SAMPLING = {"do_sample": True, "top_k": 0, "num_return_sequences": SEQUENCES}
#: What a list-indexing rule raises on stock (the declared error text, up to its explanation).
INDEX_ERROR = PATCH.error("IndexError").split(" (")[0]


@functools.cache
def _model():
    from overlay.testing.models import tiny_model

    return tiny_model("llama")


def _batch(prompts: int = len(RULES), seed: int = 5) -> dict:
    from overlay.testing.models import left_padded_batch

    return left_padded_batch((PROMPT_LENGTH,) * prompts, seed=seed)


def strict_rule(batch_id, sent):
    """A user's function that indexes its rules per prompt."""
    return list(RULES[batch_id])


def tolerant_rule(batch_id, sent):
    """A user's function that does not check the batch id (stock then mixes the prompts)."""
    return list(RULES[batch_id % len(RULES)])


def _generate(inputs: dict, seed: int = 0, **kwargs) -> list[list[int]]:
    import torch

    model = _model()  # built before seeding: building it draws from the global generator
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS, pad_token_id=0,
            disable_compile=True, **kwargs,
        )
    return out.tolist()


def _control(inputs: dict, rule, rows_per_prompt: int, **kwargs) -> list[list[int]]:
    """The call with the processor the fixed release builds, passed by the caller."""
    from transformers import LogitsProcessorList, PrefixConstrainedLogitsProcessor

    processors = LogitsProcessorList([PrefixConstrainedLogitsProcessor(rule, rows_per_prompt)])
    return _generate(inputs, logits_processor=processors, **kwargs)


def _new(sequences: list[list[int]], width: int = PROMPT_LENGTH) -> list[list[int]]:
    return [row[width:] for row in sequences]


@pytest.fixture(scope="module")
def runs():
    """``{name: ids}`` of the sampled calls, stock and patched; ``"stock strict"`` is the error."""
    import transformers.generation.utils  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay import report

    batch = _batch()
    results = {}
    with overlay.reverted():
        results["control"] = _control(batch, strict_rule, SEQUENCES, **SAMPLING)
        results["stock tolerant"] = _generate(batch, prefix_allowed_tokens_fn=tolerant_rule, **SAMPLING)
        try:
            results["stock strict"] = _generate(batch, prefix_allowed_tokens_fn=strict_rule, **SAMPLING)
        except IndexError as error:
            results["stock strict"] = error
    report.reset()
    with PATCH.applied():
        results["patched strict"] = _generate(batch, prefix_allowed_tokens_fn=strict_rule, **SAMPLING)
        results["patched tolerant"] = _generate(batch, prefix_allowed_tokens_fn=tolerant_rule, **SAMPLING)
        results["fired"] = report.fired().get(PATCH.id, 0)
    return results


def test_control_keeps_each_row_to_its_prompts_rule(runs):
    """The control is right: prompt p's rows draw only from prompt p's tokens (and differ from
    each other: the samples are random)."""
    new = _new(runs["control"])
    for row, tokens in enumerate(new):
        assert set(tokens) <= set(RULES[row // SEQUENCES]), (row, tokens)
    assert new[0] != new[1]


def test_stock_raises_or_mixes_the_prompts(runs):
    """Affected: the strict function gets batch id 2 (IndexError); the tolerant one gives prompt
    0's second sample prompt 1's tokens. Fixed release: stock is the control."""
    new = _new(runs["stock tolerant"])
    if PATCH.affected:
        assert isinstance(runs["stock strict"], IndexError), runs["stock strict"]
        assert str(runs["stock strict"]) == INDEX_ERROR
        assert set(new[1]) <= set(RULES[1]), new[1]
        assert runs["stock tolerant"] != runs["control"]
    else:
        assert runs["stock strict"] == runs["control"]
        assert runs["stock tolerant"] == runs["control"]


def test_overlay_gives_the_control_run(runs):
    assert runs["patched strict"] == runs["control"]
    assert runs["patched tolerant"] == runs["control"]
    assert runs["fired"] == (2 if PATCH.affected else 0)


def test_overlay_gives_each_prompt_alone():
    """top_k=1: each sample is the best allowed token, whatever the random draws, so a prompt run
    alone with its rule is the control of its rows in the batch."""
    batch = _batch()
    kwargs = {**SAMPLING, "top_k": 1}
    alone = []
    with overlay.reverted():
        for prompt, rule in enumerate(RULES):
            single = {name: value[prompt : prompt + 1] for name, value in batch.items()}
            alone += _generate(single, prefix_allowed_tokens_fn=lambda batch_id, sent, rule=rule: list(rule), **kwargs)
        stock = _generate(batch, prefix_allowed_tokens_fn=tolerant_rule, **kwargs)
    with PATCH.applied():
        patched = _generate(batch, prefix_allowed_tokens_fn=strict_rule, **kwargs)
    assert patched == alone
    assert (stock != alone) == PATCH.affected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_beams": 2, "num_return_sequences": 2},
        {"num_beams": 2},
        {"do_sample": True, "top_k": 0},
        {},
    ],
    ids=["beam search, 2 sequences", "beam search", "sampling, 1 sequence", "greedy"],
)
def test_where_stock_works_the_overlay_is_stock(kwargs):
    from overlay import report

    batch = _batch()
    with overlay.reverted():
        stock = _generate(batch, prefix_allowed_tokens_fn=strict_rule, **kwargs)
    report.reset()
    with PATCH.applied():
        patched = _generate(batch, prefix_allowed_tokens_fn=strict_rule, **kwargs)
        fired = report.fired().get(PATCH.id, 0)
    assert patched == stock
    assert fired == 0
    # Here stock is right: each returned row keeps to its own prompt's rule.
    for row, tokens in enumerate(_new(stock)):
        assert set(tokens) <= set(RULES[row // kwargs.get("num_return_sequences", 1)]), (row, tokens)


@pytest.mark.parametrize("also_the_argument", [False, True], ids=["processor only", "processor and argument"])
def test_processor_passed_by_the_caller_is_left_alone(also_the_argument):
    """The caller's processor, even one built with stock's row count, is theirs: the overlay
    neither copies nor changes it (with the argument too, generate() keeps the caller's)."""
    from transformers import LogitsProcessorList, PrefixConstrainedLogitsProcessor

    from overlay import report

    batch = _batch()
    extra = {"prefix_allowed_tokens_fn": tolerant_rule} if also_the_argument else {}
    with overlay.reverted():
        stock = _generate(
            batch, logits_processor=LogitsProcessorList([PrefixConstrainedLogitsProcessor(tolerant_rule, 1)]),
            **extra, **SAMPLING,
        )
    report.reset()
    with PATCH.applied():
        theirs = PrefixConstrainedLogitsProcessor(tolerant_rule, 1)
        patched = _generate(batch, logits_processor=LogitsProcessorList([theirs]), **extra, **SAMPLING)
        fired = report.fired().get(PATCH.id, 0)
    assert patched == stock
    assert theirs._num_beams == 1 and type(theirs) is PrefixConstrainedLogitsProcessor
    assert fired == 0


def test_built_processor_counts_the_return_sequences():
    """At the builder: with the argument and more sequences than beams, generate()'s processor is
    a ``PrefixConstrainedLogitsProcessor`` with ``_num_beams`` = ``max(num_beams,
    num_return_sequences)``, what the fixed release passes."""
    from transformers import GenerationConfig, PrefixConstrainedLogitsProcessor

    config = GenerationConfig(do_sample=True, num_beams=1, num_return_sequences=3)
    with overlay.reverted():
        stock = _model()._get_logits_processor(config, input_ids_seq_length=4, prefix_allowed_tokens_fn=strict_rule)
    with PATCH.applied():
        patched = _model()._get_logits_processor(config, input_ids_seq_length=4, prefix_allowed_tokens_fn=strict_rule)
    (stock_processor,) = [p for p in stock if isinstance(p, PrefixConstrainedLogitsProcessor)]
    (patched_processor,) = [p for p in patched if isinstance(p, PrefixConstrainedLogitsProcessor)]
    assert type(patched_processor) is PrefixConstrainedLogitsProcessor
    assert patched_processor._prefix_allowed_tokens_fn is strict_rule
    assert patched_processor._num_beams == 3
    assert stock_processor._num_beams == (1 if PATCH.affected else 3)


def test_engine_status():
    """Applied on the affected releases; "fixed upstream" from the fixed release on."""
    import transformers.generation.utils  # noqa: F401

    with PATCH.applied() as statuses:
        state = statuses[PATCH.id].state
    assert state == ("applied" if PATCH.affected else "fixed upstream")
    assert PATCH.fixed_upstream == (not PATCH.affected)


def test_with_the_repetition_penalty_padding_patch_both_fixes_hold():
    """Left padding, ``repetition_penalty`` and a prefix constraint with two return sequences
    (top_k=1): with both overlay patches (two layers on ``_get_logits_processor`` where both
    apply) the padded batch gives each prompt's alone run, its padding not penalised and its rows
    constrained by its own rule."""
    from overlay.testing.models import left_padded_batch

    penalty = 5.0
    kwargs = {**SAMPLING, "top_k": 1, "repetition_penalty": penalty}
    lengths = (PROMPT_LENGTH + 3, PROMPT_LENGTH)
    batch = left_padded_batch(lengths, seed=7)
    singles = [
        {name: value[prompt : prompt + 1, lengths[0] - length :] for name, value in batch.items()}
        for prompt, length in enumerate(lengths)
    ]
    with overlay.reverted():
        # The pad: the short prompt's first token alone, so that penalising the padding shows.
        first = _generate(singles[1], prefix_allowed_tokens_fn=lambda b, s: list(RULES[1]), **kwargs)
        pad = first[0][PROMPT_LENGTH]
        batch["input_ids"][batch["attention_mask"] == 0] = pad
        alone = []
        for prompt, single in enumerate(singles):
            rows = _generate(single, prefix_allowed_tokens_fn=lambda b, s, p=prompt: list(RULES[p]), **kwargs)
            alone += [row[lengths[prompt] :] for row in rows]
        stock = _generate(batch, prefix_allowed_tokens_fn=tolerant_rule, **kwargs)
    with PATCH.applied():
        this_patch_only = _generate(batch, prefix_allowed_tokens_fn=strict_rule, **kwargs)
    with PATCH.applied("repetition-penalty-padding") as statuses:
        states = {name: status.state for name, status in statuses.items()}
        patched = _generate(batch, prefix_allowed_tokens_fn=strict_rule, **kwargs)
    padding_affected = PatchUnderTest("repetition_penalty_padding").affected
    assert states == {
        PATCH.id: "applied" if PATCH.affected else "fixed upstream",
        "repetition-penalty-padding": "applied" if padding_affected else "fixed upstream",
    }
    assert _new(patched, lengths[0]) == alone
    # Each bug shows in this batch where its release carries it: stock mixes the prompts, and
    # this patch alone still penalises the padding.
    assert (_new(stock, lengths[0]) != alone) == (PATCH.affected or padding_affected)
    assert (_new(this_patch_only, lengths[0]) != alone) == padding_affected


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('both', 'test_stock_raises_or_mixes_the_prompts',
                    "stock raises IndexError, or completes with another prompt's rule")
