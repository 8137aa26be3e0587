"""quantized-cache-beam-reorder: beam search with a quantized cache reorders its quantized states.

Two parts:

- Everywhere (no backend needed): the release's own ``QuantoQuantizedLayer`` (built without
  optimum-quanto) with a lossless stand-in quantizer set on the instance (``_quantize`` keeps a copy, ``_dequantize`` returns it), batch 2,
  written past its residual length with reorders in between, as beam search does. With a lossless
  quantizer it must hold exactly what a ``DynamicLayer`` given the same writes and reorders holds.
  On 4.56.0 - 5.18.0 stock raises the declared ``IndexError`` at the first reorder after the
  prefill; with the overlay every ``update`` returns the dynamic layer's states, bit for bit, as
  stock does on 5.19.0+.
- With optimum-quanto installed only (skipped otherwise, with the reason): tiny Llama, beam search
  (2 and 3 beams) with ``cache_implementation="quantized"``. Stock raises the ``IndexError``; the
  overlay generates; with the default residual length (nothing re-quantized during the run) it
  gives the dynamic cache's beam ids (the control).
"""

from __future__ import annotations

import importlib.util

import pytest

import overlay
from overlay.patch import Variant
from overlay.testing.harness import PatchUnderTest
from tests._kit import (
    assert_replacements_keep_the_originals_face,
    assert_set_on_its_class_only_while_applied,
    covered_module,
)

PATCH = PatchUnderTest("quantized_cache_beam_reorder")
pytestmark = covered_module(PATCH)

INDEX_ERROR = PATCH.error("index out of range")
ACTION = "reordered the quantized states with the beams"
HAS_QUANTO = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None
NEEDS_QUANTO = pytest.mark.skipif(
    not HAS_QUANTO,
    reason="optimum-quanto is not installed in this lane: generate() with a quantized cache needs a backend "
    "(the layer-level test above runs without one)",
)


def _state(state: str):
    return overlay.reverted() if state == "stock" else PATCH.applied()


def test_replacements_keep_name_docstring_and_signature():
    assert_replacements_keep_the_originals_face(PATCH, otherwise=Variant("this release"))


def test_engine_status():
    from transformers import cache_utils

    inherited = "reorder_cache" not in vars(cache_utils.QuantizedLayer)
    assert inherited == PATCH.affected, "QuantizedLayer has its own reorder_cache from 5.19.0"
    # The other layers keep the mixin's reorder_cache.
    assert_set_on_its_class_only_while_applied(PATCH, cache_utils.QuantizedLayer, "reorder_cache",
                                               others=lambda: cache_utils.CacheLayerMixin.reorder_cache)


# -- the layer, with a lossless stand-in quantizer ---------------------------------------------------

#: (what happens, its argument): writes of n positions, reorders by beam index.
STEPS = (
    ("write", 5),  # the prefill: straight into the quantized states
    ("reorder", (1, 0)),
    ("write", 1),
    ("reorder", (1, 1)),
    ("write", 1),  # residual length 2: this write re-quantizes everything
    ("reorder", (1, 0)),
    ("reorder", (0, 0)),  # two in a row: composed
    ("write", 1),
    ("reorder", (1, 0)),  # the residual holds a position now
    ("write", 1),
)


def _quantized_layer(residual_length: int):
    """The release's ``QuantoQuantizedLayer``, built by ``QuantizedLayer.__init__`` alone (its own
    ``__init__`` imports optimum-quanto; the base class is abstract), with the stand-in quantizer."""
    from transformers import cache_utils

    layer = cache_utils.QuantoQuantizedLayer.__new__(cache_utils.QuantoQuantizedLayer)
    cache_utils.QuantizedLayer.__init__(layer, residual_length=residual_length)
    return _stand_in(layer)


def _stand_in(layer):
    layer._quantize = lambda tensor, axis: tensor.clone()
    layer._dequantize = lambda qtensor: qtensor.clone()
    return layer


