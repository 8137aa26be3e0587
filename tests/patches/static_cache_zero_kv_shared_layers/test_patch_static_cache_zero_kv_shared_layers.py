"""static-cache-zero-kv-shared-layers: a static cache for a config with ``num_kv_shared_layers=0``
(Gemma 4's default, Gemma 3n set to 0) has its layers.

Reproduced for real on the CPU, in this process: tiny random Gemma 4 (5.5.0 on: text model with a
head size per layer, the same with KV heads per layer, the multimodal wrapper whose text config is
inside) and Gemma 3n (every release from 4.55 on) with ``num_kv_shared_layers=0``, a prompt of 9 and
a left-padded batch of two, greedy, 5 new tokens, with ``generate(cache_implementation="static")``
and with a ``StaticCache(config=model.config, max_cache_len=...)`` the user builds. The reference
is the same prompt with the default dynamic cache, on stock.

On 4.56.0 - 5.9.0 stock raises ``IndexError: list index out of range`` (``Cache.update``: the cache
has no layers) and, in the same test, the overlay gives the reference's ids, with one cache layer
per layer type, of the class the release builds for that type. Where the slice keeps layers (Gemma
3n with ``num_kv_shared_layers=2``; Llama, whose config has no such attribute) the overlay gives
stock's ids and stock's layers and reports nothing. The wrapper reads the text config with the
arguments the release's own code uses (4.56.x: ``get_text_config()``; later: ``decoder=True``). On
5.10.1+ the engine says "fixed upstream", stock gives the reference's ids and the overlay changes
nothing; on 4.55.x, which has no slice, it says "out of range" (the code arrived in 4.56.0), leaves
``StaticCache.__init__`` alone, and stock gives the reference's ids. The fingerprints, labels and
the patch file's imports are checked for every patch by ``tests/patches/test_patch_declarations.py``.
"""

from __future__ import annotations

import pytest

import overlay
from overlay.patch import Variant
from overlay.testing.harness import PatchUnderTest

# From tests/_kit.py: the static cache's scenarios (the other static cache patch's tests run them too).
from tests._kit import STATIC_COMPOSED_PROMPT as COMPOSED_PROMPT
from tests._kit import STATIC_MAX_CACHE_LEN as MAX_CACHE_LEN
from tests._kit import STATIC_PROMPTS as PROMPTS
from tests._kit import STATIC_WAYS as WAYS
from tests._kit import assert_in_force_only_while_applied, assert_replacements_keep_the_originals_face
from tests._kit import static_cases as _cases
from tests._kit import static_greedy as _generate

PATCH = PatchUnderTest("static_cache_zero_kv_shared_layers")
OUT_OF_RANGE = not (PATCH.affected or PATCH.fixed_upstream)

pytestmark = pytest.mark.usefixtures("one_thread")

INDEX_ERROR = PATCH.error("list index")
ACTION = PATCH.patch_module.ACTION

#: Model cases: (builder name, options, whether the config sets num_kv_shared_layers to 0).
MODELS = {
    "gemma4 text": ("gemma4", {"kind": "gemma4_text"}, True),
    "gemma4 text, KV heads per layer": ("gemma4", {"kind": "gemma4_text", "kv_heads_per_layer": True}, True),
    "gemma4 multimodal": ("gemma4", {"kind": "gemma4"}, True),
    "gemma3n, no shared layer": ("gemma3n", {"num_kv_shared_layers": 0}, True),
    "gemma3n, 2 shared layers (control)": ("gemma3n", {"num_kv_shared_layers": 2}, False),
    "llama (control)": ("llama", {}, False),
}
BUG_CASES = [name for name, (_, _, zero) in MODELS.items() if zero]
CONTROL_CASES = [name for name, (_, _, zero) in MODELS.items() if not zero]


def _installed(name: str) -> bool:
    """Whether the installed release has this case's model (Gemma 4 arrived in 5.5.0)."""
    builder, options, _ = MODELS[name]
    if builder != "gemma4":
        return True
    from overlay.testing.models import heterogeneous_kinds_installed

    return options["kind"] in heterogeneous_kinds_installed()


