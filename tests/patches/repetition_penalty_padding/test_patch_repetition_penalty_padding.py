"""repetition-penalty-padding: a left-padded row with ``repetition_penalty`` generates what it does alone.

Reproduced for real on the CPU, in this process, with a tiny random Llama: a batch of a row of 7
tokens and one of 4, left-padded by 3. The padding is made of the very token the short row
generates first when it runs alone (with the penalty), so that stock, which penalises the
padding, visibly turns the row away from it: the test first proves it can tell the runs apart
(stock's ids differ from the alone run's on the affected releases, and without a penalty the
padded row equals the alone run on every release, so the padding itself changes nothing).

The deterministic half reads the processed scores of the first step (``output_scores``, greedy
or sampling alike): stock divides the pad token's score by the penalty in the padded row only;
with the patch the padded row's scores are the alone row's. Then the ids: greedy and beam search
(``num_beams=2``); the patch gives the alone run's ids, which are also what the fixed release's
stock gives. Where stock works the patch changes nothing, bit for bit: a batch without padding, no
penalty, a ``RepetitionPenaltyLogitsProcessor`` the caller passes, the processor called directly.
"""

from __future__ import annotations

import functools

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("repetition_penalty_padding")
PATCH.skip_module_unless_covered()

pytestmark = pytest.mark.usefixtures("one_thread")

PENALTY = 1.3
MAX_NEW_TOKENS = 8
LONG, SHORT = 7, 4
#: Batches (seeds of ``left_padded_batch``) where the penalised padding turns the short row's
#: greedy and beam-search ids away from the alone run's on the affected releases (checked below).
GREEDY_SEEDS = (1, 3)
BEAM_SEED = 1
EOS_TOKEN_ID = 2


@functools.lru_cache(maxsize=None)
def _model():
    from overlay.testing.models import tiny_model

    return tiny_model("llama")


def _batches(seed: int) -> tuple[dict, dict, int]:
    """``(padded batch, the short row alone, pad id)``; the pad id is the token the short row
    generates first alone, with the penalty, and is not in its prompt."""
    from overlay.testing.models import greedy_ids, left_padded_batch

    batch = left_padded_batch((LONG, SHORT), seed=seed)
    alone = {name: value[1:, LONG - SHORT :] for name, value in batch.items()}
    with overlay.reverted():
        pad = greedy_ids(_model(), alone, 1, repetition_penalty=PENALTY)[0][-1]
    assert pad not in alone["input_ids"][0].tolist()
    input_ids = batch["input_ids"].clone()
    input_ids[batch["attention_mask"] == 0] = pad
    return {"input_ids": input_ids, "attention_mask": batch["attention_mask"]}, alone, pad


def _new_ids(sequences: list[list[int]], row: int, prompt: int) -> list[int]:
    """A row's new tokens, up to and including the first eos (what follows is padding)."""
    new = sequences[row][prompt:]
    return new[: new.index(EOS_TOKEN_ID) + 1] if EOS_TOKEN_ID in new else new


def _generate(inputs: dict, pad: int, **kwargs) -> dict:
    """ids and the first step's processed scores of one generate() call."""
    import torch

    model = _model()
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=pad, disable_compile=True,
            return_dict_in_generate=True, output_scores=True, **{"do_sample": False, **kwargs},
        )
    return {"ids": out.sequences.tolist(), "scores": out.scores[0]}


