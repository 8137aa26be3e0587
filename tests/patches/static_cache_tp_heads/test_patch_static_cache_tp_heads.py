"""static-cache-tp-heads: the static cache's KV heads under tensor parallelism.

Two layers of evidence:

- in-process: the replacement, built around the installed release's own function, on a stand-in
  model that carries a config, a ``_tp_size`` and a plan (every style, per-layer heads, uneven
  heads, unknown styles);
- two real ranks on CPU (``torch.distributed`` with gloo, see ``_tp_worker.py``): tiny models saved
  with ``save_pretrained`` and loaded with tensor parallelism, once per plan, generating with a
  static cache and ``prefill_chunk_size`` smaller than the prompt. On an affected release the
  stock run fails with the real error wherever attention keeps every head; with the patch every
  plan generates the same ids as the unchunked run and as a single process.

On releases fixed upstream (5.20.0+) the stock runs pass and the patch reports "fixed upstream".
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.version import Version

from overlay.patch import PATCH_MARKER, Variant, fingerprint
from overlay.testing.harness import PatchUnderTest
from overlay.testing.models import greedy_ids, save_tiny_model, tiny_config, tiny_heterogeneous_config, tiny_heterogeneous_model
from overlay.testing.tensor_parallel import ATTENTION_COLWISE, ATTENTION_GATHERED, MLP
from tests._tp_worker import TEARDOWN_STARTED

TESTS_DIR = Path(__file__).resolve().parents[2]  # tests/: the workers beside conftest.py
REPO_ROOT = TESTS_DIR.parent

PATCH_UNDER_TEST = PatchUnderTest("static_cache_tp_heads")
PATCH_UNDER_TEST.skip_module_unless_covered()  # _get_static_cache_init_shape arrived in 5.13.0
PATCH_MODULE = PATCH_UNDER_TEST.patch_module
PATCH = PATCH_UNDER_TEST.patch
TARGET = PATCH.targets[0]

TRANSFORMERS_VERSION = PATCH_UNDER_TEST.transformers


def _by_hand(original):
    """The replacement around ``original``: the installed release's own code, which on 5.20.0+ is
    upstream's fix (no variant names it; the tests show the wrapper changes nothing there; like
    5.18.0's, it reads each layer's head shapes)."""
    per_layer = PATCH_UNDER_TEST.patch_module.PER_LAYER_HEAD_SHAPES
    return TARGET.build(original, otherwise=Variant("installed code, wrapped by hand", per_layer))

AFFECTED = PATCH_UNDER_TEST.affected
FIXED_UPSTREAM = PATCH_UNDER_TEST.fixed_upstream
# transformers 5.16.0 - 5.16.1 load a tensor-parallel model without ever setting
# `model._tp_size` (their distributed mixin declares it and never assigns it), so their eager
# static cache never divides: plans that keep every head work stock there, and a colwise k_proj
# fails the other way round (the patch divides by the size the model was sharded with).
TP_SIZE_RECORDED = not (Version("5.16.0") <= Version(TRANSFORMERS_VERSION.base_version) < Version("5.17.0"))

INDEX_COPY_ERROR = PATCH_UNDER_TEST.error("slice shapes")
# The variant of 5.13.0-5.17.0 sizes the cache from the global head count only.
SCALAR_HEADS_VARIANT = "5.13.0-5.17.0"

WORLD_SIZE = 2
# Generous for two rank processes importing torch and transformers on a busy 2-core machine;
# the run takes well under a minute. A hung rank is killed and the test fails with its log.
WORKER_TIMEOUT_S = 600  # above the ranks' collective timeout (tests/_tp_worker.py), so a hung rank reports itself


def stock_static_cache_init_shape():
    """The installed release's own function, even if the overlay patched this process already."""
    return PATCH_UNDER_TEST.stock()


def stock_variant() -> str | None:
    digest = fingerprint(stock_static_cache_init_shape())
    return TARGET.originals[digest].label if digest in TARGET.originals else TARGET.fixed.get(digest)


# -- the installed release -------------------------------------------------------------------


def test_installed_release_is_one_the_patch_knows():
    assert AFFECTED or FIXED_UPSTREAM, f"these tests need transformers >= 5.13.0, found {TRANSFORMERS_VERSION}"
    digest = fingerprint(stock_static_cache_init_shape())
    if AFFECTED:
        assert digest in TARGET.originals, f"transformers {TRANSFORMERS_VERSION}: unknown original {digest}"
    else:
        assert digest in TARGET.fixed, f"transformers {TRANSFORMERS_VERSION}: unknown fixed code {digest}"