def _model(name: str):
    from overlay.testing import models

    builder, options, _ = MODELS[name]
    if builder == "gemma4":
        options = dict(options)
        return models.tiny_heterogeneous_model(options.pop("kind"), **options)
    if builder == "gemma3n":
        return models.tiny_gemma3n(**options)
    return models.tiny_model("llama", attn_implementation="sdpa")


def _user_cache(model, batch_size: int):
    """A ``StaticCache`` built from the model's config, as users build one; its layers allocate
    on their first write (4.56+: each layer takes its own head count and size from its keys)."""
    from overlay.testing.models import user_static_cache

    return user_static_cache(model.config, batch_size, MAX_CACHE_LEN, model.dtype)


def _layers(model) -> "list[tuple[str, int | None]]":
    """What ``StaticCache(config=model.config, ...)`` holds: (layer class, the length it holds) per
    layer (a sliding layer holds its window)."""
    from transformers import StaticCache

    if not hasattr(StaticCache, "early_initialization"):  # 4.55.x: needs more arguments
        return []
    cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)
    return [(type(layer).__name__, getattr(layer, "max_cache_len", None)) for layer in cache.layers]


def _run(model, batches: dict) -> dict:
    """Every way and prompt on ``model`` in the current state (stock or patched), the layers a
    static cache for its config holds, and what the patch reported."""
    from overlay import report
    from overlay.testing.models import cache_argument_name

    report.reset()
    record: dict = {"layers": _layers(model)}
    for prompt, batch in batches.items():
        rows = batch["input_ids"].shape[0]
        record[(WAYS[0], prompt)] = _generate(model, batch, cache_implementation="static")
        record[(WAYS[1], prompt)] = _generate(model, batch, **{cache_argument_name(model): _user_cache(model, rows)})
    record["fired"] = report.fired_actions().get(PATCH.id, {})
    return record


@pytest.fixture(scope="module")
def runs():
    """``{case: {"reference": {prompt: run}, "stock": record, "patched": record, "all patches": run,
    "config before", "config after", "layer types", "sliding window"}}`` for the cases the installed
    release has."""
    import transformers.cache_utils  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay.testing.models import left_padded_batch

    batches = {prompt: left_padded_batch(lengths, seed=0) for prompt, lengths in PROMPTS.items()}
    results: dict = {}
    for name in MODELS:
        if not _installed(name):
            continue
        model = _model(name)
        text_config = model.config.get_text_config(decoder=True)
        record = results[name] = {
            "config before": getattr(text_config, "num_kv_shared_layers", None),
            "layer types": list(getattr(text_config, "layer_types", None) or ()),
            "sliding window": getattr(text_config, "sliding_window", None),
        }
        with overlay.reverted():
            record["reference"] = {prompt: _generate(model, batch) for prompt, batch in batches.items()}
            record["stock"] = _run(model, batches)
        with PATCH.applied():
            record["patched"] = _run(model, batches)
        with overlay.applied():  # every patch the release gets, as users run it
            record["all patches"] = _generate(model, batches[COMPOSED_PROMPT], cache_implementation="static")
        record["config after"] = getattr(text_config, "num_kv_shared_layers", None)
    return results


def _present(runs, name):
    if name not in runs:
        kind = MODELS[name][1].get("kind", name)
        pytest.skip(f"transformers {PATCH.transformers} has no {kind} (Gemma 4: 5.5.0 on)")
    return runs[name]


# -- the engine --------------------------------------------------------------------------------------


def test_engine_status_and_where_the_replacement_goes():
    from transformers import cache_utils

    status = assert_in_force_only_while_applied(
        PATCH, lambda: vars(cache_utils.StaticCache)["__init__"],
        stepped_aside="fixed upstream" if PATCH.fixed_upstream else "out of range",
    )
    if OUT_OF_RANGE:  # 4.55.x: the slice is not there, and the engine says so
        assert f"arrived in {PATCH.patch.introduced_in}" in status.reason, status.reason


def test_replacement_keeps_name_docstring_and_signature():
    # Built by hand where the code is not an original (fixed or older releases): only the
    # wrapper's metadata is read there. Its one target is on every release.
    otherwise = Variant("this release", dict(PATCH.patch.targets[0].defaults))
    assert assert_replacements_keep_the_originals_face(PATCH, otherwise) == len(PATCH.patch.targets) == 1


