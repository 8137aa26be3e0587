"""overlay.call_forwarding: a forwarder built for one call shape passes every call on exactly.

For the shape it was built for, the function gets the caller's positional objects in order and
the same keywords bound to the same objects; any other call reaches the fallback with the same
arguments; errors go to ``on_error`` and re-raise unchanged. Hypothesis draws the calls.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlay.call_forwarding import RERAISE, call_shape, shaped_forwarder

NAMES = ["dropout", "scaling", "position_ids", "use_cache", "sliding_window", "is_causal", "s_aux", "x"]


def recorder(*args, **kwargs):
    return "direct", args, kwargs


def fallback(*args, **kwargs):
    return "fallback", args, kwargs


def never_called(error, args, kwargs):  # pragma: no cover - the recorders never raise
    raise AssertionError("on_error called")


def forwarder_for(shape, function=recorder, on_error=never_called, catch=(RuntimeError,)):
    return shaped_forwarder(function, shape, fallback=fallback, on_error=on_error, catch=catch)


calls = st.tuples(
    st.lists(st.integers(), max_size=7).map(tuple),
    st.lists(st.sampled_from(NAMES), unique=True, max_size=6).flatmap(
        lambda names: st.tuples(*(st.integers() for _ in names)).map(lambda values: dict(zip(names, values)))
    ),
)


@settings(max_examples=300, deadline=None)
@given(built_for=calls, call=calls)
def test_every_call_reaches_the_function_or_the_fallback_with_the_same_arguments(built_for, call):
    forward = forwarder_for(call_shape(*built_for))
    args, kwargs = call
    route, got_args, got_kwargs = forward(*args, **kwargs)
    same_shape = len(args) == len(built_for[0]) and set(kwargs) == set(built_for[1])
    assert route == ("direct" if same_shape else "fallback")
    assert got_args == args
    assert got_kwargs == kwargs
    if same_shape and list(kwargs) == list(built_for[1]):
        assert list(got_kwargs) == list(kwargs)  # the same order too, for the shape's own order


def sdpa_like(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    return module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((1, 2, 3, 4, 5), {"dropout": 0.0, "scaling": 0.5, "position_ids": 7, "use_cache": True}),
        ((1, 2, 3, 4, 5), {"dropout": 0.0, "scaling": 0.5}),
        ((1, 2, 3, 4), {"attention_mask": None, "dropout": 0.1}),
        ((1, 2, 3, 4, 5, 0.2), {"scaling": 0.5}),
        ((1, 2, 3, 4, 5), {}),
    ],
)
def test_a_real_signature_binds_the_same_parameters(args, kwargs):
    """Built for the first call shape, every call (that shape or another) binds as a direct call."""
    forward = shaped_forwarder(
        sdpa_like, call_shape((1, 2, 3, 4, 5), {"dropout": 0, "scaling": 0, "position_ids": 0, "use_cache": 0}),
        fallback=lambda *a, **k: sdpa_like(*a, **k), on_error=never_called, catch=(RuntimeError,),
    )
    assert forward(*args, **kwargs) == sdpa_like(*args, **kwargs)


def test_a_wrong_call_fails_as_the_function_would():
    forward = shaped_forwarder(sdpa_like, (5, ()), fallback=sdpa_like, on_error=never_called, catch=(RuntimeError,))
    with pytest.raises(TypeError, match="missing 2 required positional"):
        forward(1, 2, 3)  # another shape: through the fallback
    forward = shaped_forwarder(sdpa_like, (3, ()), fallback=fallback, on_error=never_called, catch=(RuntimeError,))
    with pytest.raises(TypeError, match="missing 2 required positional"):
        forward(1, 2, 3)


def failing(*args, **kwargs):
    raise RuntimeError("kernel says no")


def test_errors_go_to_on_error_with_the_arguments_and_reraise_unchanged():
    seen = []

    def on_error(error, args, kwargs):
        seen.append((error, args, kwargs))
        return RERAISE

    forward = forwarder_for(call_shape((1, 2), {"a": 1}), function=failing, on_error=on_error)
    with pytest.raises(RuntimeError, match="kernel says no") as raised:
        forward(10, 20, a=30)
    error, args, kwargs = seen[0]
    assert raised.value is error and args == (10, 20) and kwargs == {"a": 30}
    frames = []
    tb = raised.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-2:] == ["forward", "failing"]  # re-raised where it was caught: a bare raise


def test_on_error_may_return_a_result_or_raise_its_own_error():
    forward = forwarder_for(call_shape((1,), {}), function=failing, on_error=lambda e, a, k: ("retried", a))
    assert forward(5) == ("retried", (5,))

    def named(error, args, kwargs):
        raise ValueError("named") from error

    forward = forwarder_for(call_shape((1,), {}), function=failing, on_error=named)
    with pytest.raises(ValueError, match="named") as raised:
        forward(5)
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_only_the_catch_types_reach_on_error():
    def keyboard(*args, **kwargs):
        raise KeyError("not caught")

    forward = forwarder_for(call_shape((1,), {}), function=keyboard, on_error=never_called)
    with pytest.raises(KeyError):
        forward(1)


@pytest.mark.parametrize("name", ["not-an-identifier", "class", "_attn_overlay_x", "a b"])
def test_keywords_no_forwarder_can_name_give_no_shape(name):
    assert call_shape((1,), {name: 1}) is None
    with pytest.raises(ValueError, match="no forwarder"):
        shaped_forwarder(recorder, (1, (name,)), fallback=fallback, on_error=never_called, catch=(RuntimeError,))


def test_tracebacks_show_the_forwarder_source():
    forward = forwarder_for(call_shape((1,), {}), function=failing, on_error=lambda e, a, k: RERAISE)
    with pytest.raises(RuntimeError) as raised:
        forward(1)
    import traceback

    text = "".join(traceback.format_exception(raised.value))
    assert "attn-overlay forwarder" in text and "_attn_overlay_function(" in text


def test_the_forwarder_keeps_no_more_than_it_was_given():
    """Only the function, the fallback and on_error are held (what the guard already holds)."""
    forward = forwarder_for(call_shape((2,), {"a": 1}))
    before = sys.getrefcount(recorder)
    forward2 = forwarder_for(call_shape((2,), {"a": 1}))
    assert sys.getrefcount(recorder) == before + 1
    del forward, forward2