def test_engine_applies_on_affected_releases_and_reports_fixed_upstream_after():
    from transformers.generation.utils import GenerationMixin

    before = vars(GenerationMixin)["_get_static_cache_init_shape"]
    with PATCH_UNDER_TEST.applied(strict=True) as statuses:
        status = statuses[PATCH.id].as_dict()
        current = vars(GenerationMixin)["_get_static_cache_init_shape"]
        if AFFECTED:
            assert status["state"] == "applied", status
            assert getattr(current, PATCH_MARKER, None) == PATCH.id
            assert status["variants"] == [stock_variant()]
        else:
            assert status["state"] == "fixed upstream", status
            assert getattr(current, PATCH_MARKER, None) is None
    assert vars(GenerationMixin)["_get_static_cache_init_shape"] is before


def test_replacement_keeps_name_docstring_and_signature():
    stock = stock_static_cache_init_shape()
    replacement = _by_hand(stock)
    assert replacement.__wrapped__ is stock
    assert replacement.__name__ == stock.__name__
    assert replacement.__doc__ == stock.__doc__
    assert inspect.signature(replacement) == inspect.signature(stock)


# -- the plan logic, in process ----------------------------------------------------------------


class ShardedModelStandIn:
    """What ``_get_static_cache_init_shape`` reads from a model loaded with tensor parallelism."""

    def __init__(self, config, tp_size, tp_plan, hf_device_map=None):
        self.config = config
        self._tp_size = tp_size
        self.tp_plan = tp_plan
        if hf_device_map is not None:
            self.hf_device_map = hf_device_map


class ShardedBy516StandIn(ShardedModelStandIn):
    """A model as 5.16.x leave it after sharding: a device mesh and the ``DistributedConfig`` in
    ``config.distributed_config``, but ``_tp_size`` never assigned (the class default ``None``)."""

    def __init__(self, config, tp_size, tp_plan):
        super().__init__(config, None, tp_plan)
        self._device_mesh = object()
        self.config.distributed_config = SimpleNamespace(tp_size=tp_size)


