"""beam-sample-sorted-candidates: beam sampling finishes its best candidates, not the first drawn.

Reproduced for real on the CPU with a tiny random Llama: a batch of two prompts,
``do_sample=True, num_beams=3, num_return_sequences=3``, fixed seeds, ending at
``max_new_tokens`` (the model's eos) and with an eos the model samples often.

The control is the same generate() call with the model's ``_get_top_k_continuations`` (set on the
instance) doing upstream's rule another way: it draws the same candidates (``multinomial`` over
the same probabilities, so the same random numbers), hides every other continuation (``-inf``),
and hands that to the release's own function with ``do_sample=False``, whose ``topk`` ranks the
drawn candidates by score. The fixed release's stock gives the control's sequences and scores
(asserted in its lane); on the affected releases stock returns others and the patch gives the
control's, bit for bit. Greedy beam search is stock's, bit for bit, and counts nothing.
"""

from __future__ import annotations

import functools
import types

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("beam_sample_sorted_candidates")
PATCH.skip_module_unless_covered()

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW_TOKENS = 8
BEAMS = {"num_beams": 3, "num_return_sequences": 3}
SAMPLING = {"do_sample": True, "top_k": 0}
#: eos ids: the model's own (the runs end at max_new_tokens), and 0, a token the tiny model
#: samples often (hypotheses also finish at an eos).
EOS = {"max length": None, "frequent eos": 0}
CASE_LIST = [(seed, eos) for seed in (0, 1) for eos in EOS]
CASES = pytest.mark.parametrize("seed,eos", CASE_LIST)


@functools.lru_cache(maxsize=None)
def _model():
    from overlay.testing.models import tiny_model

    return tiny_model("llama")


def _reference(stock):
    """``_get_top_k_continuations`` with upstream's fix, built on the release's own greedy path."""
    import torch

    def _get_top_k_continuations(self, accumulated_log_probs, *, do_sample, beams_to_keep, **kwargs):
        if do_sample:
            drawn = torch.multinomial(torch.softmax(accumulated_log_probs, dim=-1), num_samples=beams_to_keep)
            hidden = torch.full_like(accumulated_log_probs, float("-inf"))
            accumulated_log_probs = hidden.scatter(1, drawn, accumulated_log_probs.gather(1, drawn))
        return stock(self, accumulated_log_probs=accumulated_log_probs, do_sample=False, beams_to_keep=beams_to_keep, **kwargs)

    return _get_top_k_continuations


def _generate(seed: int, eos: str, control: bool = False, **kwargs) -> dict:
    import torch

    from overlay.testing.models import left_padded_batch

    model = _model()
    if control:
        (_, stock), = PATCH.present_targets()
        model._get_top_k_continuations = types.MethodType(_reference(stock), model)
    eos_kwargs = {} if EOS[eos] is None else {"eos_token_id": EOS[eos]}
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            out = model.generate(
                **left_padded_batch((6, 6), seed=1), max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0,
                disable_compile=True, return_dict_in_generate=True, output_scores=True,
                **{**BEAMS, **eos_kwargs, **kwargs},
            )
    finally:
        vars(model).pop("_get_top_k_continuations", None)
    return {"ids": out.sequences.tolist(), "scores": out.sequences_scores}


@pytest.fixture(scope="module")
def runs():
    """``{(seed, eos): {"control", "stock", "patched", "fired"}}``."""
    import transformers.generation.utils  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay import report

    results = {}
    for seed, eos in CASE_LIST:
        record = results[seed, eos] = {}
        with overlay.reverted():
            record["control"] = _generate(seed, eos, control=True, **SAMPLING)
            record["stock"] = _generate(seed, eos, **SAMPLING)
        report.reset()
        with PATCH.applied():
            record["patched"] = _generate(seed, eos, **SAMPLING)
            record["fired"] = report.fired().get(PATCH.id, 0)
    return results


@CASES
def test_stock_finishes_the_first_candidates_drawn(runs, seed, eos):
    import torch

    record = runs[seed, eos]
    if PATCH.affected:
        assert record["stock"]["ids"] != record["control"]["ids"], "stock must return other sequences"
        # What a user sees: the best returned hypothesis of some prompt scores lower than upstream's.
        best = lambda scores: scores.view(2, -1).max(dim=-1).values  # noqa: E731
        assert bool((best(record["stock"]["scores"]) <= best(record["control"]["scores"])).all())
    else:
        assert record["stock"]["ids"] == record["control"]["ids"]
        torch.testing.assert_close(record["stock"]["scores"], record["control"]["scores"], rtol=0, atol=0)


@CASES
def test_overlay_gives_the_control_run(runs, seed, eos):
    import torch

    record = runs[seed, eos]
    assert record["patched"]["ids"] == record["control"]["ids"]
    torch.testing.assert_close(record["patched"]["scores"], record["control"]["scores"], rtol=0, atol=0)
    if PATCH.affected:
        assert record["fired"] > 0  # one count per sampled step
    else:
        assert record["fired"] == 0


def test_beam_search_without_sampling_is_stock_bit_for_bit():
    import torch

    from overlay import report

    with overlay.reverted():
        stock = _generate(0, "frequent eos")
    report.reset()
    with PATCH.applied():
        patched = _generate(0, "frequent eos")
        fired = report.fired().get(PATCH.id, 0)
    assert patched["ids"] == stock["ids"]
    torch.testing.assert_close(patched["scores"], stock["scores"], rtol=0, atol=0)
    assert fired == 0


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('output', 'test_stock_finishes_the_first_candidates_drawn',
                    'stock beam sampling completes with other sequences and scores')
