"""quantized-cache-config-copy: generate() leaves the caller's ``cache_config`` dict unchanged.

Reproduced for real on the CPU, in this process, tiny random Llama, greedy. Two parts:

- Everywhere (no quantization backend needed): a dict asking for the ``"hqq"`` backend, which no
  lane installs, used for two generate() calls. Both fail while building the cache, before any
  decoding. On 4.56.0 - 5.18.0 stock has popped ``"backend"`` (and added ``"config"``) by then,
  so the second call silently asks for the default backend instead: it fails with optimum-quanto's
  ``ImportError`` (the declared error) where optimum-quanto is absent, and generates with quanto
  where it is installed (the ids of a fresh ``"quanto"`` dict: the control). With the overlay the
  dict stays as written and both calls fail the same way, asking for hqq, as on 5.19.0+.
- With optimum-quanto installed only (skipped otherwise, with the reason): a ``"quanto"`` dict
  reused for the same model and for a second model with three layers instead of two. Stock builds
  the second model's cache from the first model's config (on 4.57.6: ``IndexError: list index out
  of range``, 5.18.0 too); the overlay gives the ids of a fresh dict (the control) for both.

A generate() call without a quantized cache is the same with and without the overlay.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("quantized_cache_config_copy")
PATCH.skip_module_unless_covered()

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW_TOKENS = 6
#: q_group_size 16 divides what the tiny model's layers quantize (quanto's default, 64, does not).
SETTINGS = {"nbits": 4, "q_group_size": 16, "residual_length": 2}
HQQ = {"backend": "hqq", **SETTINGS}
QUANTO = {"backend": "quanto", **SETTINGS}
HAS_QUANTO = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None
HAS_HQQ = importlib.util.find_spec("hqq") is not None
NEEDS_QUANTO = pytest.mark.skipif(
    not HAS_QUANTO,
    reason="optimum-quanto is not installed in this lane: the runs with a working quantized cache need a "
    "backend (the dict checks above run without one)",
)
QUANTO_MISSING = PATCH.error("optimum-quanto")
ACTION = "kept the caller's cache_config unchanged"


def _generate(model, batch, cache_config) -> dict:
    from overlay.testing.models import greedy_ids

    try:
        return {"ok": True, "ids": greedy_ids(model, batch, MAX_NEW_TOKENS, cache_implementation="quantized",
                                              cache_config=cache_config)}
    except Exception as exc:  # noqa: BLE001  (the tests read which one)
        return {"ok": False, "type": type(exc).__name__, "error": str(exc)}


def _keys(cache_config: dict) -> dict:
    """The dict as the caller sees it (a model config by its class name)."""
    return {k: type(v).__name__ if k == "config" else v for k, v in cache_config.items()}


def _state(state: str):
    return overlay.reverted() if state == "stock" else PATCH.applied()


@pytest.fixture(scope="module")
def model():
    from overlay.testing.models import tiny_model

    return tiny_model("llama")


@pytest.fixture(scope="module")
def batch():
    from overlay.testing.models import left_padded_batch

    return left_padded_batch((9,), seed=2)


# -- the patch data ---------------------------------------------------------------------------------


# -- a dict reused, no backend needed ---------------------------------------------------------------


@pytest.fixture(scope="module")
def reused_hqq(model, batch):
    """``{"stock"|"patched": {"first", "after first", "second", "after second", "fired"}}`` and the
    control: a fresh quanto dict's run on stock."""
    from overlay import report

    assert not HAS_HQQ, "the check needs a backend this lane does not install"
    results = {}
    with overlay.reverted():
        results["control"] = _generate(model, batch, copy.deepcopy(QUANTO))
    for state in ("stock", "patched"):
        with _state(state):
            cache_config = copy.deepcopy(HQQ)
            report.reset()
            run = {"first": _generate(model, batch, cache_config), "after first": _keys(cache_config)}
            run["second"] = _generate(model, batch, cache_config)
            run["after second"] = _keys(cache_config)
            run["fired"] = report.fired_actions().get(PATCH.id, {})
        results[state] = run
    return results