def tiny_text_config(num_key_value_heads=4, per_layer_kv_heads=None, **extra):
    """A Llama config with 4 query heads of 8 (``extra`` set on it afterwards)."""
    overrides = {}
    if per_layer_kv_heads is not None:
        overrides["per_layer_config"] = {i: {"num_key_value_heads": h} for i, h in enumerate(per_layer_kv_heads)}
    config = tiny_config("llama", hidden_size=32, intermediate_size=64, num_key_value_heads=num_key_value_heads, **overrides)
    for name, value in extra.items():
        setattr(config, name, value)
    return config


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-style warning for the first time."""
    monkeypatch.setattr(PATCH_MODULE, "_warned_styles", set())


# (plan, KV heads, tp_size, expected (heads, head_dim) or None for lazy initialisation)
PLAN_CASES = {
    "k_proj colwise": ({**ATTENTION_COLWISE, **MLP}, 4, 2, (2, 8)),
    "k_proj colwise, tp_size 4": ({**ATTENTION_COLWISE, **MLP}, 4, 4, (1, 8)),
    "fused qkv_proj colwise": ({"layers.*.self_attn.qkv_proj": "colwise"}, 4, 2, (2, 8)),
    "fused query_key_value colwise": ({"layers.*.attention.query_key_value": "colwise"}, 4, 2, (2, 8)),
    "k_proj colwise under a prefix": ({"model.language_model.layers.*.self_attn.k_proj": "colwise"}, 4, 2, (2, 8)),
    "k_proj colwise, uneven heads": ({**ATTENTION_COLWISE, **MLP}, 3, 2, None),
    "k_proj colwise_gather_output": ({**ATTENTION_GATHERED, **MLP}, 4, 2, (4, 8)),
    "k_proj colwise_gather_output, uneven heads": ({**ATTENTION_GATHERED, **MLP}, 3, 2, (3, 8)),
    "fused qkv_proj colwise_gather_output": ({"layers.*.self_attn.qkv_proj": "colwise_gather_output"}, 4, 2, (4, 8)),
    "k_proj colwise_rep": ({"layers.*.self_attn.k_proj": "colwise_rep"}, 4, 2, (4, 8)),
    "attention not in the plan": (dict(MLP), 4, 2, (4, 8)),
    "expert styles off attention": (
        {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts": "moe_tp_experts"},
        4,
        2,
        (4, 8),
    ),
    "only lm_head": ({"lm_head": "colwise_gather_output"}, 4, 2, (4, 8)),
    "empty plan": ({}, 4, 2, (4, 8)),
    "no tensor parallelism": ({**ATTENTION_COLWISE, **MLP}, 4, None, (4, 8)),
    "tp_size 1": ({**ATTENTION_COLWISE, **MLP}, 4, 1, (4, 8)),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_patched_shape_follows_the_plan(case, fresh_warnings, caplog):
    plan, kv_heads, tp_size, expected = PLAN_CASES[case]
    model = ShardedModelStandIn(tiny_text_config(kv_heads), tp_size, plan)
    with caplog.at_level(logging.WARNING, logger="overlay"):
        assert _by_hand(stock_static_cache_init_shape())(model) == expected
    assert not caplog.records, "known styles must not warn"


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_stock_shape_shows_the_bug_or_the_upstream_fix(case):
    """Stock code on the same stand-ins: affected releases divide whatever the plan (the bug);
    releases fixed upstream agree with the patch on every plan."""
    plan, kv_heads, tp_size, expected = PLAN_CASES[case]
    model = ShardedModelStandIn(tiny_text_config(kv_heads), tp_size, plan)
    stock = stock_static_cache_init_shape()(model)
    if FIXED_UPSTREAM:
        assert stock == expected
    elif (tp_size or 1) > 1:
        assert stock == (None if kv_heads % tp_size else (kv_heads // tp_size, 8))
    else:
        assert stock == expected


PER_LAYER_CASES = {
    "k_proj colwise: each layer divided": ({**ATTENTION_COLWISE, **MLP}, [4, 2], ([2, 1], 8)),
    "k_proj colwise, a layer uneven: lazy": ({**ATTENTION_COLWISE, **MLP}, [4, 3], None),
    "k_proj gathered: every layer whole": ({**ATTENTION_GATHERED, **MLP}, [4, 2], ([4, 2], 8)),
    "k_proj gathered, a layer uneven: still whole": ({**ATTENTION_GATHERED, **MLP}, [4, 3], ([4, 3], 8)),
    "attention not in the plan": (dict(MLP), [4, 2], ([4, 2], 8)),
}


@pytest.mark.parametrize("case", list(PER_LAYER_CASES))
def test_per_layer_head_counts(case):
    """A config that sets the KV heads per layer (``per_layer_config``, 5.14.0 on): each layer's
    count, divided per layer where the plan shards keys by head; on 5.13.0 - 5.17.0 the patch
    gives what 5.18.0's own function gives."""
    plan, layer_heads, expected = PER_LAYER_CASES[case]
    config = tiny_text_config(per_layer_kv_heads=layer_heads)
    model = ShardedModelStandIn(config, 2, plan)
    replacement = _by_hand(stock_static_cache_init_shape())
    if getattr(config, "per_layer_attributes", None) is None:
        # 5.13.x: no heterogeneous configs (`per_layer_config` is a plain attribute there), every
        # layer has the global count: the patch sizes the cache as for the same config without it.
        assert stock_variant() == SCALAR_HEADS_VARIANT
        assert replacement(model) == replacement(ShardedModelStandIn(tiny_text_config(), 2, plan)) is not None
        return
    assert replacement(model) == expected


def test_other_checks_of_the_release_still_apply():
    replacement = _by_hand(stock_static_cache_init_shape())
    # Layers spread over several devices: no eager initialisation, whatever the plan.
    spread = ShardedModelStandIn(tiny_text_config(), 2, dict(MLP), hf_device_map={"model.layers.0": 0, "lm_head": 1})
    assert replacement(spread) is None
    # MLA models (distinct key and value sizes): no eager initialisation either.
    mla = ShardedModelStandIn(tiny_text_config(qk_head_dim=16), 2, dict(MLP))
    assert replacement(mla) is None


