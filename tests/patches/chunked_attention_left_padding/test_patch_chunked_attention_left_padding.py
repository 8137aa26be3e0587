"""chunked-attention-left-padding: a left-padded row of a Llama 4 batch generates what it generates alone.

Reproduced for real on the CPU, in this process: a tiny random Llama 4 (``tiny_llama4``: one chunked
attention layer with chunks of 8, one full attention layer), a batch of a 14-token row and a 10-token
row left-padded by 4, greedy, 6 new tokens, dynamic and static caches, sdpa and eager attention. The
reference is each row generated alone (no padding), on stock.

On 4.55.0 - 4.55.4 stock gives the padded row other ids than the row alone (the row without padding
is right); with the patch both rows give the ids they give alone. On 4.56+ (where the engine reports
"fixed upstream") stock already gives them, and the overlay changes nothing. A batch without
padding, a context within one chunk, and a model without chunked attention (tiny Llama) are the same
with and without the overlay. At the mask level: the masks ``create_chunked_causal_mask`` builds with
the patch (sdpa, eager, flex; a prompt and a decoding step) are, element for element, 4.56.0's
(chunks counted from each row's first token, written out independently here), which stock's are
not on 4.55.x and are on 4.56+; without padding they equal stock's.
"""

from __future__ import annotations

import inspect
import types

import pytest

import overlay
from overlay.patch import fingerprint
from overlay.testing.harness import PatchUnderTest
from tests._kit import assert_in_force_only_while_applied

PATCH = PatchUnderTest("chunked_attention_left_padding")
PATCH.skip_module_unless_covered()  # releases before 4.55.0 are out of the overlay's scope
ACTION = PATCH.patch_module.ACTION

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 8
PADDED = (14, 10)  # the second row left-padded by 4: its chunks start at column 4
UNPADDED = (14, 14)
WITHIN_ONE_CHUNK = (5, 3)  # 5 + 3 new tokens: every position in chunk 0
MAX_NEW_TOKENS = 6
SHORT_NEW_TOKENS = 3
CACHES = ("dynamic", "static")
ATTENTIONS = ("sdpa", "eager")
CASES = pytest.mark.parametrize("attention,cache", [(a, c) for a in ATTENTIONS for c in CACHES])


# -- the patch data (the checks every patch gets are in tests/patches/test_patch_declarations.py) -----------


def _masking_utils():
    from transformers import masking_utils

    return masking_utils


def test_the_caller_the_patch_reads_is_the_installed_code():
    """The variant's ``caller`` fingerprint is the release's ``create_chunked_causal_mask`` (4.55.x),
    whose locals the replacement reads; 4.56+ ship another one."""
    target = PATCH.patch.targets[0]
    with overlay.reverted():
        caller = fingerprint(_masking_utils().create_chunked_causal_mask)
    callers = {variant["caller"] for variant in target.originals.values()}
    assert (caller in callers) == PATCH.affected


def test_replacement_keeps_name_docstring_and_signature():
    target = PATCH.patch.targets[0]
    stock = PATCH.stock()
    if not PATCH.affected:
        # 4.56+: create_chunked_causal_mask is other code than the one the replacement reads.
        variant = next(iter(target.originals.values()))
        with pytest.raises(ValueError, match="not the code this patch reads"):
            target.replace(stock, variant)
        return
    replacement = target.build(stock)
    assert replacement.__wrapped__ is stock
    assert (replacement.__name__, replacement.__doc__) == (stock.__name__, stock.__doc__)
    assert inspect.signature(replacement) == inspect.signature(stock)


def _stock_with(**names):
    """The release's ``chunked_causal_mask_function`` reading ``names`` in its module instead of the
    module's own (a copy of the function over a changed copy of its globals)."""
    stock = PATCH.stock()
    return types.FunctionType(stock.__code__, {**stock.__globals__, **names}, stock.__name__)


@pytest.mark.skipif(not PATCH.affected, reason="the builder's checks are of 4.55.x's code")
def test_the_replacement_refuses_a_caller_or_torch_it_cannot_read():
    target = PATCH.patch.targets[0]
    variant = target.variant_of(PATCH.stock())

    def other_create_chunked_causal_mask(*args, **kwargs):
        return None

    with pytest.raises(ValueError, match="create_chunked_causal_mask is not the code this patch reads"):
        target.replace(_stock_with(create_chunked_causal_mask=other_create_chunked_causal_mask), variant)
    with pytest.raises(ValueError, match="needs torch >= 2.6"):
        target.replace(_stock_with(_is_torch_greater_or_equal_than_2_6=False), variant)