def _hqq_missing(run: dict) -> bool:
    return not run["ok"] and run["type"] == "ImportError" and "hqq" in run["error"].lower()


def test_reused_dict_on_stock_transformers(reused_hqq):
    stock = reused_hqq["stock"]
    assert _hqq_missing(stock["first"]), stock["first"]
    if not PATCH.affected:  # 5.19.0+: the dict is left alone, the second call asks for hqq again
        assert stock["after first"] == stock["after second"] == HQQ
        assert stock["second"] == stock["first"]
        return
    # The bug: "backend" popped, the first model's config added, by the call that failed.
    without_backend = {k: v for k, v in HQQ.items() if k != "backend"}
    assert stock["after first"] == {**without_backend, "config": stock["after first"]["config"]}
    assert stock["after first"]["config"].endswith("Config")
    # ... so the second call silently asks for the default backend, quanto.
    if HAS_QUANTO:
        assert stock["second"] == reused_hqq["control"] and stock["second"]["ok"], "generated with quanto"
    else:
        assert (stock["second"]["ok"], stock["second"]["type"]) == (False, "ImportError")
        assert QUANTO_MISSING in stock["second"]["error"], stock["second"]


def test_reused_dict_with_the_overlay(reused_hqq):
    patched = reused_hqq["patched"]
    assert patched["after first"] == patched["after second"] == HQQ, "the dict as the caller wrote it"
    assert _hqq_missing(patched["first"]) and patched["second"] == patched["first"], "hqq asked both times"
    # As the fixed release does (stock there: the test above).
    assert patched["fired"] == ({ACTION: 2} if PATCH.affected else {})


def test_the_control_run(reused_hqq):
    control = reused_hqq["control"]
    if HAS_QUANTO:
        assert control["ok"], control
    else:
        assert (control["ok"], control["type"]) == (False, "ImportError") and QUANTO_MISSING in control["error"]


def test_generate_without_a_quantized_cache_is_unchanged(model, batch):
    from overlay import report
    from overlay.testing.models import greedy_ids

    runs = {}
    for state in ("stock", "patched"):
        with _state(state):
            report.reset()
            runs[state] = (greedy_ids(model, batch, MAX_NEW_TOKENS), report.fired_actions().get(PATCH.id, {}))
    assert runs["patched"] == runs["stock"] and runs["stock"][1] == {}


# -- with optimum-quanto: a dict reused for the same model and for another --------------------------


@NEEDS_QUANTO
def test_reused_quanto_dict_for_the_same_and_another_model(model, batch):
    from overlay.testing.models import tiny_model

    three_layers = tiny_model("llama", num_hidden_layers=3, seed=1)
    with overlay.reverted():
        control = {name: _generate(m, batch, copy.deepcopy(QUANTO))
                   for name, m in (("same", model), ("three layers", three_layers))}
    runs = {}
    for state in ("stock", "patched"):
        with _state(state):
            cache_config = copy.deepcopy(QUANTO)
            runs[state] = {
                "first": _generate(model, batch, cache_config),
                "same": _generate(model, batch, cache_config),
                "three layers": _generate(three_layers, batch, cache_config),
                "after": _keys(cache_config),
            }
    assert control["same"]["ok"] and control["three layers"]["ok"], control
    patched = runs["patched"]
    assert patched["first"] == patched["same"] == control["same"]
    assert patched["three layers"] == control["three layers"], "the second model's own config"
    assert patched["after"] == QUANTO
    stock = runs["stock"]
    assert stock["first"] == stock["same"] == control["same"], "the same model: same backend, same config"
    if PATCH.affected:
        # Built from the first model's (two-layer) config.
        assert stock["three layers"] != control["three layers"], stock["three layers"]
        if not stock["three layers"]["ok"]:
            assert f"{stock['three layers']['type']}: {stock['three layers']['error']}" in PATCH.patch.errors
        assert "backend" not in stock["after"] and "config" in stock["after"]
    else:
        assert stock == patched


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('both', 'test_reused_dict_on_stock_transformers',
                    'a reused dict completes with the default backend, or raises ImportError')