def test_unknown_style_keeps_transformers_behaviour_and_warns_once(fresh_warnings, caplog):
    replacement = _by_hand(stock_static_cache_init_shape())
    stock = stock_static_cache_init_shape()
    packed = ShardedModelStandIn(tiny_text_config(), 2, {"layers.*.self_attn.k_proj": "packed_colwise", **MLP})
    units = ShardedModelStandIn(tiny_text_config(), 2, {"layers.*.self_attn.k_proj": "unit_colwise"})
    with caplog.at_level(logging.WARNING, logger="overlay"):
        assert replacement(packed) == stock(packed)
        assert replacement(packed) == stock(packed)
        assert replacement(units) == stock(units)
        assert replacement(units) == stock(units)
    messages = [r.getMessage() for r in caplog.records if r.name == "overlay"]
    assert len(messages) == 2, messages
    assert "'packed_colwise'" in messages[0] and "layers.*.self_attn.k_proj" in messages[0]
    assert "'unit_colwise'" in messages[1]
    if AFFECTED:
        # "transformers' behaviour" on an affected release is the division by tp_size.
        assert replacement(packed) == (2, 8)


# 5.16.x leave `_tp_size` unset: (plan, expected shape with the patch, stock shape on 5.13-5.19).
UNRECORDED_TP_SIZE_CASES = {
    "k_proj colwise: divided by the sharded size": ({**ATTENTION_COLWISE, **MLP}, (2, 8), (4, 8)),
    "k_proj colwise_gather_output: every head": ({**ATTENTION_GATHERED, **MLP}, (4, 8), (4, 8)),
    "attention not in the plan: every head": (dict(MLP), (4, 8), (4, 8)),
}


@pytest.mark.parametrize("case", list(UNRECORDED_TP_SIZE_CASES))
def test_tp_size_the_release_never_recorded(case):
    from overlay import report

    plan, expected, stock_affected = UNRECORDED_TP_SIZE_CASES[case]
    model = ShardedBy516StandIn(tiny_text_config(4), 2, plan)
    report.reset()
    assert _by_hand(stock_static_cache_init_shape())(model) == expected
    # Only the colwise plan needed a change (the stock code keeps every head here).
    assert (report.fired().get(PATCH.id, 0) > 0) == (expected != stock_affected)
    if AFFECTED:
        assert stock_static_cache_init_shape()(model) == stock_affected


def test_fired_counter_counts_only_calls_that_changed_the_shape():
    from overlay import report

    replacement = _by_hand(stock_static_cache_init_shape())
    report.reset()
    for plan, tp_size in (({**ATTENTION_COLWISE, **MLP}, 2), ({**ATTENTION_GATHERED, **MLP}, None), (dict(MLP), 1)):
        replacement(ShardedModelStandIn(tiny_text_config(4), tp_size, plan))
    assert report.fired().get(PATCH.id, 0) == 0, "nothing to fix: colwise keys, or no tensor parallelism"
    assert replacement(ShardedModelStandIn(tiny_text_config(4), 2, dict(MLP))) == (4, 8)
    assert report.fired()[PATCH.id] == 1
    assert report.fired_actions()[PATCH.id] == {"kept 4 KV heads per rank (plan leaves k_proj unsharded)": 1}


# -- Gemma 4: head size and KV heads per layer type -------------------------------------------------
# Sliding layers: 2 KV heads of 8; full-attention layers (the last of 6): 16 wide, and with
# attention_k_eq_v 1 KV head. Up to 5.17.0 the release's function reads one shape for all layers
# (wrong on 5.13 - 5.14, raising on 5.15 - 5.17); the patch gives what 5.18.0's gives, which on
# 5.18.0 on is the release's own answer (the same expectations hold there, unpatched).
HEAD_DIMS = [8, 8, 8, 8, 8, 16]
GEMMA4_CASES = {
    "no tensor parallelism": (False, None, {}, (2, HEAD_DIMS)),
    "KV heads per layer, no tensor parallelism": (True, None, {}, ([2, 2, 2, 2, 2, 1], HEAD_DIMS)),
    "k_proj colwise (Gemma 4's own plan): divided": (False, 2, {**ATTENTION_COLWISE, **MLP}, (1, HEAD_DIMS)),
    "k_proj colwise, a layer with 1 KV head: lazy": (True, 2, {**ATTENTION_COLWISE, **MLP}, None),
    "k_proj gathered: whole": (True, 2, {**ATTENTION_GATHERED, **MLP}, ([2, 2, 2, 2, 2, 1], HEAD_DIMS)),
    "attention not in the plan: whole": (False, 2, dict(MLP), (2, HEAD_DIMS)),
}


