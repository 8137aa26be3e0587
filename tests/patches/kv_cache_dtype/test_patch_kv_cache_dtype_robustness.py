"""Patch ``kv-cache-dtype`` used as users do, around the scenarios of ``test_patch_kv_cache_dtype.py``.

Each test runs stock transformers (``overlay.reverted()``) as the control and the patch on the same
tiny random models:

- plain ``torch.autocast`` with generate's default dynamic cache (5.13.0-5.23.x allocate values in
  the keys' float32): stock generates; the overlay must too, in ``align`` and ``strict``, with
  the same tokens and no warning about a cache the user never built;
- a float32 model continuing a bfloat16 prefix: stock promotes the dynamic cache and keeps float32;
  the overlay must not round the model's own states (bit-identical logits), and a kept bfloat16
  *static* cache (which cannot change dtype) must be reported as a precision loss;
- a float32-prefilled ``EncoderDecoderCache`` decoded in bfloat16: the cross-attention cache is
  read directly by the models, stock fails (inline attention: MVP; T5 too with only this patch);
  the overlay must give the tokens of the all-bfloat16 reference;
- the hot path: when dtypes agree, ``Cache.update`` with the overlay runs exactly as many Python
  frames as stock (no wrapper frame); on 4.55.x one fewer: the replacement does the
  processor checks of stock's ``@apply_processors`` wrapper in its own frame.
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
import warnings
from collections import Counter

import pytest
import torch

import overlay
from overlay import guard
from overlay.testing import models
from overlay.testing.harness import PatchUnderTest, counting_aten_ops
from tests._kit import count_calls

PATCH = PatchUnderTest("kv_cache_dtype")
PATCH.skip_module_unless_covered()

from transformers import cache_utils  # noqa: E402
from transformers import (  # noqa: E402  (after the version gate)
    Cache,
    DynamicCache,
    EncoderDecoderCache,
    MvpConfig,
    MvpForConditionalGeneration,
)

# 4.55.x: StaticLayer.update casts the states to its buffers' dtype before writing (the variant's
# ``casts_on_write``): stock stores a mismatch and attention then fails on what the cache hands back.
_VARIANT = PATCH.patch.targets[0].variant_of(PATCH.stock())
STATIC_LAYERS_CAST_ON_WRITE = _VARIANT is not None and bool(_VARIANT["casts_on_write"])
# 4.56.0-5.3.0: StaticLayer.update refuses states in another dtype itself (REFUSING_STATIC_UPDATES):
# the fast path calls it without reading dtypes. None elsewhere (4.55.x casts on write; 5.4.0 on
# advance cumulative_length before writing).
REFUSING_STATIC_LAYER = (
    PATCH.patch_module._layer_refusing_other_dtypes(vars(cache_utils))
    if _VARIANT is not None and _VARIANT["fast_path"] is PATCH.patch_module._replace_named_cache_kwargs_update
    else None
)

# The patch's own error texts; index_copy_'s and SDPA's without their dtypes (both directions occur here).
INDEX_COPY_ERROR = PATCH.error("index_copy_").split(", but got")[0]
SDPA_ERROR = PATCH.error("Expected query, key").split(", but got")[0]
EAGER_ERROR = PATCH.error("expected scalar type BFloat16")
# A kept bfloat16 static cache with a float32 (sdpa) model: index_copy_ refuses the write, or (4.55.x) SDPA the read.
STATIC_WRITE_ERROR = SDPA_ERROR if STATIC_LAYERS_CAST_ON_WRITE else INDEX_COPY_ERROR
NEW_TOKENS = 5
# 4.55.0-5.3.0: Cache.update(key_states, value_states, layer_idx, cache_kwargs); later releases take none.
TAKES_CACHE_KWARGS = "cache_kwargs" in inspect.signature(Cache.update).parameters

# 4.56.0-5.23.x: DynamicLayer.lazy_initialization allocates values in the keys' dtype (4.55.x has no lazy
# initialisation: its DynamicLayer stores the first states as they come).
DYNAMIC_VALUES_IN_KEY_DTYPE = type(PATCH.transformers)("4.56.0") <= PATCH.transformers < type(PATCH.transformers)("5.24.0")

# Expected casts are asserted where they matter (warnings recorded); keep the rest out of the summary.
pytestmark = [
    pytest.mark.filterwarnings("ignore::overlay.guard.KVCacheDtypeWarning"),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.fixture(autouse=True)
def _fresh_warnings_and_mode():
    guard.reset_warnings()
    with guard.using_mode("align"):
        yield


patch_on = PATCH.applied
stock = overlay.reverted


def cache_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, guard.KVCacheDtypeWarning)]


# -- decoder-only models ---------------------------------------------------------------------

_MODELS: dict = {}


def tiny_lm(kind: str, attn: str, dtype: torch.dtype):
    key = (kind, attn, dtype)
    if key not in _MODELS:
        model = models.tiny_model(
            kind, dtype, attn_implementation=attn, hidden_size=32, intermediate_size=64, max_position_embeddings=64
        )
        model.generation_config.eos_token_id = None
        _MODELS[key] = model
    return _MODELS[key]


INPUT_IDS, ATTENTION_MASK = models.hand_padded_batch()


def generate(model, **kwargs):
    return models.tokens_and_logits(model, INPUT_IDS, ATTENTION_MASK, NEW_TOKENS, **kwargs)


def prefix_cache(kind: str, attn: str, dtype: torch.dtype) -> DynamicCache:
    """A prompt prefix computed once by the ``dtype`` twin of the model."""
    model = tiny_lm(kind, attn, dtype)
    cache = models.dynamic_cache(model.config)
    with torch.no_grad():
        model(input_ids=INPUT_IDS[:, :-1], attention_mask=ATTENTION_MASK[:, :-1], past_key_values=cache, use_cache=True)
    return cache


# -- plain autocast, generate's default cache ----------------------------------------------


@pytest.mark.parametrize("mode", ["align", "check"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_plain_autocast_with_the_default_cache_generates_as_stock(kind, attn, mode):
    model = tiny_lm(kind, attn, torch.float32)
    with stock(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref_tokens, ref_logits = generate(model)
    with patch_on(), guard.using_mode(mode), torch.autocast("cpu", dtype=torch.bfloat16):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokens, logits = generate(model)
    assert cache_warnings(caught) == []  # no "Build the cache in torch.bfloat16" about a cache nobody built
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)


def test_the_autocast_premise_values_are_promoted_on_stock():
    # Why 15.3 happens on 5.13.0-5.23.x: the default cache stores values in float32 under autocast.
    model = tiny_lm("llama", "sdpa", torch.float32)
    cache = models.dynamic_cache(model.config)
    with stock(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, past_key_values=cache, use_cache=True)
    expected = torch.float32 if DYNAMIC_VALUES_IN_KEY_DTYPE else torch.bfloat16
    assert {layer.values.dtype for layer in cache.layers} == {expected}


# -- precision ----------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_float32_model_continuing_a_bfloat16_prefix_keeps_stock_precision(kind, attn):
    model = tiny_lm(kind, attn, torch.float32)
    with stock():
        ref_cache = prefix_cache(kind, attn, torch.bfloat16)
        ref_tokens, ref_logits = generate(model, past_key_values=ref_cache)
    with patch_on(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = prefix_cache(kind, attn, torch.bfloat16)
        tokens, logits = generate(model, past_key_values=cache)
    # Stock promotes the cache to float32 and keeps the model's own states exact; so does the overlay.
    assert {layer.keys.dtype for layer in cache.layers} == {torch.float32} == {layer.keys.dtype for layer in ref_cache.layers}
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)  # bit for bit: nothing was rounded to bfloat16
    assert cache_warnings(caught) == []


def _static_cache(model, dtype, max_cache_len=16):
    return models.static_cache(model.config, INPUT_IDS.shape[0], max_cache_len, dtype, "cpu")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_kept_bfloat16_static_cache_with_a_float32_model_says_precision_is_lost(kind):
    model = tiny_lm(kind, "sdpa", torch.float32)
    with stock():
        with pytest.raises(RuntimeError, match=re.escape(STATIC_WRITE_ERROR)):
            generate(model, past_key_values=_static_cache(model, torch.bfloat16))
        ref_tokens, ref_logits = generate(model, past_key_values=_static_cache(model, torch.float32))
    with patch_on(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, logits = generate(model, past_key_values=_static_cache(model, torch.bfloat16))
    messages = cache_warnings(caught)
    rounding = [m for m in messages if "PRECISION IS LOST" in m]
    assert len(rounding) == 2, messages  # keys and values, once each
    assert "KV cache layer 0 (StaticLayer) stores keys in torch.bfloat16 but the model writes key states in torch.float32" in rounding[0]
    assert "Build the cache in torch.float32 to keep full precision" in rounding[0]
    # The static buffers kept their dtype (compiled graphs and exported programs hold them) ...
    assert torch.equal(tokens, ref_tokens)
    # ... so the logits are those of bfloat16-rounded keys/values, close to but not the float32 run.
    assert not torch.equal(logits, ref_logits)
    torch.testing.assert_close(logits, ref_logits, atol=5e-3, rtol=5e-2)
    with patch_on(), guard.using_mode("check"), pytest.raises(guard.CacheDtypeError, match="stores keys in torch.bfloat16"):
        generate(model, past_key_values=_static_cache(model, torch.bfloat16))


# -- cross-attention caches ----------------------------------------------------------------

SOURCE_IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
DECODER_IDS = torch.tensor([[3, 20, 21, 22], [3, 23, 24, 25]])
_SEQ2SEQ: dict = {}


def tiny_seq2seq(kind: str, dtype: torch.dtype):
    key = (kind, dtype)
    if key not in _SEQ2SEQ:
        torch.manual_seed(0)
        if kind == "t5":
            model = models.tiny_model(
                "t5", dtype, attn_implementation="eager", hidden_size=32, intermediate_size=64, eos_token_id=1
            )
            model.generation_config.eos_token_id = None
            _SEQ2SEQ[key] = model
            return model
        else:  # MVP: Bart-like, attention written inline (torch.bmm) in every 5.x release
            try:
                config = MvpConfig(
                    vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                    pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                )
            except Exception as error:  # noqa: BLE001 - e.g. 5.4.0's MvpConfig under a newer huggingface_hub
                pytest.skip(f"MvpConfig cannot be built on transformers {PATCH.transformers} here: {type(error).__name__}: {error}")
            cls = MvpForConditionalGeneration
        config._attn_implementation = "eager"
        model = cls(config).eval().to(dtype)
        model.generation_config.eos_token_id = None
        _SEQ2SEQ[key] = model
    return _SEQ2SEQ[key]


def float32_encoder_decoder_prefix(kind: str, cast_to: torch.dtype | None = None, by_name: bool = False) -> EncoderDecoderCache:
    """Encoder run and decoder prompt computed once by the float32 twin (self- and cross-attention filled).
    ``by_name``: the cache built as ``EncoderDecoderCache(self_attention_cache=..., cross_attention_cache=...)``
    (4.55.x only: later releases take ``*caches``)."""
    if by_name:
        cache = EncoderDecoderCache(self_attention_cache=DynamicCache(), cross_attention_cache=DynamicCache())
    else:
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        tiny_seq2seq(kind, torch.float32)(
            input_ids=SOURCE_IDS, decoder_input_ids=DECODER_IDS[:, :-1], past_key_values=cache, use_cache=True
        )
    if cast_to is not None:
        for part in (cache.self_attention_cache, cache.cross_attention_cache):
            for layer in part.layers:
                layer.keys, layer.values = layer.keys.to(cast_to), layer.values.to(cast_to)
    return cache


def generate_seq2seq(model, cache):
    out = model.generate(
        input_ids=SOURCE_IDS, decoder_input_ids=DECODER_IDS, past_key_values=cache, max_new_tokens=NEW_TOKENS,
        do_sample=False, disable_compile=True, return_dict_in_generate=True, output_logits=True,
    )
    return out.sequences[:, -NEW_TOKENS:], torch.stack(out.logits)


@pytest.mark.parametrize("kind", ["t5", "mvp"])
def test_float32_prefilled_encoder_decoder_cache_with_a_bfloat16_decoder(kind):
    model = tiny_seq2seq(kind, torch.bfloat16)
    with stock():
        with pytest.raises(RuntimeError, match=re.escape(EAGER_ERROR)):
            generate_seq2seq(model, float32_encoder_decoder_prefix(kind))
        ref_tokens, ref_logits = generate_seq2seq(model, float32_encoder_decoder_prefix(kind, cast_to=torch.bfloat16))
    with patch_on(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = float32_encoder_decoder_prefix(kind)
        tokens, logits = generate_seq2seq(model, cache)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)  # attention saw exactly the bfloat16-cast prefix
    # The cross-attention cache was converted once, in place; the self-attention cache keeps float32.
    assert {layer.keys.dtype for layer in cache.cross_attention_cache.layers} == {torch.bfloat16}
    assert {layer.keys.dtype for layer in cache.self_attention_cache.layers} == {torch.float32}
    assert any("cross-attention cache layer 0" in m and "converted it once, in place" in m for m in cache_warnings(caught))


def test_deep_copied_encoder_decoder_prefix_is_aligned_too():
    # Prefix reuse as documented upstream: copy.deepcopy(prompt_cache) for every continuation.
    model = tiny_seq2seq("mvp", torch.bfloat16)
    with stock():
        ref_tokens, _ = generate_seq2seq(model, float32_encoder_decoder_prefix("mvp", cast_to=torch.bfloat16))
    with patch_on():
        prompt_cache = float32_encoder_decoder_prefix("mvp")
        first, _ = generate_seq2seq(model, copy.deepcopy(prompt_cache))
        second, _ = generate_seq2seq(model, copy.deepcopy(prompt_cache))
    assert torch.equal(first, ref_tokens) and torch.equal(second, ref_tokens)
    # The prompt cache itself was left in float32: only the copies were aligned.
    assert {layer.keys.dtype for layer in prompt_cache.cross_attention_cache.layers} == {torch.float32}


def test_strict_mode_names_the_cross_attention_cache():
    model = tiny_seq2seq("mvp", torch.bfloat16)
    with patch_on(), guard.using_mode("check"):
        with pytest.raises(guard.CacheDtypeError, match=r"cross-attention cache layer 0 \(DynamicLayer\) stores keys in torch.float32"):
            generate_seq2seq(model, float32_encoder_decoder_prefix("mvp"))


def test_encoder_decoder_cache_takes_the_arguments_stock_takes():
    # 4.55.x names its two caches (its own from_legacy_cache passes them by name); 4.56.0 on take
    # *caches and refuse names. The replacement takes exactly what stock takes, and a cache built by
    # name is aligned like one built by position.
    def by_name():
        try:
            EncoderDecoderCache(self_attention_cache=DynamicCache(), cross_attention_cache=DynamicCache())
        except TypeError as error:
            return f"TypeError: {error}"
        return "built"

    with stock():
        expected = by_name()
    with patch_on():
        assert by_name() == expected
    if expected != "built":
        return
    model = tiny_seq2seq("mvp", torch.bfloat16)
    with stock():
        ref_tokens, ref_logits = generate_seq2seq(model, float32_encoder_decoder_prefix("mvp", cast_to=torch.bfloat16))
    with patch_on():
        cache = float32_encoder_decoder_prefix("mvp", by_name=True)
        tokens, logits = generate_seq2seq(model, cache)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)
    assert {layer.keys.dtype for layer in cache.cross_attention_cache.layers} == {torch.bfloat16}


# -- 4.55.x: cache processors -------------------------------------------------------------------------

CACHE_PROCESSORS = hasattr(cache_utils, "CacheProcessor")
NO_PROCESSORS = (
    f"transformers {PATCH.transformers} has no cache processors: CacheProcessor hooks around Cache.update "
    "(@apply_processors) exist in 4.55.x only (4.56.0 replaced them with an offloading flag and quantized layers)"
)


def processor_cache() -> DynamicCache:
    """A ``DynamicCache`` with a user's ``CacheProcessor`` that logs every hook stock runs around a layer update."""

    class Recording(cache_utils.CacheProcessor):
        def __init__(self, cache, **kwargs):
            self.log = []

        def pre_update(self, cache, key_states, value_states, layer_idx, cache_kwargs=None):
            self.log.append(("pre", layer_idx, key_states.shape[-2], key_states.dtype))
            return key_states, value_states

        def post_update(self, cache, key_tensors, value_tensors, layer_idx, cache_kwargs=None):
            self.log.append(("post", layer_idx, key_tensors.shape[-2]))
            return key_tensors, value_tensors

    return DynamicCache(cache_processor=Recording)


