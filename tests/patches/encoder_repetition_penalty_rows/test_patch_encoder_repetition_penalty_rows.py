"""encoder-repetition-penalty-rows: each beam / return sequence is penalised by its own prompt.

Reproduced for real on the CPU with a tiny random Llama (and T5, whose encoder input is the
prompt): a batch of two prompts, ``encoder_repetition_penalty`` with beam search
(``num_beams=2``) and with sampling (``num_return_sequences=2``, fixed seed).

The control is the same generate() call with the processor passed by the caller, built from the
prompt ids already repeated for the rows (``repeat_interleave``): its rows match the scores', so
every release's own ``__call__`` treats every row right. The fixed release's stock gives the
control's ids and scores (asserted in its lane); on the affected releases stock gives others,
and the patch gives the control's, scores bit for bit. Where stock works (one row per prompt) the
patch changes nothing and counts nothing.
"""

from __future__ import annotations

import functools

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest
from tests._kit import covered_module

PATCH = PatchUnderTest("encoder_repetition_penalty_rows")
pytestmark = covered_module(PATCH)

PENALTY = 3.0
MAX_NEW_TOKENS = 6
SEED = 1
MODES = {
    "beam search": {"num_beams": 2, "num_return_sequences": 2},
    "beam search, one sequence": {"num_beams": 2},
    "sampling": {"do_sample": True, "num_return_sequences": 2, "top_k": 0},
}


@functools.lru_cache(maxsize=None)
def _model(kind: str):
    from overlay.testing.models import tiny_model

    return tiny_model(kind, attn_implementation=None if kind == "t5" else "sdpa")


def _batch() -> dict:
    from overlay.testing.models import left_padded_batch

    return left_padded_batch((6, 6), seed=SEED)


def _rows(kwargs: dict) -> int:
    return max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1))


def _generate(kind: str, control: bool = False, **kwargs) -> dict:
    """ids and the first step's processed scores; ``control`` passes the processor with the
    prompt ids repeated for the rows instead of ``encoder_repetition_penalty``."""
    import torch
    from transformers import EncoderRepetitionPenaltyLogitsProcessor, LogitsProcessorList

    batch = _batch()
    if control:
        ids = batch["input_ids"].repeat_interleave(_rows(kwargs), dim=0)
        kwargs["logits_processor"] = LogitsProcessorList([EncoderRepetitionPenaltyLogitsProcessor(PENALTY, ids)])
    else:
        kwargs["encoder_repetition_penalty"] = PENALTY
    torch.manual_seed(0)
    with torch.no_grad():
        out = _model(kind).generate(
            **batch, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0, disable_compile=True,
            return_dict_in_generate=True, output_scores=True, **kwargs,
        )
    return {"ids": out.sequences.tolist(), "scores": out.scores[0]}


@pytest.fixture(scope="module")
def runs():
    """``{(kind, mode): {"control", "stock", "patched", "fired"}}``."""
    import transformers.generation.logits_process  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay import report

    results = {}
    for kind, mode in CASE_LIST:
        kwargs = MODES[mode]
        record = results[kind, mode] = {}
        with overlay.reverted():
            record["control"] = _generate(kind, control=True, **kwargs)
            record["stock"] = _generate(kind, **kwargs)
        report.reset()
        with PATCH.applied():
            record["patched"] = _generate(kind, **kwargs)
            record["patched control"] = _generate(kind, control=True, **kwargs)
            record["fired"] = report.fired().get(PATCH.id, 0)
    return results


CASE_LIST = [("llama", mode) for mode in MODES] + [("t5", "beam search")]
CASES = pytest.mark.parametrize("kind,mode", CASE_LIST)


@CASES
def test_stock_penalises_the_wrong_rows(runs, kind, mode):
    """On the affected releases stock's rows differ from the control's (the first row is right:
    prompt 0's first beam is penalised by prompt 0); the fixed release gives the control's."""
    import torch

    record = runs[kind, mode]
    stock, control = record["stock"], record["control"]
    torch.testing.assert_close(stock["scores"][0], control["scores"][0], rtol=0, atol=0)
    if PATCH.affected:
        assert not torch.equal(stock["scores"], control["scores"])
        assert stock["ids"] != control["ids"], "the wrong rows' penalty must change the generated ids"
    else:
        torch.testing.assert_close(stock["scores"], control["scores"], rtol=0, atol=0)
        assert stock["ids"] == control["ids"]


@CASES
def test_overlay_gives_the_control_run(runs, kind, mode):
    import torch

    record = runs[kind, mode]
    assert record["patched"]["ids"] == record["control"]["ids"]
    torch.testing.assert_close(record["patched"]["scores"], record["control"]["scores"], rtol=0, atol=0)
    # The caller's processor whose rows already match is the release's own, unchanged.
    assert record["patched control"]["ids"] == record["control"]["ids"]
    torch.testing.assert_close(record["patched control"]["scores"], record["control"]["scores"], rtol=0, atol=0)
    # One count per generate() call that needed the repeat (the control needs none).
    assert record["fired"] == (1 if PATCH.affected else 0)


@pytest.mark.parametrize("kwargs", [{}, {"do_sample": True, "top_k": 0}], ids=["greedy", "sampling"])
def test_one_row_per_prompt_is_stock_bit_for_bit(kwargs):
    import torch

    from overlay import report

    with overlay.reverted():
        stock = _generate("llama", **kwargs)
    report.reset()
    with PATCH.applied():
        patched = _generate("llama", **kwargs)
        fired = report.fired().get(PATCH.id, 0)
    assert patched["ids"] == stock["ids"]
    torch.testing.assert_close(patched["scores"], stock["scores"], rtol=0, atol=0)
    assert fired == 0


def test_processor_called_directly():
    """The class as upstream's fixed release has it: more score rows than prompts repeats each
    prompt's ids for its rows; as many rows calls the release's own code."""
    import torch
    from transformers import EncoderRepetitionPenaltyLogitsProcessor as Processor

    prompts = torch.tensor([[5, 9], [7, 12]])
    scores = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with overlay.reverted():
        expected = Processor(PENALTY, prompts.repeat_interleave(2, dim=0))(None, scores.clone())
        stock_two_rows = Processor(PENALTY, prompts)(None, scores[:2].clone())
    with PATCH.applied():
        processor = Processor(PENALTY, prompts)
        first = processor(None, scores.clone())
        again = processor(None, scores.clone())  # from the cached repeat
        two_rows = Processor(PENALTY, prompts)(None, scores[:2].clone())
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    torch.testing.assert_close(two_rows, stock_two_rows, rtol=0, atol=0)
    if PATCH.affected:
        with overlay.reverted():
            stock = Processor(PENALTY, prompts)(None, scores.clone())
        assert not torch.equal(stock, expected)
        torch.testing.assert_close(stock[2:], scores[2:], rtol=0, atol=0)  # the last rows: no penalty at all


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('output', 'test_stock_penalises_the_wrong_rows',
                    'stock completes, penalising the wrong rows')