def test_engine_status_and_what_is_in_force():
    module = _masking_utils()
    with overlay.reverted():
        assert_in_force_only_while_applied(PATCH, lambda: vars(module)["chunked_causal_mask_function"])


# -- the runs ---------------------------------------------------------------------------------------


def _model(attention: str):
    from overlay.testing.models import tiny_llama4

    return tiny_llama4(attn_implementation=attention, attention_chunk_size=CHUNK)


def _generate_kwargs(cache: str) -> dict:
    return {"cache_implementation": "static"} if cache == "static" else {}


def _new_ids(model, batch, cache: str, new_tokens: int) -> list:
    from overlay.testing.models import greedy_ids

    width = batch["input_ids"].shape[1]
    return [row[width:] for row in greedy_ids(model, batch, new_tokens, **_generate_kwargs(cache))]


def _alone(batch, row: int) -> dict:
    """Row ``row`` of ``batch`` without its padding, as a batch of one."""
    keep = batch["attention_mask"][row].bool()
    return {name: value[row : row + 1, keep] for name, value in batch.items()}


def _attempt(run):
    """``run()``, or the error it raised as ``"Type: message"`` (compared, never hidden)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def _runs_of(model, batch, cache: str, new_tokens: int) -> dict:
    """Stock's, the overlay's (and what the patch reported) and each row alone's new ids, or the
    error each raised."""
    from overlay import report

    rows = range(len(batch["input_ids"]))
    with overlay.reverted():
        record = {
            "stock": _attempt(lambda: _new_ids(model, batch, cache, new_tokens)),
            "alone": _attempt(lambda: [_new_ids(model, _alone(batch, row), cache, new_tokens)[0] for row in rows]),
        }
    with PATCH.applied():
        report.reset()
        record["patched"] = _attempt(lambda: _new_ids(model, batch, cache, new_tokens))
        record["fired"] = report.fired_actions().get(PATCH.id, {})
    return record


# Stock's own crash, outside this patch's releases: with a static cache, generate() builds Llama 4's
# masks ahead (create_masks_for_generate), which from 5.9.0 passes block_sequence_ids to a
# create_chunked_causal_mask that takes it only from 5.20 (read: 5.9.0 - 5.18.0 fail, 5.20.2 works).
STOCK_STATIC_MASK_CRASH = "TypeError: create_chunked_causal_mask() got an unexpected keyword argument 'block_sequence_ids'"


def _stock_fails_by_itself(run: dict) -> bool:
    """Whether stock failed there (never on the patch's releases): the overlay must fail the same way."""
    if not isinstance(run["stock"], str):
        return False
    assert not PATCH.affected and run["stock"] == STOCK_STATIC_MASK_CRASH, run["stock"]
    assert run["patched"] == run["stock"] and run["fired"] == {}, run
    return True


@pytest.fixture(scope="module")
def runs():
    """``{(attention, cache): {"padded"|"unpadded"|"within one chunk": run}}``."""
    import transformers.masking_utils  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay.testing.models import left_padded_batch

    batches = {
        "padded": (left_padded_batch(PADDED, seed=0), MAX_NEW_TOKENS),
        "unpadded": (left_padded_batch(UNPADDED, seed=1), MAX_NEW_TOKENS),
        "within one chunk": (left_padded_batch(WITHIN_ONE_CHUNK, seed=2), SHORT_NEW_TOKENS),
    }
    results: dict = {}
    for attention in ATTENTIONS:
        model = _model(attention)
        for cache in CACHES:
            results[attention, cache] = {
                name: _runs_of(model, batch, cache, new_tokens) for name, (batch, new_tokens) in batches.items()
            }
    return results


@CASES
def test_padded_row_on_stock_transformers(runs, attention, cache):
    run = runs[attention, cache]["padded"]
    if _stock_fails_by_itself(run):
        return
    assert run["stock"][0] == run["alone"][0], "the row without padding is right on every release"
    if PATCH.affected:
        assert run["stock"][1] != run["alone"][1], "4.55.x: the padded row's chunks start 4 tokens early"
    else:
        assert run["stock"][1] == run["alone"][1], "4.56+: chunks counted from each row's first token"


@CASES
def test_padded_row_with_the_overlay_generates_what_it_generates_alone(runs, attention, cache):
    run = runs[attention, cache]["padded"]
    if _stock_fails_by_itself(run):
        return
    assert run["patched"] == run["alone"]
    if not PATCH.affected:
        assert run["patched"] == run["stock"]


@CASES
def test_batch_without_padding_is_the_same_with_and_without_the_overlay(runs, attention, cache):
    run = runs[attention, cache]["unpadded"]
    if _stock_fails_by_itself(run):
        return
    assert run["patched"] == run["stock"] == run["alone"]


@CASES
def test_context_within_one_chunk_is_the_same_with_and_without_the_overlay(runs, attention, cache):
    run = runs[attention, cache]["within one chunk"]
    if _stock_fails_by_itself(run):
        return
    assert run["patched"] == run["stock"] == run["alone"]
    assert run["fired"] == {}, "the release's own function: nothing computed"


@CASES
def test_what_the_patch_reports(runs, attention, cache):
    run = runs[attention, cache]["padded"]
    if _stock_fails_by_itself(run):
        return
    if PATCH.affected:
        # One chunked mask per step (the prompt, then one per new token but the last); with a static
        # cache generate() builds it ahead and the forward reuses it.
        assert run["fired"] == {ACTION: MAX_NEW_TOKENS}
    else:
        assert run["fired"] == {}


def test_a_model_without_chunked_attention_never_runs_it():
    """Tiny Llama (no ``layer_types``, no chunks): nothing calls ``chunked_causal_mask_function``,
    the patch reports nothing, and the ids are stock's; the Llama 4 batch calls it (the count's check)."""
    from unittest import mock

    from overlay import report
    from overlay.testing.models import left_padded_batch, tiny_model

    module = _masking_utils()
    llama, llama4 = tiny_model("llama"), _model("sdpa")
    batch = left_padded_batch(PADDED, seed=0)
    with overlay.reverted():
        stock = {cache: _new_ids(llama, batch, cache, MAX_NEW_TOKENS) for cache in CACHES}
    with PATCH.applied():
        report.reset()
        in_force = module.chunked_causal_mask_function
        calls = {}
        for name, model in (("llama", llama), ("llama4", llama4)):
            with mock.patch.object(module, "chunked_causal_mask_function", side_effect=in_force) as spy:
                # Llama 4 with a static cache may meet stock's own mask crash (STOCK_STATIC_MASK_CRASH):
                # the dynamic cache's calls are counted either way.
                ids = {cache: _attempt(lambda: _new_ids(model, batch, cache, MAX_NEW_TOKENS)) for cache in CACHES}
            calls[name] = spy.call_count
            if name == "llama":
                patched, fired = ids, report.fired_actions().get(PATCH.id, {})
    assert calls["llama"] == 0 and fired == {}
    assert patched == stock
    assert calls["llama4"] > 0


# -- the masks --------------------------------------------------------------------------------------


def _expected_mask(attention_mask, cache_position, kv_length: int):
    """4.56.0's chunked mask, written out: row ``b`` attends from ``q`` to ``kv`` when ``kv`` is not
    padding, ``kv <= q``, and both are in the same chunk counted from the row's first token."""
    import torch

    valid = attention_mask.bool()
    left_padding = (valid.cumsum(-1) == 0).sum(-1)[:, None, None]
    kv = torch.arange(kv_length)
    q = cache_position[:, None]
    not_padding = valid[:, kv][:, None, :]
    same_chunk = (kv[None, None, :] - left_padding) // CHUNK == (q[None] - left_padding) // CHUNK
    return (not_padding & (kv[None, :] <= q)[None] & same_chunk)[:, None]


def _takes_input_embeds() -> bool:
    return "input_embeds" in inspect.signature(_masking_utils().create_chunked_causal_mask).parameters


def _chunked_mask(attention: str, attention_mask, step: str):
    """The boolean 4D mask ``create_chunked_causal_mask`` builds with ``attention`` for the prompt
    (no cache) or for one decoding step after it (a dynamic cache holding all but the last column)."""
    import torch
    from torch.nn.attention.flex_attention import create_mask
    from transformers import DynamicCache

    from overlay.testing.models import tiny_llama4_config

    module = _masking_utils()
    config = tiny_llama4_config(attention_chunk_size=CHUNK)
    config._attn_implementation = attention
    batch, width = attention_mask.shape
    if step == "prompt":
        cache_position, cache = torch.arange(width), None
    else:
        cache_position, cache = torch.tensor([width - 1]), DynamicCache()
        states = torch.zeros(batch, config.num_key_value_heads, width - 1, config.head_dim)
        cache.update(states, states, 0)
    embeds = torch.empty(batch, len(cache_position), config.hidden_size)
    mask = module.create_chunked_causal_mask(config, embeds, attention_mask, cache_position, cache)
    if attention == "eager":
        return mask == 0
    if attention == "flex_attention":  # the mask function flex gets, evaluated densely
        return create_mask(mask.mask_mod, batch, 1, len(cache_position), width, device="cpu")
    return mask


@pytest.fixture
def uncompiled_block_masks(monkeypatch):
    """The flex mask builder without torch.compile (inductor takes a minute on this CPU; the mask
    function it gets is the same)."""
    module = _masking_utils()
    original = module.create_block_mask

    def create_block_mask(*args, **kwargs):
        return original(*args, **{**kwargs, "_compile": False})

    monkeypatch.setattr(module, "create_block_mask", create_block_mask)


MASK_CASES = pytest.mark.parametrize(
    "attention,step", [(a, s) for a in ("sdpa", "eager", "flex_attention") for s in ("prompt", "decoding step")]
)


@MASK_CASES
def test_masks_count_chunks_from_each_row_first_token(uncompiled_block_masks, attention, step):
    import torch

    from overlay.testing.models import left_padded_batch

    if not _takes_input_embeds():
        pytest.skip(f"transformers {PATCH.transformers}: create_chunked_causal_mask takes other arguments")
    attention_mask = left_padded_batch(PADDED, seed=0)["attention_mask"]
    positions = torch.arange(attention_mask.shape[1])
    expected = _expected_mask(attention_mask, positions if step == "prompt" else positions[-1:], attention_mask.shape[1])
    with overlay.reverted():
        stock = _chunked_mask(attention, attention_mask, step)
    with PATCH.applied():
        patched = _chunked_mask(attention, attention_mask, step)
    assert torch.equal(patched, expected)
    assert torch.equal(stock[0], expected[0]), "the row without padding: the same on every release"
    assert torch.equal(stock[1], expected[1]) == (not PATCH.affected)


@MASK_CASES
def test_masks_without_padding_are_the_release_masks(uncompiled_block_masks, attention, step):
    import torch

    from overlay.testing.models import left_padded_batch

    if not _takes_input_embeds():
        pytest.skip(f"transformers {PATCH.transformers}: create_chunked_causal_mask takes other arguments")
    attention_mask = left_padded_batch(UNPADDED, seed=1)["attention_mask"]
    with overlay.reverted():
        stock = _chunked_mask(attention, attention_mask, step)
    with PATCH.applied():
        patched = _chunked_mask(attention, attention_mask, step)
    assert torch.equal(patched, stock)


@pytest.mark.skipif(not PATCH.affected, reason="4.56+ call chunked_causal_mask_function with the left padding")
def test_other_callers_and_compiled_regions_get_the_release_function(monkeypatch):
    """Called by hand (no caller to read) or while torch.compile traces, the replacement gives what
    the release's function gives, and reports nothing."""
    import torch

    from overlay import report
    from overlay.testing.models import left_padded_batch

    module = _masking_utils()
    attention_mask = left_padded_batch(PADDED, seed=0)["attention_mask"]
    indices = torch.arange(2), torch.arange(1), torch.arange(14), torch.arange(14)
    with overlay.reverted():
        stock_by_hand = module._vmap_for_bhqkv(module.chunked_causal_mask_function(CHUNK))(*indices)
        with monkeypatch.context() as tracing:
            tracing.setattr(torch.compiler, "is_compiling", lambda: True)
            stock = _chunked_mask("sdpa", attention_mask, "prompt")
    with PATCH.applied():
        report.reset()
        by_hand = module._vmap_for_bhqkv(module.chunked_causal_mask_function(CHUNK))(*indices)
        with monkeypatch.context() as tracing:
            tracing.setattr(torch.compiler, "is_compiling", lambda: True)
            compiling = _chunked_mask("sdpa", attention_mask, "prompt")
        fired = report.fired_actions().get(PATCH.id, {})
    assert torch.equal(by_hand, stock_by_hand)
    assert torch.equal(compiling, stock)
    assert fired == {}


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('output', 'test_padded_row_on_stock_transformers',
                    'stock Llama 4 padded rows complete with other tokens than alone')
