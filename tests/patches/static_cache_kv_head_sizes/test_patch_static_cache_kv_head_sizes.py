"""static-cache-kv-head-sizes: a static cache stores keys and values in their own head sizes
(DeepSeek-V2/V3: keys ``qk_nope_head_dim + qk_rope_head_dim``, values ``v_head_dim``).

Reproduced for real on the CPU, in this process: tiny random DeepSeek-V3 (sdpa and eager) and
DeepSeek-V2 (sdpa) with keys of 16 + 8 = 24 and values of 12 per head, a prompt of 9 and a
left-padded batch of two, greedy, 5 new tokens, with ``generate(cache_implementation="static")`` and
with a ``StaticCache`` the user builds from the config and passes as ``past_key_values``. The
reference is the same prompt with the default dynamic cache, on stock (and ``use_cache=False`` gives
the same ids).

On the affected releases (4.55.0 - 5.0.0rc1) stock raises ``RuntimeError: index_copy_():
Source/destination tensor must have same slice shapes`` from ``StaticLayer.update`` (4.55.x: the keys,
allocated from ``config.head_dim``, the rope part only; 4.56.0 on: the values, allocated in the keys'
head size) and, in the same test, the overlay gives the reference's ids, with buffers of 24 and 12.
Llama (equal head sizes) gives stock's ids and reports nothing. A layer that already holds tokens
keeps stock's error. From 5.0.0rc2 the engine says "fixed upstream", stock gives the reference's
ids and the overlay changes nothing.
"""

from __future__ import annotations

import inspect

import pytest

import overlay
from overlay.patch import Variant
from overlay.testing.harness import PatchUnderTest

# From tests/_kit.py: the static cache's scenarios (the other static cache patch's tests run them too).
from tests._kit import STATIC_COMPOSED_PROMPT as COMPOSED_PROMPT
from tests._kit import STATIC_MAX_CACHE_LEN as MAX_CACHE_LEN
from tests._kit import STATIC_MAX_NEW_TOKENS as MAX_NEW_TOKENS
from tests._kit import STATIC_PROMPTS as PROMPTS
from tests._kit import STATIC_WAYS as WAYS
from tests._kit import assert_in_force_only_while_applied, assert_replacements_keep_the_originals_face
from tests._kit import static_cases as _cases
from tests._kit import static_greedy as _generate

PATCH = PatchUnderTest("static_cache_kv_head_sizes")

pytestmark = pytest.mark.usefixtures("one_thread")

SLICE_SHAPES = PATCH.error("slice shapes")
ACTION = PATCH.patch_module.ACTION
NUM_LAYERS = 2
QK_NOPE, QK_ROPE, V_HEAD = 16, 8, 12

#: Model cases: (config class, attention implementation); None: the Llama control.
MODELS = {
    "deepseek_v3 sdpa": ("DeepseekV3Config", "sdpa"),
    "deepseek_v3 eager": ("DeepseekV3Config", "eager"),
    "deepseek_v2 sdpa": ("DeepseekV2Config", "sdpa"),
    "llama (control)": (None, "sdpa"),
}
BUG_CASES = [name for name, (config, _) in MODELS.items() if config]
CONTROL_CASES = [name for name, (config, _) in MODELS.items() if not config]


def deepseek_config(config_class: str):
    """A tiny DeepSeek config (MLA): 4 heads, keys of 16 + 8, values of 12, two layers (one dense,
    one of 4 routed experts plus a shared one), no q LoRA."""
    import transformers

    from overlay.testing.models import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID

    return getattr(transformers, config_class)(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=QK_ROPE, v_head_dim=V_HEAD,
        max_position_embeddings=64, pad_token_id=PAD_TOKEN_ID, bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID, tie_word_embeddings=False,
    )


def _model(name: str):
    import torch
    from transformers import AutoModelForCausalLM

    from overlay.testing.models import PAD_TOKEN_ID, tiny_model

    config_class, attn = MODELS[name]
    if config_class is None:
        return tiny_model("llama", attn_implementation=attn)
    config = deepseek_config(config_class)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def _user_cache(model, batch_size: int):
    """A ``StaticCache`` built from the model's config, as users build one: lazily allocated
    (4.56.0 on), or allocated by its constructor (4.55.x, from ``config.head_dim``)."""
    from overlay.testing.models import user_static_cache

    return user_static_cache(model.config, batch_size, MAX_CACHE_LEN, model.dtype)


