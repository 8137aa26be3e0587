"""decoder-text-config-layers: a T5 whose decoder is deeper than its encoder generates.

Reproduced for real on the CPU, in this process: a tiny random T5 with 2 encoder and 3 decoder
layers (``num_decoder_layers``), a batch of two, greedy and beam search, with the default cache
and with ``cache_implementation="static"``. The reference is the same model and batch without a
cache (``use_cache=False``): every step runs the whole decoder again, so no cache is sized.

From 4.57 stock raises ``IndexError: list index out of range`` (the cache has the encoder's 2
layers) with a static cache, and with the default cache where generate() sizes it from the config
(not on 5.0.0rc0 - 5.0.x, where the model grows its own cache layer by layer); with the patch the
run gives the reference's ids. 4.55.x, whose caches grow layer by layer, is "out of range" and
generates. 4.56.x is "out of range" too, with another bug: its caches read the *whole* config's
depth (the encoder's) for BART as well; the tests pin that down as stock's (this patch leaves it;
``encoder-decoder-cache-depth`` fixes it, tests/patches/encoder_decoder_cache_depth/).
Where stock works (equal depths, a shallower decoder, BART's ``decoder_layers``) the overlay
gives stock's ids, and the model's own config is never changed.
"""

from __future__ import annotations

import inspect

import pytest
from packaging.version import Version

import overlay
from overlay.testing.harness import PatchUnderTest
from overlay.testing.models import seq2seq_outcome, tiny_seq2seq
from tests._kit import assert_in_force_only_while_applied, fired_after_each

PATCH = PatchUnderTest("decoder_text_config_layers")

pytestmark = pytest.mark.usefixtures("one_thread")

INDEX_ERROR = PATCH.error("list index")
#: 4.56.x hands the caches the whole config (``get_text_config()``): its ``num_hidden_layers`` is
#: the encoder's depth for T5 and BART alike (4.57 asks for the decoder's). Not this patch's:
#: encoder-decoder-cache-depth's.
CACHES_READ_THE_WHOLE_CONFIG = Version("4.56.0") <= PATCH.transformers < Version("4.57.0")
#: 5.0.0rc0 - 5.0.x leave the default cache to the model, which grows it layer by layer (read in
#: the wheels: 5.1.0's generate() builds it from the config again).
MODEL_GROWS_THE_DEFAULT_CACHE = Version("5.0.0rc0") <= PATCH.transformers < Version("5.1.0")
#: (encoder layers, decoder layers): deeper, equal and shallower decoders.
DEPTHS = {"deeper decoder": (2, 3), "equal": (2, 2), "shallower decoder": (3, 2)}
MODES = {
    "default cache": {},
    "static cache": {"cache_implementation": "static"},
    "beam search": {"num_beams": 2},
}


@pytest.fixture(scope="module")
def runs():
    """``{(depth, mode): {"reference", "stock", "patched"}}``."""
    import transformers.configuration_utils  # noqa: F401  (the patch's module, so the engine judges it)

    results = {}
    for depth, (encoder_layers, decoder_layers) in DEPTHS.items():
        model = tiny_seq2seq("t5", encoder_layers, decoder_layers)
        for mode, kwargs in MODES.items():
            record = results[depth, mode] = {}
            with overlay.reverted():
                record["reference"] = seq2seq_outcome(model, use_cache=False, **kwargs)
                record["stock"] = seq2seq_outcome(model, **kwargs)
            with PATCH.applied():
                record["patched"] = seq2seq_outcome(model, **kwargs)
    return results


CASES = pytest.mark.parametrize("depth,mode", [(d, m) for d in DEPTHS for m in MODES])


def test_replacements_keep_name_docstring_and_signature():
    for target, stock in PATCH.present_targets():
        replacement = target.replace(stock, target.variant_of(stock))
        assert replacement.__wrapped__ is stock
        assert (replacement.__name__, replacement.__doc__) == (stock.__name__, stock.__doc__)
        assert inspect.signature(replacement) == inspect.signature(stock)


