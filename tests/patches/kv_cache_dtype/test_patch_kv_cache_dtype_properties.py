"""Property-based test of patch ``kv-cache-dtype`` against stock transformers (hypothesis).

One example: a cache layer (dynamic, dynamic sliding-window, static, static sliding-window) filled
with a prompt by a "previous model" in the *stored* dtype (or, for static layers, early-initialised
in it), then one or two decoding steps that write key/value states in the *incoming* dtypes, each
followed by attention (SDPA or the eager matmul/softmax/matmul) with a query in the keys' dtype,
with or without ``torch.autocast``. The same example runs on stock (``overlay.reverted()``) and
with the patch in each mode. The properties:

1. ``align`` and ``off`` never fail where stock works, and give bit-identical outputs there;
2. ``off`` behaves exactly as stock, failures included (same exception type and message);
3. ``strict`` raises only where ``align`` reports something (a ``KVCacheDtypeWarning``), never
   elsewhere, and otherwise gives stock's outputs; what it raises is ``CacheDtypeError``;
4. ``align`` makes every example whose keys and values arrive in one dtype work (outside autocast
   that is the whole point of the patch; under autocast, autocast decides, as on stock).

Deterministic (``derandomize``, no example database) and sized to a few seconds;
``ATTN_OVERLAY_PROPERTY_EXAMPLES`` raises the number of examples for a longer search.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import overlay  # noqa: E402
from overlay import guard  # noqa: E402
from overlay.testing.harness import PatchUnderTest  # noqa: E402

PATCH = PatchUnderTest("kv_cache_dtype")
PATCH.skip_module_unless_covered()

import inspect  # noqa: E402

from transformers import cache_utils  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer  # noqa: E402

from overlay.testing import models  # noqa: E402

EXAMPLES = int(os.environ.get("ATTN_OVERLAY_PROPERTY_EXAMPLES", "120"))

BATCH, KV_HEADS, Q_HEADS, HEAD_DIM, MAX_LEN, WINDOW = 1, 2, 2, 8, 12, 4
# The static sliding-window layer: StaticSlidingWindowLayer from 4.57 on. 4.56 has two sliding
# layers with updates of their own instead: ChunkedSlidingLayer (any number of tokens per step, as
# StaticSlidingWindowLayer) and SlidingWindowLayer (what StaticCache builds for sliding layers: a
# rolling window that takes one token per step once full; see run_example).
# 4.55.x ships both of 4.56's too (same branches; its SlidingWindowLayer casts what it stores, as its
# StaticLayer does), and no DynamicSlidingWindowLayer (added in 4.56.0).
STATIC_SLIDING = getattr(cache_utils, "StaticSlidingWindowLayer", None) or cache_utils.ChunkedSlidingLayer
# 4.55.x: static layers allocate their buffers in their constructor, in the dtype given there (no lazy
# or early initialisation): a layer is built in the example's stored dtype, which is the dtype a
# "previous model" would have built it in; 4.56.0 on, the layer picks its dtype when first written
# (or early-initialised), and the factories ignore ``stored``.
EAGER_STATIC_LAYERS = not hasattr(Cache, "early_initialization")


def _static(layer_class, stored, **sizes):
    if EAGER_STATIC_LAYERS:
        shape = dict(batch_size=BATCH, num_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=stored, device=torch.device("cpu"))
        return layer_class(max_cache_len=MAX_LEN, **sizes, **shape)
    return layer_class(max_cache_len=MAX_LEN, **sizes)


LAYERS = {
    "dynamic": lambda stored: DynamicLayer(),
    "static": lambda stored: _static(StaticLayer, stored),
    "static_sliding": lambda stored: _static(STATIC_SLIDING, stored, sliding_window=WINDOW),
}
if hasattr(cache_utils, "DynamicSlidingWindowLayer"):  # 4.56.0 on
    LAYERS["dynamic_sliding"] = lambda stored: cache_utils.DynamicSlidingWindowLayer(sliding_window=WINDOW)
if "update" in vars(getattr(cache_utils, "SlidingWindowLayer", object)):  # 4.55's and 4.56's rolling window
    LAYERS["static_rolling"] = lambda stored: _static(cache_utils.SlidingWindowLayer, stored, sliding_window=WINDOW)
# 4.55.0-5.3.0: Cache.update(key_states, value_states, layer_idx, cache_kwargs), and the layers read the
# write positions from cache_kwargs["cache_position"] (4.55's and 4.56's sliding layers require it); later
# releases track positions in the layers and take no cache_kwargs.
TAKES_CACHE_KWARGS = "cache_kwargs" in inspect.signature(Cache.update).parameters
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True, scope="module")
def _patch_applied():
    with PATCH.applied(expect="applied"):
        yield


def _states(generator, length, dtype):
    return torch.randn(BATCH, KV_HEADS, length, HEAD_DIM, generator=generator).to(dtype)


def _attention(kind, query, keys, values):
    if kind == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values)
    weights = torch.matmul(query, keys.transpose(2, 3)) * HEAD_DIM**-0.5
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values)


def run_example(ex):
    """The example's outputs (a list of tensors) or the exception it raised, and its cache warnings."""
    generator = torch.Generator().manual_seed(ex["seed"])
    stored = DTYPES[ex["stored"]]
    key_dtype, value_dtype = DTYPES[ex["key_dtype"]], DTYPES[ex["value_dtype"]]
    cache = models.cache_of_layers([LAYERS[ex["layer"]](stored)])
    # 4.56's rolling SlidingWindowLayer takes one token per step once full (more fail on stock in any dtype).
    steps = [1] * len(ex["steps"]) if ex["layer"] == "static_rolling" else ex["steps"]
    position = 0

    def update(k, v):
        nonlocal position
        extra = ({"cache_position": torch.arange(position, position + k.shape[-2])},) if TAKES_CACHE_KWARGS else ()
        position += k.shape[-2]
        return cache.update(k, v, 0, *extra)

    guard.reset_warnings()
    outputs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if ex["early_init"]:
                if not EAGER_STATIC_LAYERS:  # 4.55.x: the constructor allocated the buffers in ``stored``
                    cache.early_initialization(BATCH, KV_HEADS, HEAD_DIM, stored, "cpu")
            else:  # the prompt, written by the previous model in the stored dtype
                update(_states(generator, ex["prompt"], stored), _states(generator, ex["prompt"], stored))
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if ex["autocast"] else contextlib.nullcontext()
            with autocast, torch.no_grad():
                for length in steps:
                    k, v = _states(generator, length, key_dtype), _states(generator, length, value_dtype)
                    query = torch.randn(BATCH, Q_HEADS, length, HEAD_DIM, generator=generator).to(key_dtype)
                    keys, values = update(k, v)
                    outputs.append(_attention(ex["attention"], query, keys, values))
        except Exception as error:  # noqa: BLE001 - the outcome under test
            outputs = error
    reported = [str(w.message) for w in caught if issubclass(w.category, guard.KVCacheDtypeWarning)]
    return outputs, reported