@pytest.mark.skipif(not CACHE_PROCESSORS, reason=NO_PROCESSORS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cache_processor_hooks_run_as_on_stock_when_dtypes_agree(attn):
    # The fast path takes a cache only without a processor: with one, every hook runs as on stock.
    model = tiny_lm("qwen3", attn, torch.bfloat16)

    def run():
        cache = processor_cache()
        tokens, logits = generate(model, past_key_values=cache)
        return tokens, logits, cache.cache_processor.log

    with stock():
        ref_tokens, ref_logits, ref_log = run()
    with patch_on():
        tokens, logits, log = run()
    assert len(ref_log) == 2 * model.config.num_hidden_layers * NEW_TOKENS  # pre and post, every layer, every step
    assert log == ref_log
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)


@pytest.mark.skipif(not CACHE_PROCESSORS, reason=NO_PROCESSORS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_float32_prefix_in_a_cache_with_a_processor_then_bfloat16_decoding(attn):
    model = tiny_lm("qwen3", attn, torch.bfloat16)
    expected_error = {"sdpa": PATCH.error("Expected query, key"), "eager": EAGER_ERROR}[attn]

    def prefixed(cast_to=None):
        cache = processor_cache()
        with torch.no_grad():
            tiny_lm("qwen3", attn, torch.float32)(
                input_ids=INPUT_IDS[:, :-1], attention_mask=ATTENTION_MASK[:, :-1], past_key_values=cache, use_cache=True
            )
        if cast_to is not None:
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.to(cast_to), layer.values.to(cast_to)
        cache.cache_processor.log.clear()  # the hooks of decoding only
        return cache

    with stock():
        with pytest.raises(RuntimeError, match=re.escape(expected_error)):
            generate(model, past_key_values=prefixed())
        ref_cache = prefixed(cast_to=torch.bfloat16)
        ref_tokens, ref_logits = generate(model, past_key_values=ref_cache)
    with patch_on():
        cache = prefixed()
        tokens, logits = generate(model, past_key_values=cache)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)
    assert cache.cache_processor.log == ref_cache.cache_processor.log  # every hook ran, with the same states


