"""Patch ``kv-cache-dtype``: a KV cache in another dtype than the model's compute dtype.

Each scenario of the issue runs three times on tiny random Llama / Qwen3 / Gemma3 (Gemma3 with a
sliding-window layer and a prompt longer than the window), for sdpa and eager:
stock transformers (must fail with the error users report, on every affected release), with the
overlay (must pass), and a reference run on stock transformers (must give the same token ids).
Tests adapt to the installed release: plain autocast + static cache works on stock 5.24.0 (its
StaticLayer allocates values in their own dtype) and fails before, back to 4.56.0; on 4.55.x static
layers cast what they store to their buffers' dtype (the patch's variant says so), so there a
mismatched static cache fails in attention instead of ``index_copy_``, and autocast with
generate's static cache (allocated in the model's float32) works on stock.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections import Counter

import pytest
import torch

import overlay
from overlay import guard
from overlay.testing import models
from overlay.testing.harness import PatchUnderTest, counting_aten_ops

PATCH = PatchUnderTest("kv_cache_dtype")
GUARD = PatchUnderTest("attention_guard")
PATCH.skip_module_unless_covered()

from transformers import LlamaForCausalLM  # noqa: E402  (after the version gate)

# 4.55.x: StaticLayer.update casts the states to its buffers' dtype before writing (the variant's
# ``casts_on_write``): stock stores a mismatch and attention then fails on what the cache hands back.
_VARIANT = PATCH.patch.targets[0].variant_of(PATCH.stock())
STATIC_LAYERS_CAST_ON_WRITE = _VARIANT is not None and bool(_VARIANT["casts_on_write"])

# The exact errors of stock transformers (what users paste into a search box): the patch's own.
INDEX_COPY_ERROR = PATCH.error("index_copy_")
PREFIX_ERRORS = {"sdpa": PATCH.error("Expected query, key"), "eager": PATCH.error("expected scalar type BFloat16")}
# A float32 static cache with a bfloat16 model: index_copy_ refuses the write, or (4.55.x) attention the read.
if STATIC_LAYERS_CAST_ON_WRITE:
    STATIC_ERRORS = {"sdpa": PATCH.error("Expected query, key"), "eager": PATCH.error("expected scalar type Float")}
else:
    STATIC_ERRORS = {"sdpa": INDEX_COPY_ERROR, "eager": INDEX_COPY_ERROR}
# Layer 0 is a static layer, or Gemma3's sliding one: StaticSlidingWindowLayer, on 4.56 SlidingWindowLayer.
CAST_WARNING = (
    r"KV cache layer 0 \((Static|StaticSlidingWindow|SlidingWindow)Layer\) holds keys in torch.float32 "
    r"but attention computes in torch.bfloat16"
)

# Up to 5.12 the models take ``cache_position`` (5.13 dropped it).
TAKES_CACHE_POSITION = "cache_position" in inspect.signature(LlamaForCausalLM.forward).parameters

# Since 5.24.0 StaticLayer allocates values in the value dtype: plain autocast + static works. On
# 4.55.x too: generate builds the static cache in the model's float32 and its layers cast on write.
AUTOCAST_STATIC_WORKS_ON_STOCK = PATCH.transformers >= type(PATCH.transformers)("5.24.0") or STATIC_LAYERS_CAST_ON_WRITE

# The scenarios' expected casts are reported once per test (see the warning tests); keep them out of the summary.
pytestmark = [
    pytest.mark.filterwarnings("ignore::overlay.guard.KVCacheDtypeWarning"),
    pytest.mark.usefixtures("one_thread"),
]

KINDS = ("llama", "qwen3", "gemma3")
ATTNS = ("sdpa", "eager")
NEW_TOKENS = 5
MAX_CACHE_LEN = 16


# -- applying the overlay --------------------------------------------------------------------


def overlay_on(*also: str):
    """The patch and the attention guard where the guard covers the release (or the patch with
    ``also``), applied for a block. The scenarios need the patch alone; the guard rides along to
    prove the two together change nothing more."""
    return PATCH.applied(*(also if also else (GUARD.id,) if GUARD.affected else ()), expect="applied")


stock = overlay.reverted  # the control: stock transformers (a no-op when nothing is applied)


@pytest.fixture(autouse=True)
def _fresh_warnings_and_mode():
    guard.reset_warnings()
    with guard.using_mode("align"):
        yield


# -- tiny models and inputs ------------------------------------------------------------------

_MODELS: dict = {}
# Sizes the scenarios rely on: head_dim 8, 64 positions; Gemma3 with a sliding layer (window 4 <
# prompt 6) and a full one, so both static layer kinds run, with Gemma3's own tying and scaling.
SIZES = dict(hidden_size=32, intermediate_size=64, max_position_embeddings=64, sliding_window=4)
GEMMA3_AS_RELEASED = dict(tie_word_embeddings=True, query_pre_attn_scalar=256)


def tiny_model(kind: str, attn: str, dtype: torch.dtype = torch.bfloat16):
    """Tiny random model; the same weights for every dtype (cast from one float32 build)."""
    key = (kind, attn, dtype)
    if key not in _MODELS:
        extra = GEMMA3_AS_RELEASED if kind == "gemma3" else {}
        model = models.tiny_model(kind, dtype, attn_implementation=attn, **SIZES, **extra)
        model.generation_config.eos_token_id = None  # always NEW_TOKENS tokens
        _MODELS[key] = model
    return _MODELS[key]


INPUT_IDS, ATTENTION_MASK = models.hand_padded_batch()


def generate(model, **kwargs):
    # Up to 5.17 generate keeps its static cache on the model (``_cache``) for the next call; a call
    # that failed (the stock runs) leaves it half-initialised, and 4.56-5.3 then fail on it in
    # ``_get_cache`` (``'StaticLayer' object has no attribute 'max_batch_size'``): start clean.
    vars(model).pop("_cache", None)
    return models.tokens_and_logits(model, INPUT_IDS, ATTENTION_MASK, NEW_TOKENS, **kwargs)


def static_cache(model, dtype):
    return models.static_cache(model.config, INPUT_IDS.shape[0], MAX_CACHE_LEN, dtype, "cpu")


def fp32_prefix_cache(kind, attn, cast_to=None):
    """A shared prompt prefix computed once by the float32 twin of the model."""
    model32 = tiny_model(kind, attn, torch.float32)
    cache = models.dynamic_cache(model32.config)
    with torch.no_grad():
        model32(input_ids=INPUT_IDS[:, :-1], attention_mask=ATTENTION_MASK[:, :-1], past_key_values=cache, use_cache=True)
    if cast_to is not None:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.to(cast_to), layer.values.to(cast_to)
    return cache


def autocast_generate(kind, attn, **kwargs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return generate(tiny_model(kind, attn, torch.float32), **kwargs)


# -- the scenarios ---------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("kind", KINDS)
def test_user_static_cache_in_fp32_on_bf16_model(kind, attn):
    model = tiny_model(kind, attn)
    with stock(), pytest.raises(RuntimeError, match=re.escape(STATIC_ERRORS[attn])):
        generate(model, past_key_values=static_cache(model, torch.float32))
    with overlay_on(), pytest.warns(guard.KVCacheDtypeWarning, match=CAST_WARNING):
        tokens, logits = generate(model, past_key_values=static_cache(model, torch.float32))
    with stock():
        ref_tokens, ref_logits = generate(model, past_key_values=static_cache(model, torch.bfloat16))
    assert torch.equal(tokens, ref_tokens)
    # bf16 -> fp32 -> bf16 is exact: attention saw bit-identical inputs
    assert torch.equal(logits, ref_logits)


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("kind", KINDS)
def test_fp32_prefilled_dynamic_cache_then_bf16_decoding(kind, attn):
    model = tiny_model(kind, attn)
    with stock(), pytest.raises(RuntimeError, match=re.escape(PREFIX_ERRORS[attn])):
        generate(model, past_key_values=fp32_prefix_cache(kind, attn))
    with overlay_on():
        cache = fp32_prefix_cache(kind, attn)
        tokens, logits = generate(model, past_key_values=cache)
    # The cache keeps its dtype: torch.cat no longer promotes, and writes were stored in float32.
    assert {layer.keys.dtype for layer in cache.layers} == {torch.float32}
    with stock():
        ref_tokens, ref_logits = generate(model, past_key_values=fp32_prefix_cache(kind, attn, cast_to=torch.bfloat16))
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("kind", KINDS)
def test_autocast_generate_with_static_cache(kind, attn):
    with stock():
        ref_tokens, ref_logits = autocast_generate(kind, attn)  # default dynamic cache
        if AUTOCAST_STATIC_WORKS_ON_STOCK:
            stock_tokens, _ = autocast_generate(kind, attn, cache_implementation="static")
            assert torch.equal(stock_tokens, ref_tokens)
        else:
            with pytest.raises(RuntimeError, match=re.escape(INDEX_COPY_ERROR)):
                autocast_generate(kind, attn, cache_implementation="static")
    with overlay_on():
        tokens, logits = autocast_generate(kind, attn, cache_implementation="static")
    assert torch.equal(tokens, ref_tokens)
    # a static cache attends over its whole (masked) buffer: same maths, other summation order
    torch.testing.assert_close(logits, ref_logits, atol=2e-2, rtol=2e-2)


def _static_chunked_prefill_fails_on_stock(kind, attn):
    """The error of stock generate() with a static cache and ``prefill_chunk_size`` with no dtype
    mismatch at all (the float32 model, no autocast), or None. 5.0-5.3 write past the cache's end
    (``index_copy_(): index 10 is out of bounds for dimension 2 with size 10``)."""
    with stock():
        try:
            generate(tiny_model(kind, attn, torch.float32), cache_implementation="static", prefill_chunk_size=2)
        except (IndexError, RuntimeError) as error:
            return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("kind", KINDS)
def test_autocast_generate_with_static_cache_and_chunked_prefill(kind, attn):
    # generate() initialises the static cache early, in the model's dtype (float32), for chunked prefill
    # (5.13 on; before, lazily in the keys' dtype, and the values fail as without chunking; 4.55.x
    # allocates it in the model's dtype and its layers cast on write: stock works there).
    broken = _static_chunked_prefill_fails_on_stock(kind, attn)
    if broken is not None:
        pytest.skip(f"transformers {PATCH.transformers} cannot chunk a prefill into a static cache in any dtype: {broken}")
    with stock():
        # The reference chunks the prefill too, on a dynamic cache (given: 5.0 does not chunk without
        # one): 4.56-4.57's chunked prefill gives the left-padded row other tokens than an unchunked
        # one, on stock, whatever the cache and dtype.
        dynamic = models.dynamic_cache(tiny_model(kind, attn, torch.float32).config)
        ref_tokens, ref_logits = autocast_generate(kind, attn, prefill_chunk_size=2, past_key_values=dynamic)
        if STATIC_LAYERS_CAST_ON_WRITE:
            stock_tokens, _ = autocast_generate(kind, attn, cache_implementation="static", prefill_chunk_size=2)
            assert torch.equal(stock_tokens, ref_tokens)
        else:
            with pytest.raises(RuntimeError, match=re.escape(INDEX_COPY_ERROR)):
                autocast_generate(kind, attn, cache_implementation="static", prefill_chunk_size=2)
    with overlay_on():
        tokens, logits = autocast_generate(kind, attn, cache_implementation="static", prefill_chunk_size=2)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=2e-2, rtol=2e-2)


# -- warning, modes ----------------------------------------------------------------------------


def test_cast_warning_is_shown_once_per_dtype_pair_and_names_layer_and_dtypes():
    model = tiny_model("llama", "sdpa")
    with overlay_on(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(model, past_key_values=static_cache(model, torch.float32))
        generate(model, past_key_values=static_cache(model, torch.float32))
    messages = [str(w.message) for w in caught if issubclass(w.category, guard.KVCacheDtypeWarning)]
    assert len(messages) == 2, messages  # keys and values, once each, for two full generations
    assert "KV cache layer 0 (StaticLayer) holds keys in torch.float32 but attention computes in torch.bfloat16" in messages[0]
    assert "holds values in torch.float32" in messages[1]


def test_no_warning_when_dtypes_match():
    model = tiny_model("gemma3", "eager")
    with overlay_on(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(model, past_key_values=static_cache(model, torch.bfloat16))
    assert not [w for w in caught if issubclass(w.category, guard.KVCacheDtypeWarning)]


def test_strict_mode_raises_naming_layer_and_tensors():
    model = tiny_model("llama", "sdpa")
    with overlay_on(), guard.using_mode("check"):
        with pytest.raises(guard.AttentionInputError) as caught:
            generate(model, past_key_values=static_cache(model, torch.float32))
    message = str(caught.value)
    assert "KV cache layer 0 (StaticLayer) stores keys in torch.float32 but the model writes key_states in torch.bfloat16" in message
    assert "cache keys: device=cpu, dtype=torch.float32, shape=(2, 2, 16, 8)" in message
    assert "key_states: device=cpu, dtype=torch.bfloat16, shape=(2, 2, 6, 8)" in message
    assert "what to do:" in message


def test_strict_mode_names_a_promoting_dynamic_layer():
    model = tiny_model("qwen3", "eager")
    with overlay_on(), guard.using_mode("check"):
        with pytest.raises(guard.AttentionInputError, match=r"KV cache layer 0 \(DynamicLayer\) stores keys in torch.float32"):
            generate(model, past_key_values=fp32_prefix_cache("qwen3", "eager"))


def test_mode_off_passes_through_like_stock():
    model = tiny_model("llama", "sdpa")
    with overlay_on(), guard.using_mode("off"), pytest.raises(RuntimeError, match=re.escape(STATIC_ERRORS["sdpa"])):
        generate(model, past_key_values=static_cache(model, torch.float32))


# -- torch.compile -------------------------------------------------------------------------------


def _compiled_decode(kind, cache_dtype, steps=4):
    """Eager prefill, then ``steps`` decode steps under torch.compile(fullgraph=True).

    The CompileCounter backend counts frames and ops without running inductor (seconds, not minutes).
    Returns (generated token ids, compiled frames, ops in the graph, cast warnings emitted by the
    compiled steps).
    """
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = tiny_model(kind, "sdpa")
    cache = models.static_cache(model.config, 1, MAX_CACHE_LEN, cache_dtype, "cpu")
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    # What the compiled steps see first must be the mismatch, not the eager prefill's report.
    guard.reset_warnings()
    counter = CompileCounter()

    def decode_step(token, position):
        # Up to 5.3 a static layer counts its length from its buffer (data-dependent under dynamo):
        # where the model takes ``cache_position`` it is given, as generate() gives it.
        positions = {"cache_position": position[0]} if TAKES_CACHE_POSITION else {}
        return model(input_ids=token, past_key_values=cache, position_ids=position, use_cache=True, **positions).logits

    compiled = torch.compile(decode_step, backend=counter, fullgraph=True)
    tokens = []
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            logits = compiled(token, torch.tensor([[prompt.shape[1] + step]]))
            token = logits[:, -1:].argmax(-1)
            tokens.append(token.item())
    torch._dynamo.reset()
    cast_warnings = [w for w in caught if issubclass(w.category, guard.KVCacheDtypeWarning)]
    return tokens, counter.frame_count, counter.op_count, cast_warnings


def test_compiled_decode_step_matching_dtypes_compiles_once_and_adds_no_op():
    with stock():
        stock_tokens, stock_frames, stock_ops, _ = _compiled_decode("llama", torch.bfloat16)
    with overlay_on():
        tokens, frames, ops, _ = _compiled_decode("llama", torch.bfloat16)
    # fullgraph=True raises on any graph break; one frame over four steps: no recompilation
    assert frames == 1 == stock_frames
    assert ops == stock_ops  # the dtype checks are decided at trace time: not one op more
    assert tokens == stock_tokens


def test_compiled_decode_step_with_fp32_cache_casts_inside_the_graph():
    with stock():
        ref_tokens, _, ref_ops, _ = _compiled_decode("llama", torch.bfloat16)
    with overlay_on():
        tokens, frames, ops, cast_warnings = _compiled_decode("llama", torch.float32)
    assert frames == 1  # the mismatch branch (cast, skipped warning) did not break or recompile
    layers = tiny_model("llama", "sdpa").config.num_hidden_layers
    if STATIC_LAYERS_CAST_ON_WRITE:
        # 4.55.x: the write casts are the layer's own ``.to`` calls, in stock's graph too (no-ops there)
        assert ops == ref_ops + 2 * layers  # per layer: key and value cast back on read
    else:
        assert ops == ref_ops + 4 * layers  # per layer: key and value cast on write, and back on read
    assert tokens == ref_tokens
    # the warning is not emitted from compiled code (it would break the graph); the eager prefill reported it
    assert cast_warnings == []


@pytest.mark.slow  # two models x two frames of dynamo tracing: ~25 s on a 2-core box
def test_compiled_sliding_window_decode_compiles_as_often_as_stock():
    # StaticSlidingWindowLayer keeps a Python int position: stock compiles it twice (the int changes)
    with stock():
        stock_tokens, stock_frames, stock_ops, _ = _compiled_decode("gemma3", torch.bfloat16)
    with overlay_on():
        tokens, frames, ops, _ = _compiled_decode("gemma3", torch.bfloat16)
    assert (frames, ops, tokens) == (stock_frames, stock_ops, stock_tokens)


# -- copies ---------------------------------------------------------------------------------------


def _aten_ops_of_one_decode_step(kind, attn, cache_dtype) -> Counter:
    model = tiny_model(kind, attn)
    cache = models.static_cache(model.config, 1, MAX_CACHE_LEN, cache_dtype, "cpu")
    with torch.no_grad():
        token = model(input_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        with counting_aten_ops() as ops:
            model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[4]]), use_cache=True)
    return ops


@pytest.mark.parametrize("attn", ATTNS)
def test_aligned_path_adds_no_copy_when_dtypes_match(attn):
    with stock():
        stock_ops = _aten_ops_of_one_decode_step("qwen3", attn, torch.bfloat16)
    with overlay_on():
        ops = _aten_ops_of_one_decode_step("qwen3", attn, torch.bfloat16)
    assert ops["_to_copy"] == stock_ops["_to_copy"] and ops["copy_"] == stock_ops["copy_"]
    assert ops == stock_ops  # not one aten op more, of any kind (cache patch and guard together)


def test_copy_count_sees_the_casts_of_a_mismatched_cache():
    # The counter is not blind: an fp32 cache costs two casts per layer on write and two on read.
    with overlay_on():
        matched = _aten_ops_of_one_decode_step("qwen3", "sdpa", torch.bfloat16)
        mismatched = _aten_ops_of_one_decode_step("qwen3", "sdpa", torch.float32)
    layers = tiny_model("qwen3", "sdpa").config.num_hidden_layers
    assert mismatched["_to_copy"] - matched["_to_copy"] == 4 * layers


# -- FlashAttention-2 (CUDA only) ------------------------------------------------------------------


def _flash_attention_2_missing() -> str | None:
    """Why flash_attention_2 cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "flash_attention_2 is CUDA-only and this machine has no CUDA device"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "flash_attention_2 needs the flash-attn package, which is not installed"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_flash_attention_2_missing() is not None, reason=str(_flash_attention_2_missing()))
