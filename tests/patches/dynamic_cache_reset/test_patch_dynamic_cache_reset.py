"""dynamic-cache-reset: a cache reused after ``cache.reset()`` generates like a fresh cache.

Reproduced for real on the CPU, in this process: tiny random Llama (full attention layers), Gemma 3
(a sliding layer: from 4.56 a sliding dynamic layer, which counts its length itself) and T5 (an
``EncoderDecoderCache`` of two dynamic caches: self- and cross-attention layers). A cache generates
for a first prompt (7 tokens), is ``reset()``, then generates for a second prompt: a longer one (9
tokens, the recipe of docs/upstream-fixes.md), a batch of two, a shorter one (5 tokens). The
reference is the second prompt's run with a fresh cache.

On 4.55.0 - 5.17.0 stock gives other ids than the reference or raises one of the errors the patch
declares (Llama's longer prompt: other ids, ``get_seq_length()`` the old length; the batch of two:
the size mismatch; the shorter prompt up to 5.2.0: the empty cache positions); with the patch every
run gives the reference's ids and ``get_seq_length()`` is 0 after ``reset()``. Where stock works
(a fresh cache; a static cache's ``reset()``; 5.18.0+, where the engine reports "fixed upstream")
the overlay gives stock's ids. ``reset()`` of a cache never written raises on 4.55 stock, and
works with the patch. At the layer level: 5.11+'s indexed layers (sparse attention) start their
indexer keys afresh too, and a dynamic layer class defined outside ``transformers.cache_utils``
keeps the release's own ``reset``.
"""

from __future__ import annotations

import pytest
from packaging.version import Version

import overlay
from overlay.patch import Variant
from overlay.testing.harness import PatchUnderTest
from tests._kit import (
    assert_replacements_keep_the_originals_face,
    assert_set_on_its_class_only_while_applied,
    covered_module,
)

PATCH = PatchUnderTest("dynamic_cache_reset")
pytestmark = covered_module(PATCH)  # releases before 4.55.0 are out of the overlay's scope

MODELS = ("llama", "gemma3", "t5")
FIRST_PROMPT = (7,)
SECOND_PROMPTS = {"longer": (9,), "batch of two": (9, 6), "shorter": (5,)}
MAX_NEW_TOKENS = 5
STATIC_CACHE_LENGTH = 32

SIZE_ERROR = PATCH.error("Sizes of tensors")
EMPTY_POSITIONS_ERROR = PATCH.error("index -1")
NEVER_WRITTEN_ERROR = PATCH.error("zero_")
#: Up to 5.2.0 generate() reads the last cache position left for the prompt: none is left when
#: the stale length is at least the prompt's.
RAISES_ON_EMPTY_POSITIONS = PATCH.affected and PATCH.transformers < Version("5.3.0")
#: 4.55's layers have no lazy initialisation: the release's reset() zeroes ``None`` there.
RESET_FAILS_WHEN_NEVER_WRITTEN = PATCH.affected and PATCH.transformers < Version("4.56.0")
#: 4.55's layers are emptied in place instead of dropped (see the patch's docstring).
KEEPS_EMPTY_TENSORS = PATCH.affected and PATCH.transformers < Version("4.56.0")
LAYER_ACTION = "emptied a reset dynamic cache layer"
INDEXER_ACTION = "emptied a reset indexer key cache"





# -- the patch data ---------------------------------------------------------------------------------


def test_replacements_keep_name_docstring_and_signature():
    # Built by hand for the fixed code too (5.18.0+): only the wrapper's metadata is read there.
    assert_replacements_keep_the_originals_face(
        PATCH, otherwise=Variant("this release", {"forget": None, "original_after": True}))


def test_engine_status_and_where_the_replacement_goes():
    from transformers import cache_utils

    inherited = "reset" not in vars(cache_utils.DynamicLayer)
    assert inherited == PATCH.affected, "the dynamic layers inherit the static layers' reset() up to 5.17.0"
    # The static layers keep zeroing their fixed-size buffers (right for them).
    assert_set_on_its_class_only_while_applied(PATCH, cache_utils.DynamicLayer, "reset",
                                               others=lambda: cache_utils.StaticLayer.reset)


# -- the runs ---------------------------------------------------------------------------------------


def _model(kind: str):
    from overlay.testing.models import tiny_model

    # T5 of some releases has no SDPA: its default attention everywhere.
    return tiny_model(kind, attn_implementation=None if kind == "t5" else "sdpa")