# -- the hot path ---------------------------------------------------------------------------


def _python_calls(call) -> Counter:
    """The Python frames ``call()`` runs, by qualified name (C functions not counted)."""
    count = Counter()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            count[getattr(code, "co_qualname", code.co_name)] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_hot_path_runs_no_extra_python_frame(cache_kind):
    config = tiny_lm("llama", "sdpa", torch.bfloat16).config
    k_prefix = torch.randn(1, 2, 32, 8, dtype=torch.bfloat16)
    v_prefix = torch.randn(1, 2, 32, 8, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, 1, 8, dtype=torch.bfloat16), torch.randn(1, 2, 1, 8, dtype=torch.bfloat16)

    def decode_step_calls() -> tuple[Counter, torch.Tensor]:
        if cache_kind == "static":
            cache = models.static_cache(config, 1, 40, torch.bfloat16, "cpu")
        else:
            cache = models.dynamic_cache(config)
        # As the models call it: up to 5.3.0 with ``cache_kwargs`` holding the write positions (4.55.x's
        # StaticLayer needs them: without, it copies the states over its whole buffer).
        def positions(start, length):
            return ({"cache_position": torch.arange(start, start + length)},) if TAKES_CACHE_KWARGS else ()

        cache.update(k_prefix, v_prefix, 0, *positions(0, 32))
        calls = _python_calls(lambda: cache.update(k, v, 0, *positions(32, 1)))
        return calls, cache.update(k, v, 0, *positions(33, 1))[0]

    with stock():
        stock_calls, stock_keys = decode_step_calls()
    with patch_on():
        calls, keys = decode_step_calls()
    # 4.55.x: stock's Cache.update is the wrapper @apply_processors puts around it (its processor checks,
    # then the decorated update); the replacement is one function: exactly that frame fewer. None elsewhere.
    wrapper = stock_calls["apply_processors.<locals>._wrapped_update"]
    assert wrapper == (1 if _VARIANT["fast_path"] is PATCH.patch_module._replace_processed_cache_update else 0), stock_calls
    # 4.56.0-5.3.0, a StaticLayer: no dtype is read, the layer's own write refuses another one; the
    # price is one leaf call, torch.compiler.is_dynamo_compiling() (a refusal cannot be caught in a
    # graph), ~150 instructions against the four .dtype reads' ~1,700. No other frame, no wrapper.
    leaf = 1 if cache_kind == "static" and REFUSING_STATIC_LAYER is not None else 0
    assert calls["is_dynamo_compiling"] == leaf, calls
    assert sum(calls.values()) == sum(stock_calls.values()) - wrapper + leaf, (calls, stock_calls)
    assert torch.equal(keys, stock_keys)