def _same(a, b) -> bool:
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b)
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _describe(outcome) -> str:
    return f"{type(outcome).__name__}: {outcome}" if isinstance(outcome, Exception) else "works"


examples = st.fixed_dictionaries(
    {
        "layer": st.sampled_from(sorted(LAYERS)),
        "stored": st.sampled_from(sorted(DTYPES)),
        "key_dtype": st.sampled_from(sorted(DTYPES)),
        "value_dtype": st.sampled_from(sorted(DTYPES)),
        "autocast": st.booleans(),
        "attention": st.sampled_from(["sdpa", "eager"]),
        "early_init": st.booleans(),
        "prompt": st.integers(1, 6),
        "steps": st.lists(st.sampled_from([1, 3]), min_size=1, max_size=2),
        "seed": st.integers(0, 3),
    }
).map(lambda ex: {**ex, "early_init": ex["early_init"] and ex["layer"].startswith("static")})


def _ex(layer, stored, key_dtype, value_dtype=None, autocast=False, attention="sdpa", early_init=False, steps=(1, 1)):
    return {
        "layer": layer, "stored": stored, "key_dtype": key_dtype, "value_dtype": value_dtype or key_dtype,
        "autocast": autocast, "attention": attention, "early_init": early_init, "prompt": 5, "steps": list(steps),
        "seed": 0,
    }


def _release_examples(test):
    """The user-built static cache scenario on 4.55's and 4.56's rolling sliding window, where the release ships it."""
    if "static_rolling" in LAYERS:
        test = example(ex=_ex("static_rolling", "float32", "bfloat16", early_init=True))(test)
        test = example(ex=_ex("static_rolling", "bfloat16", "float32"))(test)  # wraps: prompt longer than the window
    return test


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
@given(ex=examples)
# The issues' own scenarios, always run:
@example(ex=_ex("dynamic", "float32", "bfloat16"))  # float32 prefix, bfloat16 decoding
@example(ex=_ex("dynamic", "bfloat16", "float32", attention="eager"))  # 15.5: float32 model, bfloat16 prefix
@example(ex=_ex("static", "float32", "bfloat16", early_init=True))  # user-built float32 static cache
@example(ex=_ex("static", "bfloat16", "float32", early_init=True))  # 15.5: kept bfloat16 static cache
@example(ex=_ex("dynamic", "float32", "float32", "bfloat16", autocast=True))  # 15.3: autocast, values in key dtype
@example(ex=_ex("static", "float32", "float32", "bfloat16", autocast=True, early_init=True))  # autocast + static
@example(ex=_ex("static_sliding", "float32", "bfloat16", steps=(3, 1)))  # sliding window wraps
@example(ex=_ex("static_sliding", "bfloat16", "float32", steps=(3,)))  # full window, 3 tokens: concatenated (works on stock)
@_release_examples
def test_the_patch_never_fails_or_changes_results_where_stock_works(ex):
    with overlay.reverted():
        stock, _ = run_example(ex)
    outcomes = {}
    for mode in ("align", "check", "off"):
        with guard.using_mode(mode):
            outcomes[mode] = run_example(ex)
    stock_works = not isinstance(stock, Exception)
    (aligned, align_reported), (strict, _), (off, _) = outcomes["align"], outcomes["check"], outcomes["off"]

    # 2. off is stock, failures included.
    assert _same(off, stock), (_describe(off), _describe(stock))
    if stock_works:
        # 1. align never fails where stock works, and changes nothing there.
        assert not isinstance(aligned, Exception), _describe(aligned)
        assert _same(aligned, stock), "align changed the results of an example that works on stock"
        # 3. strict: stock's results, or a named error only where align reported a mismatch.
        if isinstance(strict, Exception):
            assert isinstance(strict, guard.CacheDtypeError), _describe(strict)
            assert align_reported, f"strict raised where align reported nothing: {strict}"
        else:
            assert _same(strict, stock)
    elif isinstance(strict, guard.AttentionInputError):
        assert isinstance(strict, guard.CacheDtypeError), _describe(strict)
    # 4. keys and values in one dtype: align makes it work (outside autocast; under autocast as stock).
    if ex["key_dtype"] == ex["value_dtype"] and not ex["autocast"]:
        assert not isinstance(aligned, Exception), _describe(aligned)
