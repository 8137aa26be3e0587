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
from overlay.testing.models import SEQ2SEQ_KINDS, seq2seq_outcome, tiny_seq2seq

PATCH = PatchUnderTest("encoder_decoder_dynamic_cache")
PATCH.skip_module_unless_covered()
PATCH_ID = PATCH.id
AFFECTED = PATCH.affected

pytestmark = pytest.mark.usefixtures("one_thread")

UNBOUND = f"UnboundLocalError: {PATCH.error('is_updated')}"
ACTION = PATCH.patch_module.ACTION
MODES = {"greedy": {}, "beam search": {"num_beams": 2}}
DYNAMIC = {"cache_implementation": "dynamic"}


@pytest.fixture(scope="module")
def runs():
    """``{(model, mode): {"default", "no cache", "stock", "patched", "overlay", "fired"}}``."""
    import transformers.generation.utils  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay import report

    results = {}
    for kind in SEQ2SEQ_KINDS:
        model = tiny_seq2seq(kind)
        for mode, kwargs in MODES.items():
            record = results[kind, mode] = {}
            with overlay.reverted():
                record["default"] = seq2seq_outcome(model, **kwargs)
                record["no cache"] = seq2seq_outcome(model, use_cache=False, **kwargs)
                record["stock"] = seq2seq_outcome(model, **DYNAMIC, **kwargs)
            with PATCH.applied():
                report.reset()
                record["patched default"] = seq2seq_outcome(model, **kwargs)
                record["fired on default"] = report.fired_actions().get(PATCH_ID, {})
                record["patched"] = seq2seq_outcome(model, **DYNAMIC, **kwargs)
                record["fired"] = report.fired_actions().get(PATCH_ID, {})
            with overlay.applied():  # every patch, as users get them
                record["overlay"] = seq2seq_outcome(model, **DYNAMIC, **kwargs)
    return results


CASES = pytest.mark.parametrize("kind,mode", [(k, m) for k in SEQ2SEQ_KINDS for m in MODES])


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


@pytest.mark.parametrize("kind", SEQ2SEQ_KINDS)
def test_deeper_decoder_with_the_whole_overlay(kind):
    """A 3-layer decoder on a 2-layer encoder (4.56's config-sized caches take the encoder's depth:
    encoder-decoder-cache-depth's bug): the whole overlay generates the no-cache ids."""
    model = tiny_seq2seq(kind, decoder_layers=3)
    with overlay.reverted():
        reference = seq2seq_outcome(model, use_cache=False, num_beams=2)
    with overlay.applied():  # every patch, as users get them
        assert seq2seq_outcome(model, **DYNAMIC, num_beams=2) == reference
    assert "ids" in reference, reference


@pytest.mark.parametrize("kind", SEQ2SEQ_KINDS)
def test_reference_ids_vary(runs, kind):
    """The comparisons can tell runs apart: the batch's rows differ on every release and, where
    the patch's ids are the proof (4.55 - 4.56), a row changes from step to step too (5.x
    initialises these tiny weights otherwise: there the rows may repeat one token each)."""
    ids = runs[kind, "greedy"]["default"]["ids"]
    assert ids[0] != ids[1], ids
    if AFFECTED:
        assert any(len(set(row[1:])) > 2 for row in ids), ids


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_default_cache_untouched',
                    'the default cache is untouched; the fixed call raised UnboundLocalError')