class _DtypeReadCounter(torch.Tensor):
    """A tensor that counts the Python-level ``.dtype`` reads made on it (torch routes a
    subclass's attribute getters through ``__torch_function__``)."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func == torch.Tensor.dtype.__get__:
            cls.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("values_dtype", [torch.bfloat16, torch.float32], ids=["values-like-keys", "values-other"])
def test_a_dynamic_layers_fast_path_reads_three_dtypes_when_values_are_cached_like_keys(values_dtype):
    # The fast-path test of a DynamicLayer reads the incoming keys', the cached keys' and the cached
    # values' dtypes; the incoming values' only when the cached values are in another dtype than the
    # incoming keys (four reads). Stock's own update reads none.
    def states(dtype):
        return torch.randn(1, 2, 3, 8, dtype=dtype).as_subclass(_DtypeReadCounter)

    def reads_of_one_update():
        cache = models.dynamic_cache(tiny_lm("llama", "sdpa", torch.bfloat16).config)
        positions = ({"cache_position": torch.arange(3)},) if TAKES_CACHE_KWARGS else ()
        cache.update(states(torch.bfloat16), states(values_dtype), 0, *positions)
        keys, values = states(torch.bfloat16), states(values_dtype)
        _DtypeReadCounter.reads = 0
        result = cache.update(keys, values, 0, *positions)
        return _DtypeReadCounter.reads, [t.dtype for t in result]

    with stock():
        stock_reads, stock_dtypes = reads_of_one_update()
    with patch_on():
        reads, dtypes = reads_of_one_update()
    assert stock_reads == 0
    assert dtypes == stock_dtypes  # what is handed back is stock's in both cases (nothing to align)
    # 4.56.0-5.3.0 allocate a new layer's values in the keys' dtype: float32 values promote them
    # (cached float32, incoming float32: the fourth read); 4.55.x and 5.4.0 on in the values' own.
    assert reads == (3 if values_dtype is torch.bfloat16 else 4)


def _slow_updates(run) -> int:
    """How many updates went to the patch's slow path while ``run()`` ran."""
    slow_path = PATCH.patch_module._slow_update.__code__
    return count_calls(lambda code: "slow" if code is slow_path else None, run).get("slow", 0)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_call_whose_dtypes_agree_takes_no_slow_path_at_prefill(kind, cache_implementation, dtype):
    # Issue 39: a fresh layer's first update (keys None, once per layer and call) went to the slow
    # path, about 29,000 (dynamic) and 41,000 (static) instructions over stock per layer. It now
    # calls the layer directly where the slow path would change nothing; what generate() returns
    # is stock's, bit for bit. Gemma 3 alternates sliding and full layers (the sliding layer
    # classes of both caches).
    model = tiny_lm(kind, "sdpa", dtype)

    def run():
        return generate(model, cache_implementation=cache_implementation)

    with stock():
        stock_tokens, stock_logits = run()
    outputs = []
    with patch_on():
        run()  # builds what the first call builds (kernel wrappers)
        slow_updates = _slow_updates(lambda: outputs.append(run()))
    (tokens, logits), = outputs
    assert torch.equal(tokens, stock_tokens) and torch.equal(logits, stock_logits)
    fast_path = _VARIANT["fast_path"]
    module = PATCH.patch_module
    layers = model.config.num_hidden_layers
    if fast_path is module._replace_any_cache_kwargs_update:  # 5.4.0 on: no slow path at all
        expected = 0
    elif fast_path is module._replace_processed_cache_update:
        # 4.55.x, unchanged: a dynamic layer's first update (no lazy initialisation: it stores the
        # first states as they come); a static layer's buffers are allocated by the constructor.
        expected = layers if cache_implementation == "dynamic" else 0
    else:  # 4.56.0 - 5.3.0: dynamic layers skip it; a refusing StaticLayer's first update records its check
        expected = layers if cache_implementation == "static" else 0
    assert slow_updates == expected


