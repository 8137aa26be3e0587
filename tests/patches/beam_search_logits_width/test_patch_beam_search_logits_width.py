"""beam-search-logits-width: beam search works on a model whose output head differs from its config.

Reproduced for real on the CPU, in this process: a tiny random Llama whose ``lm_head`` is 16
columns wider (a padded head, CPM-Ant's shape, with input embeddings for the extra tokens) or 16
narrower (Ovis2's) than ``config.vocab_size``; and, where the release ships them with that shape, the library's own
CPM-Ant (head wider by its prompt tokens, 4.55.0 - 5.15.1) and Inkling with
``unpadded_vocab_size`` (5.14.0 on: the forward drops the head's padding columns). A left-padded
batch, ``num_beams=3``, greedy beam search and beam sampling.

The control is the same model, on stock, with its config's ``vocab_size`` set to the logits'
width for the call: the release then reads the right width, which is what the fixed release
reads off the logits (the models' forwards do not read that attribute). On 4.55.0 - 5.17.0 stock
raises the declared ``RuntimeError`` of ``torch.reshape``; with the patch every run gives the
control's ids. On 5.18.0 on (fixed upstream) stock gives the control's ids itself. Models whose
head is as wide as the config, and greedy search, are stock's with nothing fired. A forward that
cuts its head's output back to the config's width (stock works; no library class does) gets the
patch's named error; the one-shot read is checked per thread.
"""

from __future__ import annotations

import threading

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("beam_search_logits_width")
PATCH.skip_module_unless_covered()

pytestmark = pytest.mark.usefixtures("one_thread")

HEAD_CHANGES = {"wider head": 16, "narrower head": -16}
MODES = {
    "beam search": dict(num_beams=3),
    "beam sampling": dict(num_beams=3, do_sample=True, num_return_sequences=2),
}
MAX_NEW_TOKENS = 6
ACTION = "beam search took the output head's width"
RESHAPE_ERROR = "is invalid for input of size"


def _llama(head_change: int):
    import torch

    from overlay.testing.models import tiny_model

    model = tiny_model("llama")
    width = model.config.vocab_size + head_change
    torch.manual_seed(1)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, width, bias=False)
    if head_change > 0:  # the extra tokens can be generated: they need input embeddings too
        model.set_input_embeddings(torch.nn.Embedding(width, model.config.hidden_size))
    return model


def _batch(vocab_size: int) -> dict:
    from overlay.testing.models import left_padded_batch

    return left_padded_batch((7, 5), vocab_size=min(vocab_size, 128) - 16, seed=2)


def _generate(model, batch, **kwargs) -> dict:
    """The ids of one run (seeded: beam sampling draws), or the error it raised; what fired."""
    import torch

    from overlay import report
    from overlay.testing.models import greedy_outcome

    report.reset()
    torch.manual_seed(7)
    run = greedy_outcome(model, batch, MAX_NEW_TOKENS, **kwargs)
    run["fired"] = report.fired_actions().get(PATCH.id, {})
    return run


def _control(model, batch, width: int, **kwargs) -> dict:
    """Stock, with the config's width set to the logits' for the call."""
    text_config = model.config.get_text_config()
    configured = text_config.vocab_size
    text_config.vocab_size = width
    try:
        with overlay.reverted():
            return _generate(model, batch, **kwargs)
    finally:
        text_config.vocab_size = configured


def _logits_width(model, batch) -> int:
    import torch

    with torch.no_grad():
        return model(**batch).logits.shape[-1]


def _stock_and_patched(model, batch, **kwargs) -> tuple[dict, dict]:
    """One call on stock transformers, then the same call with this patch applied."""
    with overlay.reverted():
        stock = _generate(model, batch, **kwargs)
    with PATCH.applied():
        patched = _generate(model, batch, **kwargs)
    return stock, patched


def _compare(model, batch, **kwargs) -> dict:
    width = _logits_width(model, batch)
    stock, patched = _stock_and_patched(model, batch, **kwargs)
    return {"width": width, "control": _control(model, batch, width, **kwargs), "stock": stock, "patched": patched}


