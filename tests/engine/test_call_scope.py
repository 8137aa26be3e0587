"""The per-call decision (``overlay.call_scope``): a generate() call that cannot need a per-step
replacement runs the release's own method at every step, on real transformers (issue 39).

Counted, not timed: the calls of overlay code during generate() are traced (``sys.setprofile``),
for a call of 4 and one of 8 new tokens; the difference is what runs per step. Where nothing fires
no gated layer may run at any step; a call that needs one runs it at every step; the bindings exist
on the model only during the call; a predicate that raises, a wrapper around a gated layer, and an
instance attribute of the model's own keep every layer; revert() takes the decision off.
"""

from __future__ import annotations

import functools
import importlib
import threading

import pytest

from overlay import call_scope, engine
from overlay.patch import Patch, wraps
from overlay.testing.models import greedy_ids, left_padded_batch, tiny_model
from tests._kit import count_calls, toy_generation_patch

pytestmark = pytest.mark.lane

NAME = "prepare_inputs_for_generation"
TOY = "test-gated-prepare-inputs"


@pytest.fixture(scope="module")
def mixin():
    return importlib.import_module("transformers.generation.utils").GenerationMixin


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def applied():
    """Every patch applied for the test, and only what it applied reverted after it."""
    with engine.applied():
        yield


def _gated_layers(mixin) -> dict[str, object]:
    """Every gated replacement in force on the mixin, by code object -> patch id."""
    found = {}
    for name in call_scope._gated_names:
        layer = vars(mixin).get(name)
        while layer is not None and hasattr(layer, "__wrapped__"):
            predicate, owner = getattr(layer, call_scope.NEEDED_BY_CALL, (None, None))
            if owner is layer:
                found[layer.__code__] = layer.__overlay_patch__
            layer = layer.__wrapped__
    return found


def _calls_per_call(codes, run) -> dict[str, int]:
    return count_calls(codes.get, run)


MODES = {
    "greedy": {},
    "static cache": {"cache_implementation": "static"},
    "beam search": {"num_beams": 3},
}


@pytest.mark.parametrize("mode", MODES)
def test_where_nothing_fires_no_gated_layer_runs_at_any_step(mixin, model, mode, applied):
    codes = _gated_layers(mixin)
    # offload-execution-device covers every release the overlay supports: there is a gated layer.
    assert codes, "no gated replacement in force on GenerationMixin"
    batch = left_padded_batch()
    for tokens in (4, 8):
        counts = _calls_per_call(codes, lambda: greedy_ids(model, batch, tokens, **MODES[mode]))
        assert counts == {}, f"{mode}, {tokens} new tokens: gated layers ran: {counts}"
    assert NAME not in vars(model), "the call's binding outlived the call"


def _toy_patch(calls: list, needed) -> Patch:
    def replace(original, variant):
        @wraps(original)
        def prepare_inputs_for_generation(self, *args, **kwargs):
            calls.append(vars(self).get(NAME))
            return original(self, *args, **kwargs)

        return prepare_inputs_for_generation

    return toy_generation_patch(TOY, NAME, replace, needed)


def _run_with(needed, model, **kwargs):
    calls: list = []
    with engine.reverted(), engine.isolated([_toy_patch(calls, needed)]):
        engine.apply(only=[TOY])
        assert call_scope.is_installed()
        ids = greedy_ids(model, left_padded_batch(), 4, **kwargs)
    assert not call_scope.is_installed() or engine.is_active()
    return calls, ids


def test_a_call_that_needs_the_layer_runs_it_at_every_step_and_one_that_does_not_never(model):
    with engine.reverted():
        stock_ids = greedy_ids(model, left_padded_batch(), 4)
    seen: list = []

    def needed(model_, args, kwargs):
        seen.append((type(model_).__name__, kwargs.get("max_new_tokens")))
        return kwargs.get("position_ids") is not None

    calls, ids = _run_with(needed, model)
    assert calls == [] and ids == stock_ids
    assert seen == [("LlamaForCausalLM", 4)]  # decided once per call
    calls, ids = _run_with(lambda *_: True, model)
    assert len(calls) == 4 and ids == stock_ids
    assert calls == [None] * 4  # nothing bound on the instance when the layer is needed


def test_a_predicate_that_raises_keeps_the_layer(model):
    def broken(*_):
        raise RuntimeError("cannot decide")

    calls, _ = _run_with(broken, model)
    assert len(calls) == 4