def _head_sizes(cache) -> "list[tuple[int, int] | None]":
    """Per layer of a cache that ran: the head sizes of its key and value buffers."""
    return [
        (layer.keys.shape[-1], layer.values.shape[-1]) if getattr(layer, "keys", None) is not None else None
        for layer in cache.layers
    ]


def _run(model, batches: dict) -> dict:
    """Every way and prompt on ``model`` in the current state (stock or patched), the head sizes
    of the user-built caches, and what the patch reported."""
    from overlay import report
    from overlay.testing.models import cache_argument_name

    report.reset()
    record: dict = {}
    for prompt, batch in batches.items():
        rows = batch["input_ids"].shape[0]
        record[(WAYS[0], prompt)] = _generate(model, batch, cache_implementation="static")
        cache = _user_cache(model, rows)
        record[(WAYS[1], prompt)] = _generate(model, batch, **{cache_argument_name(model): cache})
        record[("head sizes", prompt)] = _head_sizes(cache)
    record["fired"] = report.fired_actions().get(PATCH.id, {})
    return record


@pytest.fixture(scope="module")
def runs():
    """``{case: {"reference": {prompt: run}, "no cache": {prompt: run}, "stock": record,
    "patched": record, "all patches": run}}``."""
    import transformers.cache_utils  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay.testing.models import left_padded_batch

    batches = {prompt: left_padded_batch(lengths, seed=0) for prompt, lengths in PROMPTS.items()}
    results: dict = {}
    for name in MODELS:
        model = _model(name)
        record = results[name] = {}
        with overlay.reverted():
            record["reference"] = {prompt: _generate(model, batch) for prompt, batch in batches.items()}
            record["no cache"] = {prompt: _generate(model, batch, use_cache=False) for prompt, batch in batches.items()}
            record["stock"] = _run(model, batches)
        with PATCH.applied():
            record["patched"] = _run(model, batches)
        with overlay.applied():  # every patch the release gets, as users run it
            record["all patches"] = _generate(model, batches[COMPOSED_PROMPT], cache_implementation="static")
    return results


# -- the engine --------------------------------------------------------------------------------------


def test_engine_status_and_where_the_replacement_goes():
    from transformers import cache_utils

    assert_in_force_only_while_applied(PATCH, lambda: vars(cache_utils.StaticLayer)["update"])
    if not PATCH.affected:
        assert PATCH.fixed_upstream


def test_replacement_keeps_name_docstring_and_signature():
    # Built by hand where the code is not an original (fixed or older releases): only the
    # wrapper's metadata is read there. Its one target is on every release.
    otherwise = Variant("this release", dict(PATCH.patch.targets[0].defaults))
    assert assert_replacements_keep_the_originals_face(PATCH, otherwise) == len(PATCH.patch.targets) == 1


# -- the runs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUG_CASES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_reference_is_the_model_without_a_cache(runs, name, prompt):
    record = runs[name]
    assert record["reference"][prompt]["ok"], record["reference"][prompt]
    assert record["no cache"][prompt] == record["reference"][prompt]


@_cases(BUG_CASES)
def test_static_cache_with_other_value_head_size(runs, name, way, prompt):
    """The bug and the fix in one test: stock's error, the overlay's ids, the reference's ids."""
    record = runs[name]
    reference = record["reference"][prompt]
    stock, patched = record["stock"][(way, prompt)], record["patched"][(way, prompt)]
    assert reference["ok"], reference
    if PATCH.affected:
        assert (stock["ok"], stock.get("type"), stock.get("raised in")) == (False, "RuntimeError", "update"), stock
        assert stock["error"].startswith(SLICE_SHAPES), stock
        assert patched == reference, "the overlay gives the dynamic cache's ids"
    else:
        assert stock == reference, "upstream's fix gives the dynamic cache's ids"
        assert patched == stock