@pytest.fixture(scope="module")
def llama_runs():
    import transformers.generation.utils  # noqa: F401  (the patch's module)

    runs = {}
    for head, change in HEAD_CHANGES.items():
        model = _llama(change)
        batch = _batch(model.config.vocab_size + min(change, 0))
        for mode, kwargs in MODES.items():
            runs[head, mode] = _compare(model, batch, **kwargs)
    return runs


def _assert_fixed(record: dict) -> None:
    control, stock, patched = record["control"], record["stock"], record["patched"]
    assert control["ok"], control
    if PATCH.affected:
        assert (stock["ok"], stock.get("type")) == (False, "RuntimeError"), stock
        assert RESHAPE_ERROR in stock["error"]
        assert patched["ok"] and patched["ids"] == control["ids"], (patched, control)
        assert patched["fired"] == {ACTION: 1}, patched["fired"]
    else:  # 5.18.0 on: the release reads the width off the logits
        assert stock["ok"] and stock["ids"] == control["ids"], (stock, control)
        assert patched == stock


CASES = pytest.mark.parametrize("head,mode", [(h, m) for h in HEAD_CHANGES for m in MODES])


@CASES
def test_a_head_of_another_width(llama_runs, head, mode):
    record = llama_runs[head, mode]
    assert record["width"] == 128 + HEAD_CHANGES[head]
    _assert_fixed(record)


@pytest.mark.parametrize("head", HEAD_CHANGES)
def test_under_the_whole_overlay(llama_runs, head):
    """With every patch applied (beam-search-recurrent-cache wraps the same function, above this
    one): the control's ids."""
    model = _llama(HEAD_CHANGES[head])
    batch = _batch(model.config.vocab_size + min(HEAD_CHANGES[head], 0))
    with overlay.applied():
        whole = _generate(model, batch, **MODES["beam search"])
    assert whole["ok"] and whole["ids"] == llama_runs[head, "beam search"]["control"]["ids"]


def test_the_runs_differ(llama_runs):
    """The references are not degenerate: the two modes and the two heads give other ids."""
    ids = [str(record["control"]["ids"]) for record in llama_runs.values()]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("mode", [*MODES, "greedy"])
def test_a_head_as_wide_as_the_config_is_stock(mode):
    from overlay.testing.models import tiny_model

    model = tiny_model("llama")
    batch = _batch(model.config.vocab_size)
    kwargs = MODES.get(mode, {})
    stock, patched = _stock_and_patched(model, batch, **kwargs)
    assert stock["ok"] and patched == stock


def test_a_head_tied_to_wider_embeddings_is_stock():
    """A head declared narrower whose weight is the (wider) input embeddings gives the embeddings'
    width (Ovis2 on 5.0.0rc0 - rc3): as wide as the config, so stock works; the patch reads the
    weight's rows and leaves the run alone."""
    model = _llama(-16)
    model.lm_head.weight = model.get_input_embeddings().weight
    batch = _batch(model.config.vocab_size)
    assert model.lm_head.out_features == 112 and _logits_width(model, batch) == 128
    stock, patched = _stock_and_patched(model, batch, num_beams=3)
    assert stock["ok"] and patched == stock


def test_an_output_embedding_that_is_not_the_lm_head_is_stock():
    """An adaptive softmax's ``get_output_embeddings()`` is one of its clusters (Transformer-XL):
    a ``Linear`` of another width than the logits. The patch reads only a model's ``lm_head``."""
    import torch

    model = _llama(0)
    cluster = torch.nn.Linear(model.config.hidden_size, 40, bias=False)
    model.get_output_embeddings = lambda: cluster
    batch = _batch(model.config.vocab_size)
    stock, patched = _stock_and_patched(model, batch, num_beams=3)
    assert stock["ok"] and patched == stock


def test_greedy_search_on_a_wider_head_is_stock():
    model = _llama(16)
    batch = _batch(model.config.vocab_size)
    stock, patched = _stock_and_patched(model, batch)
    assert stock["ok"] and patched == stock


# -- the library's own models --------------------------------------------------------------------


def _cpmant():
    import torch
    import transformers

    config = transformers.CpmAntConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, dim_head=16, dim_ff=64, num_hidden_layers=2,
        prompt_types=4, prompt_length=4, position_bias_num_buckets=32, position_bias_max_distance=64,
    )
    torch.manual_seed(0)
    return transformers.CpmAntForCausalLM(config).eval()