def _fresh_cache(model):
    from transformers import DynamicCache, EncoderDecoderCache

    from overlay.testing.models import dynamic_cache

    if model.config.is_encoder_decoder:
        return EncoderDecoderCache(DynamicCache(), DynamicCache())
    return dynamic_cache(model.config)


def _generate(model, batch, cache) -> dict:
    """The generated ids of one greedy run with ``cache``, or the error, without its type."""
    from overlay.testing.models import cache_argument_name, greedy_ids

    try:
        return {"ok": True, "ids": greedy_ids(model, batch, MAX_NEW_TOKENS, **{cache_argument_name(model): cache})}
    except Exception as exc:  # noqa: BLE001  (the tests read which one)
        return {"ok": False, "type": type(exc).__name__, "error": str(exc)}


def _reused(model, first, second) -> dict:
    """A cache used for ``first``, reset, then used for ``second``: both runs, the cache's length
    before and after ``reset()``, and what the patch reported."""
    from overlay import report

    cache = _fresh_cache(model)
    run = {"first": _generate(model, first, cache), "before": int(cache.get_seq_length())}
    placement = [(str(layer.keys.dtype), str(layer.keys.device)) for layer in _dynamic_layers(cache)]
    report.reset()
    cache.reset()
    run["fired"] = report.fired_actions().get(PATCH.id, {})
    run["after"] = int(cache.get_seq_length())
    run["layers after"] = [int(layer.get_seq_length()) for layer in _dynamic_layers(cache)]
    # What each layer holds after reset(): nothing (None), or (elements, dtype, device) and
    # whether that dtype and device are the ones it held before.
    run["held after"] = [
        None if layer.keys is None
        else (layer.keys.numel(), (str(layer.keys.dtype), str(layer.keys.device)) == before)
        for layer, before in zip(_dynamic_layers(cache), placement)
    ]
    run["second"] = _generate(model, second, cache)
    return run


def _dynamic_layers(cache) -> list:
    halves = [getattr(cache, "self_attention_cache", cache), getattr(cache, "cross_attention_cache", None)]
    return [layer for half in halves if half is not None for layer in half.layers]


@pytest.fixture(scope="module")
def runs():
    """``{model: {"first reference", "second reference": {prompt: run}, prompt: {"stock"|"patched":
    reused run}, "never written": {...}}}``: the references with fresh caches, on stock."""
    import transformers.cache_utils  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay.testing.models import left_padded_batch

    first = left_padded_batch(FIRST_PROMPT, seed=1)
    seconds = {name: left_padded_batch(lengths, seed=2) for name, lengths in SECOND_PROMPTS.items()}
    return {kind: _runs_of(_model(kind), first, seconds) for kind in MODELS}


def _runs_of(model, first, seconds: dict) -> dict:
    """One model's record of :func:`runs`."""
    with overlay.reverted():
        record = {
            "first reference": _generate(model, first, _fresh_cache(model)),
            "second reference": {name: _generate(model, batch, _fresh_cache(model)) for name, batch in seconds.items()},
        }
    for name, batch in seconds.items():
        record[name] = {}
        for state in ("stock", "patched"):
            with overlay.reverted() if state == "stock" else PATCH.applied():
                record[name][state] = _reused(model, first, batch)
    record["never written"] = {}
    for state in ("stock", "patched"):
        with overlay.reverted() if state == "stock" else PATCH.applied():
            cache = _fresh_cache(model)
            try:
                cache.reset()
            except Exception as exc:  # noqa: BLE001
                record["never written"][state] = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
            else:
                record["never written"][state] = _generate(model, seconds["longer"], cache)
    return record


CASES = pytest.mark.parametrize("kind,prompt", [(k, p) for k in MODELS for p in SECOND_PROMPTS])


def _assert_is_declared(run: dict) -> None:
    """A failed stock run failed with one of the errors the patch declares."""
    assert f"{run['type']}: {run['error']}" in PATCH.patch.errors, run