def gemma4_text_config(kv_heads_per_layer=False, **extra):
    if importlib.util.find_spec("transformers.models.gemma4") is None:
        pytest.fail(f"transformers {TRANSFORMERS_VERSION} has no Gemma 4 (it ships from 5.13.0 on)")
    config = tiny_heterogeneous_config("gemma4_text", kv_heads_per_layer=kv_heads_per_layer)
    for name, value in extra.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize("case", list(GEMMA4_CASES))
def test_gemma4_layers_get_their_own_head_shapes(case):
    kv_heads_per_layer, tp_size, plan, expected = GEMMA4_CASES[case]
    model = ShardedModelStandIn(gemma4_text_config(kv_heads_per_layer), tp_size, plan)
    assert _by_hand(stock_static_cache_init_shape())(model) == expected
    if not (AFFECTED and stock_variant() == SCALAR_HEADS_VARIANT) and (tp_size is None or plan == {**ATTENTION_COLWISE, **MLP}):
        # 5.18.0 on: the release's own per-layer shapes are these (the plans it divides right).
        assert stock_static_cache_init_shape()(model) == expected


def test_gemma4_stock_reads_one_shape_for_every_layer_up_to_5_17():
    """The bug, on the stand-in: what stock gives for Gemma 4 on the releases of the variant."""
    if stock_variant() != SCALAR_HEADS_VARIANT:
        assert stock_static_cache_init_shape()(ShardedModelStandIn(gemma4_text_config(), None, {})) == (2, HEAD_DIMS)
        return
    model = ShardedModelStandIn(gemma4_text_config(), None, {})
    if getattr(model.config, "per_layer_attributes", None):  # 5.15.0 on: a heterogeneous config
        from transformers.integrations.heterogeneity import AmbiguousGlobalPerLayerAttributeError

        with pytest.raises(AmbiguousGlobalPerLayerAttributeError, match=PATCH_UNDER_TEST.error("'head_dim'")[:40]):
            stock_static_cache_init_shape()(model)
    else:  # 5.13 - 5.14: the sliding layers' shape for every layer, the full-attention one too
        assert stock_static_cache_init_shape()(model) == (2, 8)


def test_gemma4_release_checks_still_apply():
    replacement = _by_hand(stock_static_cache_init_shape())
    spread = ShardedModelStandIn(gemma4_text_config(), None, {}, hf_device_map={"model.layers.0": 0, "lm_head": 1})
    assert replacement(spread) is None
    assert replacement(ShardedModelStandIn(gemma4_text_config(qk_head_dim=16), None, {})) is None


def test_gemma4_tp_size_the_release_never_recorded():
    from overlay import report

    model = ShardedBy516StandIn(gemma4_text_config(), 2, {**ATTENTION_COLWISE, **MLP})
    report.reset()
    assert _by_hand(stock_static_cache_init_shape())(model) == (1, HEAD_DIMS)
    # Sized per layer (5.13 - 5.17) or divided by the sharded size (5.18 on): one fix either way.
    assert report.fired().get(PATCH.id, 0) == 1


def test_gemma4_fired_once_per_call_that_sized_the_cache_per_layer():
    from overlay import report

    replacement = _by_hand(stock_static_cache_init_shape())
    report.reset()
    replacement(ShardedModelStandIn(gemma4_text_config(True), None, {}))
    replacement(ShardedModelStandIn(tiny_text_config(), None, {}))  # layers alike: the original's answer
    if AFFECTED and stock_variant() == SCALAR_HEADS_VARIANT:
        assert report.fired_actions()[PATCH.id] == {"sized the static cache per layer (per-layer head_dim and KV heads)": 1}
    else:
        assert report.fired().get(PATCH.id, 0) == 0, "5.18.0 on size the cache per layer themselves"


# -- two ranks on CPU ---------------------------------------------------------------------------

PROMPT = [[5, 17, 33, 9, 101, 64, 2], [7, 7, 90, 45, 3, 12, 88]]
PREFILL_CHUNK_SIZE = 3  # smaller than the prompt: chunks of 3, 3 and 1 tokens
MAX_NEW_TOKENS = 5

