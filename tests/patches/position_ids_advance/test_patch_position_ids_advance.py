"""position-ids-advance: ``generate(position_ids=...)`` gives the tokens of the same call without them.

Reproduced for real on the CPU, in this process: tiny random Llama (no ``layer_types``), Gemma 3
(sliding + full layers) and Qwen 3, a batch of one row and a left-padded batch of two, and the
generate() modes a caller passing positions uses: greedy with the default cache, with a static
cache and without a cache, beam search, and sampling from a fixed seed. Each call is made with
the ``position_ids`` generate() would derive itself (``attention_mask.cumsum(-1) - 1``); the
reference is the same call without them.

What a step is fed is read at the model's forward (a pre-hook): on 4.55.0 - 5.1.0 stock feeds every
new token the last prompt position (the bug, whatever the ids); with the patch each step gets the
reference's positions and the run the reference's ids. Where stock works (no positions passed;
5.2.0+, where the engine reports "fixed upstream") the overlay gives stock's ids.
"""

from __future__ import annotations


import pytest

import overlay
from overlay.testing.harness import PatchUnderTest
from tests._kit import assert_in_force_only_while_applied

PATCH = PatchUnderTest("position_ids_advance")
PATCH.skip_module_unless_covered()

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = ("llama", "gemma3", "qwen3")
BATCHES = {"one row": (7,), "left-padded": (7, 4)}
MAX_NEW_TOKENS = 6
MODES = {
    "greedy": {},
    "static cache": {"cache_implementation": "static"},
    "no cache": {"use_cache": False},
    "beam search": {"num_beams": 2},
    "sampling": {"do_sample": True, "top_k": 0},
}
SAMPLING_SEED = 1234
#: Weights large enough that rotary positions change the ids: at the default 0.02 a tiny random
#: Llama's logits hardly depend on positions (stale positions gave the reference's ids on 4.57.6).
POSITION_SENSITIVE_INIT = 0.2
NO_CACHE_ERROR = PATCH.error("must match the size")


