"""encoder-decoder-cache-depth: on 4.56.x a T5 or BART whose decoder is deeper than its encoder generates.

Reproduced for real on the CPU, in this process: tiny random T5 (``num_decoder_layers``) and BART
(``decoder_layers``) with 2 encoder and 3 decoder layers, a batch of two, greedy and beam search,
with the default cache and with ``cache_implementation="static"``. The reference is the same model
and batch without a cache (``use_cache=False``: every step runs the whole decoder again, so no
cache is sized).

On 4.56.0 - 4.56.2 stock raises ``IndexError: list index out of range`` (the caches have the
encoder's 2 layers); with the patch the run gives the reference's ids, static and default caches
alike, alone and with every other patch of the overlay layered on the same targets. Equal and
shallower decoders give stock's ids (a shallower decoder's extra cache layers are never filled).
4.55.x is "out of range" (its caches grow), 4.57.1 on "fixed upstream" (the caches ask for the
decoder's config; T5's ``num_decoder_layers`` there is ``decoder-text-config-layers``): on every
lane the whole overlay gives the reference's ids for every depth.
"""

from __future__ import annotations

import os

import pytest

import overlay
from overlay import _patch_files, engine
from overlay.patch import PATCH_MARKER
from overlay.testing.harness import PatchUnderTest
from overlay.testing.models import SEQ2SEQ_KINDS, seq2seq_outcome, tiny_seq2seq
from tests._kit import fired_after_each

PATCH = PatchUnderTest("encoder_decoder_cache_depth")

pytestmark = pytest.mark.usefixtures("one_thread")

INDEX_ERROR = f"IndexError: {PATCH.error('list index')}"
#: T5's decoder depth in the decoder text config (4.57.1 on) is another patch's bug: its own module
#: pins stock down there; here the whole overlay must generate.
T5_DEPTH_IS_THE_OTHER_PATCH = (
    engine.gate(_patch_files.module("decoder_text_config_layers").PATCH, str(PATCH.transformers))[0]
    == engine.PENDING
)
#: (encoder layers, decoder layers): deeper, equal and shallower decoders.
DEPTHS = {"deeper decoder": (2, 3), "equal": (2, 2), "shallower decoder": (3, 2)}
MODES = {
    "default cache": {},
    "static cache": {"cache_implementation": "static"},
    "beam search": {"num_beams": 2},
    "static beam search": {"cache_implementation": "static", "num_beams": 2},
}


@pytest.fixture(scope="module")
def runs():
    """``{(model, depth, mode): {"reference", "stock", "patched", "overlay"}}``."""
    import transformers.cache_utils  # noqa: F401  (the patch's module, so the engine judges it)

    results = {}
    for kind in SEQ2SEQ_KINDS:
        for depth, (encoder_layers, decoder_layers) in DEPTHS.items():
            model = tiny_seq2seq(kind, encoder_layers, decoder_layers)
            for mode, kwargs in MODES.items():
                record = results[kind, depth, mode] = {}
                with overlay.reverted():
                    record["reference"] = seq2seq_outcome(model, use_cache=False, **kwargs)
                    record["stock"] = seq2seq_outcome(model, **kwargs)
                with PATCH.applied():
                    record["patched"] = seq2seq_outcome(model, **kwargs)
                with overlay.applied():  # every patch, as users get them
                    record["overlay"] = seq2seq_outcome(model, **kwargs)
    return results


CASES = pytest.mark.parametrize(
    "kind,depth,mode", [(k, d, m) for k in SEQ2SEQ_KINDS for d in DEPTHS for m in MODES]
)


def test_engine_status():
    from transformers import cache_utils

    classes = (cache_utils.DynamicCache, cache_utils.StaticCache)
    with PATCH.applied() as statuses:
        status = statuses[PATCH.id]
        during = [vars(cls)["__init__"] for cls in classes]
    if PATCH.affected:
        assert status.state == "applied", status.reason
        assert [getattr(init, PATCH_MARKER, None) for init in during] == [PATCH.id, PATCH.id]
    elif PATCH.transformers.release < (4, 56):
        assert status.state == "out of range", status.reason
    else:
        assert status.state == "fixed upstream", status.reason
    assert not any(hasattr(vars(cls)["__init__"], PATCH_MARKER) for cls in classes)


def test_layered_with_the_other_patches_of_its_targets():
    """On 4.56 ``StaticCache.__init__`` is static-cache-zero-kv-shared-layers' target too: both apply."""
    with overlay.applied() as statuses:  # every patch, as users get them
        states = {status.id: status.state for status in statuses}
    if PATCH.affected:
        other = "static-cache-zero-kv-shared-layers"
        disabled = other in os.environ.get("ATTN_OVERLAY_DISABLE", "").split(",")
        assert states[PATCH.id] == "applied", states
        assert states[other] == ("disabled" if disabled else "applied"), states


@CASES
def test_stock(runs, kind, depth, mode):
    record = runs[kind, depth, mode]
    assert "ids" in record["reference"], record["reference"]
    if depth == "deeper decoder" and PATCH.affected:
        assert record["stock"] == {"error": INDEX_ERROR}, record["stock"]
    elif not (kind == "t5" and depth == "deeper decoder" and T5_DEPTH_IS_THE_OTHER_PATCH):
        assert record["stock"] == record["reference"]


@CASES
def test_patch_gives_the_reference(runs, kind, depth, mode):
    record = runs[kind, depth, mode]
    if PATCH.affected:
        assert record["patched"] == record["reference"]
    else:
        assert record["patched"] == record["stock"], "not applied here: stock's behaviour"