# plan name -> (model, plan put in the config; None keeps the model's own)
TP_PLANS = {
    "olmo2 own plan (k_proj colwise_gather_output)": ("olmo2", None),
    "attention unsharded (MLP-only plan)": ("llama", dict(MLP)),
    "k_proj colwise_gather_output": ("llama", {**ATTENTION_GATHERED, **MLP}),
    "k_proj colwise": ("llama", {**ATTENTION_COLWISE, **MLP}),
    "no plan": ("llama", {}),
}
# Plans where every rank computes all KV heads: the stock eager cache is too small for them.
FULL_HEAD_PLANS = {name for name in TP_PLANS if name != "k_proj colwise"}
# Rows of layer 0's k_proj / gate_proj weight each rank holds (16 / 64 unsharded): proof that the
# ranks really ran the plan under test.
EXPECTED_LOCAL_ROWS = {
    "olmo2 own plan (k_proj colwise_gather_output)": {"self_attn.k_proj": 8, "mlp.gate_proj": 32},
    "attention unsharded (MLP-only plan)": {"self_attn.k_proj": 16, "mlp.gate_proj": 32},
    "k_proj colwise_gather_output": {"self_attn.k_proj": 8, "mlp.gate_proj": 32},
    "k_proj colwise": {"self_attn.k_proj": 8, "mlp.gate_proj": 32},
    "no plan": {"self_attn.k_proj": 16, "mlp.gate_proj": 64},
}


# Gemma 4 under its own plan (q/k/v colwise): layers whose head size differs (8 sliding, 16 full
# attention), each rank holding 1 of the 2 KV heads of every layer. Stock sizes the cache from one
# head size (5.13 - 5.14: the full-attention layer's write fails) or raises (5.15 - 5.17).
HETEROGENEOUS_TP_CASE = "gemma4 own plan (k_proj colwise), head size per layer"
HETEROGENEOUS_LOCAL_ROWS = {"self_attn.k_proj": 8, "mlp.gate_proj": 32}


def build_tiny_models(directory: Path) -> dict[str, Path]:
    # Wide weights (initializer_range 0.5) give well-separated logits, so greedy picks do not
    # hinge on the last bit of a sum that tensor parallelism adds up in another order.
    shape = dict(hidden_size=32, intermediate_size=64, max_position_embeddings=64, initializer_range=0.5,
                 eos_token_id=None)
    dirs = {kind: Path(save_tiny_model(directory / kind, kind, **shape)) for kind in ("llama", "olmo2")}
    if importlib.util.find_spec("transformers.models.gemma4") is not None:  # 5.13.0 on
        dirs["gemma4"] = directory / "gemma4"
        # Untied, as the other models: with tied embeddings 5.15.0's tensor-parallel Gemma 4 fails
        # every run, the unchunked control too (IndexError in the token embedding).
        gemma4 = tiny_heterogeneous_model("gemma4_text", initializer_range=0.5, tie_word_embeddings=False)
        gemma4.save_pretrained(dirs["gemma4"])
    return dirs


def single_process_ids(model_dir: Path) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = torch.tensor(PROMPT)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    return greedy_ids(model, inputs, MAX_NEW_TOKENS, cache_implementation="static")