def test_engine_status():
    from transformers import configuration_utils

    config_class = getattr(configuration_utils, "PreTrainedConfig", None) or configuration_utils.PretrainedConfig
    assert_in_force_only_while_applied(PATCH, lambda: config_class.get_text_config, stepped_aside="out of range")


def _stock_raises(depth: str, mode: str) -> bool:
    if depth != "deeper decoder":
        return False
    if CACHES_READ_THE_WHOLE_CONFIG:
        return True
    if not PATCH.affected:
        return False
    return mode == "static cache" or not MODEL_GROWS_THE_DEFAULT_CACHE


@CASES
def test_stock(runs, depth, mode):
    record = runs[depth, mode]
    assert "ids" in record["reference"], record["reference"]
    if _stock_raises(depth, mode):
        assert record["stock"] == {"error": f"IndexError: {INDEX_ERROR}"}, record["stock"]
    else:
        assert record["stock"] == record["reference"]


@CASES
def test_overlay_gives_the_reference(runs, depth, mode):
    record = runs[depth, mode]
    if CACHES_READ_THE_WHOLE_CONFIG:
        assert record["patched"] == record["stock"], "4.56.x: out of range, stock's behaviour"
    else:
        assert record["patched"] == record["reference"]


@pytest.mark.skipif(not CACHES_READ_THE_WHOLE_CONFIG, reason="4.56.x only")
def test_bart_deeper_decoder_fails_on_4_56_as_stock():
    """The limit the docs state: 4.56.x sizes BART's caches from the encoder too (fixed there by
    encoder-decoder-cache-depth); upstream fixed that in 4.57 (the caches ask for the decoder text
    config), which this patch then completes."""
    model = tiny_seq2seq("bart", 2, 3)
    with PATCH.applied() as statuses:
        assert statuses[PATCH.id].state == "out of range"
        assert seq2seq_outcome(model) == {"error": f"IndexError: {INDEX_ERROR}"}


def test_reference_ids_vary():
    """The comparison can tell runs apart: the reference rows are not one repeated token."""
    ids = seq2seq_outcome(tiny_seq2seq("t5", 2, 3), use_cache=False)["ids"]
    assert any(len(set(row[1:])) > 2 for row in ids), ids


def test_decoder_text_config_and_the_model_config():
    from transformers import T5Config

    config = T5Config(num_layers=2, num_decoder_layers=3)
    with PATCH.applied():
        both = config.get_text_config()
        if PATCH.affected:
            decoder = config.get_text_config(decoder=True)
            encoder = config.get_text_config(encoder=True)
            assert decoder is not config and decoder.num_hidden_layers == 3
            assert encoder.num_hidden_layers == 2
    assert both is config
    assert (config.num_layers, config.num_decoder_layers, config.num_hidden_layers) == (2, 3, 2), "unchanged"


def test_bart_and_sub_configs_are_left_alone():
    from transformers import BartConfig, EncoderDecoderConfig, T5Config

    bart = BartConfig(encoder_layers=2, decoder_layers=3)
    with overlay.reverted():
        stock = bart.get_text_config(decoder=True).num_hidden_layers
    with PATCH.applied():
        assert bart.get_text_config(decoder=True).num_hidden_layers == stock
        composite = EncoderDecoderConfig.from_encoder_decoder_configs(T5Config(), T5Config(num_layers=2, num_decoder_layers=3))
        sub = composite.get_text_config(decoder=True)
        assert sub is composite.decoder and sub.num_hidden_layers == 2, "a shared sub-config is never changed"


def test_report_counts_what_it_changed():
    equal, deeper = fired_after_each(PATCH, lambda: seq2seq_outcome(tiny_seq2seq("t5", 2, 2)),
                                     lambda: seq2seq_outcome(tiny_seq2seq("t5", 2, 3)))
    assert equal == 0
    assert (deeper > 0) == PATCH.affected


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_bart_and_sub_configs_are_left_alone',
                    'changes only a T5-style decoder copy whose depth differs; a deeper one raises on stock')