@CASES
def test_reused_cache_on_stock_transformers(runs, kind, prompt):
    record = runs[kind]
    stock = record[prompt]["stock"]
    reference = record["second reference"][prompt]
    assert reference["ok"], reference
    assert stock["first"] == record["first reference"], "the first call uses a fresh cache"
    if not PATCH.affected:
        assert stock["second"] == reference, "5.18.0+: a reset cache is a fresh one"
        assert stock["after"] == 0
        return
    # The bug: whatever the model, stock does not give the fresh cache's ids.
    if stock["second"]["ok"]:
        if stock["second"]["ids"] == reference["ids"]:
            # Seen on 5.9.0: the tiny random T5 generates nothing but its start token (0) with any
            # cache, so its ids cannot show the stale entries; the bug's cause must show instead.
            assert all(len(set(row)) == 1 for row in reference["ids"]), (reference, stock["second"])
            assert stock["after"] == stock["before"] > 0, "reset() keeps the old length"
        else:
            assert stock["second"]["ids"] != reference["ids"]
    else:
        _assert_is_declared(stock["second"])


@pytest.mark.parametrize("prompt", list(SECOND_PROMPTS))
def test_what_stock_does_with_full_attention_layers(runs, prompt):
    """Llama: ``reset()`` keeps the old length; the longer prompt is the recipe of
    docs/upstream-fixes.md (other ids, no error)."""
    stock = runs["llama"][prompt]["stock"]
    reference = runs["llama"]["second reference"][prompt]
    if not PATCH.affected:
        assert stock["second"] == reference
        return
    assert stock["before"] > 0 and stock["after"] == stock["before"], "reset() keeps the old length"
    if prompt == "longer":
        assert stock["second"]["ok"] and stock["second"]["ids"] != reference["ids"], "silently other ids"
    elif prompt == "batch of two":
        assert (stock["second"]["ok"], stock["second"].get("error")) == (False, SIZE_ERROR)
    elif RAISES_ON_EMPTY_POSITIONS:
        assert (stock["second"]["ok"], stock["second"].get("error")) == (False, EMPTY_POSITIONS_ERROR)
    else:
        assert stock["second"]["ok"] and stock["second"]["ids"] != reference["ids"]


@CASES
def test_reused_cache_with_the_overlay_is_a_fresh_cache(runs, kind, prompt):
    record = runs[kind]
    patched = record[prompt]["patched"]
    assert patched["first"] == record["first reference"], "a fresh cache: the overlay changes nothing"
    assert patched["after"] == 0 and set(patched["layers after"]) <= {0}
    assert patched["second"] == record["second reference"][prompt]
    if KEEPS_EMPTY_TENSORS:
        # 4.55's offloading processor moves every layer's tensors on each write: still tensors,
        # empty, on the device and in the dtype they were.
        assert patched["held after"] == [(0, True)] * len(patched["held after"])
    else:  # dropped, as 5.18.0 does: the next write initialises the layer
        assert patched["held after"] == [None] * len(patched["held after"])


@CASES
def test_what_the_patch_reports(runs, kind, prompt):
    patched = runs[kind][prompt]["patched"]
    if PATCH.affected:
        # One count per dynamic layer that held states (T5: the self- and cross-attention ones).
        assert patched["fired"] == {LAYER_ACTION: len(patched["layers after"])}
    else:
        assert patched["fired"] == {}


@pytest.mark.parametrize("kind", MODELS)
def test_reset_of_a_cache_never_written(runs, kind):
    record = runs[kind]["never written"]
    reference = runs[kind]["second reference"]["longer"]
    if RESET_FAILS_WHEN_NEVER_WRITTEN:
        assert (record["stock"]["ok"], record["stock"].get("error")) == (False, NEVER_WRITTEN_ERROR)
    else:
        assert record["stock"] == reference
    assert record["patched"] == reference


# -- a static cache: its layers keep the release's own reset() ------------------------------------


@pytest.fixture(scope="module")
def static_runs():
    """Llama and Gemma 3 with a user-built static cache: a fresh one's run, and one used for the
    first prompt, reset, then used for the second, on stock and with the overlay."""
    import torch

    from overlay import report
    from overlay.testing.models import left_padded_batch, static_cache

    first = left_padded_batch(FIRST_PROMPT, seed=1)
    second = left_padded_batch(SECOND_PROMPTS["longer"], seed=2)
    results: dict = {}
    for kind in ("llama", "gemma3"):
        model = _model(kind)

        def new_cache():
            return static_cache(model.config, 1, STATIC_CACHE_LENGTH, torch.float32)

        with overlay.reverted():
            results[kind] = {"reference": _generate(model, second, new_cache())}
        for state in ("stock", "patched"):
            with overlay.reverted() if state == "stock" else PATCH.applied():
                cache = new_cache()
                _generate(model, first, cache)
                report.reset()
                cache.reset()
                results[kind][state] = {
                    "fired": report.fired_actions().get(PATCH.id, {}),
                    "second": _generate(model, second, cache),
                }
    return results