@pytest.fixture(scope="module")
def runs():
    """``{(seed, mode): {"alone", "stock", "patched", "stock no penalty", "alone no penalty"}}``."""
    import transformers.generation.utils  # noqa: F401  (the patch's module, so the engine judges it)

    modes = {"greedy": {}, "beam search": {"num_beams": 2}}
    results = {}
    for seed in sorted({*GREEDY_SEEDS, BEAM_SEED}):
        padded, alone, pad = _batches(seed)
        for mode, kwargs in modes.items():
            if mode == "beam search" and seed != BEAM_SEED:
                continue
            record = results[seed, mode] = {"pad": pad}
            with overlay.reverted():
                record["alone"] = _generate(alone, pad, repetition_penalty=PENALTY, **kwargs)
                record["stock"] = _generate(padded, pad, repetition_penalty=PENALTY, **kwargs)
                record["alone no penalty"] = _generate(alone, pad, **kwargs)
                record["stock no penalty"] = _generate(padded, pad, **kwargs)
            with PATCH.applied():
                record["patched"] = _generate(padded, pad, repetition_penalty=PENALTY, **kwargs)
    return results


CASES = pytest.mark.parametrize(
    "seed,mode", [*((s, "greedy") for s in GREEDY_SEEDS), (BEAM_SEED, "beam search")]
)


@CASES
def test_padding_alone_changes_nothing_without_a_penalty(runs, seed, mode):
    """The control: without a penalty the padded row generates what it does alone, on every
    release, so any difference below is the penalty's."""
    record = runs[seed, mode]
    assert _new_ids(record["stock no penalty"]["ids"], 1, LONG) == _new_ids(record["alone no penalty"]["ids"], 0, SHORT)


@CASES
def test_stock_penalises_the_padding(runs, seed, mode):
    record = runs[seed, mode]
    alone = _new_ids(record["alone"]["ids"], 0, SHORT)
    stock = _new_ids(record["stock"]["ids"], 1, LONG)
    if PATCH.affected:
        assert stock != alone, "the padded row must generate other ids on the affected releases"
    else:
        assert stock == alone, "the fixed release leaves the padding out"


@CASES
def test_overlay_gives_the_alone_run(runs, seed, mode):
    record = runs[seed, mode]
    assert _new_ids(record["patched"]["ids"], 1, LONG) == _new_ids(record["alone"]["ids"], 0, SHORT)
    # The row without padding is stock's (up to its eos: a batch that ends sooner pads it less).
    assert _new_ids(record["patched"]["ids"], 0, 0) == _new_ids(record["stock"]["ids"], 0, 0)


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_first_step_scores(sampling):
    """The bug at the scores, whatever the argmax: stock divides the pad token's score by the
    penalty in the padded row (and only there); the patch gives the alone row's scores."""
    import torch

    padded, alone, pad = _batches(GREEDY_SEEDS[0])
    kwargs = {"do_sample": True, "top_k": 0} if sampling else {}
    with overlay.reverted():
        alone_scores = _generate(alone, pad, repetition_penalty=PENALTY, **kwargs)["scores"][0]
        stock_scores = _generate(padded, pad, repetition_penalty=PENALTY, **kwargs)["scores"]
        unpenalised = _generate(padded, pad, **kwargs)["scores"]
    with PATCH.applied():
        patched_scores = _generate(padded, pad, repetition_penalty=PENALTY, **kwargs)["scores"]
    torch.testing.assert_close(patched_scores[1], alone_scores)
    torch.testing.assert_close(patched_scores[0], stock_scores[0], rtol=0, atol=0)
    others = torch.ones_like(alone_scores, dtype=torch.bool)
    others[pad] = False
    torch.testing.assert_close(stock_scores[1][others], alone_scores[others])
    if PATCH.affected:
        raw = unpenalised[1][pad]
        expected = raw * PENALTY if raw < 0 else raw / PENALTY
        torch.testing.assert_close(stock_scores[1][pad], expected)
        assert not torch.isclose(stock_scores[1][pad], alone_scores[pad])
    else:
        torch.testing.assert_close(stock_scores[1], alone_scores)


