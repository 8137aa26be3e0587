"""The attention-entry guard (``overlay/guard.py``, patch ``attention-guard``) and its mode setting.

Each kind of violation must give an error that names the offending tensor(s) with device, dtype
and shape and says what to do; ``align`` fixes dtypes, ``check`` raises on them, ``off`` leaves
everything alone. Device mismatches are built with the ``meta`` device (no second accelerator
needed: the guard only reads metadata).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import overlay
from overlay import guard
from overlay.testing import models
from overlay.testing.harness import PatchUnderTest

GUARD = PatchUnderTest("attention_guard")
GUARD.skip_module_unless_covered()

REPO = Path(__file__).resolve().parents[3]


def guard_applied():
    """Only the guard (not the cache patch): what the attention entry alone does. The target module
    is imported first: a test run alone (``-k``) would otherwise find it not imported yet (pending)."""
    import transformers.modeling_utils  # noqa: F401

    return GUARD.applied(expect="applied")


def has_get_interface() -> bool:
    """5.1.0 on: the models dispatch through ``AttentionInterface.get_interface``."""
    from transformers.modeling_utils import AttentionInterface

    return hasattr(AttentionInterface, "get_interface")


#: Why a test of the model's own eager function cannot apply before 5.1.0.
EAGER_NOT_DISPATCHED = (
    "before 5.1.0 the models call their own eager_attention_forward directly (`attention_interface = "
    "eager_attention_forward`; the registry is indexed only when _attn_implementation != 'eager'), so "
    "no dispatch point sees it"
)


def lookup(interface, name, default):
    """The registry's own lookup on this release, the function the guard replaces:
    ``get_interface(name, default)`` from 5.1.0, ``interface[name]`` before."""
    if has_get_interface():
        return interface.get_interface(name, default)
    return interface[name]


def dispatch(name, default, interface=None):
    """What an attention layer of this release calls for ``_attn_implementation = name``, exactly as
    the model files do: ``ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)`` from
    5.1.0; before, the model's own eager function for ``"eager"``, else ``ALL_ATTENTION_FUNCTIONS[name]``."""
    if interface is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as interface
    if not has_get_interface() and name == "eager":
        return default
    return lookup(interface, name, default)


@pytest.fixture(autouse=True)
def _align_mode():
    with guard.using_mode("align"):
        yield


def qkv(batch=2, q_heads=4, kv_heads=2, q_len=1, kv_len=7, head_dim=8, v_head_dim=None, dtype=torch.bfloat16):
    query = torch.zeros(batch, q_heads, q_len, head_dim, dtype=dtype)
    key = torch.zeros(batch, kv_heads, kv_len, head_dim, dtype=dtype)
    value = torch.zeros(batch, kv_heads, kv_len, v_head_dim or head_dim, dtype=dtype)
    return query, key, value


def problem_lines(message: str) -> list[str]:
    """The problem list: between the header line and ``tensors:``."""
    return message.split("tensors:\n")[0].splitlines()[1:]


# -- the mode setting ----------------------------------------------------------------------------


def test_mode_api_defaults_to_align_and_validates():
    assert guard.get_mode() == "align"
    previous = guard.set_mode("check")
    try:
        assert previous == "align" and guard.get_mode() == "check"
        with guard.using_mode("off"):
            assert guard.get_mode() == "off"
        assert guard.get_mode() == "check"
        with pytest.raises(ValueError, match="must be one of align, check, off"):
            guard.set_mode("loose")
    finally:
        guard.set_mode(previous)


def test_the_old_mode_name_strict_is_check_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="'strict' is deprecated: it is now called 'check'"):
        previous = guard.set_mode("strict")
    try:
        assert guard.get_mode() == "check" == guard.STRICT
    finally:
        guard.set_mode(previous)


@pytest.mark.parametrize(
    ("value", "expected"), [("check", "check"), ("strict", "check"), (" OFF ", "off"), ("", "align"), ("bogus", "align")]
)
def test_mode_from_environment(value, expected):
    env = {k: v for k, v in os.environ.items() if k != guard.MODE_VAR}
    env[guard.MODE_VAR] = value
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", "from overlay import guard; import sys; print(guard.get_mode(), 'torch' in sys.modules)"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    # the mode module is cheap: it imports neither torch nor transformers
    assert done.stdout.split() == [expected, "False"]
    if value == "bogus":
        assert "ATTN_OVERLAY_ATTENTION_GUARD='bogus' is not a mode (accepted: align, check, off" in done.stderr
        assert "using the default, align" in done.stderr
    elif value == "strict":
        assert "ATTN_OVERLAY_ATTENTION_GUARD='strict' is deprecated: that mode is now called 'check'" in done.stderr
    else:
        assert done.stderr == ""


# -- each kind of violation -----------------------------------------------------------------------


def test_matching_inputs_pass_untouched_in_every_mode():
    query, key, value = qkv()
    for mode in guard.MODES:
        out = guard.check_attention_inputs(query, key, value, mode=mode)
        assert all(a is b for a, b in zip(out, (query, key, value)))


