"""Patch ``executorch-cache-dtype``: the seq2seq export module's static cache follows the model's dtype.

On a tiny bfloat16 T5, on every release the patch covers (4.55.4 ... 5.24.0): stock fails on the
first decoder step (its cache is hard-coded float32) with the ``index_copy_`` dtype error, or on
4.55, whose cache casts the states to its own dtype on write, with the attention matmul's dtype
error; with the patch the module's logits (and so its greedy token ids) equal a run of the same
decoder with a static cache built in bfloat16 by hand, eagerly and through ``torch.export``.
"""

from __future__ import annotations

import re

import pytest
import torch

import overlay
from overlay.testing.harness import PatchUnderTest
from overlay.testing.models import tiny_model

PATCH = PatchUnderTest("executorch_cache_dtype")
PATCH.skip_module_unless_covered()

from transformers import DynamicCache, EncoderDecoderCache, StaticCache  # noqa: E402
from transformers.cache_utils import StaticLayer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
INDEX_COPY_ERROR = PATCH.error("same dtype")
# 4.55's StaticLayer allocates in __init__ and casts the states to its dtype on write: no
# index_copy_ error there, the float32 keys reach T5's attention matmul instead.
MATMUL_ERROR = PATCH.error("scalar type")
CASTS_ON_WRITE = not hasattr(StaticLayer, "lazy_initialization")  # 4.55's eager StaticLayer
STOCK_ERROR = MATMUL_ERROR if CASTS_ON_WRITE else INDEX_COPY_ERROR
MAX_CACHE_LEN = 8
STEPS = 3


@pytest.fixture(scope="module")
def t5():
    # The release's default attention (5.13's T5 has no sdpa).
    model = tiny_model("t5", torch.bfloat16, attn_implementation=None, vocab_size=64, hidden_size=32, intermediate_size=64)
    with torch.no_grad():
        encoder_states = model.get_encoder()(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).last_hidden_state
    return model, encoder_states


def greedy_steps(step):
    """Run ``STEPS`` greedy decoder steps through ``step(token, position) -> logits``."""
    token, all_logits = torch.tensor([[0]]), []
    with torch.no_grad():
        for position in range(STEPS):
            logits = step(token, position)
            all_logits.append(logits)
            token = logits[:, -1:].argmax(-1)
    return all_logits


def export_module(model):
    from transformers.integrations.executorch import Seq2SeqLMDecoderExportableModuleWithStaticCache

    return Seq2SeqLMDecoderExportableModuleWithStaticCache(model, max_static_cache_length=MAX_CACHE_LEN, batch_size=1)


def token_ids(all_logits):
    return [logits[:, -1].argmax(-1).tolist() for logits in all_logits]


def bf16_static_cache(config):
    """A decoder self-attention ``StaticCache`` allocated in bfloat16, in the release's own API."""
    if CASTS_ON_WRITE:  # 4.55: layers allocate in __init__, no early_initialization
        return StaticCache(config=config, max_batch_size=1, max_cache_len=MAX_CACHE_LEN, device="cpu", dtype=torch.bfloat16)
    self_attention = StaticCache(config=config, max_cache_len=MAX_CACHE_LEN)
    self_attention.early_initialization(1, config.num_heads, config.d_kv, torch.bfloat16, "cpu")
    return self_attention


def bf16_cache_reference(model, encoder_states):
    """The same decoder and lm_head as the export module, with the static cache built in bfloat16 by hand."""
    config = model.config
    self_attention = bf16_static_cache(config)
    cross_attention = DynamicCache() if CASTS_ON_WRITE else DynamicCache(config=config)  # as the module builds it
    cache = EncoderDecoderCache(self_attention, cross_attention)
    decoder = model.get_decoder()
    return greedy_steps(
        lambda token, _: model.lm_head(
            decoder(input_ids=token, encoder_hidden_states=encoder_states, past_key_values=cache, use_cache=True)[0]
        )
    )


def test_stock_module_fails_on_a_bf16_model(t5):
    model, encoder_states = t5
    with overlay.reverted():
        module = export_module(model)
        assert module.static_cache.layers[0].keys.dtype == torch.float32  # the hard-coded dtype
        with pytest.raises(RuntimeError, match=re.escape(STOCK_ERROR)):
            greedy_steps(lambda token, position: module(token, encoder_states, torch.tensor([position])))


def test_patched_module_logits_equal_a_bf16_cache_run(t5):
    model, encoder_states = t5
    reference = bf16_cache_reference(model, encoder_states)
    with PATCH.applied(expect="applied"):
        module = export_module(model)
    layers = module.static_cache.layers
    assert {layer.keys.dtype for layer in layers} | {layer.values.dtype for layer in layers} == {torch.bfloat16}
    # the buffers the exported program will carry are the cache's tensors
    for i, layer in enumerate(layers):
        assert getattr(module, f"key_cache_{i}") is layer.keys and getattr(module, f"value_cache_{i}") is layer.values
    logits = greedy_steps(lambda token, position: module(token, encoder_states, torch.tensor([position])))
    assert all(torch.equal(got, want) for got, want in zip(logits, reference))
    assert logits[0].dtype == torch.bfloat16
    assert len(logits) == STEPS and token_ids(logits) == token_ids(reference)


@pytest.mark.slow  # torch.export(strict=True) of the decoder: ~12 s alone, far more on a busy 2-core box
@pytest.mark.filterwarnings("ignore:While compiling, we found certain side effects:UserWarning")
def test_patched_module_exports_and_the_program_matches(t5):
    model, encoder_states = t5
    reference = bf16_cache_reference(model, encoder_states)
    with PATCH.applied(expect="applied"):
        module = export_module(model)
    with torch.no_grad():
        program = torch.export.export(module, (torch.tensor([[0]]), encoder_states, torch.tensor([0])), strict=True)
    exported = program.module()
    logits = greedy_steps(lambda token, position: exported(token, encoder_states, torch.tensor([position])))
    assert all(torch.equal(got, want) for got, want in zip(logits, reference))
    assert len(logits) == STEPS and token_ids(logits) == token_ids(reference)


def test_float32_model_is_left_exactly_as_stock(t5):
    from unittest import mock

    model, _ = t5
    fp32_model = type(model)(model.config).eval()
    allocations = []
    # Where the release allocates a layer's tensors: lazy_initialization since 4.56, __init__ on 4.55.
    allocator = "lazy_initialization" if hasattr(StaticLayer, "lazy_initialization") else "__init__"
    original = getattr(StaticLayer, allocator)
    allocated = []

    def counting(layer, *args, **kwargs):
        allocations.append(layer)
        result = original(layer, *args, **kwargs)
        allocated.append((layer, layer.keys, layer.values))
        return result

    with mock.patch.object(StaticLayer, allocator, counting):
        with overlay.reverted():
            export_module(fp32_model)
        stock_allocations = len(allocations)
        with PATCH.applied(expect="applied"):
            module = export_module(fp32_model)
    # nothing re-allocated: as many cache allocations as stock, all float32
    assert len(allocations) == 2 * stock_allocations
    assert all(layer.keys.dtype == torch.float32 for layer in module.static_cache.layers)
    # ... and the patched module holds the very tensors its release allocated
    assert stock_allocations > 0
    assert all(layer.keys is keys and layer.values is values for layer, keys, values in allocated[stock_allocations:])
    for i, layer in enumerate(module.static_cache.layers):
        assert getattr(module, f"key_cache_{i}") is layer.keys and getattr(module, f"value_cache_{i}") is layer.values


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_float32_model_is_left_exactly_as_stock',
                    'a float32 model is exactly stock; a bfloat16 one raised on stock')