def test_batch_without_padding_is_stock_bit_for_bit():
    import torch

    from overlay import report
    from overlay.testing.models import PAD_TOKEN_ID, left_padded_batch

    batch = left_padded_batch((6, 6), seed=4)
    with overlay.reverted():
        stock = _generate(batch, PAD_TOKEN_ID, repetition_penalty=PENALTY)
    report.reset()
    with PATCH.applied():
        patched = _generate(batch, PAD_TOKEN_ID, repetition_penalty=PENALTY)
        fired = report.fired().get(PATCH.id, 0)
    assert patched["ids"] == stock["ids"]
    assert torch.equal(patched["scores"], stock["scores"])
    assert fired == 0


def test_processor_passed_by_the_caller_is_left_alone():
    import torch
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    padded, _, pad = _batches(GREEDY_SEEDS[0])
    # With and without repetition_penalty too (then generate() builds one and keeps the caller's).
    for kwargs in ({}, {"repetition_penalty": PENALTY}):
        with overlay.reverted():
            theirs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(PENALTY)])
            stock = _generate(padded, pad, logits_processor=theirs, **kwargs)
        with PATCH.applied():
            mine = RepetitionPenaltyLogitsProcessor(PENALTY)
            patched = _generate(padded, pad, logits_processor=LogitsProcessorList([mine]), **kwargs)
        assert type(mine) is RepetitionPenaltyLogitsProcessor
        assert patched["ids"] == stock["ids"]
        assert torch.equal(patched["scores"], stock["scores"])


def test_processor_without_a_mask_is_stock():
    """The processor class is not patched: called directly, or built by ``_get_logits_processor``
    without a mask, it is the release's own, with the release's scores."""
    import torch
    from transformers import GenerationConfig, RepetitionPenaltyLogitsProcessor

    input_ids = torch.tensor([[5, 5, 9, 11], [0, 0, 7, 12]])
    scores = torch.randn(2, 128, generator=torch.Generator().manual_seed(0))
    with overlay.reverted():
        stock = RepetitionPenaltyLogitsProcessor(PENALTY)(input_ids, scores.clone())
    with PATCH.applied():
        direct = RepetitionPenaltyLogitsProcessor(PENALTY)(input_ids, scores.clone())
        built = _model()._get_logits_processor(GenerationConfig(repetition_penalty=PENALTY), input_ids_seq_length=4)
    assert torch.equal(direct, stock)
    (processor,) = [p for p in built if isinstance(p, RepetitionPenaltyLogitsProcessor)]
    assert type(processor) is RepetitionPenaltyLogitsProcessor
    assert torch.equal(processor(input_ids, scores.clone()), stock)


def test_generate_builds_a_padding_aware_processor_and_reports_it():
    """Under the patch, with left padding, the processor generate() builds is still a
    ``RepetitionPenaltyLogitsProcessor``; one report count per generate() call."""
    from transformers import GenerationConfig, RepetitionPenaltyLogitsProcessor

    from overlay import report

    padded, _, pad = _batches(GREEDY_SEEDS[0])
    report.reset()
    with PATCH.applied():
        built = _model()._get_logits_processor(
            GenerationConfig(repetition_penalty=PENALTY),
            input_ids_seq_length=LONG,
            model_kwargs={"attention_mask": padded["attention_mask"]},
        )
        after_build = report.fired().get(PATCH.id, 0)
        _generate(padded, pad, repetition_penalty=PENALTY)
        after_generate = report.fired().get(PATCH.id, 0)
    (processor,) = [p for p in built if isinstance(p, RepetitionPenaltyLogitsProcessor)]
    if PATCH.affected:
        assert type(processor) is not RepetitionPenaltyLogitsProcessor
        assert (after_build, after_generate) == (1, 2)
    else:
        assert type(processor) is RepetitionPenaltyLogitsProcessor
        assert (after_build, after_generate) == (0, 0)