def test_a_fresh_layer_whose_states_differ_still_takes_the_slow_path():
    # The shortcut compares after the layer's own initialisation: a static layer whose buffers do not
    # come out in the states' dtypes (values in another dtype than the keys, up to 5.23.x) is the
    # slow path's, which casts the write (stock refuses it); a dynamic layer of a cache holding a
    # cross-attention cache to align keeps it too (covered by the encoder-decoder tests above).
    if _VARIANT["fast_path"] is not PATCH.patch_module._replace_any_cache_kwargs_update:
        pytest.skip("the shortcut for static layers exists from 5.4.0 (this release's variant has none)")
    config = tiny_lm("llama", "sdpa", torch.bfloat16).config
    keys = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
    values = torch.randn(1, 2, 3, 8, dtype=torch.float32)
    with patch_on():
        cache = models.user_static_cache(config, 1, 8, torch.bfloat16)
        slow_updates = _slow_updates(lambda: cache.update(keys, values, 0))
        stored = cache.layers[0].keys.dtype, cache.layers[0].values.dtype
    # 5.24.0 on allocate each buffer in its states' dtype (nothing to change: the layer directly);
    # before, both in the keys' dtype, so the float32 values are the slow path's.
    if stored == (torch.bfloat16, torch.float32):
        assert slow_updates == 0
    else:
        assert stored == (torch.bfloat16, torch.bfloat16) and slow_updates == 1, stored