def test_flash_attention_2_with_fp32_prefilled_cache():
    # head_dim 64 (flash-attn's smallest), Llama's own default positions (2048).
    config = models.tiny_config(
        "llama", hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    model = models.tiny_model("llama", torch.bfloat16, "cuda", attn_implementation="flash_attention_2", config=config)
    model.generation_config.eos_token_id = None
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]], device="cuda")

    def prefix(dtype):
        twin = models.tiny_model("llama", torch.float32, "cuda", attn_implementation="flash_attention_2", config=config)
        twin.load_state_dict(model.state_dict())
        cache = models.dynamic_cache(config)
        with torch.no_grad():
            twin(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
        return cache

    def run(cache):
        return model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False,
                              disable_compile=True)[:, -NEW_TOKENS:]

    with stock(), pytest.raises(RuntimeError, match="query and key must have the same dtype"):
        run(prefix(torch.float32))
    with overlay_on():
        tokens = run(prefix(torch.float32))
    with stock():
        assert torch.equal(tokens, run(prefix(torch.bfloat16)))


# -- what overlay.fired() says -----------------------------------------------------------------


def test_fired_counts_one_per_cache_update_that_changed_something():
    # A bfloat16 model with a float32 static cache: every Cache.update call casts (what is stored,
    # and what is handed back), and fired() counts each such call once, as its words say.
    from overlay import report

    model = models.tiny_model("llama", dtype=torch.bfloat16)
    batch = models.left_padded_batch((6, 4))
    cache = models.static_cache(model.config, 2, MAX_CACHE_LEN, torch.float32)
    calls = Counter()

    def counting_update(*args, **kwargs):
        calls["update"] += 1
        return type(cache).update(cache, *args, **kwargs)  # the class's, looked up now: patched

    cache.update = counting_update  # the models call past_key_values.update(...)
    report.reset()
    try:
        with overlay_on():
            models.greedy_ids(model, batch, NEW_TOKENS, **{models.cache_argument_name(model): cache})
        updates = calls["update"]
        assert updates == model.config.num_hidden_layers * NEW_TOKENS  # prefill + decode steps, per layer
        assert report.fired()[PATCH.id] == updates
        actions = report.fired_actions()[PATCH.id]
        assert max(actions.values()) <= updates
        line = next(line for line in report.report_lines(overlay.known_patches()) if PATCH.id in line)
        assert f"{PATCH.id} fired in {updates} call(s)" in line
    finally:
        report.reset()


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_the_patch_never_fails_or_changes_results_where_stock_works',
                    "property test: wherever stock completes, the overlay's results equal stock's")
