"""static-cache-tp-heads on models whose layers differ in head size or KV heads (Gemma 4).

``generate(cache_implementation="static", prefill_chunk_size=N)`` allocates the static cache up
front from ``GenerationMixin._get_static_cache_init_shape``. Up to 5.17.0 that function reads one
head size and one KV head count for every layer, while Gemma 4's full-attention layers have heads
``global_head_dim`` wide (and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` of them):

- 5.13.0 - 5.14.x: the cache gets the sliding layers' shape everywhere, and the first write to a
  full-attention layer fails (``index_copy_(): Source/destination tensor must have same slice
  shapes``);
- 5.15.0 - 5.17.0: the config is heterogeneous (``per_layer_config``) and the read raises
  ``AmbiguousGlobalPerLayerAttributeError``;
- 5.18.0 on: upstream sizes the cache per layer; the stock run passes and the overlay changes
  nothing.

Every test runs the stock release inside ``overlay.reverted()`` and the patch inside
``PATCH_UNDER_TEST.applied()``, and compares the generated ids with an unchunked static run of the
same model (the control, whose cache is allocated lazily from the real keys). The sweep covers
every model class of the installed release whose config varies per layer (and checks that no
such class is missing from it); the shapes each layer's keys really have are read from a
forward pass, so the expected cache shape comes from the model, not from the patch. The
tensor-parallel case is in ``test_patch_static_cache_tp_heads.py`` (it shares that module's
two-rank launch).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest
from overlay.testing.models import greedy_ids, heterogeneous_kinds_installed, tiny_heterogeneous_model

PATCH_UNDER_TEST = PatchUnderTest("static_cache_tp_heads")
PATCH_UNDER_TEST.skip_module_unless_covered()  # _get_static_cache_init_shape arrived in 5.13.0
PATCH = PATCH_UNDER_TEST.patch
TARGET = PATCH.targets[0]
TRANSFORMERS_VERSION = PATCH_UNDER_TEST.transformers

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [[5, 17, 33, 9, 101, 64, 2, 8, 9, 10], [7, 7, 90, 45, 3, 12, 88, 4, 5, 6]]
PREFILL_CHUNK_SIZE = 4  # chunks of 4, 4 and 2 tokens
MAX_NEW_TOKENS = 5

INDEX_COPY_ERROR = PATCH_UNDER_TEST.error("slice shapes")
PER_LAYER_ERRORS = {name: PATCH_UNDER_TEST.error(f"'{name}' is a per-layer") for name in ("head_dim", "num_key_value_heads")}


def stock_reads_one_shape_for_every_layer() -> bool:
    """The installed release's own function reads one head size and KV head count for all layers
    (the variant the patch declares for its code; 5.18.0 on read them per layer)."""
    if not PATCH_UNDER_TEST.affected:
        return False  # upstream's fixed code (5.20.0 on) sizes the cache per layer too
    return TARGET.variant_of(PATCH_UNDER_TEST.stock())["global_head_shapes"]


def inputs():
    import torch

    input_ids = torch.tensor(PROMPT)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def layer_key_shapes(model) -> list[tuple[int, int] | None]:
    """``(KV heads, head size)`` of the keys each cache layer really receives: one forward pass of
    the prompt with a dynamic cache (allocated from the keys themselves). ``None`` for a layer
    that holds no keys of its own (5.23+ keep a placeholder for a KV-shared layer; earlier
    releases leave shared layers out of the cache)."""
    import torch

    with torch.no_grad():
        cache = model(**inputs(), use_cache=True).past_key_values
    return [None if layer.keys is None else (int(layer.keys.shape[1]), int(layer.keys.shape[-1])) for layer in cache.layers]


def agrees_with_the_keys(init_shape, real_shapes) -> bool:
    """An eager init shape has each cache layer's real shape (placeholder layers aside)."""
    eager = as_layer_shapes(init_shape, len(real_shapes))
    return len(eager) == len(real_shapes) and all(r is None or e == r for e, r in zip(eager, real_shapes))