# -- the runs -----------------------------------------------------------------------------------------


@_cases(BUG_CASES)
def test_static_cache_with_no_shared_layer(runs, name, way, prompt):
    """The bug and the fix in one test: stock's error, the overlay's ids, the reference's ids."""
    record = _present(runs, name)
    reference = record["reference"][prompt]
    stock, patched = record["stock"][(way, prompt)], record["patched"][(way, prompt)]
    assert reference["ok"], reference
    if PATCH.affected:
        assert (stock["ok"], stock.get("type"), stock.get("error"), stock.get("raised in")) == (
            False, "IndexError", INDEX_ERROR, "update"
        ), stock
        assert patched == reference, "the overlay gives the dynamic cache's ids"
    elif PATCH.fixed_upstream:
        assert stock == reference, "upstream's fix gives the dynamic cache's ids"
        assert patched == stock
    else:  # 4.55.x: no slice, no bug
        assert stock == reference, "before 4.56.0 the static cache has every layer"
        assert patched == stock


@pytest.mark.parametrize("name", BUG_CASES)
def test_the_cache_has_a_layer_per_layer_type(runs, name):
    """As the fixed release builds it: a sliding window layer for each sliding layer type (the
    release's own class: ``SlidingWindowLayer`` on 4.56.x, ``StaticSlidingWindowLayer`` from
    4.57.0), a plain static layer for each full attention one; stock on 4.56.0 - 5.9.0 builds none."""
    from transformers import cache_utils

    record = _present(runs, name)
    if OUT_OF_RANGE:  # 4.55.x: a StaticCache needs more arguments there (_layers() builds none)
        assert record["patched"]["layers"] == record["stock"]["layers"]
        return
    sliding = "StaticSlidingWindowLayer" if hasattr(cache_utils, "StaticSlidingWindowLayer") else "SlidingWindowLayer"
    expected = [
        (sliding, min(record["sliding window"], MAX_CACHE_LEN))
        if kind == "sliding_attention"
        else ("StaticLayer", MAX_CACHE_LEN)
        for kind in record["layer types"]
    ]
    if PATCH.affected:
        assert record["stock"]["layers"] == []
        assert record["patched"]["layers"] == expected
    else:
        assert record["stock"]["layers"] == expected, "upstream's fix"
        assert record["patched"]["layers"] == record["stock"]["layers"]


@_cases(CONTROL_CASES)
def test_where_the_slice_keeps_layers_the_overlay_is_stock(runs, name, way, prompt):
    record = runs[name]
    assert record["patched"][(way, prompt)] == record["stock"][(way, prompt)]
    assert record["patched"]["layers"] == record["stock"]["layers"]


def test_what_the_patch_reports(runs):
    for name, record in runs.items():
        assert record["stock"]["fired"] == {}, name
        if PATCH.affected and name in BUG_CASES:
            # One count per StaticCache built for the config: the one _layers() builds, then one per
            # run (generate() builds one for each cache_implementation='static' call; the user
            # builds the other).
            assert record["patched"]["fired"] == {ACTION: 1 + len(PROMPTS) * len(WAYS)}, name
        else:
            assert record["patched"]["fired"] == {}, name


def test_the_users_config_is_left_as_it_was(runs):
    for name, record in runs.items():
        assert record["config after"] == record["config before"], name


@pytest.mark.parametrize("name", BUG_CASES)
def test_with_every_patch_of_the_release(runs, name):
    """The whole overlay (on 4.56.0 - 5.9.0 also ``kept-static-cache``, which wraps the function
    that builds generate()'s static cache) gives the reference's ids too."""
    record = _present(runs, name)
    if OUT_OF_RANGE:
        pytest.skip(f"{PATCH.id} is out of range on {PATCH.transformers}: the other patches' tests cover them")
    assert record["all patches"] == record["reference"][COMPOSED_PROMPT]