def test_an_error_in_the_layers_update_is_raised_once_as_on_stock():
    # The fast path's checks are guarded against odd objects; the layer's own update must not be:
    # an AttributeError/TypeError raised inside it reaches the caller, and the update ran once.
    from transformers.cache_utils import DynamicLayer

    class FailingLayer(DynamicLayer):
        calls = 0

        def update(self, key_states, value_states, *args, **kwargs):
            FailingLayer.calls += 1
            if FailingLayer.calls > 1:
                raise AttributeError("boom from the layer")
            return super().update(key_states, value_states, *args, **kwargs)

    k = torch.randn(1, 2, 3, 8)

    def run():
        FailingLayer.calls = 0
        cache = models.cache_of_layers([FailingLayer()])
        cache.update(k, k, 0)
        with pytest.raises(AttributeError, match="boom from the layer"):
            cache.update(k, k, 0)
        return FailingLayer.calls

    with stock():
        assert run() == 2
    with patch_on():
        assert run() == 2


# -- 4.56.0-5.3.0: a StaticLayer's own write is the dtype check ----------------------------------------

needs_refusing_layer = pytest.mark.skipif(
    REFUSING_STATIC_LAYER is None, reason="StaticLayer.update is compared dtype by dtype on this release"
)


def _index_copies(call):
    """(what ``call()`` returns, how many ``index_copy_`` it dispatched, refused ones included)."""
    with counting_aten_ops() as ops:
        result = call()
    return result, ops["index_copy_"]