def _positions_like_generate(attention_mask):
    """The positions stock generate() derives from the mask (pads: 1, masked out anyway)."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 1)


def _run(model, batch, mode: str, *, pass_positions: bool) -> dict:
    """One generate() call: its ids and the position ids each forward got (the last column of
    each, per row: the position of the newest token)."""
    import torch

    from overlay.testing.models import greedy_ids

    fed: list[list[int]] = []

    def note_positions(module, args, kwargs):
        position_ids = kwargs.get("position_ids")
        fed.append(None if position_ids is None else position_ids[..., -1].reshape(-1).tolist())

    inputs = dict(batch)
    if pass_positions:
        inputs["position_ids"] = _positions_like_generate(batch["attention_mask"])
    handle = model.register_forward_pre_hook(note_positions, with_kwargs=True)
    try:
        torch.manual_seed(SAMPLING_SEED)
        ids = greedy_ids(model, inputs, MAX_NEW_TOKENS, **MODES[mode])
    except Exception as exc:  # noqa: BLE001  (stock without a cache fails; the tests read how)
        return {"error": f"{type(exc).__name__}: {exc}", "fed": fed}
    finally:
        handle.remove()
    return {"ids": ids, "fed": fed}


@pytest.fixture(scope="module")
def runs():
    """``{(model, batch, mode): {"reference", "stock", "patched", "patched without"}}``."""
    import transformers.generation.utils  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay.testing.models import left_padded_batch, tiny_model

    results = {}
    for kind in MODELS:
        model = tiny_model(kind, initializer_range=POSITION_SENSITIVE_INIT)
        for batch_name, lengths in BATCHES.items():
            batch = left_padded_batch(lengths, seed=5)
            for mode in MODES:
                record = results[kind, batch_name, mode] = {}
                with overlay.reverted():
                    record["reference"] = _run(model, batch, mode, pass_positions=False)
                    record["stock"] = _run(model, batch, mode, pass_positions=True)
                with PATCH.applied():
                    record["patched"] = _run(model, batch, mode, pass_positions=True)
                    record["patched without"] = _run(model, batch, mode, pass_positions=False)
    return results


CASES = pytest.mark.parametrize(
    "kind,batch,mode", [(k, b, m) for k in MODELS for b in BATCHES for m in MODES]
)


def test_engine_status():
    from transformers.generation.utils import GenerationMixin

    assert_in_force_only_while_applied(PATCH, lambda: GenerationMixin._update_model_kwargs_for_generation)


@CASES
def test_stock_feeds_the_last_prompt_position(runs, kind, batch, mode):
    """The bug itself: every decoding step gets the last prompt position; the ids differ from
    the reference's, or (no cache: the whole sequence against the prompt's positions) it fails."""
    record = runs[kind, batch, mode]
    reference, stock = record["reference"], record["stock"]
    if not PATCH.affected:
        assert stock == reference, "5.2.0+: passed positions advance"
        return
    prompt_positions = stock["fed"][0]
    assert len(stock["fed"]) >= 2 and all(step == prompt_positions for step in stock["fed"][1:]), stock["fed"]
    assert reference["fed"][1:] != stock["fed"][1:]
    if mode == "no cache":
        assert "ids" not in stock and NO_CACHE_ERROR in stock["error"], stock
    else:
        assert stock["ids"] != reference["ids"], "silently other ids"


@CASES
def test_overlay_gives_the_reference(runs, kind, batch, mode):
    record = runs[kind, batch, mode]
    assert record["patched"]["ids"] == record["reference"]["ids"]
    assert record["patched"]["fed"][1:] == record["reference"]["fed"][1:]


@CASES
def test_overlay_changes_nothing_without_positions(runs, kind, batch, mode):
    record = runs[kind, batch, mode]
    assert record["patched without"] == record["reference"]


def test_report_counts_the_steps_it_advanced():
    from overlay import report
    from overlay.testing.models import left_padded_batch, tiny_model

    model = tiny_model("llama", initializer_range=POSITION_SENSITIVE_INIT)
    batch = left_padded_batch((5,), seed=5)
    report.reset()
    with PATCH.applied():
        _run(model, batch, "greedy", pass_positions=False)
        without = report.fired().get(PATCH.id, 0)
        _run(model, batch, "greedy", pass_positions=True)
        with_positions = report.fired().get(PATCH.id, 0)
    assert without == 0
    # One count per step after the prompt (the last step's update is not used by a forward).
    assert with_positions == (MAX_NEW_TOKENS if PATCH.affected else 0)


def _stack_like_subclass(base):
    """A model class defined outside transformers whose override calls the mixin's step and then
    appends the next position itself, as OpenVINO's ``OVModelForCausalLM`` does on these releases."""

    class StackModel(base):
        def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False, **kwargs):
            import torch

            model_kwargs = super()._update_model_kwargs_for_generation(
                outputs=outputs, model_kwargs=model_kwargs, is_encoder_decoder=is_encoder_decoder, **kwargs
            )
            if "position_ids" in model_kwargs:
                position_ids = model_kwargs["position_ids"]
                model_kwargs["position_ids"] = torch.cat([position_ids, position_ids[..., -1:] + 1], dim=-1)
            return model_kwargs

    return StackModel


def test_a_stacks_override_that_advances_positions_itself_is_not_advanced_twice():
    from overlay import report
    from overlay.testing.models import left_padded_batch, tiny_model

    model = tiny_model("llama", initializer_range=POSITION_SENSITIVE_INIT)
    model.__class__ = _stack_like_subclass(type(model))
    batch = left_padded_batch((7, 4), seed=5)
    with overlay.reverted():
        reference = _run(model, batch, "greedy", pass_positions=False)
        own_fix = _run(model, batch, "greedy", pass_positions=True)
    report.reset()
    with PATCH.applied():
        patched = _run(model, batch, "greedy", pass_positions=True)
    assert own_fix["ids"] == reference["ids"]  # the stack's own fix, on stock
    assert patched == own_fix  # the overlay steps aside: one advance per step, not two
    assert report.fired().get(PATCH.id, 0) == 0


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('both', 'test_stock_feeds_the_last_prompt_position',
                    'stock completes with the last prompt position for every token, or raises a size mismatch')