#: The cases whose config a test builds by itself: (the runs' case, the config builder's name, its options).
CONFIGS = {
    "gemma4 text": ("tiny_heterogeneous_config", ("gemma4_text",), {}),
    "gemma3n, no shared layer": ("tiny_gemma3n_config", (), {"num_kv_shared_layers": 0}),
}


def _config(name: str):
    from overlay.testing import models

    builder, args, options = CONFIGS[name]
    return getattr(models, builder)(*args, **options)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_given_by_position_or_by_keyword(runs, name):
    """generate() passes the config by keyword; users may pass it first, by position."""
    record = _present(runs, name)
    if OUT_OF_RANGE:
        pytest.skip(f"transformers {PATCH.transformers}'s StaticCache takes more arguments; no slice there")
    from transformers import StaticCache

    config = _config(name)

    def layers(cache):
        return [(type(layer).__name__, layer.max_cache_len) for layer in cache.layers]

    with PATCH.applied():
        by_position = layers(StaticCache(config, MAX_CACHE_LEN))
        by_keyword = layers(StaticCache(max_cache_len=MAX_CACHE_LEN, config=config))
    assert by_position == by_keyword == record["patched"]["layers"]
    assert len(by_position) == len(config.layer_types)


class _RecordingConfig:
    """A composite config as ``StaticCache`` meets it: ``get_text_config`` records how it was called
    and hands back the text config; every other attribute is the text config's."""

    def __init__(self, text_config):
        self.text_config = text_config
        self.calls = []

    def get_text_config(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.text_config

    def __getattr__(self, name):
        return getattr(self.__dict__["text_config"], name)


@pytest.mark.parametrize("shared", [2, 0])
def test_the_text_config_is_read_as_the_release_reads_it(shared):
    """The wrapper asks for the text config with the release's own arguments (4.56.x:
    ``get_text_config()``, which also looks for a text encoder; later ``decoder=True``): it judges
    the config the original slices. With 2 the original asks again, the same way; with 0 it asks
    the view, not the user's config."""
    from transformers import StaticCache

    from overlay.testing.models import tiny_gemma3n_config

    if not hasattr(StaticCache, "early_initialization"):
        pytest.skip(f"transformers {PATCH.transformers}'s StaticCache takes more arguments; no slice there")
    stock_config = _RecordingConfig(tiny_gemma3n_config(num_kv_shared_layers=shared))
    patched_config = _RecordingConfig(tiny_gemma3n_config(num_kv_shared_layers=shared))
    with overlay.reverted():
        StaticCache(config=stock_config, max_cache_len=MAX_CACHE_LEN)
    with PATCH.applied():
        StaticCache(config=patched_config, max_cache_len=MAX_CACHE_LEN)
    assert stock_config.calls, "the release reads the text config through get_text_config"
    if not PATCH.affected:
        assert patched_config.calls == stock_config.calls, "the patch steps aside"
    elif shared:
        assert patched_config.calls == stock_config.calls * 2, "the wrapper's call, then the original's"
    else:
        assert patched_config.calls == stock_config.calls, "the wrapper's call; the original reads the view"


class _AmbiguousConfig:
    """A config whose ``get_text_config`` fails (as a composite one with two text configs does)."""

    def get_text_config(self, *args, **kwargs):
        raise ValueError("Multiple valid text configs were found in the model config")


def test_a_config_the_release_cannot_read_fails_as_on_stock():
    """The wrapper cannot judge such a config: the original runs and raises its own error, from its
    own line (no frame of the wrapper's between)."""
    import traceback

    from transformers import StaticCache

    def failure():
        try:
            StaticCache(config=_AmbiguousConfig(), max_cache_len=MAX_CACHE_LEN)
        except Exception as exc:  # noqa: BLE001
            frames = [(f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)]
            return type(exc).__name__, str(exc), frames[-2:]
        return None

    with overlay.reverted():
        stock = failure()
    with PATCH.applied():
        patched = failure()
    if hasattr(StaticCache, "early_initialization"):  # 4.56.0 on: the release asks the config first
        assert stock is not None and stock[0] == "ValueError", stock
    assert patched == stock


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_where_the_slice_keeps_layers_the_overlay_is_stock',
                    'only num_kv_shared_layers=0, whose empty cache raises IndexError on stock')