def worker_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(
        # Stock transformers in the ranks; the worker applies the patch itself where it should.
        ATTN_OVERLAY="0",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    return env


def run_ranks(workdir: Path, spec: dict, worker: Path = TESTS_DIR / "_tp_worker.py") -> list[dict]:
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    store = workdir / "process_group_store"  # gloo rendezvous through a file: no port to pick
    procs, logs = [], []
    for rank in range(WORLD_SIZE):
        log = open(workdir / f"rank{rank}.log", "wb")
        logs.append(log)
        cmd = [sys.executable, str(worker), str(rank), str(WORLD_SIZE), str(store),
               str(spec_path), str(workdir / f"rank{rank}.json")]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_environment()))
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p for p in procs if p.poll() is None]
        for proc in timed_out:
            proc.kill()
            proc.wait()
        for log in logs:
            log.close()

    def tail(rank: int) -> str:
        return (workdir / f"rank{rank}.log").read_text(errors="replace")[-4000:]

    if timed_out:
        logs_text = "\n".join(tail(rank) for rank in range(WORLD_SIZE))
        pytest.fail(f"rank processes did not finish within {WORKER_TIMEOUT_S}s\n{logs_text}")
    results = []
    for rank, proc in enumerate(procs):
        out = workdir / f"rank{rank}.json"
        if not out.exists():
            pytest.fail(f"rank {rank} exited {proc.returncode} before writing its results\n{tail(rank)}")
        result = json.loads(out.read_text(encoding="utf-8"))
        if "fatal" in result:
            pytest.fail(f"rank {rank} failed:\n{result['fatal']}\n{tail(rank)}")
        if proc.returncode != 0:
            # The worker writes its results (atomically) before it tears the process group down. A
            # crash after that is torch's teardown, not the work the tests check: said, not hidden.
            if TEARDOWN_STARTED not in tail(rank):
                pytest.fail(f"rank {rank} exited {proc.returncode} after writing its results\n{tail(rank)}")
            warnings.warn(f"rank {rank} exited {proc.returncode} in torch.distributed's teardown, after writing "
                          f"complete results: {tail(rank).strip().splitlines()[-1]}", stacklevel=1)
        results.append(result)
    return results


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Both ranks' results for every plan, and each model's single-process ids (one launch)."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.fail("loading with tensor parallelism needs `accelerate` (transformers asks for it); install it")
    workdir = tmp_path_factory.mktemp("static_cache_tp_heads")
    model_dirs = build_tiny_models(workdir)
    spec = {
        "cases": [
            {
                "name": name,
                "model_dir": str(model_dirs[model]),
                "plan": plan,
                "prompt": PROMPT,
                "prefill_chunk_size": PREFILL_CHUNK_SIZE,
                "max_new_tokens": MAX_NEW_TOKENS,
            }
            for name, (model, plan) in TP_PLANS.items()
        ]
    }
    if "gemma4" in model_dirs:
        spec["cases"].append({**spec["cases"][0], "name": HETEROGENEOUS_TP_CASE, "model_dir": str(model_dirs["gemma4"]), "plan": None})
    ranks = run_ranks(workdir, spec)
    reference = {model: single_process_ids(path) for model, path in model_dirs.items()}
    return {"ranks": ranks, "reference": reference}


def outcome(run: dict):
    """What a run produced, comparable across ranks: ids, or (error type, message)."""
    if "ids" in run:
        return run["ids"]
    return (run["error"]["type"], run["error"]["message"])


@pytest.mark.parametrize("plan_name", list(TP_PLANS))
def test_chunked_static_generation_under_tensor_parallelism(plan_name, tp_run):
    model, _ = TP_PLANS[plan_name]
    per_rank = [next(c for c in rank["cases"] if c["name"] == plan_name) for rank in tp_run["ranks"]]
    for case in per_rank:
        assert case["tp_size"] == (WORLD_SIZE if TP_SIZE_RECORDED else None)
        assert case["local_rows"] == EXPECTED_LOCAL_ROWS[plan_name], case["effective_tp_plan"]
    first, second = per_rank
    for run in ("unchunked", "chunked_stock", "chunked_patched"):
        assert outcome(first["runs"][run]) == outcome(second["runs"][run]), f"ranks disagree on {run}"
    runs = first["runs"]

    # The control: lazily allocated static cache, the same ids as one process without parallelism.
    assert outcome(runs["unchunked"]) == tp_run["reference"][model]

    stock = runs["chunked_stock"]
    # Where stock transformers sizes the eager cache wrongly: every plan that keeps all heads,
    # except on 5.16.x, which never divide and so fail on the colwise plan instead.
    stock_fails = AFFECTED and ((plan_name in FULL_HEAD_PLANS) == TP_SIZE_RECORDED)
    if stock_fails:
        assert "error" in stock, f"expected the stock chunked run to fail on {TRANSFORMERS_VERSION}"
        assert stock["error"]["type"] == "RuntimeError"
        assert INDEX_COPY_ERROR in stock["error"]["message"]
    else:
        assert "ids" in stock, stock.get("error", {}).get("traceback")
        assert stock["ids"] == runs["unchunked"]["ids"]
    assert stock["fired"] == 0, "the patch is not applied in the stock run"

    status = first["patch_status"]
    assert status["state"] == ("applied" if AFFECTED else "fixed upstream"), status
    patched = runs["chunked_patched"]
    assert "ids" in patched, patched.get("error", {}).get("traceback")
    assert patched["ids"] == runs["unchunked"]["ids"] == tp_run["reference"][model]
    # The patch counts exactly the runs it had to fix.
    assert (patched["fired"] > 0) == stock_fails, patched