def test_encoder_decoder_reads_the_decoder_mask():
    """As upstream: for an encoder-decoder model (T5) the decoder's mask counts, not the encoder's."""
    from transformers import GenerationConfig, RepetitionPenaltyLogitsProcessor

    from overlay.testing.models import left_padded_batch, tiny_model

    t5 = tiny_model("t5", attn_implementation=None)
    padded_mask = left_padded_batch((LONG, SHORT))["attention_mask"]
    kinds = {}
    with PATCH.applied():
        for name in ("attention_mask", "decoder_attention_mask"):
            built = t5._get_logits_processor(
                GenerationConfig(repetition_penalty=PENALTY), input_ids_seq_length=1, model_kwargs={name: padded_mask}
            )
            (processor,) = [p for p in built if isinstance(p, RepetitionPenaltyLogitsProcessor)]
            kinds[name] = type(processor) is RepetitionPenaltyLogitsProcessor
    assert kinds == {"attention_mask": True, "decoder_attention_mask": not PATCH.affected}


def test_left_padding_counts_each_rows_leading_zeros():
    """Each row's left padding, as upstream reads it: its leading zeros, 0 for a row without any
    token; right padding and holes after the first token are not left padding. Compared with the
    definition on every 0/1 mask of 4 columns (all rows at once), and on bool and float masks."""
    import itertools

    import torch

    module = PATCH.patch_module
    rows = list(itertools.product((0, 1), repeat=4))

    def expected(row):
        leading = next((i for i, value in enumerate(row) if value), None)
        return 0 if leading is None else leading

    mask = torch.tensor(rows)
    assert module.left_padding(mask).tolist() == [expected(row) for row in rows]
    assert module.left_padding(mask.bool()).tolist() == [expected(row) for row in rows]
    assert module.left_padding(mask.float() * 0.5).tolist() == [expected(row) for row in rows]
    assert module.left_padding(torch.tensor([[0], [1]])).tolist() == [0, 0]


def test_later_steps_cost_one_op_and_give_the_first_steps_formula():
    """Issue 39: the padding positions are found once per call (the first step); every later step
    of the call adds one small op to the release's own (an out-of-place ``scatter``), and its
    scores are what the first step's formula (padding replaced by the row's first real token) gives
    for that step's ids, also when the rows of one prompt's beams trade places."""
    if not PATCH.affected:
        pytest.skip(f"{PATCH.id} is not applied on this release (the release's own processor runs)")
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import GenerationConfig, RepetitionPenaltyLogitsProcessor

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    prompt = torch.tensor([[0, 0, 9, 11], [5, 6, 7, 12]])
    with PATCH.applied():
        (processor,) = [p for p in _model()._get_logits_processor(
            GenerationConfig(repetition_penalty=PENALTY), input_ids_seq_length=4,
            model_kwargs={"attention_mask": mask}) if isinstance(p, RepetitionPenaltyLogitsProcessor)]
    stock = RepetitionPenaltyLogitsProcessor(PENALTY)
    generator = torch.Generator().manual_seed(0)

    # Two beams per prompt (rows 0-1 prompt 0, rows 2-3 prompt 1), the processor built before the
    # inputs were expanded; the rows of a prompt swap places between steps, as beam search does.
    ids = prompt.repeat_interleave(2, dim=0)
    for step in range(4):
        scores = torch.randn(4, 128, generator=generator)
        with Ops() as with_patch:
            got = processor(ids, scores.clone())
        with Ops() as release:
            stock(ids, scores.clone())
        fixed = ids.clone()
        fixed[:2, :2] = ids[:2, 2:3]  # prompt 0's padding: its first real token, in both beams
        assert torch.equal(got, stock(fixed, scores.clone())), step
        assert not torch.equal(got, stock(ids, scores.clone())), step  # the padding is left out
        if step:
            extra = list(with_patch.names)
            for name in release.names:
                extra.remove(name)
            assert extra == ["aten.scatter"], (step, extra)
        new = torch.randint(3, 128, (4, 1), generator=generator)
        ids = torch.cat([ids[[1, 0, 3, 2]], new], dim=1)


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('output', 'test_stock_penalises_the_padding',
                    'stock completes, penalising the padding of padded rows')