def as_layer_shapes(init_shape, layers: int) -> list[tuple[int, int]]:
    """An eager init shape (scalars or per-layer lists) as one ``(heads, head size)`` per layer."""
    heads, head_dim = init_shape
    heads = heads if isinstance(heads, list) else [heads] * layers
    head_dim = head_dim if isinstance(head_dim, list) else [head_dim] * layers
    return list(zip(heads, head_dim))


def expected_stock_error(model) -> tuple[type, str]:
    """The error the stock chunked run meets on a release that reads one shape for every layer."""
    config = model.config.get_text_config(decoder=True)
    per_layer = getattr(config, "per_layer_attributes", None) or ()
    if per_layer:
        from transformers.integrations.heterogeneity import AmbiguousGlobalPerLayerAttributeError

        # The function reads the KV head count first, then the head size.
        first = "num_key_value_heads" if "num_key_value_heads" in per_layer else "head_dim"
        return AmbiguousGlobalPerLayerAttributeError, PER_LAYER_ERRORS[first]
    return RuntimeError, INDEX_COPY_ERROR


def chunked(model):
    return greedy_ids(model, inputs(), MAX_NEW_TOKENS, cache_implementation="static", prefill_chunk_size=PREFILL_CHUNK_SIZE)


def prove_chunked_generation(model) -> None:
    """The whole proof on one model: the stock chunked run fails exactly where the layers differ on
    a release that reads one shape (and equals the control elsewhere); with the patch the eager
    cache has each layer's real shape, the chunked run equals the control, and the patch counts a
    fix exactly where stock failed."""
    from overlay import report

    control = greedy_ids(model, inputs(), MAX_NEW_TOKENS, cache_implementation="static")
    real_shapes = layer_key_shapes(model)
    layers_differ = len({shape for shape in real_shapes if shape is not None}) > 1
    stock_fails = layers_differ and stock_reads_one_shape_for_every_layer()

    with overlay.reverted():
        if stock_fails:
            error_type, text = expected_stock_error(model)
            with pytest.raises(error_type) as raised:
                chunked(model)
            assert text in str(raised.value)
        else:
            assert chunked(model) == control
            assert agrees_with_the_keys(PATCH_UNDER_TEST.stock()(model), real_shapes)

    expected_state = "applied" if PATCH_UNDER_TEST.affected else "fixed upstream"
    with PATCH_UNDER_TEST.applied(expect=expected_state):
        assert agrees_with_the_keys(model._get_static_cache_init_shape(), real_shapes)
        report.reset()
        assert chunked(model) == control
        assert (report.fired().get(PATCH.id, 0) > 0) == stock_fails, report.fired_actions()


# -- one model, three shapes of per-layer heads --------------------------------------------------

GEMMA4_TEXT_CASES = {
    # The config of issue 48501: full-attention heads 16 wide where the sliding ones are 8.
    "head size per layer": {},
    # attention_k_eq_v: the full-attention layers also have 1 KV head instead of 2.
    "head size and KV heads per layer": {"kv_heads_per_layer": True},
    # The last two layers reuse earlier layers' keys and values: 4 cache layers of 6 hold keys.
    "KV-shared layers": {
        "kv_heads_per_layer": True,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    },
}


@pytest.mark.parametrize("case", list(GEMMA4_TEXT_CASES))
def test_gemma4_chunked_static_generation_equals_the_unchunked_run(case):
    if "gemma4_text" not in heterogeneous_kinds_installed():
        pytest.fail(f"transformers {TRANSFORMERS_VERSION} has no Gemma4ForCausalLM (it ships from 5.13.0 on)")
    model = tiny_heterogeneous_model("gemma4_text", **GEMMA4_TEXT_CASES[case])
    if case == "KV-shared layers":
        held = [shape for shape in layer_key_shapes(model) if shape is not None]
        assert len(held) == 4, "the two shared layers must hold no keys of their own"
    prove_chunked_generation(model)


# -- every model class whose config varies per layer, in the installed release ----------------

SWEEP_KINDS = heterogeneous_kinds_installed()
# Each kind with the most per-layer variation it supports (Step3p7 varies query heads only).
SWEEP_OPTIONS = {kind: ({} if kind == "step3p7" else {"kv_heads_per_layer": True}) for kind in SWEEP_KINDS}


