"""device-move-nested (on ``GenerationMixin.prepare_inputs_for_generation``) next to a patch on a
model class's inherited copy of the same method, on real transformers (issue 38).

No shipped pair does this yet; the next patch on a model's ``prepare_inputs_for_generation`` (a
class that inherits it, ``Target.inherited_from``) will. A spy patch on
``LlamaForCausalLM.prepare_inputs_for_generation`` stands in for it: it counts its calls and
changes nothing. In either order of application both are in force in Llama (the spy wraps what
Llama inherits now: device-move-nested's replacement), each reverted alone leaves the other in
force, and all reverted leave Llama's namespace as it was; generate() gives stock's ids throughout.
"""

from __future__ import annotations

import importlib

import pytest

from overlay import engine
from overlay.patch import Patch, Target, fingerprint, wraps
from overlay.swapping import carries
from overlay.testing.harness import PatchUnderTest
from overlay.testing.models import greedy_ids, left_padded_batch, tiny_model

PATCH = PatchUnderTest("device_move")
if not PATCH.affected:
    pytest.skip(f"{PATCH.id} applies on {PATCH.patch.affected}; found {PATCH.transformers}", allow_module_level=True)

NAME = "prepare_inputs_for_generation"
SPY = "test-llama-prepare-inputs-spy"
LLAMA = "transformers.models.llama.modeling_llama"


def _spy_patch(calls: list) -> Patch:
    stock = PATCH.stock()  # GenerationMixin's own, behind any replacement in this process

    def replace(original, variant):
        @wraps(original)
        def prepare_inputs_for_generation(self, *args, **kwargs):
            calls.append(type(self).__name__)
            return original(self, *args, **kwargs)

        return prepare_inputs_for_generation

    target = Target(module=LLAMA, qualname=f"LlamaForCausalLM.{NAME}", replace=replace,
                    originals={fingerprint(stock): "installed"},
                    inherited_from=f"transformers.generation.utils:GenerationMixin.{NAME}")
    return Patch(id=SPY, title="spy", errors=(), why="test", upstream="none", affected=">=0", fixed_in=None,
                 targets=(target,))


@pytest.fixture(scope="module")
def classes():
    generation = importlib.import_module("transformers.generation.utils")
    llama = importlib.import_module(LLAMA)
    return generation.GenerationMixin, llama.LlamaForCausalLM


@pytest.fixture(scope="module")
def stock_ids():
    with engine.reverted():
        return greedy_ids(tiny_model("llama"), left_padded_batch(), 4)


def _states() -> dict[str, str]:
    return {s.id: s.state for s in engine.status()}


@pytest.mark.parametrize("order", [(SPY, "device-move-nested"), ("device-move-nested", SPY)])
def test_the_base_patch_reaches_a_subclass_patched_before_or_after_it(classes, stock_ids, order):
    mixin, llama = classes
    calls: list = []
    with engine.reverted():
        stock = vars(mixin)[NAME]
        before = dict(vars(llama))
        with engine.isolated([PATCH.patch, _spy_patch(calls)]):
            for patch_id in order:
                engine.apply(only=[patch_id])
            assert _states() == {PATCH.id: engine.APPLIED, SPY: engine.APPLIED}
            in_llama = vars(llama)[NAME]
            assert carries(in_llama, SPY) and carries(in_llama, PATCH.id)
            assert in_llama.__wrapped__ is vars(mixin)[NAME]  # what Llama inherits now
            assert greedy_ids(tiny_model("llama"), left_padded_batch(), 4) == stock_ids
            assert calls and set(calls) == {"LlamaForCausalLM"}

            engine.revert(only=[PATCH.id])  # the base patch alone: gone from Llama too
            assert _states() == {PATCH.id: engine.INACTIVE, SPY: engine.APPLIED}
            assert vars(mixin)[NAME] is stock
            assert vars(llama)[NAME].__wrapped__ is stock and not carries(vars(llama)[NAME], PATCH.id)

            engine.apply(only=[PATCH.id])
            engine.revert(only=[SPY])  # the subclass patch alone: the base one stays in force
            assert _states() == {PATCH.id: engine.APPLIED, SPY: engine.INACTIVE}
            assert NAME not in vars(llama) and carries(llama.prepare_inputs_for_generation, PATCH.id)

            engine.apply(only=[SPY])
            engine.revert()
            assert vars(mixin)[NAME] is stock
            assert dict(vars(llama)) == before
            calls.clear()
            assert greedy_ids(tiny_model("llama"), left_padded_batch(), 4) == stock_ids
            assert calls == []