def test_device_mismatch_names_the_tensor_on_the_other_device():
    query, key, value = qkv()
    with pytest.raises(guard.AttentionInputError) as caught:
        guard.check_attention_inputs(query, key, value.to("meta"))
    message = str(caught.value)
    assert problem_lines(message) == ["  - device: value is not on the query's device cpu"]
    assert "value: device=meta, dtype=torch.bfloat16, shape=(2, 2, 7, 8)" in message
    assert "query: device=cpu, dtype=torch.bfloat16, shape=(2, 4, 1, 8)" in message
    assert "key: " not in message  # the key is fine: not listed
    assert "  - device: move the model, the inputs and the cache to one device" in message


def test_device_mismatch_is_not_fixed_by_align():
    query, key, value = qkv()
    with pytest.raises(guard.AttentionInputError, match=r"key and value are not on the query's device cpu"):
        guard.check_attention_inputs(query, key.to("meta"), value.to("meta"), mode="align")


def test_dtype_mismatch_in_check_mode_names_the_tensor():
    query, key, value = qkv()
    with pytest.raises(guard.AttentionInputError) as caught:
        guard.check_attention_inputs(query, key.float(), value, mode="check")
    message = str(caught.value)
    assert problem_lines(message) == ["  - dtype: key is torch.float32, but query is torch.bfloat16"]
    assert "key: device=cpu, dtype=torch.float32, shape=(2, 2, 7, 8)" in message
    assert "value: " not in message
    assert "early_initialization(..., dtype=model.dtype)" in message


def test_dtype_mismatch_in_align_mode_casts_to_the_query_dtype():
    query, key, value = qkv()
    fp32_key = key.float()
    out_query, out_key, out_value = guard.check_attention_inputs(query, fp32_key, value)
    assert out_query is query and out_value is value  # only what differs is touched
    assert out_key.dtype == torch.bfloat16 and torch.equal(out_key, key)


def test_autocast_leaves_dtypes_to_autocast_even_in_check_mode():
    query, key, value = qkv()
    fp32_query, fp32_key = query.float(), key.float()  # what rotary embeddings do under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = guard.check_attention_inputs(fp32_query, fp32_key, value, mode="check")
    assert out[0] is fp32_query and out[1] is fp32_key and out[2] is value


@pytest.mark.parametrize(
    ("shapes", "problem", "listed"),
    [
        (dict(head_dim=8), "head_dim (last dim) of key is 16, of query 8: they must be equal", ("query", "key")),
        (dict(), "key holds 7 positions (dim 2), value 6: they must be equal", ("key", "value")),
        (dict(), "key has 2 heads (dim 1), value 1: they must be equal", ("key", "value")),
        (dict(q_heads=3), "query has 3 heads (dim 1), not a multiple of the key's 2", ("query", "key")),
        (dict(), "batch size (dim 0) of key and value does not match the query's 2", ("query", "key", "value")),
    ],
    ids=["head_dim", "kv_positions", "kv_heads", "gqa_ratio", "batch"],
)
def test_shape_violations_name_the_tensors(shapes, problem, listed):
    query, key, value = qkv(**shapes)
    if "head_dim" in problem:
        key = torch.zeros(2, 2, 7, 16, dtype=torch.bfloat16)
        value = torch.zeros(2, 2, 7, 16, dtype=torch.bfloat16)
    elif "positions" in problem:
        value = value[:, :, :6]
    elif "value 1" in problem:
        value = value[:, :1]
    elif "batch" in problem:
        key, value = torch.cat([key] * 3), torch.cat([value] * 3)
    with pytest.raises(guard.AttentionInputError) as caught:
        guard.check_attention_inputs(query, key, value)
    message = str(caught.value)
    assert problem_lines(message) == [f"  - shape: {problem}"]
    listed_names = [line.split(":")[0].strip() for line in message.split("tensors:\n")[1].split("what to do:")[0].splitlines()]
    assert listed_names == list(listed)
    assert "  - shape: the cache was built for another configuration" in message


def test_batch_broadcast_and_separate_value_head_dim_are_allowed():
    query, key, value = qkv(v_head_dim=16)  # MLA-style: values may have their own head_dim
    guard.check_attention_inputs(query, key[:1], value[:1])  # a batch of 1 broadcasts


def test_several_problems_are_reported_together():
    query, key, value = qkv()
    with pytest.raises(guard.AttentionInputError) as caught:
        guard.check_attention_inputs(query, key.to("meta"), value[:, :, :6].float(), mode="check")
    kinds = [line.split(":")[0].strip(" -") for line in problem_lines(str(caught.value))]
    assert kinds == ["device", "dtype", "shape"]


def test_packed_layouts_only_get_device_and_dtype_checks():
    packed_query = torch.zeros(5, 4, 8, dtype=torch.bfloat16)  # varlen: [tokens, heads, head_dim]
    packed_kv = torch.zeros(9, 2, 8, dtype=torch.bfloat16)
    guard.check_attention_inputs(packed_query, packed_kv, packed_kv)
    with pytest.raises(guard.AttentionInputError, match="value is not on the query's device"):
        guard.check_attention_inputs(packed_query, packed_kv, packed_kv.to("meta"))


def test_mode_off_checks_nothing():
    query, key, value = qkv()
    out = guard.check_attention_inputs(query, key.to("meta"), value[:, :1].float(), mode="off")
    assert out[1].device.type == "meta" and out[2].dtype == torch.float32