@CASES
def test_whole_overlay_gives_the_reference_on_every_release(runs, kind, depth, mode):
    assert runs[kind, depth, mode]["overlay"] == runs[kind, depth, mode]["reference"]


@pytest.mark.parametrize("kind", SEQ2SEQ_KINDS)
def test_reference_ids_vary(runs, kind):
    """The comparisons can tell runs apart: a reference row is not one repeated token."""
    ids = runs[kind, "deeper decoder", "default cache"]["reference"]["ids"]
    assert any(len(set(row[1:])) > 2 for row in ids), ids


@pytest.mark.parametrize("kind", SEQ2SEQ_KINDS)
def test_static_cache_gives_the_default_cache_ids(runs, kind):
    """With the overlay (on 4.56 this patch, on 4.57 and later decoder-text-config-layers for T5)."""
    for depth in DEPTHS:
        for greedy, static in (("default cache", "static cache"), ("beam search", "static beam search")):
            assert runs[kind, depth, static]["overlay"] == runs[kind, depth, greedy]["overlay"], (depth, static)


@pytest.mark.parametrize("depth", ["deeper decoder", "shallower decoder"])
@pytest.mark.parametrize("kind", SEQ2SEQ_KINDS)
def test_a_kept_static_cache_serves_the_next_call(kind, depth):
    """A static cache generate() keeps on the model (and resets) has grown once, for good; a
    shallower decoder's never-filled layer survives the reset."""
    encoder_layers, decoder_layers = DEPTHS[depth]
    model = tiny_seq2seq(kind, encoder_layers, decoder_layers)
    with overlay.reverted():
        reference = seq2seq_outcome(model, use_cache=False)
    vars(model).pop("_cache", None)
    with overlay.applied():  # every patch, as users get them
        first = seq2seq_outcome(model, reuse_kept_cache=True, cache_implementation="static")
        second = seq2seq_outcome(model, reuse_kept_cache=True, cache_implementation="static")
    assert first == second == reference
    cache = vars(model).get("_cache")
    if PATCH.affected and cache is not None and depth == "deeper decoder":
        assert len(cache.self_attention_cache.layers) == len(cache.cross_attention_cache.layers) == 3


@pytest.mark.skipif(not PATCH.affected, reason="4.56.x only: the stock caches of a shallower decoder")
@pytest.mark.parametrize("kind", SEQ2SEQ_KINDS)
def test_a_shallower_decoder_leaves_one_cache_layer_empty(kind):
    """Stock sizes the caches of a 3-encoder, 2-decoder model with 3 layers: the third is never
    filled and allocates nothing (a static layer allocates on its first update); the ids are the
    reference's (test_stock). Harmless, so left as it is."""
    model = tiny_seq2seq(kind, 3, 2)
    with overlay.reverted():
        assert "ids" in seq2seq_outcome(model, reuse_kept_cache=True, cache_implementation="static")
    cache = vars(model).pop("_cache")
    for half in (cache.self_attention_cache, cache.cross_attention_cache):
        assert len(half.layers) in (2, 3)
        assert all(layer.keys is None for layer in half.layers[2:])


@pytest.mark.skipif(not PATCH.affected, reason="the replacement's choices, on the releases it applies to")
def test_only_uniform_plain_caches_of_encoder_decoder_configs_grow():
    import pickle

    import torch
    from transformers import DynamicCache, LlamaConfig, StaticCache, T5Config

    t5 = T5Config(num_layers=2, num_decoder_layers=3)
    llama = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64)
    sliding_t5 = T5Config(num_layers=2, num_decoder_layers=3)
    sliding_t5.sliding_window = 4
    with PATCH.applied():
        grows = [
            DynamicCache(config=t5).layer_class_to_replicate is not None,
            StaticCache(config=t5, max_cache_len=8).layer_class_to_replicate is not None,
            StaticCache(t5, 8).layer_class_to_replicate is not None,
        ]
        stays = [
            DynamicCache(config=llama).layer_class_to_replicate,
            StaticCache(config=llama, max_cache_len=8).layer_class_to_replicate,
            DynamicCache(config=sliding_t5).layer_class_to_replicate,
            StaticCache(config=sliding_t5, max_cache_len=8).layer_class_to_replicate,
        ]
        lazy = DynamicCache()
        grown = pickle.loads(pickle.dumps(StaticCache(config=t5, max_cache_len=8)))
        grown.update(*[torch.zeros(1, 2, 3, 4)] * 2, 2, {"cache_position": torch.arange(3)})
    assert grows == [True, True, True]
    assert stays == [None, None, None, None]
    assert lazy.layer_class_to_replicate is not None and not lazy.layers, "stock's lazy cache, as it was"
    assert len(grown.layers) == 3, "a pickled cache still grows"
    assert (t5.num_layers, t5.num_decoder_layers, t5.num_hidden_layers) == (2, 3, 2), "the config is unchanged"


def test_report_counts_what_it_changed():
    def shallower():
        seq2seq_outcome(tiny_seq2seq("t5", 2, 2))
        seq2seq_outcome(tiny_seq2seq("bart", 3, 2), cache_implementation="static")

    unchanged, deeper = fired_after_each(PATCH, shallower, lambda: seq2seq_outcome(tiny_seq2seq("bart", 2, 3)))
    assert unchanged == 0
    assert (deeper > 0) == PATCH.affected


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_static_cache_gives_the_default_cache_ids',
                    "grows a cache only to the decoder's depth, where stock raises IndexError")
