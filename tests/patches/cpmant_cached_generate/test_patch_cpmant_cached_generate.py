"""cpmant-cached-generate: CPM-Ant's cached greedy and beam-search ``generate()``.

Reproduced for real on the CPU, in this process, with a tiny random CPM-Ant built from a config.
CPM-Ant attends in both directions over the whole sequence, so ``use_cache=False`` is no control
(a token's states then see the tokens after it; the cached path's do not). The control is the
cached path driven by hand: the model called step by step with the full ids and the cache it
returned (what 5.16.0's ``generate()`` passes it), argmax for greedy search, and a beam search
written out (cumulative log-probabilities, top ``num_beams`` over beams x tokens, the cache
reordered with ``Cache.reorder_cache``; no eos token, so every beam runs to ``max_new_tokens``,
and all of them are compared, best first, as ``generate()`` returns them).

On 4.55.0 - 5.15.1 stock greedy search raises the patch's ``RuntimeError``; beam search (which
needs ``beam-search-logits-width`` first: CPM-Ant's head is wider than its vocabulary up to
5.15.1) raises the ``AttributeError`` on 4.56 - 4.57 and the ``RuntimeError`` on 4.55 and 5.x
(4.55's forward reads the list back as a cache; the overlay's reorder keeps it one). With the
patch every run gives the hand loop's ids, and with ``device-move-nested`` too where that one
applies (5.13 - 5.15.1: both wrap the same inherited function). From 5.16.0 on the engine reports
"fixed upstream" and stock's own ids are the hand loop's.
"""

from __future__ import annotations

import inspect

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("cpmant_cached_generate")
PATCH.skip_module_unless_covered()
LOGITS_WIDTH = PatchUnderTest("beam_search_logits_width")
DEVICE_MOVE = PatchUnderTest("device_move")

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW_TOKENS = 5
NUM_BEAMS = 3
#: Five prompt tokens, no 0 (CPM-Ant reads 0 as padding); with the config's 4 prompt slots the
#: second step's sizes are the 9 and 5 of the error text the patch declares.
PROMPT = [[5, 9, 13, 17, 21]]
BATCH = [[5, 9, 13, 17, 21], [30, 2, 44, 7, 11]]
SIZE_ERROR = PATCH.error("size of tensor")
LIST_ERROR = PATCH.error("get_seq_length")


def tiny_cpmant(seed: int = 0):
    """A float32 CPM-Ant with two layers of width 32, on the CPU, in eval mode, greedy, no eos
    token. ``prompt_types`` must be 3 or more: the forward prepends the ids of the third prompt
    type (``vocab_size + 2 * prompt_length`` on), and the embedding holds ``prompt_types *
    prompt_length`` of them."""
    import torch
    from transformers import CpmAntConfig, CpmAntForCausalLM

    config = CpmAntConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, dim_head=16, dim_ff=64, num_hidden_layers=2,
        position_bias_num_buckets=32, position_bias_max_distance=64, prompt_types=3, prompt_length=4,
        segment_types=4,
    )
    torch.manual_seed(seed)
    model = CpmAntForCausalLM(config).eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _inputs(rows):
    import torch

    ids = torch.tensor(rows)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def hand_greedy(model, rows) -> list:
    """The cached path by hand: full ids and the cache each step, argmax over the whole head."""
    import torch

    from overlay.testing.models import dynamic_cache

    # A Cache from the start, as generate() passes one: 4.55's forward hands back legacy tuples
    # for a cache it made itself.
    ids, cache = torch.tensor(rows), dynamic_cache(model.config)
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            ids = torch.cat([ids, out.logits[:, -1, :].argmax(-1, keepdim=True)], dim=1)
    return ids.tolist()