def test_cpmant():
    """CPM-Ant's head is ``prompt_types * prompt_length`` wider than its vocabulary up to 5.15.1.
    Its cached path fails on 4.57.6 - 5.13.0 in greedy search too (another bug): the runs use
    ``use_cache=False``, as its users must there."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "CpmAntForCausalLM"):
        pytest.skip("this release has no CPM-Ant")
    model = _cpmant()
    if model.get_output_embeddings().out_features == model.config.vocab_size:
        pytest.skip("this release's CPM-Ant head is as wide as its vocabulary (5.16.0 on)")
    batch = _batch(64)
    record = _compare(model, batch, num_beams=3, use_cache=False)
    assert record["width"] == 64 + 4 * 4
    _assert_fixed(record)


def _inkling(unpadded_vocab_size):
    """A tiny Inkling: the default config's own keys scaled down (the keys differ by release)."""
    import torch
    import transformers

    small = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=1,
        swa_head_dim=16, sliding_window_size=8, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, logits_mup_width_multiplier=1.0, pad_token_id=0,
    )
    # 5.14.0 - 5.17.0: InklingConfig is the text model's; later releases split off InklingTextConfig.
    config_class = getattr(transformers, "InklingTextConfig", None) or transformers.InklingConfig
    defaults = config_class().to_dict()
    small["unpadded_vocab_size"] = unpadded_vocab_size
    config = config_class(**{key: value for key, value in small.items() if key in defaults})
    torch.manual_seed(0)
    return transformers.InklingForCausalLM(config).eval()


@pytest.mark.parametrize("unpadded", (80, None))
def test_inkling_unpadded_vocabulary(unpadded):
    """Inkling's forward keeps the first ``unpadded_vocab_size`` columns of its head's output."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "InklingForCausalLM"):
        pytest.skip("this release has no Inkling (5.14.0 on)")
    model = _inkling(unpadded)
    record = _compare(model, _batch(80), num_beams=3)
    if unpadded is None:  # head and config agree: stock's run, nothing fired
        assert record["stock"]["ok"] and record["patched"] == record["stock"] == record["control"]
        return
    assert record["width"] == unpadded
    _assert_fixed(record)


# -- the limits and the one-shot read -------------------------------------------------------------------


def test_a_forward_that_cuts_its_head_back_gets_the_named_error():
    """Stock works here (the logits are as wide as the config); the patch, which takes the head's
    width, says what it did and how to turn it off."""
    model = _llama(16)
    configured = model.config.vocab_size

    def cut(module, inputs, output):
        output.logits = output.logits[..., :configured]
        return output

    model.register_forward_hook(cut)
    batch = _batch(configured)
    stock, patched = _stock_and_patched(model, batch, num_beams=3)
    assert stock["ok"], stock
    if PATCH.affected:
        assert (patched["ok"], patched["type"]) == (False, "RuntimeError"), patched
        assert f"ATTN_OVERLAY_DISABLE={PATCH.id}" in patched["error"]
        assert "144 wide" in patched["error"] and "logits 128 wide" in patched["error"]
    else:
        assert patched == stock


def test_the_view_answers_one_read_in_its_own_thread():
    from transformers import LlamaConfig

    from overlay.patches.beam_search_logits_width import _ReadOnce, _TextConfigWithWidth

    config = LlamaConfig(vocab_size=128, hidden_size=32, num_attention_heads=2)
    view = _TextConfigWithWidth(config, 144)
    seen = {}
    with _ReadOnce(config, view):
        other = threading.Thread(target=lambda: seen.setdefault("other thread", config.get_text_config()))
        other.start()
        other.join()
        seen["first"] = config.get_text_config()
        seen["second"] = config.get_text_config()
    assert seen["other thread"] is config and seen["second"] is config
    assert seen["first"] is view and view.vocab_size == 144 and view.hidden_size == 32
    assert "get_text_config" not in vars(config)
    with _ReadOnce(config, view):  # never read: put back on the way out
        pass
    assert "get_text_config" not in vars(config) and config.get_text_config() is config


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_a_head_as_wide_as_the_config_is_stock',
                    "acts only where the logits' width differs from the config, where stock's reshape raises")