def _play(layer) -> dict:
    import torch

    generator = torch.Generator().manual_seed(0)
    returned = []
    try:
        for what, arg in STEPS:
            if what == "write":
                keys = torch.randn(2, 2, arg, 8, generator=generator)
                values = torch.randn(2, 2, arg, 8, generator=generator)
                returned.append(layer.update(keys, values))
            else:
                layer.reorder_cache(torch.tensor(arg))
    except Exception as exc:  # noqa: BLE001  (the tests read which one)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "returned": returned}
    return {"ok": True, "returned": returned}


@pytest.fixture(scope="module")
def layer_runs():
    from transformers import cache_utils

    from overlay import report

    runs = {}
    with overlay.reverted():
        runs["dynamic"] = _play(cache_utils.DynamicLayer())
    for state in ("stock", "patched"):
        with _state(state):
            report.reset()
            runs[state] = _play(_quantized_layer(2))
            runs[state]["fired"] = report.fired_actions().get(PATCH.id, {})
    return runs


def _same(run: dict, reference: dict) -> bool:
    import torch

    return len(run["returned"]) == len(reference["returned"]) and all(
        torch.equal(a, b) for got, want in zip(run["returned"], reference["returned"]) for a, b in zip(got, want)
    )


def test_layer_on_stock_transformers(layer_runs):
    stock = layer_runs["stock"]
    assert layer_runs["dynamic"]["ok"], layer_runs["dynamic"]
    if PATCH.affected:
        assert (stock["ok"], stock["error"]) == (False, f"IndexError: {INDEX_ERROR}"), stock.get("error")
        assert len(stock["returned"]) == 1, "the first reorder after the prefill"
    else:
        assert stock["ok"] and _same(stock, layer_runs["dynamic"])


def test_layer_with_the_overlay(layer_runs):
    patched = layer_runs["patched"]
    assert patched["ok"], patched.get("error")
    assert _same(patched, layer_runs["dynamic"]), "the dynamic layer's states, in beam order"
    reorders = sum(1 for what, _ in STEPS if what == "reorder")
    assert patched["fired"] == ({ACTION: reorders} if PATCH.affected else {})


def test_layer_without_reorders_is_unchanged():
    import torch

    runs = {}
    for state in ("stock", "patched"):
        with _state(state):
            layer = _quantized_layer(2)
            generator = torch.Generator().manual_seed(1)
            runs[state] = [layer.update(torch.randn(2, 2, n, 8, generator=generator),
                                        torch.randn(2, 2, n, 8, generator=generator)) for n in (5, 1, 1, 1)]
    for got, want in zip(runs["patched"], runs["stock"]):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# -- generate() with optimum-quanto ------------------------------------------------------------------


@NEEDS_QUANTO
@pytest.mark.parametrize("num_beams", (2, 3))
def test_beam_search_with_a_quantized_cache(num_beams):
    from overlay.testing.models import greedy_ids, left_padded_batch, tiny_model

    model, batch = tiny_model("llama"), left_padded_batch((9,), seed=2)

    def run(**kwargs):
        try:
            return {"ok": True, "ids": greedy_ids(model, batch, 10, num_beams=num_beams, **kwargs)}
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def quantized(residual_length):
        return dict(cache_implementation="quantized", cache_config={
            "backend": "quanto", "nbits": 4, "q_group_size": 16, "residual_length": residual_length})

    with overlay.reverted():
        control = run()  # the dynamic cache
    runs = {}
    for state in ("stock", "patched"):
        with _state(state):
            runs[state] = {rl: run(**quantized(rl)) for rl in (2, 128)}
    assert control["ok"], control
    for rl in (2, 128):
        assert runs["patched"][rl]["ok"], runs["patched"][rl]
        if PATCH.affected:
            assert runs["stock"][rl] == {"ok": False, "error": f"IndexError: {INDEX_ERROR}"}
        else:
            assert runs["stock"][rl] == runs["patched"][rl]
    # Nothing re-quantized within 10 tokens: the prompt's quantization only, the dynamic cache's ids.
    assert runs["patched"][128]["ids"] == control["ids"]


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_layer_without_reorders_is_unchanged',
                    'without beam reorders nothing changes; beam search raised IndexError on stock')