def hand_beams(model, rows) -> list:
    """Beam search by hand on the cached path, one prompt at a time: every beam's ids, best first."""
    import torch

    from overlay.testing.models import dynamic_cache

    best = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row] * NUM_BEAMS)
            scores = torch.full((NUM_BEAMS,), -1e9)
            scores[0] = 0.0  # the beams start as copies of one prompt: only the first one counts
            cache = dynamic_cache(model.config)
            for _ in range(MAX_NEW_TOKENS):
                out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                logprobs = torch.log_softmax(out.logits[:, -1, :].float(), dim=-1)
                width = logprobs.shape[-1]
                scores, flat = (scores[:, None] + logprobs).view(-1).topk(NUM_BEAMS)
                beam_idx, tokens = flat // width, flat % width
                cache.reorder_cache(beam_idx)
                ids = torch.cat([ids[beam_idx], tokens[:, None]], dim=1)
            best += ids.tolist()  # topk sorts: best first, as generate() returns them
    return best


def _generate(model, rows, **kwargs) -> dict:
    """One generate() call's ids or the error it raised, with what this patch reported."""
    import torch

    from overlay import report

    report.reset()
    try:
        with torch.no_grad():
            ids = model.generate(**_inputs(rows), max_new_tokens=MAX_NEW_TOKENS, **kwargs)
        run = {"ok": True, "ids": ids.tolist()}
    except Exception as exc:  # noqa: BLE001  (the tests read which one)
        run = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
    run["fired"] = report.fired_actions().get(PATCH.id, {})
    return run


def _beam_kwargs() -> dict:
    # Every beam comes back: a wrong reorder of the cache shows in the beams below the best too.
    return {"num_beams": NUM_BEAMS, "num_return_sequences": NUM_BEAMS}


@pytest.fixture(scope="module")
def model():
    import transformers.models.cpmant.modeling_cpmant  # noqa: F401  (the patch's module)

    return tiny_cpmant()


@pytest.fixture(scope="module")
def control(model):
    return {
        "greedy": {name: hand_greedy(model, rows) for name, rows in (("one", PROMPT), ("batch", BATCH))},
        "beams": {name: hand_beams(model, rows) for name, rows in (("one", PROMPT), ("batch", BATCH))},
    }


ROWS = pytest.mark.parametrize("name,rows", [("one", PROMPT), ("batch", BATCH)])
affected_only = pytest.mark.skipif(not PATCH.affected, reason="stock carries the bug only where affected")


# -- the engine's word ------------------------------------------------------------------------------


def test_the_engine_says_what_this_release_gets(model):
    """(``model`` imports the module the patch waits for.)"""
    with PATCH.applied() as statuses:
        state = statuses[PATCH.id].state
    assert state == ("applied" if PATCH.affected else "fixed upstream"), statuses
    PATCH.assert_labels_within_range()


@affected_only
def test_the_replacement_keeps_the_signature_generate_reads(model):
    """generate()'s _validate_model_kwargs reads prepare_inputs_for_generation's parameters: a bare
    **kwargs there would reject attention_mask (every call below passes one)."""
    from transformers import CpmAntForCausalLM

    stock = inspect.signature(CpmAntForCausalLM.prepare_inputs_for_generation)
    with PATCH.applied(expect="applied"):
        patched = CpmAntForCausalLM.prepare_inputs_for_generation
        assert "prepare_inputs_for_generation" in vars(CpmAntForCausalLM)
        assert inspect.signature(patched) == stock
        assert "attention_mask" in inspect.signature(patched).parameters
    # Set on CPM-Ant only, and deleted again by the revert: the class inherits the base's once more.
    assert "prepare_inputs_for_generation" not in vars(CpmAntForCausalLM)


# -- greedy search ----------------------------------------------------------------------------------