def test_message_names_the_layer_and_the_implementation():
    class LlamaAttention:  # stands for the calling module
        layer_idx = 3

    query, key, value = qkv()
    with pytest.raises(guard.AttentionInputError) as caught:
        guard.check_attention_inputs(query, key.float(), value, module=LlamaAttention(), attn_implementation="sdpa", mode="check")
    assert str(caught.value).startswith(
        "attn-overlay attention guard (mode=check): the inputs of LlamaAttention (layer 3, attn_implementation='sdpa') do not go together:"
    )


# -- through the patch: every attention implementation dispatched through the registry -------------


def _dummy_eager(module, query, key, value, attention_mask, **kwargs):
    return "eager ran", (query.dtype, key.dtype, value.dtype)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_get_interface_wraps_registered_kernels_and_each_models_eager(implementation):
    if implementation == "eager" and not has_get_interface():
        pytest.skip(EAGER_NOT_DISPATCHED)
    query, key, value = qkv()
    unpatched = dispatch(implementation, _dummy_eager)
    with guard_applied():
        attention = dispatch(implementation, _dummy_eager)
        assert attention is not unpatched and attention.__wrapped__ is unpatched
        with pytest.raises(guard.AttentionInputError, match=re.escape(f"attn_implementation={implementation!r}")):
            attention(None, query, key[..., :4], value, None, scaling=1.0)
        with guard.using_mode("off"):
            assert dispatch(implementation, _dummy_eager) is unpatched
    if implementation == "eager":  # the model's own eager function is what runs, behind the guard
        with guard_applied():
            result = dispatch("eager", _dummy_eager)(None, query, key.float(), value, None)
        assert result == ("eager ran", (torch.bfloat16,) * 3)


def _tiny_llama(attn, dtype):
    # Llama's own default positions (2048); head_dim 8.
    model = models.tiny_model(
        "llama", dtype, attn_implementation=attn, hidden_size=32, intermediate_size=64, max_position_embeddings=2048
    )
    model.generation_config.eos_token_id = None
    return model


