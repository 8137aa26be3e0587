"""encoder-decoder-dynamic-cache: ``generate(cache_implementation="dynamic")`` on T5 and BART.

Reproduced for real on the CPU, in this process: tiny random T5 and BART (2 encoder and 2 decoder
layers; the whole overlay also with a 3-layer decoder), a left-padded batch of two, greedy and
beam search. The references are the same model and batch with the default cache (no
``cache_implementation``) and without a cache (``use_cache=False``), on stock.

On 4.55.x and 4.56.x stock raises ``UnboundLocalError: cannot access local variable 'is_updated'
...`` in the cross-attention at the first step (the cache generate() built is a bare
``DynamicCache``); with the patch, alone and with the whole overlay, the ids equal both references
and the report counts the fix. 4.57.1 on reports "fixed upstream": stock generates the references'
ids, and the patch changes nothing there. The default cache is never touched (nothing recorded).
"""

from __future__ import annotations

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("encoder_decoder_dynamic_cache")
PATCH.skip_module_unless_covered()
PATCH_ID = PATCH.id
AFFECTED = PATCH.affected

pytestmark = pytest.mark.usefixtures("one_thread")

UNBOUND = f"UnboundLocalError: {PATCH.error('is_updated')}"
ACTION = PATCH.patch_module.ACTION
MAX_NEW_TOKENS = 6
MODES = {"greedy": {}, "beam search": {"num_beams": 2}}
DYNAMIC = {"cache_implementation": "dynamic"}
#: Larger weights than the defaults, so the tiny models' ids vary from step to step.
T5_INITIALIZER_FACTOR = 8.0
BART_INIT_STD = 0.2


def _t5(decoder_layers: int = 2):
    from overlay.testing.models import tiny_model

    return tiny_model(
        "t5", attn_implementation=None, num_hidden_layers=2, num_decoder_layers=decoder_layers,
        initializer_factor=T5_INITIALIZER_FACTOR,
    )


def _bart(decoder_layers: int = 2):
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=128, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_layers=2, decoder_layers=decoder_layers,
        max_position_embeddings=64, init_std=BART_INIT_STD,
    )
    torch.manual_seed(0)
    return BartForConditionalGeneration(config).eval()


MODELS = {"t5": _t5, "bart": _bart}


def _generate(model, **kwargs) -> dict:
    from overlay.testing.models import greedy_ids, left_padded_batch

    batch = left_padded_batch((7, 5), seed=3)
    try:
        return {"ids": greedy_ids(model, batch, MAX_NEW_TOKENS, **kwargs)}
    except Exception as exc:  # noqa: BLE001  (the tests read which one)
        return {"error": f"{type(exc).__name__}: {exc}"}


@pytest.fixture(scope="module")
def runs():
    """``{(model, mode): {"default", "no cache", "stock", "patched", "overlay", "fired"}}``."""
    import transformers.generation.utils  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay import report

    results = {}
    for kind, build in MODELS.items():
        model = build()
        for mode, kwargs in MODES.items():
            record = results[kind, mode] = {}
            with overlay.reverted():
                record["default"] = _generate(model, **kwargs)
                record["no cache"] = _generate(model, use_cache=False, **kwargs)
                record["stock"] = _generate(model, **DYNAMIC, **kwargs)
            with PATCH.applied():
                report.reset()
                record["patched default"] = _generate(model, **kwargs)
                record["fired on default"] = report.fired_actions().get(PATCH_ID, {})
                record["patched"] = _generate(model, **DYNAMIC, **kwargs)
                record["fired"] = report.fired_actions().get(PATCH_ID, {})
            with overlay.applied():  # every patch, as users get them
                record["overlay"] = _generate(model, **DYNAMIC, **kwargs)
    return results


CASES = pytest.mark.parametrize("kind,mode", [(k, m) for k in MODELS for m in MODES])


def test_engine_status():
    import transformers.generation.utils  # noqa: F401

    with PATCH.applied() as statuses:
        status = statuses[PATCH_ID]
    assert status.state == ("applied" if AFFECTED else "fixed upstream"), status.reason


def test_layered_with_quantized_cache_config_copy():
    """Both patches of ``_prepare_cache_for_generation`` are in force together where both apply."""
    with overlay.applied() as statuses:  # every patch, as users get them
        states = {status.id: status.state for status in statuses}
    if AFFECTED:
        assert states[PATCH_ID] == "applied", states
        other = PatchUnderTest("quantized_cache_config_copy")
        assert states[other.id] == ("applied" if other.affected else "out of range"), states


@CASES
def test_references_agree(runs, kind, mode):
    record = runs[kind, mode]
    assert "ids" in record["default"], record["default"]
    assert record["default"] == record["no cache"]


@CASES
def test_stock(runs, kind, mode):
    record = runs[kind, mode]
    if AFFECTED:
        assert record["stock"] == {"error": UNBOUND}, record["stock"]
    else:
        assert record["stock"] == record["default"], "fixed upstream: stock generates"


@CASES
def test_patch_gives_the_references(runs, kind, mode):
    record = runs[kind, mode]
    assert record["patched"] == record["default"] == record["no cache"]
    assert record["fired"] == ({ACTION: 1} if AFFECTED else {}), record["fired"]


@CASES
def test_default_cache_untouched(runs, kind, mode):
    record = runs[kind, mode]
    assert record["patched default"] == record["default"]
    assert record["fired on default"] == {}, record["fired on default"]


@CASES
def test_whole_overlay_gives_the_references(runs, kind, mode):
    assert runs[kind, mode]["overlay"] == runs[kind, mode]["default"]


@pytest.mark.parametrize("kind", list(MODELS))
def test_deeper_decoder_with_the_whole_overlay(kind):
    """A 3-layer decoder on a 2-layer encoder (4.56's config-sized caches take the encoder's depth:
    encoder-decoder-cache-depth's bug): the whole overlay generates the no-cache ids."""
    model = MODELS[kind](decoder_layers=3)
    with overlay.reverted():
        reference = _generate(model, use_cache=False, num_beams=2)
    with overlay.applied():  # every patch, as users get them
        assert _generate(model, **DYNAMIC, num_beams=2) == reference
    assert "ids" in reference, reference


@pytest.mark.parametrize("kind", list(MODELS))
def test_reference_ids_vary(runs, kind):
    """The comparisons can tell runs apart: the batch's rows differ on every release and, where
    the patch's ids are the proof (4.55 - 4.56), a row changes from step to step too (5.x
    initialises these tiny weights otherwise: there the rows may repeat one token each)."""
    ids = runs[kind, "greedy"]["default"]["ids"]
    assert ids[0] != ids[1], ids
    if AFFECTED:
        assert any(len(set(row[1:])) > 2 for row in ids), ids
