"""xpu-sdpa-mask-skip: on an XPU machine, multi-token queries over a cache keep their causal mask.

Reproduced on the CPU, in this process, as the release sees an XPU machine: ``masking_utils``'s
``_is_torch_xpu_available`` (set at import from ``torch.xpu.is_available()``) is set to ``True`` for
the run; the rule reads that flag, not the tensors' device. A tiny random Llama, SDPA, greedy, one
prompt; the modes whose queries span several tokens over a non-empty cache: assisted decoding (a
second tiny Llama as the assistant), prompt lookup, chunked prefill.

The control is the same call with the flag as a CPU or CUDA machine has it (``False``), on stock:
the release's other rule, which never skips there; its ids begin with plain greedy decoding's. On
4.55.0 - 4.57.6 stock on an "XPU machine" gives other tokens (no error); with the patch, the
control's. From 5.0.0rc0 (fixed upstream for this case) stock gives them itself. Plain decoding
(one-token queries) and a first prefill without a cache are stock's with nothing fired.
"""

from __future__ import annotations

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("xpu_sdpa_mask_skip")
PATCH.skip_module_unless_covered()

pytestmark = pytest.mark.usefixtures("one_thread")

ACTION = "kept the causal mask of a multi-token query over a cache (XPU rule)"
MODES = {
    "assisted decoding": dict(max_new_tokens=10),
    "prompt lookup": dict(prompt_lookup_num_tokens=3, max_new_tokens=40),
    "chunked prefill": dict(prefill_chunk_size=3, max_new_tokens=10),
}


def _machine(xpu: bool):
    """The release's view of the machine for a block: its import-time XPU flag set to ``xpu``."""
    from unittest import mock

    import transformers.masking_utils as masking_utils

    return mock.patch.object(masking_utils, "_is_torch_xpu_available", xpu)


def _generate(model, batch, *, xpu: bool, **kwargs) -> dict:
    from overlay import report
    from overlay.testing.models import dynamic_cache, greedy_outcome

    report.reset()
    if "prefill_chunk_size" in kwargs:  # a cache of its own: 5.0.0rc1 chunks only into a given cache
        kwargs["past_key_values"] = dynamic_cache(model.config)
    with _machine(xpu):
        run = greedy_outcome(model, batch, kwargs.pop("max_new_tokens"), **kwargs)
    run["fired"] = report.fired_actions().get(PATCH.id, {})
    return run


@pytest.fixture(scope="module")
def runs():
    import transformers.masking_utils  # noqa: F401  (the patch's module)

    from overlay.testing.models import left_padded_batch, tiny_model

    model = tiny_model("llama")
    batch = left_padded_batch((8,), seed=3)
    results = {}
    for mode, settings in {"greedy": dict(max_new_tokens=10), **MODES}.items():
        kwargs = dict(settings)
        if mode == "assisted decoding":
            kwargs["assistant_model"] = tiny_model("llama", seed=1)
        with overlay.reverted():
            control = _generate(model, batch, xpu=False, **kwargs)
            stock = _generate(model, batch, xpu=True, **kwargs)
        with PATCH.applied():
            patched = _generate(model, batch, xpu=True, **kwargs)
            patched_off_xpu = _generate(model, batch, xpu=False, **kwargs)
        results[mode] = {"control": control, "stock": stock, "patched": patched, "off xpu": patched_off_xpu}
    return results


@pytest.mark.parametrize("mode", MODES)
def test_the_control_begins_with_greedy_decoding(runs, mode):
    control, greedy = runs[mode]["control"], runs["greedy"]["control"]
    assert control["ok"] and greedy["ok"], (control, greedy)
    width = min(len(control["ids"][0]), len(greedy["ids"][0]))
    assert control["ids"][0][:width] == greedy["ids"][0][:width]


@pytest.mark.parametrize("mode", MODES)
def test_multi_token_queries_on_an_xpu_machine(runs, mode):
    record = runs[mode]
    control, stock, patched = record["control"], record["stock"], record["patched"]
    assert patched["ok"] and patched["ids"] == control["ids"], (patched, control)
    if PATCH.affected:
        assert stock["ok"] and stock["ids"] != control["ids"], "stock must give other tokens"
        assert set(patched["fired"]) == {ACTION}, patched["fired"]
    else:
        assert stock == {**patched, "fired": {}}


@pytest.mark.parametrize("mode", MODES)
def test_other_machines_are_stock(runs, mode):
    record = runs[mode]
    assert record["off xpu"] == {**record["control"], "fired": {}}


def test_plain_decoding_is_stock(runs):
    record = runs["greedy"]
    assert record["stock"]["ok"] and record["patched"] == record["stock"] == {**record["control"], "fired": {}}


def test_the_rule_itself():
    """The release's answers, but for the one case: several query tokens, fewer than the keys."""
    import torch
    import transformers.masking_utils as masking_utils

    if not PATCH.affected:  # 5.0.0rc0 on: another rule (and, from 5.14.0, another signature)
        with PATCH.applied(expect="fixed upstream"):
            assert not hasattr(masking_utils._ignore_causal_mask_sdpa, "__wrapped__")
        return

    no_padding = torch.ones(1, 8, dtype=torch.bool)
    cases = [(no_padding, 1, 8), (no_padding, 8, 8), (no_padding, 3, 8), (None, 3, 8)]
    answers = {}
    for state in ("stock", "patched"):
        with overlay.reverted() if state == "stock" else PATCH.applied(), _machine(xpu=True):
            answers[state] = [bool(masking_utils._ignore_causal_mask_sdpa(m, q, kv, 0)) for m, q, kv in cases]
    assert answers["patched"] == [True, True, False, False]
    assert answers["stock"] == [True, True, True, True]


def test_under_the_whole_overlay(runs):
    from overlay.testing.models import left_padded_batch, tiny_model

    model = tiny_model("llama")
    with overlay.applied():
        whole = _generate(model, left_padded_batch((8,), seed=3), xpu=True, **MODES["chunked prefill"])
    assert whole["ok"] and whole["ids"] == runs["chunked prefill"]["control"]["ids"]


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('output', 'test_multi_token_queries_on_an_xpu_machine',
                    'stock completes without the causal mask on XPU machines: other tokens')