def _static_update(cache, states, position):
    return cache.update(states, states, 0, {"cache_position": torch.tensor([position])})


def test_the_static_layers_own_write_check_is_recognised_exactly_on_4_56_to_5_3():
    # The fingerprints (REFUSING_STATIC_UPDATES) cover every release of 4.56.0-5.3.0 and no other:
    # 4.55.x's layer casts on write, and from 5.4.0 cumulative_length advances before the writes.
    version = type(PATCH.transformers)
    expected = cache_utils.StaticLayer if version("4.56.0") <= PATCH.transformers < version("5.4.0") else None
    assert PATCH.patch_module._layer_refusing_other_dtypes(vars(cache_utils)) is expected
    assert REFUSING_STATIC_LAYER is expected


def _own_write_check(layer):
    return layer.__dict__.get(PATCH.patch_module.OWN_WRITE_CHECK)


@needs_refusing_layer
def test_a_mismatched_static_layer_goes_to_the_slow_path_without_a_refusal_per_step():
    config = tiny_lm("llama", "sdpa", torch.bfloat16).config
    states = [torch.randn(1, 2, 1, 8, dtype=torch.bfloat16) for _ in range(3)]
    with patch_on(), warnings.catch_warnings():
        warnings.simplefilter("ignore", guard.KVCacheDtypeWarning)
        cache = models.static_cache(config, 1, 8, torch.float32, "cpu")  # early-initialised in float32
        layer = cache.layers[0]
        assert type(layer) is REFUSING_STATIC_LAYER and _own_write_check(layer) is None
        counts = []
        for position, step in enumerate(states):
            (keys, values), copies = _index_copies(lambda: _static_update(cache, step, position))
            counts.append(copies)
        # The first update takes the slow path (it does for every layer) and notes the float32
        # buffers; every later one goes there directly: two writes, cast to float32, no refusal.
        assert counts == [2, 2, 2]
        assert _own_write_check(layer) is False
    assert keys.dtype is values.dtype is torch.bfloat16  # handed back in the compute dtype
    assert torch.equal(keys[:, :, :3], torch.cat(states, dim=-2))  # bfloat16 -> float32 -> bfloat16 is exact
    assert layer.keys.dtype is torch.float32  # the buffers kept their dtype (and address)


@needs_refusing_layer
def test_a_refusal_after_the_models_dtype_changed_goes_to_the_slow_path_once_then_straight_there():
    # A bfloat16 cache kept while the model moves to float32: the layer's own write refuses once.
    config = tiny_lm("llama", "sdpa", torch.bfloat16).config
    bf16 = torch.randn(1, 2, 1, 8, dtype=torch.bfloat16)
    fp32 = [torch.randn(1, 2, 1, 8, dtype=torch.float32) for _ in range(2)]
    with patch_on(), warnings.catch_warnings():
        warnings.simplefilter("ignore", guard.KVCacheDtypeWarning)
        cache = models.static_cache(config, 1, 8, torch.bfloat16, "cpu")
        layer = cache.layers[0]
        counts = [_index_copies(lambda: _static_update(cache, bf16, 0))[1]]
        assert _own_write_check(layer) is True  # buffers in the states' dtype: the layer's write checks
        counts.append(_index_copies(lambda: _static_update(cache, bf16, 1))[1])
        (keys, _), copies = _index_copies(lambda: _static_update(cache, fp32[0], 2))
        counts.append(copies)
        assert _own_write_check(layer) is False
        (keys, _), copies = _index_copies(lambda: _static_update(cache, fp32[1], 3))
        counts.append(copies)
    # slow path, the layer's own write, a refused keys write then the slow path's two, the slow path
    assert counts == [2, 2, 3, 2]
    assert keys.dtype is torch.float32  # handed back in the compute dtype (rounded through bfloat16)
    assert torch.equal(keys[:, :, 2:4], torch.cat(fp32, dim=-2).to(torch.bfloat16).float())


@needs_refusing_layer
def test_a_matching_static_layer_is_written_as_on_stock():
    config = tiny_lm("llama", "sdpa", torch.bfloat16).config
    states = [torch.randn(1, 2, 1, 8, dtype=torch.bfloat16) for _ in range(3)]

    def run():
        cache = models.static_cache(config, 1, 8, torch.bfloat16, "cpu")
        copies = [_index_copies(lambda: _static_update(cache, step, position))[1] for position, step in enumerate(states)]
        return cache.layers[0].keys.clone(), copies, cache.layers[0]

    with stock():
        stock_keys, stock_copies, _ = run()
    with patch_on():
        keys, copies, layer = run()
    assert copies == stock_copies == [2, 2, 2]
    assert _own_write_check(layer) is True
    assert torch.equal(keys, stock_keys)