def test_without_the_cache_is_no_control(model):
    """Why the control is the hand loop: without the cache every position attends to the tokens
    after it too, so the next token's logits are not the cached path's."""
    import torch

    from overlay.testing.models import dynamic_cache

    ids = torch.tensor(PROMPT)
    longer = torch.cat([ids, torch.tensor([[38]])], dim=1)
    with torch.no_grad():
        cache = dynamic_cache(model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        cached = model(input_ids=longer, past_key_values=cache, use_cache=True).logits[:, -1]
        whole = model(input_ids=longer, use_cache=False).logits[:, -1]
    assert (cached - whole).abs().max() > 1e-2


@affected_only
@ROWS
def test_stock_greedy_fails(model, name, rows):
    with overlay.reverted():
        run = _generate(model, rows)
    assert not run["ok"] and run["type"] == "RuntimeError", run
    if name == "one":
        assert run["error"] == SIZE_ERROR, run
    else:
        assert "must match the size of tensor b" in run["error"], run


@ROWS
def test_greedy_gives_the_hand_loops_ids(model, control, name, rows):
    with PATCH.applied() as statuses:
        run = _generate(model, rows)
    assert run["ok"], run
    assert run["ids"] == control["greedy"][name]
    if PATCH.affected:
        assert statuses[PATCH.id].state == "applied"
        assert run["fired"] == {"passed CPM-Ant the whole sequence": MAX_NEW_TOKENS - 1}, run
    else:  # 5.16.0 on: the release's own generate() is the hand loop
        assert run["fired"] == {}, run


def test_without_the_cache_the_patch_changes_nothing(model):
    """A call that never meets the cache is the release's own, ids and all (changes="errors")."""
    with overlay.reverted():
        stock = _generate(model, PROMPT, use_cache=False)
    with PATCH.applied():
        patched = _generate(model, PROMPT, use_cache=False)
    assert stock["ok"] and patched == stock, (stock, patched)
    assert patched["fired"] == {}


# -- beam search ------------------------------------------------------------------------------------


@affected_only
def test_stock_beam_search_fails_first_on_the_head_width(model):
    """Without beam-search-logits-width stock fails before reaching this bug, and so does the
    overlay without that patch: this patch does not hide it."""
    with overlay.reverted():
        stock = _generate(model, PROMPT, **_beam_kwargs())
    with PATCH.applied(expect="applied"):
        alone = _generate(model, PROMPT, **_beam_kwargs())
    for run in (stock, alone):
        assert not run["ok"] and run["type"] == "RuntimeError" and "is invalid for input of size" in run["error"], run


@affected_only
@ROWS
def test_beam_search_fails_without_this_patch(model, name, rows):
    """With the head's width fixed, beam search meets this bug: the list cache where the release
    still has CPM-Ant's _reorder_cache (4.56 - 4.57; 5.0.0rc0 on dropped it), the cut ids on 4.55
    (whose forward turns any cache that is not a Cache back into one) and on 5.x."""
    from packaging.version import Version

    with LOGITS_WIDTH.applied(expect="applied"):
        run = _generate(model, rows, **_beam_kwargs())
    assert not run["ok"], run
    reorders_into_a_list = len(PATCH.present_targets()) == 2  # the release defines _reorder_cache
    if reorders_into_a_list and PATCH.transformers >= Version("4.56"):
        assert run["type"] == "AttributeError" and run["error"] == LIST_ERROR, run
    else:
        assert run["type"] == "RuntimeError" and "must match the size of tensor b" in run["error"], run


def test_the_beam_reorder_keeps_the_cache_a_cache(model):
    """4.55 - 4.57: CPM-Ant's own _reorder_cache makes a list of lists of the cache; the overlay's
    reorders the Cache in place and hands back the same object, its rows those of stock's list."""
    import copy

    import torch

    from overlay.testing.models import dynamic_cache

    if len(PATCH.present_targets()) != 2:
        assert not hasattr(type(model), "_reorder_cache")  # 5.0.0 on: beam search reorders the Cache
        return
    cache = dynamic_cache(model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor(BATCH), past_key_values=cache, use_cache=True)
    beam_idx = torch.tensor([1, 0])
    with overlay.reverted():
        stock = model._reorder_cache(copy.deepcopy(cache), beam_idx)
    assert isinstance(stock, list) and isinstance(stock[0], list)
    with PATCH.applied(expect="applied"):
        patched = model._reorder_cache(cache, beam_idx)
    assert patched is cache
    for layer, (keys, values) in zip(cache.to_legacy_cache(), stock, strict=True):
        assert torch.equal(layer[0], keys) and torch.equal(layer[1], values)


@ROWS
def test_the_hand_beams_differ_from_each_other(control, name, rows):
    """The control's beams are distinct sequences, so comparing all of them tests the cache's
    reorder: beams that swapped their caches would continue from another beam's states."""
    beams = control["beams"][name]
    assert len(beams) == NUM_BEAMS * len(rows)
    assert len({tuple(b) for b in beams}) == len(beams)


@ROWS
def test_beam_search_gives_the_hand_beams(model, control, name, rows):
    also = (LOGITS_WIDTH.id,) if LOGITS_WIDTH.affected else ()
    with PATCH.applied(*also):
        run = _generate(model, rows, **_beam_kwargs())
    assert run["ok"], run
    assert run["ids"] == control["beams"][name]
    if PATCH.affected:
        assert run["fired"].get("passed CPM-Ant the whole sequence") == MAX_NEW_TOKENS - 1, run
    else:
        assert run["fired"] == {}, run


# -- with device-move-nested on the same inherited function ------------------------------------------

both_patches = pytest.mark.skipif(
    not (PATCH.affected and DEVICE_MOVE.affected), reason="device-move-nested and this patch overlap on 5.13 - 5.15 only"
)


@both_patches
def test_with_device_move_nested_both_are_in_force(model, control):
    """device-move-nested wraps GenerationMixin.prepare_inputs_for_generation; this patch wraps
    CPM-Ant's inherited copy of it: the engine layers this one over the base's replacement, in
    either order, and each reverts alone."""
    from transformers import CpmAntForCausalLM
    from transformers.generation.utils import GenerationMixin

    from overlay.patch import PATCH_MARKER

    with PATCH.applied(DEVICE_MOVE.id, LOGITS_WIDTH.id, expect="applied"):
        mine = vars(CpmAntForCausalLM)["prepare_inputs_for_generation"]
        assert getattr(mine, PATCH_MARKER) == PATCH.id
        assert getattr(mine.__wrapped__, PATCH_MARKER) == DEVICE_MOVE.id
        greedy = _generate(model, PROMPT)
        beams = _generate(model, BATCH, **_beam_kwargs())
    assert greedy["ok"] and greedy["ids"] == control["greedy"]["one"], greedy
    assert beams["ok"] and beams["ids"] == control["beams"]["batch"], beams
    for outer, inner in ((DEVICE_MOVE, PATCH), (PATCH, DEVICE_MOVE)):  # applied one after the other
        with outer.applied(expect="applied"):
            with inner.applied(expect="applied"):
                mine = vars(CpmAntForCausalLM)["prepare_inputs_for_generation"]
                assert getattr(mine.__wrapped__, PATCH_MARKER) == DEVICE_MOVE.id
                assert _generate(model, PROMPT)["ids"] == control["greedy"]["one"]
            # the inner one reverted alone: the outer one is still in force, and alone
            mine = vars(CpmAntForCausalLM).get("prepare_inputs_for_generation")
            if outer is PATCH:
                assert getattr(mine, PATCH_MARKER) == PATCH.id
                assert getattr(mine.__wrapped__, PATCH_MARKER, None) is None
                assert _generate(model, PROMPT)["ids"] == control["greedy"]["one"]
            else:
                assert mine is None
                assert getattr(GenerationMixin.prepare_inputs_for_generation, PATCH_MARKER) == DEVICE_MOVE.id
    assert "prepare_inputs_for_generation" not in vars(CpmAntForCausalLM)
    assert getattr(GenerationMixin.prepare_inputs_for_generation, PATCH_MARKER, None) is None


# -- the fixed release ------------------------------------------------------------------------------


@pytest.mark.skipif(PATCH.affected, reason="the fixed releases only")
@ROWS
def test_the_fixed_release_is_the_hand_loop(model, control, name, rows):
    """5.16.0 on: stock greedy and beam search (the head is vocab-wide there) are the hand loop's."""
    with overlay.reverted():
        greedy = _generate(model, rows)
        beams = _generate(model, rows, **_beam_kwargs())
    assert greedy["ok"] and greedy["ids"] == control["greedy"][name], greedy
    assert beams["ok"] and beams["ids"] == control["beams"][name], beams


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_without_the_cache_the_patch_changes_nothing',
                    'without the cache it changes nothing; cached generate() raised at its second step')