def _prefix_then_generate(attn, cast_prefix_to=None):
    """float32 prefix cache (a DynamicCache, which keeps whatever dtype it is given), bf16 decoding."""
    from transformers import DynamicCache

    model = _tiny_llama(attn, torch.bfloat16)
    twin = _tiny_llama(attn, torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    # 4.55's DynamicCache(config=...) builds layers that take a max_cache_len: a plain one there
    cache = DynamicCache(config=model.config) if GUARD.transformers.release >= (4, 56) else DynamicCache()
    with torch.no_grad():
        twin(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
    if cast_prefix_to is not None:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.to(cast_prefix_to), layer.values.to(cast_prefix_to)
    out = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=4, do_sample=False, disable_compile=True)
    return out[:, -4:]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_guard_in_a_model_check_names_layer_and_tensors_instead_of_the_kernel_error(attn):
    if attn == "eager" and not has_get_interface():
        pytest.skip(EAGER_NOT_DISPATCHED + "; test_eager_before_5_1_is_exactly_stock shows what happens there")
    with guard_applied(), guard.using_mode("check"):
        with pytest.raises(guard.AttentionInputError) as caught:
            _prefix_then_generate(attn)
    message = str(caught.value)
    assert f"the inputs of LlamaAttention (layer 0, attn_implementation={attn!r}) do not go together" in message
    assert "  - dtype: key is torch.float32, value is torch.float32, but query is torch.bfloat16" in message
    assert "key: device=cpu, dtype=torch.float32, shape=(1, 2, 6, 8)" in message


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_guard_in_a_model_align_casts_at_the_entry(attn):
    # Without the cache patch, the guard alone still hands the kernel one dtype (for models that
    # dispatch through the registry); tokens equal a prefix cast by hand.
    if attn == "eager" and not has_get_interface():
        pytest.skip(EAGER_NOT_DISPATCHED + "; test_eager_before_5_1_is_exactly_stock shows what happens there")
    with overlay.reverted():
        reference = _prefix_then_generate(attn, cast_prefix_to=torch.bfloat16)
    with guard_applied():
        tokens = _prefix_then_generate(attn)
    assert torch.equal(tokens, reference)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", ["align", "check"])
def test_eager_before_5_1_is_exactly_stock(mode):
    # What the docstring says of eager before 5.1.0: not guarded. The model's own eager function
    # meets the float32 prefix as on stock, with stock's very error (the guard alone, without
    # kv-cache-dtype); from 5.1.0 the tests above show the guard's named error and cast instead.
    if has_get_interface():
        pytest.skip("from 5.1.0 eager is dispatched through get_interface, and guarded (tests above)")
    with overlay.reverted():
        with pytest.raises(Exception) as stock:
            _prefix_then_generate("eager")
    with guard_applied(), guard.using_mode(mode):
        with pytest.raises(Exception) as patched:
            _prefix_then_generate("eager")
    # the kernel's own error: the float32 keys met the bfloat16 query in eager's matmul
    assert type(stock.value) is RuntimeError and str(stock.value) == GUARD.error("expected scalar type")
    assert type(patched.value) is type(stock.value) and str(patched.value) == str(stock.value)


# -- the hot path and robustness (issues 12 and 15) ----------------------------------------------


def _sdpa_inputs(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(1, 4, 1, 8, dtype=dtype), torch.randn(1, 2, 6, 8, dtype=dtype), torch.randn(1, 2, 6, 8, dtype=dtype)


class _GQA:  # stands for the attention module: what sdpa_attention_forward reads from it
    num_key_value_groups = 2
    is_causal = True
    layer_idx = 0


def test_transformers_kernels_are_not_checked_when_nothing_needs_fixing(monkeypatch):
    # issue 12: in align, transformers' own kernels are called straight away; the tensors are only
    # looked at when the kernel raises. The very tensors reach the kernel, and the result is stock's.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key, value = _sdpa_inputs()
    with overlay.reverted():
        expected = dispatch("sdpa", _dummy_eager)(_GQA(), query, key, value, None)[0]
    checks = []
    for name in ("check_attention_inputs", "_all_agree", "_diagnose"):
        original = getattr(guard, name)
        monkeypatch.setattr(guard, name, lambda *a, _o=original, _n=name, **k: checks.append(_n) or _o(*a, **k))
    with guard_applied():
        first = dispatch("sdpa", _dummy_eager)
        assert dispatch("sdpa", _dummy_eager) is first  # built once
        assert first.__wrapped__ is sdpa_attention_forward
        out = first(_GQA(), query, key, value, None)[0]
    assert checks == []
    assert torch.equal(out, expected)


def _user_kernel(module, query, key, value, attention_mask, **kwargs):
    return query, None


def _user_paged_kernel(module, query, key, value, attention_mask, **kwargs):
    return query, None


def _lookup_outcome(interface, name):
    """What the release's lookup (:func:`lookup`) gives: the function behind the guard's wrapper
    (a registered kernel can be a wrapper itself: only the guard's is taken off), or the
    exception's type and text."""
    try:
        function = lookup(interface, name, _dummy_eager)
    except Exception as error:  # noqa: BLE001 - the outcome is what is compared
        return type(error), str(error)
    if getattr(function, "__code__", None) is not None and function.__code__.co_name == "guarded_attention":
        return function.__wrapped__
    return function


def test_get_interface_looks_up_exactly_what_stock_looks_up():
    # issue 12: in align the replacement reads the registry's two dicts itself instead of calling
    # stock's get_interface (five Python calls); every name must give what stock gives: the
    # registered kernels, "eager" -> the model's default, an instance's own override, None (stock
    # warns and gives the default), an unknown name (stock's KeyError), the paged names (5.19.0
    # strips "paged|" except for "paged|eager"), a name registered by the user. Before 5.1.0 the
    # same names through the replaced registry lookup (the replacement reads the two dicts itself
    # there too), where "eager", None and the other unregistered names raise stock's KeyError.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    local = AttentionInterface()
    local["sdpa"] = _user_kernel  # an instance's own override wins over the class-wide entry
    names = [
        "sdpa", "eager", "flash_attention_2", "flex_attention", None, "no_such_kernel",
        "paged|eager", "paged|sdpa", "paged|no_such_kernel", "attn_overlay_test_kernel",
        "paged|attn_overlay_test_kernel", ("not", "a", "str"), ["x"],
    ]
    AttentionInterface.register("attn_overlay_test_kernel", _user_kernel)
    # registered under both names: up to 5.18.0 the paged name gives its own entry, from 5.19.0 the other
    AttentionInterface.register("paged|attn_overlay_test_kernel", _user_paged_kernel)
    try:
        for interface in (ALL_ATTENTION_FUNCTIONS, local):
            with overlay.reverted():
                expected = {repr(name): _lookup_outcome(interface, name) for name in names}
            with guard_applied():
                got = {repr(name): _lookup_outcome(interface, name) for name in names}
            assert got == expected
        assert expected["'no_such_kernel'"][0] is KeyError
    finally:
        AttentionInterface._global_mapping.pop("attn_overlay_test_kernel", None)
        AttentionInterface._global_mapping.pop("paged|attn_overlay_test_kernel", None)


def test_get_interface_reads_the_registry_directly_only_where_stock_would_read_it(monkeypatch):
    # The direct lookup is in use for AttentionInterface itself on every covered release (else the
    # test above would pass without it); a subclass with its own lookup always gets stock's.
    if not has_get_interface():
        pytest.skip("get_interface's direct read of the registry exists from 5.1.0; before, the replaced "
                    "function is the registry read itself (test_other_readers_of_the_registry_get_what_stock_gives)")
    from transformers.modeling_utils import AttentionInterface
    from transformers.utils.generic import GeneralInterface

    assert GUARD.patch_module._lookup_class(GUARD.stock()) is AttentionInterface

    class RenamingInterface(AttentionInterface):
        def __getitem__(self, key):
            return super().__getitem__("sdpa" if key == "fast" else key)

    renaming = RenamingInterface()
    with guard_applied():
        # counted from here: applied before, the patch would not recognise the counting lookup
        calls = []
        original_getitem = GeneralInterface.__getitem__
        monkeypatch.setattr(
            GeneralInterface, "__getitem__", lambda self, key: calls.append(key) or original_getitem(self, key)
        )
        assert _lookup_outcome(AttentionInterface(), "sdpa") is AttentionInterface._global_mapping["sdpa"]
        assert calls == []  # the direct lookup
        assert _lookup_outcome(renaming, "fast") is AttentionInterface._global_mapping["sdpa"]
        assert calls == ["sdpa", "sdpa"]  # stock's: `in self`, then `get`, each through the subclass


def _unguarded(function):
    """The callable behind the guard's wrapper, else the callable itself."""
    if getattr(function, "__code__", None) is not None and function.__code__.co_name == "guarded_attention":
        return function.__wrapped__
    return function


class _OwnMappingInterface:  # a registry subclass with its own class-wide mapping (made a subclass below)
    _global_mapping = {"sdpa": _user_kernel}


def test_other_readers_of_the_registry_get_what_stock_gives():
    # Before 5.1.0 the guard sits in the lookup that every reader of the registry goes through
    # (Mapping's `in`, `.get`, `items()` call it): what they read must be what stock reads (behind
    # the guard's wrapper: the very same callable), for the shared registry, an instance with its
    # own entries and a subclass with its own class-wide mapping. From 5.1.0 they must be untouched.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    local = AttentionInterface()
    local["sdpa"] = _user_kernel
    local["local-only"] = _user_paged_kernel
    subclass = type("OwnMapping", (AttentionInterface,), dict(vars(_OwnMappingInterface)))()
    names = ["sdpa", "eager", "flash_attention_2", "local-only", "no_such_kernel", None, ("a", "b")]

    def readings(interface):
        def outcome(read):
            try:
                return read()
            except Exception as error:  # noqa: BLE001 - the outcome is what is compared
                return type(error), str(error)

        return {
            "in": [outcome(lambda: name in interface) for name in names],
            "get": [outcome(lambda: _unguarded(interface.get(name))) for name in names],
            "get default": [outcome(lambda: _unguarded(interface.get(name, _dummy_eager))) for name in names],
            "[]": [outcome(lambda: _unguarded(interface[name])) for name in names],
            "valid_keys": interface.valid_keys(),
            "keys": list(interface.keys()),
            "len": len(interface),
            "items": [(key, _unguarded(function)) for key, function in interface.items()],
            "values": [_unguarded(function) for function in interface.values()],
        }

    for interface in (ALL_ATTENTION_FUNCTIONS, local, subclass):
        with overlay.reverted():
            expected = readings(interface)
        with guard_applied():
            got = readings(interface)
            wrapped = interface["sdpa"]
        assert got == expected
        assert (wrapped is not _unguarded(wrapped)) is (not has_get_interface())  # guarded where it is the dispatch point
    assert expected["[]"][1][0] is KeyError  # "eager" is not in the registry: the model calls its own


def test_the_guard_changes_one_entry_of_the_attention_registry_class_and_revert_restores_it_exactly():
    # Before 5.1.0 the lookup AttentionInterface uses is GeneralInterface.__getitem__, inherited: the
    # guard is set on AttentionInterface itself (every other registry, e.g. the mask functions', keeps
    # GeneralInterface's), and a revert deletes it again instead of leaving a copy of the inherited one.
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
    from transformers.utils.generic import GeneralInterface

    classes = (AttentionInterface, GeneralInterface, AttentionMaskInterface)
    missing = object()
    with overlay.reverted():
        before = {cls: dict(vars(cls)) for cls in classes}
        with guard_applied():
            during = {cls: dict(vars(cls)) for cls in classes}
            assert AttentionMaskInterface.__getitem__ is GeneralInterface.__getitem__
        after = {cls: dict(vars(cls)) for cls in classes}
    changed = {
        cls.__name__: sorted(k for k in {*before[cls], *during[cls]} if before[cls].get(k, missing) is not during[cls].get(k, missing))
        for cls in classes
    }
    entry = "get_interface" if has_get_interface() else "__getitem__"
    assert changed == {"AttentionInterface": [entry], "GeneralInterface": [], "AttentionMaskInterface": []}
    assert ("__getitem__" in before[AttentionInterface]) is False  # inherited on stock, on every release
    assert {cls: list(d.items()) for cls, d in after.items()} == {cls: list(d.items()) for cls, d in before.items()}


def test_a_kernel_copied_within_the_registry_stays_one_guarded_kernel():
    # executorch's export modules (4.55-5.x) copy an entry through the lookup:
    # `ALL_ATTENTION_FUNCTIONS.register("sdpa_without_vmap", ALL_ATTENTION_FUNCTIONS["sdpa"])`.
    # Before 5.1.0 that stores the guard's wrapper; read back it is the one wrapper of sdpa (not a
    # wrapper of the wrapper), computes stock's result and names bad inputs once.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    query, key, value = _sdpa_inputs()
    with overlay.reverted():
        expected = sdpa_attention_forward(_GQA(), query, key, value, None)[0]
    try:
        with guard_applied():
            AttentionInterface.register("copy-test", ALL_ATTENTION_FUNCTIONS["sdpa"])
            copied = dispatch("copy-test", _dummy_eager)
            assert copied is dispatch("sdpa", _dummy_eager) and copied.__wrapped__ is sdpa_attention_forward
            assert torch.equal(copied(_GQA(), query, key, value, None)[0], expected)
            for mode in ("align", "check"):
                with guard.using_mode(mode), pytest.raises(guard.AttentionInputError) as caught:
                    dispatch("copy-test", _dummy_eager)(_GQA(), query, key[..., :4], value, None)
                assert str(caught.value).count("attn-overlay attention guard") == 1
        # What a revert cannot undo: the registry keeps what was registered (before 5.1.0 the
        # guard's wrapper of sdpa; it computes stock's result) until the entry is registered again.
        stored = ALL_ATTENTION_FUNCTIONS["copy-test"]
        assert _unguarded(stored) is sdpa_attention_forward
        assert torch.equal(stored(_GQA(), query, key, value, None)[0], expected)
    finally:
        AttentionInterface._global_mapping.pop("copy-test", None)


def test_get_interface_lookup_of_unknown_code_is_left_to_stock():
    # Only the known GeneralInterface.__getitem__ (by fingerprint), reached through Mapping's get
    # and __contains__, is read directly; any other lookup keeps stock's get_interface in charge.
    from transformers.modeling_utils import AttentionInterface

    def get_interface(self, attn_implementation, default):  # stands for a release's original
        return default

    class OwnLookup(AttentionInterface):
        def __getitem__(self, key):
            return self._global_mapping[key]

    class OwnGet(AttentionInterface):
        def get(self, key, default=None):
            return default

    lookup_class = GUARD.patch_module._lookup_class
    for interface, expected in ((AttentionInterface, AttentionInterface), (OwnLookup, None), (OwnGet, None)):
        stand_in = type(get_interface)(get_interface.__code__, {"AttentionInterface": interface})
        assert lookup_class(stand_in) is expected


def test_kernel_failure_on_mismatched_devices_raises_the_named_error_chained_to_the_kernels():
    query, key, value = _sdpa_inputs()
    with guard_applied():
        attention = dispatch("sdpa", _dummy_eager)
        with pytest.raises(guard.AttentionInputError) as caught:
            attention(_GQA(), query, key, value.to("meta"), None)
    assert problem_lines(str(caught.value)) == ["  - device: value is not on the query's device cpu"]
    assert "_GQA (layer 0, attn_implementation='sdpa')" in str(caught.value)
    # the kernel ran and rejected them: its own error is kept as the cause
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert not isinstance(caught.value.__cause__, guard.AttentionInputError)


@pytest.mark.parametrize("defect", ["device", "dtype", "shape"])
def test_the_kernels_raw_error_on_stock_is_named_or_aligned_with_the_guard(defect):
    # Through this release's dispatch point (get_interface from 5.1.0, the registry lookup before):
    # stock fails deep in torch's SDPA with a message that names no layer; the guard names the
    # tensors (device on the meta device, shape), chained to that very error, or (dtype, align)
    # computes what stock computes on key/value cast by hand.
    query, key, value = _sdpa_inputs(torch.bfloat16)
    bad_key, bad_value = {
        "device": (key, value.to("meta")),
        "dtype": (key.float(), value.float()),
        "shape": (key[..., :4], value),
    }[defect]
    with overlay.reverted():
        with pytest.raises(RuntimeError) as stock:
            dispatch("sdpa", _dummy_eager)(_GQA(), query, bad_key, bad_value, None)
        reference = dispatch("sdpa", _dummy_eager)(_GQA(), query, key, value, None)[0]
    raw = str(stock.value)
    assert not isinstance(stock.value, guard.AttentionInputError) and "_GQA" not in raw
    if defect == "dtype":
        assert raw.startswith(GUARD.error("Expected query, key, and value"))
    elif defect == "device":
        assert raw.startswith("Expected query, key, and value to have the same device type")
    with guard_applied():
        attention = dispatch("sdpa", _dummy_eager)
        if defect == "dtype":
            assert torch.equal(attention(_GQA(), query, bad_key, bad_value, None)[0], reference)
            return
        with pytest.raises(guard.AttentionInputError) as caught:
            attention(_GQA(), query, bad_key, bad_value, None)
    message = str(caught.value)
    assert "the inputs of _GQA (layer 0, attn_implementation='sdpa') do not go together" in message
    assert problem_lines(message)[0].startswith(f"  - {defect}: ")
    assert type(caught.value.__cause__) is type(stock.value) and str(caught.value.__cause__) == raw


def test_kernel_errors_unrelated_to_qkv_are_re_raised_unchanged():
    query, key, value = _sdpa_inputs()
    bad_mask = torch.zeros(1, 1, 1, 5, dtype=torch.bool)  # 5 positions, the cache holds 6
    with overlay.reverted():
        with pytest.raises(RuntimeError) as stock:
            dispatch("sdpa", _dummy_eager)(_GQA(), query, key, value, bad_mask)
    with guard_applied():
        with pytest.raises(RuntimeError) as caught:
            dispatch("sdpa", _dummy_eager)(_GQA(), query, key, value, bad_mask)
    assert type(caught.value) is type(stock.value) and str(caught.value) == str(stock.value)


def test_align_casts_after_a_kernel_rejects_dtypes_and_reports_it():
    from overlay import report

    query, key, value = _sdpa_inputs(torch.bfloat16)
    with overlay.reverted():
        reference = dispatch("sdpa", _dummy_eager)(_GQA(), query, key, value, None)[0]
    report.reset()
    with guard_applied():
        out = dispatch("sdpa", _dummy_eager)(_GQA(), query, key.float(), value.float(), None)[0]
    assert torch.equal(out, reference)
    assert report.fired_actions()[GUARD.id] == {"cast torch.float32 key/value to torch.bfloat16 at the attention entry": 1}
    report.reset()


@pytest.mark.parametrize("kind", ["dataclass", "eq_without_hash"])
def test_unhashable_registered_attention_callables_work(kind):
    # issue 15.1: AttentionInterface.register accepts any callable; a @dataclass with __call__ (or
    # any class defining __eq__ without __hash__) is not hashable and failed with the guard on.
    import dataclasses

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    if kind == "dataclass":

        @dataclasses.dataclass
        class CountingAttention:
            calls: int = 0

            def __call__(self, module, query, key, value, attention_mask, **kwargs):
                self.calls += 1
                return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    else:

        class CountingAttention:
            def __init__(self):
                self.calls = 0

            def __eq__(self, other):
                return isinstance(other, CountingAttention)

            def __call__(self, module, query, key, value, attention_mask, **kwargs):
                self.calls += 1
                return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    counting = CountingAttention()
    with pytest.raises(TypeError):
        hash(counting)
    query, key, value = _sdpa_inputs()
    AttentionInterface.register("counting-test", counting)
    try:
        with overlay.reverted():
            expected = dispatch("counting-test", None)(_GQA(), query, key, value, None)[0]
        with guard_applied():
            for mode in guard.MODES:
                with guard.using_mode(mode):
                    out = dispatch("counting-test", None)(_GQA(), query, key, value, None)[0]
                assert torch.equal(out, expected)
            with pytest.raises(guard.AttentionInputError, match="counting-test"):  # still guarded
                dispatch("counting-test", None)(_GQA(), query, key[..., :4], value, None)
    finally:
        AttentionInterface._global_mapping.pop("counting-test", None)
    assert counting.calls == 4


def test_the_guard_keeps_no_registered_function_alive():
    # issue 15.2: an attention function registered per model load (a closure capturing the model,
    # re-registered on each load) must be freed with the model, as on stock.
    import gc
    import weakref

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    def load_three_models():
        refs = []
        query, key, value = _sdpa_inputs()
        for _ in range(3):
            model = torch.nn.Linear(8, 8)

            def attention(module, query, key, value, attention_mask, _model=model, **kwargs):
                return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

            AttentionInterface.register("per-load-test", attention)
            for mode in guard.MODES:
                with guard.using_mode(mode):
                    dispatch("per-load-test", None)(_GQA(), query, key, value, None)
            refs.append(weakref.ref(model))
            del model, attention
        AttentionInterface._global_mapping.pop("per-load-test")  # the last registration goes too
        gc.collect()
        return [ref() is None for ref in refs]

    with overlay.reverted():
        assert load_three_models() == [True, True, True]  # stock frees every model
    with guard_applied():
        assert load_three_models() == [True, True, True]


def test_meta_tensors_get_the_named_error_not_an_autocast_error():
    # issue 15.8: torch.is_autocast_enabled("meta") raises "unknown device type for autocast"; the
    # guard must not replace the kernel's error (or its own named one) with that.
    query, key, value = (t.to("meta") for t in qkv())
    with pytest.raises(guard.AttentionInputError, match=r"  - dtype: key is torch.float32, but query is torch.bfloat16"):
        guard.check_attention_inputs(query, key.float(), value, mode="check")
    out = guard.check_attention_inputs(query, key.float(), value, mode="align")
    assert out[1].dtype == torch.bfloat16 and out[1].device.type == "meta"
    error = RuntimeError("the kernel's error")
    with pytest.raises(guard.AttentionInputError, match="head_dim") as caught:
        guard.diagnose_kernel_error(error, query, key[..., :4].float(), value)
    assert caught.value.__cause__ is error


def test_meta_tensors_through_the_patch_behave_as_stock_or_name_the_tensors():
    query, key, value = (t.to("meta") for t in _sdpa_inputs(torch.bfloat16))
    with overlay.reverted():
        stock = dispatch("sdpa", _dummy_eager)(_GQA(), query, key, value, None)[0]
    with guard_applied():
        attention = dispatch("sdpa", _dummy_eager)
        out = attention(_GQA(), query, key, value, None)[0]
        assert out.shape == stock.shape and out.dtype == stock.dtype and out.device == stock.device
        out = attention(_GQA(), query, key.float(), value.float(), None)[0]  # align: cast, as on cpu
        assert out.shape == stock.shape and out.dtype == stock.dtype
        with guard.using_mode("check"), pytest.raises(guard.AttentionInputError, match="dtype: key is torch.float32"):
            dispatch("sdpa", _dummy_eager)(_GQA(), query, key.float(), value, None)


def test_compiled_attention_call_checks_at_trace_time_without_graph_break_or_recompile():
    # Under torch.compile, exceptions a kernel raises on fake tensors cannot be caught in the graph:
    # the guard checks before the call there (decided at trace time), as before.
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    query, key, value = _sdpa_inputs(torch.bfloat16)

    def step(query, key, value):
        return dispatch("sdpa", _dummy_eager)(_GQA(), query, key, value, None)[0]

    def compiled_run(key, value, runs=3):
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        outs = [compiled(query, key, value) for _ in range(runs)]
        torch._dynamo.reset()
        return outs, counter.frame_count, counter.op_count

    with overlay.reverted():
        stock_outs, stock_frames, stock_ops = compiled_run(key, value)
    with guard_applied():
        outs, frames, ops = compiled_run(key, value)
        cast_outs, cast_frames, cast_ops = compiled_run(key.float(), value.float())
        with guard.using_mode("check"), pytest.raises(Exception) as check_error:
            compiled_run(key.float(), value)
    # With fullgraph, dynamo reports an exception raised while tracing as its own error ("Observed
    # exception"): torch 2.13 (CI's) quotes the guard's message in it, torch 2.8 (the Neuron
    # stack's) names only the exception's class.
    text = str(check_error.value)
    assert isinstance(check_error.value, guard.AttentionInputError) or "Observed exception" in text
    if Version(torch.__version__.split("+")[0]) >= Version("2.13"):
        assert "dtype: key is torch.float32" in text
    else:
        assert "AttentionInputError" in text
    assert frames == stock_frames == 1 and ops == stock_ops  # not one op more when q, k, v agree
    assert all(torch.equal(a, b) for a, b in zip(outs, stock_outs))
    assert cast_frames == 1 and cast_ops == stock_ops + 2  # key and value cast inside the graph
    assert all(torch.equal(a, b) for a, b in zip(cast_outs, stock_outs))


def test_a_kernel_that_still_fails_after_the_cast_fails_with_stocks_error():
    # Found by the property test: packed 3-D q/k in float32 with a bfloat16 value. SDPA rejects
    # the dtypes; after the guard's cast it rejects the layout instead. The user must see the
    # error stock gives, not the second one.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Module:
        is_causal, training, layer_idx, num_key_value_groups = True, False, 0, 2

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 4, generator=generator)  # 3-D, as the property test drew them
    key = torch.randn(3, 1, 4, generator=generator)
    value = torch.randn(3, 1, 4, generator=generator).to(torch.bfloat16)

    def call():
        kernel = dispatch("sdpa", sdpa_attention_forward)
        return kernel(Module(), query, key, value, None, dropout=0.0, scaling=0.5)

    with overlay.reverted():
        with pytest.raises(Exception) as stock:
            call()
    with GUARD.applied(), guard.using_mode("align"):
        with pytest.raises(Exception) as patched:
            call()
    assert type(patched.value) is type(stock.value)
    assert str(patched.value) == str(stock.value)


@pytest.mark.parametrize("wrapper", ["generic", "shaped"])
@pytest.mark.parametrize("defect", ["none", "device", "dtype", "shape", "mask"])
def test_the_wrapper_built_for_the_models_call_shape_behaves_as_the_generic_one(wrapper, defect):
    # A kernel's first call goes through the generic wrapper (``*args, **kwargs``), which then
    # builds one for that call's shape (overlay.call_forwarding: cheaper per call) and puts it in
    # its place. Both must give exactly what the guard gives: stock's result, the named error
    # chained to the kernel's own, the cast in align, stock's error where q, k, v go together.
    from overlay.patches import attention_guard
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key, value = _sdpa_inputs(torch.bfloat16)
    call_keywords = {"dropout": 0.0, "scaling": 0.5, "position_ids": None, "use_cache": True}
    bad_key, bad_value, mask = {
        "none": (key, value, None),
        "device": (key, value.to("meta"), None),
        "dtype": (key.float(), value.float(), None),
        "shape": (key[..., :4], value, None),
        "mask": (key, value, torch.zeros(1, 1, 1, 5, dtype=torch.bool)),  # 5 positions, 6 cached
    }[defect]
    with overlay.reverted():
        reference = dispatch("sdpa", _dummy_eager)(_GQA(), query, key, value, None, **call_keywords)[0]
        try:
            dispatch("sdpa", _dummy_eager)(_GQA(), query, bad_key, bad_value, mask, **call_keywords)
            stock_error = None
        except RuntimeError as error:
            stock_error = error
    with guard_applied():
        attention_guard._kernel_wrappers.pop(sdpa_attention_forward, None)  # a first call again
        attention = dispatch("sdpa", _dummy_eager)
        generic_code = attention.__code__
        if wrapper == "shaped":
            assert torch.equal(attention(_GQA(), query, key, value, None, **call_keywords)[0], reference)
            attention = dispatch("sdpa", _dummy_eager)
            assert attention.__code__ is not generic_code  # the shaped one took its place
            assert attention.__wrapped__ is sdpa_attention_forward
        try:
            out, error = attention(_GQA(), query, bad_key, bad_value, mask, **call_keywords)[0], None
        except RuntimeError as raised:
            out, error = None, raised
        if wrapper == "generic":
            assert dispatch("sdpa", _dummy_eager).__code__ is not generic_code  # built by that call
    if defect in ("none", "dtype"):
        assert error is None and torch.equal(out, reference)
    elif defect == "mask":  # q, k, v go together: the kernel's own error, unchanged
        assert type(error) is type(stock_error) and str(error) == str(stock_error)
        assert not isinstance(error, guard.AttentionInputError)
    else:
        assert isinstance(error, guard.AttentionInputError)
        assert problem_lines(str(error))[0].startswith(f"  - {defect}: ")
        assert type(error.__cause__) is type(stock_error) and str(error.__cause__) == str(stock_error)


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_matching_inputs_pass_untouched_in_every_mode',
                    'q, k, v that go together reach the kernel untouched; a cast only after the kernel raised')