@pytest.mark.parametrize("name", BUG_CASES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_buffers_have_the_key_and_value_head_sizes(runs, name, prompt):
    """On the affected releases the user's cache holds keys of 24 and values of 12 per head (stock:
    keys and values of one size, or, on 4.55.x, of ``config.head_dim``)."""
    record = runs[name]
    if PATCH.affected:
        assert record["stock"][("head sizes", prompt)] != record["patched"][("head sizes", prompt)]
        assert record["patched"][("head sizes", prompt)] == [(QK_NOPE + QK_ROPE, V_HEAD)] * NUM_LAYERS
    else:  # what the release stores (later releases may cache DeepSeek's compressed latent instead)
        assert record["patched"][("head sizes", prompt)] == record["stock"][("head sizes", prompt)]


@_cases(CONTROL_CASES)
def test_equal_head_sizes_are_left_as_stock(runs, name, way, prompt):
    record = runs[name]
    assert record["stock"][(way, prompt)]["ok"], record["stock"][(way, prompt)]
    assert record["patched"][(way, prompt)] == record["stock"][(way, prompt)]
    assert record["patched"][(way, prompt)] == record["reference"][prompt]
    assert record["patched"][("head sizes", prompt)] == record["stock"][("head sizes", prompt)]


def test_what_the_patch_reports(runs):
    for name, record in runs.items():
        assert record["stock"]["fired"] == {}, name
        if PATCH.affected and name in BUG_CASES:
            # One count per layer of each static cache a run filled (generate's, then the user's).
            assert record["patched"]["fired"] == {ACTION: NUM_LAYERS * len(PROMPTS) * len(WAYS)}, name
        else:
            assert record["patched"]["fired"] == {}, name


@pytest.mark.parametrize("name", BUG_CASES)
def test_with_every_patch_of_the_release(runs, name):
    """The whole overlay (``kv-cache-dtype`` may allocate the layer before its ``update``;
    ``kept-static-cache`` wraps the function that builds generate()'s static cache) gives the
    reference's ids too."""
    if not PATCH.affected:
        pytest.skip(f"{PATCH.id} is fixed upstream in {PATCH.transformers}: the other patches' tests cover them")
    record = runs[name]
    assert record["all patches"] == record["reference"][COMPOSED_PROMPT]


# -- a layer that holds tokens ------------------------------------------------------------------------


def _layer_with_tokens():
    """A ``StaticLayer`` of head size 24 for keys and values, holding two tokens."""
    import torch
    from transformers.cache_utils import StaticLayer

    keys = torch.ones(1, 2, 2, 24)
    if "head_dim" in inspect.signature(StaticLayer.__init__).parameters:  # 4.55.x: allocated here
        layer = StaticLayer(max_cache_len=8, batch_size=1, num_heads=2, head_dim=24)
    else:
        layer = StaticLayer(max_cache_len=8)
    layer.update(keys, keys.clone(), {"cache_position": torch.arange(2)})
    return layer


def test_a_layer_that_holds_tokens_keeps_stocks_error():
    """The reallocation is for a layer that holds nothing: one that holds tokens (here in another
    value head size) fails as on stock, and its buffers are left as they were."""
    import torch

    def write_other_value_size():
        layer = _layer_with_tokens()
        keys, values = layer.keys, layer.values
        try:
            layer.update(torch.ones(1, 2, 1, 24), torch.ones(1, 2, 1, 12), {"cache_position": torch.tensor([2])})
        except RuntimeError as exc:
            return str(exc), layer.keys is keys and layer.values is values
        return None, layer.keys is keys and layer.values is values

    with overlay.reverted():
        stock = write_other_value_size()
    with PATCH.applied():
        patched = write_other_value_size()
    assert stock[0] is not None and stock[0].startswith(SLICE_SHAPES), stock
    assert patched == stock


# -- compiled decoding ----------------------------------------------------------------------------------


def test_compiled_decoding_after_an_eager_prefill():
    """generate() compiles the decoding steps, never the prefill: the reallocation happens in the eager
    prefill (one count per layer), and the traced ``update`` (dynamo, eager backend) leaves the
    buffers alone and gives the reference's ids."""
    if not PATCH.affected:
        pytest.skip(f"{PATCH.id} is fixed upstream in {PATCH.transformers}")
    import torch
    from transformers import CompileConfig

    from overlay import report
    from overlay.testing.models import greedy_ids, left_padded_batch

    model = _model("deepseek_v3 sdpa")
    batch = left_padded_batch(PROMPTS[COMPOSED_PROMPT], seed=0)
    with overlay.reverted():
        reference = greedy_ids(model, batch, MAX_NEW_TOKENS)
    compile_config = CompileConfig(backend="eager", fullgraph=False)
    compile_config._compile_all_devices = True  # the CPU too
    torch._dynamo.reset()
    try:
        with PATCH.applied():
            report.reset()
            compiled = greedy_ids(model, batch, MAX_NEW_TOKENS, cache_implementation="static",
                                  compile_config=compile_config, disable_compile=False)
            fired = report.fired_actions().get(PATCH.id, {})
    finally:
        torch._dynamo.reset()
    assert compiled == reference
    assert fired == {ACTION: NUM_LAYERS}


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_equal_head_sizes_are_left_as_stock',
                    'equal key and value head sizes are stock; others raised index_copy_ on stock')