@pytest.mark.parametrize("kind", SWEEP_KINDS)
def test_every_model_class_with_per_layer_configs_generates_chunked(kind):
    prove_chunked_generation(tiny_heterogeneous_model(kind, **SWEEP_OPTIONS[kind]))


# Model folders of the installed release whose configs vary per layer but whose models never reach
# GenerationMixin._get_static_cache_init_shape, and how the test below sees that.
NOT_REACHING = {
    "neomme": "no generative model class (masked LM, retrieval)",
    "diffusion_gemma": "its own generate() builds the static cache without eager initialisation",
}
# The model folder of each sweep kind (its config class's module).
SWEEP_FOLDERS = {
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",
    "gemma4_unified_text": "gemma4_unified",
    "gemma4_unified": "gemma4_unified",
    "step3p7": "step3p7",
}


def model_folders_with_per_layer_configs() -> set[str]:
    """Model folders of the installed transformers whose configuration module sets per-layer
    values (``per_layer_config``, 5.14.0 on) or Gemma 4's per-layer-type head attributes
    (``global_head_dim``, before 5.15.0), read from the installed source files."""
    import transformers

    models = Path(transformers.__file__).parent / "models"
    found = set()
    for path in models.glob("*/configuration_*.py"):
        text = path.read_text(encoding="utf-8")
        if "per_layer_config" in text or "global_head_dim" in text:
            found.add(path.parent.name)
    return found


def test_the_sweep_covers_every_model_with_per_layer_configs_of_the_release():
    import importlib

    from transformers import GenerationMixin

    folders = model_folders_with_per_layer_configs()
    swept = {SWEEP_FOLDERS[kind] for kind in SWEEP_KINDS}
    assert swept <= folders
    if not stock_reads_one_shape_for_every_layer():
        # 5.18.0 on size the cache per layer themselves and the patch leaves the shapes to them:
        # the sweep there shows it changes nothing; models added later need no rule from it.
        return
    assert folders - swept <= set(NOT_REACHING), (
        f"transformers {TRANSFORMERS_VERSION}: models with per-layer configs not in the sweep: "
        f"{sorted(folders - swept - set(NOT_REACHING))} (add them to overlay.testing.models' heterogeneous kinds)"
    )
    # The ones left out really cannot reach the function (checked, not assumed).
    for folder in folders - swept:
        modeling = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
        generative = [
            cls for _, cls in inspect.getmembers(modeling, inspect.isclass)
            if cls.__module__ == modeling.__name__ and hasattr(cls, "generate")
        ]
        for cls in generative:
            assert not issubclass(cls, GenerationMixin), f"{cls.__name__} uses GenerationMixin.generate"
            generate_source = inspect.getsource(inspect.getmodule(cls.generate))
            assert "_get_static_cache_init_shape" not in generate_source, f"{cls.__name__}'s generate sizes a cache eagerly"
        if folder == "neomme":
            assert not generative


# -- the doctor's scenario, in this process ------------------------------------------------------


def test_doctor_scenario_fails_stock_where_the_layers_are_sized_alike_and_passes_with_the_patch():
    """``python -m overlay.doctor``'s ``gemma4-prefill-chunk`` cases (run here on the CPU, as
    the doctor's scenario subprocess runs them on a device): the Gemma 4 ones fail on stock
    exactly where the release sizes every layer alike, the control never; with the patch every
    case generates its reference's tokens."""
    from overlay.doctor._scenarios import run_gemma4_prefill_chunk

    assert "gemma4-prefill-chunk" in PATCH.doctor
    with overlay.reverted():
        stock = run_gemma4_prefill_chunk("cpu")
    expected_state = "applied" if PATCH_UNDER_TEST.affected else "fixed upstream"
    with PATCH_UNDER_TEST.applied(expect=expected_state):
        patched = run_gemma4_prefill_chunk("cpu")
    sized_alike = stock_reads_one_shape_for_every_layer()
    for case in stock:
        assert case["ok"] is (case["control"] or not sized_alike), case
        if not case["ok"]:
            assert case["error_type"] in ("RuntimeError", "AmbiguousGlobalPerLayerAttributeError"), case
    for case in patched:
        assert case["ok"] and case["identical"], case
    assert [c["reference_tokens"] for c in patched] == [c["reference_tokens"] for c in stock]