def test_layers_with_their_own_head_size_under_tensor_parallelism(tp_run):
    from overlay.testing.models import heterogeneous_kinds_installed

    assert "gemma4_text" in heterogeneous_kinds_installed(), f"transformers {TRANSFORMERS_VERSION} has no Gemma 4"
    per_rank = [next(c for c in rank["cases"] if c["name"] == HETEROGENEOUS_TP_CASE) for rank in tp_run["ranks"]]
    for case in per_rank:
        assert case["tp_size"] == (WORLD_SIZE if TP_SIZE_RECORDED else None)
        assert case["local_rows"] == HETEROGENEOUS_LOCAL_ROWS, case["effective_tp_plan"]
        assert set(PATCH_MODULE.key_projection_styles(case["effective_tp_plan"]).values()) == {"colwise"}
    first, second = per_rank
    for run in ("unchunked", "chunked_stock", "chunked_patched"):
        assert outcome(first["runs"][run]) == outcome(second["runs"][run]), f"ranks disagree on {run}"
    runs = first["runs"]
    assert outcome(runs["unchunked"]) == tp_run["reference"]["gemma4"], runs["unchunked"].get("error", {}).get("traceback")

    stock = runs["chunked_stock"]
    stock_fails = AFFECTED and stock_variant() == SCALAR_HEADS_VARIANT
    if stock_fails and Version(TRANSFORMERS_VERSION.base_version) >= Version("5.15.0"):
        # Gemma 4's config is heterogeneous there: the global head size cannot be read.
        assert stock["error"]["type"] == "AmbiguousGlobalPerLayerAttributeError", stock["error"]
        assert PATCH_UNDER_TEST.error("'head_dim' is a per-layer") in stock["error"]["message"]
    elif stock_fails:
        # 5.13 - 5.14: every layer allocated 8 wide; the full-attention layer writes 16.
        assert stock["error"]["type"] == "RuntimeError", stock["error"]
        assert INDEX_COPY_ERROR in stock["error"]["message"]
    else:
        assert stock.get("ids") == runs["unchunked"]["ids"], stock.get("error", {}).get("traceback")

    patched = runs["chunked_patched"]
    assert "ids" in patched, patched.get("error", {}).get("traceback")
    assert patched["ids"] == runs["unchunked"]["ids"] == tp_run["reference"]["gemma4"]
    # The patch fired where stock failed, and on 5.16.x, which never record tp_size, also to divide.
    assert (patched["fired"] > 0) == (stock_fails or (AFFECTED and not TP_SIZE_RECORDED)), patched


# -- how run_ranks reads its ranks: stand-in workers (no torch) that end each way a rank can end --

_STAND_IN_WORKER = """
import json, os, sys
rank, out_path = int(sys.argv[1]), sys.argv[5]
how = json.load(open(sys.argv[4]))["ending"]
if how != "crash in the work":
    with open(out_path, "w") as f:
        json.dump({"rank": rank, "cases": [], **({"fatal": "Traceback: boom"} if how == "fatal" else {})}, f)
    print(%r, flush=True)
if how in ("crash in the work", "crash in the teardown") and rank == 1:
    os.abort()
"""


@pytest.mark.parametrize("ending", ["clean", "crash in the teardown", "crash in the work", "fatal"])
def test_run_ranks_tells_a_teardown_crash_from_a_failed_rank(ending, tmp_path):
    worker = tmp_path / "stand_in_worker.py"
    worker.write_text(_STAND_IN_WORKER % TEARDOWN_STARTED, encoding="utf-8")
    if ending == "clean":
        assert [r["rank"] for r in run_ranks(tmp_path, {"ending": ending}, worker)] == [0, 1]
    elif ending == "crash in the teardown":  # complete results, then torch's teardown aborted: said
        with pytest.warns(UserWarning, match="rank 1 exited -6 in torch.distributed's teardown"):
            assert [r["rank"] for r in run_ranks(tmp_path, {"ending": ending}, worker)] == [0, 1]
    else:
        expected = "before writing its results" if ending == "crash in the work" else "Traceback: boom"
        with pytest.raises(pytest.fail.Exception, match=expected):
            run_ranks(tmp_path, {"ending": ending}, worker)


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_fired_counter_counts_only_calls_that_changed_the_shape',
                    "changes the cache shape only where stock's shape cannot take the keys (index_copy_ raises)")