def test_the_binding_lives_only_during_the_call_even_when_it_raises(mixin, model):
    seen: list = []
    with engine.reverted(), engine.isolated([_toy_patch([], lambda *_: False)]):
        engine.apply(only=[TOY])
        gated = vars(mixin)[NAME]
        stock = gated.__wrapped__
        original_forward = type(model).forward

        def forward(self, *args, **kwargs):
            seen.append(vars(self).get(NAME))
            raise KeyError("boom")

        type(model).forward = forward
        try:
            with pytest.raises(KeyError, match="boom"):
                greedy_ids(model, left_padded_batch(), 2)
        finally:
            type(model).forward = original_forward
    assert seen and seen[0].__func__ is stock and seen[0].__self__ is model
    assert NAME not in vars(model)


def test_an_instance_attribute_of_the_model_is_left_alone(model):
    def own(*args, **kwargs):  # what PEFT binds: its own method, reaching the class's at call time
        return type(model).prepare_inputs_for_generation(model, *args, **kwargs)

    vars(model)[NAME] = own
    try:
        calls, _ = _run_with(lambda *_: False, model)
        assert len(calls) == 4  # the instance's own method reaches the class's layers: all run
        assert vars(model)[NAME] is own
    finally:
        del vars(model)[NAME]


def test_a_wrapper_around_a_gated_layer_is_never_passed_over(mixin, model):
    calls: list = []
    with engine.reverted(), engine.isolated([_toy_patch(calls, lambda *_: False)]):
        engine.apply(only=[TOY])
        gated = vars(mixin)[NAME]

        @functools.wraps(gated)  # copies the gated layer's attributes, the decision included
        def theirs(self, *args, **kwargs):
            calls.append("theirs")
            return gated(self, *args, **kwargs)

        mixin.prepare_inputs_for_generation = theirs
        try:
            greedy_ids(model, left_padded_batch(), 3)
        finally:
            mixin.prepare_inputs_for_generation = gated
    assert calls.count("theirs") == 3
    assert len(calls) == 6  # theirs, and the gated layer below it (theirs stops the descent)


def test_a_second_call_on_the_same_model_takes_the_bindings_off():
    class Model:
        pass

    first, second = Model(), Model()
    bound = {NAME: object()}
    assert call_scope._enter(first, dict(bound)) == bound and vars(first)[NAME] is bound[NAME]
    assert call_scope._enter(first, {NAME: object()}) == {}  # another call on it: nothing bound
    assert NAME not in vars(first)  # and the first call's binding is gone
    assert call_scope._enter(second, dict(bound)) == bound  # other instances are unaffected
    call_scope._leave(first, {})
    call_scope._leave(first, bound)
    call_scope._leave(second, bound)
    assert call_scope._running == {} and NAME not in vars(second)


def test_a_nested_call_that_needs_the_layer_gets_it_while_the_outer_one_had_it_skipped(model):
    # The outer call (4 tokens) does not need the layer; a call made from inside its first step
    # (3 tokens) does. The inner call must not run with the outer call's binding.
    calls: list = []
    inner_done: list = []
    with engine.reverted(), engine.isolated([_toy_patch(calls, lambda m, a, k: k.get("max_new_tokens") == 3)]):
        engine.apply(only=[TOY])
        original_forward = type(model).forward

        def forward(self, *args, **kwargs):
            if not inner_done:
                inner_done.append("started")  # before the inner call: its own steps come here too
                inner_done.append(greedy_ids(self, left_padded_batch(), 3))
            return original_forward(self, *args, **kwargs)

        type(model).forward = forward
        try:
            greedy_ids(model, left_padded_batch(), 4)
        finally:
            type(model).forward = original_forward
    # The inner call's 3 steps ran the layer; so did the outer call's steps after the inner one
    # took its binding off (every layer from then on).
    assert len(calls) >= 3 and inner_done
    assert NAME not in vars(model) and call_scope._running == {}


def test_threads_on_one_model_give_the_ids_of_one_thread(model, applied):
    with engine.reverted():
        stock_ids = greedy_ids(model, left_padded_batch(), 6)
    results: list = []
    barrier = threading.Barrier(3)

    def worker():
        barrier.wait()
        results.append(greedy_ids(model, left_padded_batch(), 6))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [stock_ids] * 3
    assert NAME not in vars(model) and call_scope._running == {}


def test_revert_takes_the_decision_off_and_apply_puts_it_back(mixin, applied):
    assert call_scope.is_installed()
    wrapper = vars(mixin)["generate"]
    with engine.reverted():
        assert not call_scope.is_installed()
        assert vars(mixin)["generate"] is wrapper.__wrapped__
        assert not hasattr(vars(mixin)["generate"], call_scope.SCOPE_MARKER)
    assert call_scope.is_installed()