@pytest.mark.parametrize("kind", ("llama", "gemma3"))
def test_static_cache_reset_is_the_same_with_and_without_the_overlay(static_runs, kind):
    record = static_runs[kind]
    assert record["reference"]["ok"], record["reference"]
    assert record["stock"]["second"] == record["reference"], "a static cache's reset() works on stock"
    assert record["patched"]["second"] == record["stock"]["second"]
    assert record["patched"]["fired"] == {}, "the static layers are not the patch's"


# -- at the layer level -------------------------------------------------------------------------------


def _states(batch: int, length: int, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 2, length, 8, generator=generator) for _ in range(2)]


def _reset_and_rewrite(layer_class) -> dict:
    """A layer of ``layer_class`` written with 5 positions, reset, written with 3: its keys and
    values then, and those of a fresh layer written with the same 3."""
    used, fresh = layer_class(), layer_class()
    used.update(*_states(1, 5, seed=0))
    used.reset()
    used.update(*_states(1, 3, seed=1))
    fresh.update(*_states(1, 3, seed=1))
    return {"used": (used.keys, used.values), "fresh": (fresh.keys, fresh.values)}


def test_a_dynamic_layer_defined_elsewhere_keeps_the_release_reset():
    import torch
    from transformers import cache_utils

    class LayerOfAnotherModule(cache_utils.DynamicLayer):
        """Stands for a model file's layer that may hold more states than the keys and values."""

    with overlay.reverted():
        stock = _reset_and_rewrite(LayerOfAnotherModule)
    with PATCH.applied():
        patched = _reset_and_rewrite(LayerOfAnotherModule)
        known = _reset_and_rewrite(cache_utils.DynamicLayer)
    for got, expected in zip(patched["used"], stock["used"]):
        assert torch.equal(got, expected), "a layer class the patch does not know: stock's reset()"
    # The release's own dynamic layer, reset with the overlay, holds exactly a fresh layer's states.
    for got, expected in zip(known["used"], known["fresh"]):
        assert torch.equal(got, expected)
    if PATCH.affected:  # and stock's held 5 stale positions before the new 3
        assert stock["used"][0].shape[-2] == 5 + 3


def _indexed_layer_after_reset() -> dict:
    """A ``DynamicIndexedLayer`` (main and indexer states) written with 5 positions, reset, written
    with 3: its lengths, and whether its indexer keys are a fresh layer's."""
    import torch
    from transformers import cache_utils

    def write(layer, length, seed):
        layer.update(*_states(1, length, seed))
        generator = torch.Generator().manual_seed(seed + 100)
        layer.update_indexer(torch.randn(1, length, 4, generator=generator))

    from overlay import report

    used, fresh = cache_utils.DynamicIndexedLayer(), cache_utils.DynamicIndexedLayer()
    write(used, 5, seed=0)
    report.reset()
    used.reset()
    fired = report.fired_actions().get(PATCH.id, {})
    write(used, 3, seed=1)
    write(fresh, 3, seed=1)
    return {
        "fired": fired,
        "lengths": (used.keys.shape[-2], used.indexer_keys.shape[1]),
        "as fresh": torch.equal(used.keys, fresh.keys) and torch.equal(used.indexer_keys, fresh.indexer_keys),
    }


def test_indexed_layer_starts_its_indexer_keys_afresh():
    from transformers import cache_utils

    if not hasattr(cache_utils, "DynamicIndexedLayer"):
        pytest.skip(f"transformers {PATCH.transformers} has no DynamicIndexedLayer (5.11.0 on)")
    with overlay.reverted():
        stock = _indexed_layer_after_reset()
    with PATCH.applied():
        patched = _indexed_layer_after_reset()
    if PATCH.affected:
        assert stock["lengths"] == (5 + 3, 5 + 3) and not stock["as fresh"], stock
        fired = {LAYER_ACTION: 1, INDEXER_ACTION: 1}
    else:
        assert stock == {"fired": {}, "lengths": (3, 3), "as fresh": True}
        fired = {}
    assert patched == {"fired": fired, "lengths": (3, 3), "as fresh": True}


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('both', 'test_reused_cache_on_stock_transformers',
                    'a reset cache completes with other tokens, or raises (RuntimeError, IndexError) on stock')