@needs_refusing_layer
def test_a_static_layers_own_runtime_error_is_raised_once_unchanged():
    # States the layer refuses for another reason than their dtype (the head dim): its own error,
    # raised once, as on stock, from a layer whose own write stands for the dtype check.
    config = tiny_lm("llama", "sdpa", torch.bfloat16).config
    wrong = torch.randn(1, 2, 1, 5, dtype=torch.bfloat16)

    def run():
        cache = models.static_cache(config, 1, 8, torch.bfloat16, "cpu")
        _static_update(cache, torch.randn(1, 2, 1, 8, dtype=torch.bfloat16), 0)

        def update():
            with pytest.raises(RuntimeError) as raised:
                _static_update(cache, wrong, 0)
            return raised

        raised, copies = _index_copies(update)
        return str(raised.value), raised.traceback[-1].frame.code.name, copies, cache.layers[0]

    with stock():
        stock_error, stock_origin, stock_copies, _ = run()
    with patch_on():
        error, origin, copies, layer = run()
    assert (error, origin) == (stock_error, stock_origin) and "index_copy_" in error
    assert copies == stock_copies == 1  # the layer's update ran once, as on stock
    assert _own_write_check(layer) is True  # still: the error was not about dtypes


@needs_refusing_layer
@pytest.mark.parametrize("mode", ["check", "off"])
def test_a_refused_static_write_in_strict_and_off_ends_as_without_the_own_write_check(mode):
    # A layer whose own write checks (bfloat16 buffers, bfloat16 states seen), then float32 states.
    config = tiny_lm("llama", "sdpa", torch.bfloat16).config
    with patch_on(), guard.using_mode(mode):
        cache = models.static_cache(config, 1, 8, torch.bfloat16, "cpu")
        _static_update(cache, torch.randn(1, 2, 1, 8, dtype=torch.bfloat16), 0)
        assert _own_write_check(cache.layers[0]) is True
        expected = guard.CacheDtypeError if mode == "check" else RuntimeError
        match = r"layer 0 \(StaticLayer\) stores keys in torch.bfloat16" if mode == "check" else re.escape(INDEX_COPY_ERROR)
        with pytest.raises(expected, match=match):
            _static_update(cache, torch.randn(1, 2, 1, 8, dtype=torch.float32), 1)
    assert not cache.layers[0].keys[:, :, 1].any()  # the refused keys were never written


@needs_refusing_layer
def test_compiled_from_the_first_call_with_a_float32_static_cache():
    # No eager call first: under dynamo a refused write cannot be caught in the graph, so the dtypes
    # are compared there (decided at trace time), and the compiled forward generates the reference.
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    model = tiny_lm("llama", "sdpa", torch.bfloat16)
    prompt = torch.tensor([[5, 6, 7, 8]])

    def greedy(forward, cache_dtype):
        cache = models.static_cache(model.config, 1, 16, cache_dtype, "cpu")
        tokens, ids = [], prompt
        for step in range(3):
            start = prompt.shape[1] - ids.shape[1] + step if step else 0
            positions = torch.arange(start, start + ids.shape[1])
            with torch.no_grad():
                logits = forward(ids, positions[None], cache, positions)
            ids = logits[:, -1:].argmax(-1)
            tokens.append(ids.item())
        return tokens

    def forward(ids, position_ids, cache, cache_position):
        positions = {"cache_position": cache_position} if TAKES_CACHE_KWARGS else {}
        return model(input_ids=ids, position_ids=position_ids, past_key_values=cache, use_cache=True, **positions).logits

    with stock():
        reference = greedy(forward, torch.bfloat16)
    torch._dynamo.reset()
    counter = CompileCounter()
    with patch_on(), warnings.catch_warnings():
        warnings.simplefilter("ignore", guard.KVCacheDtypeWarning)
        tokens = greedy(torch.compile(forward, backend=counter, fullgraph=True), torch.float32)
    torch._dynamo.reset()
    assert counter.frame_count >= 1
    assert tokens == reference


def test_lazily_appended_layers_are_built_as_on_stock():
    # DynamicCache() without a config appends its layers inside Cache.update, one per new layer_idx.
    model = tiny_lm("qwen3", "eager", torch.float32)

    def run():
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, past_key_values=cache, use_cache=True)
        return [(type(layer).__name__, layer.keys.dtype, tuple(layer.keys.shape)) for layer in cache.layers], cache

    with stock():
        ref, _ = run()
    with patch_on():
        got, cache = run()
    assert got == ref and len(got) == model.config.num_hidden_layers
