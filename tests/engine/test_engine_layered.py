"""Two overlay patches on one target, on a throwaway package: the second is judged by the stock
code under the first one's replacement and wraps it (layered), so both fixes are in force; each
can be reverted alone, in any order, and reverting all puts back the very stock objects.

The toy fixes are arithmetic on the result, so which ones are in force, and in which order they
wrap, reads off one call: stock ``compute(1)`` is 2, ``lower`` adds one, ``upper`` doubles.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import threading

import pytest

from overlay import engine
from overlay.patch import PATCH_MARKER, Patch, Target, function_of, wraps
from tests.toypkg import CORE_SOURCE, make_toy_package, remove_from_path, run_in_threads

LAYERED_SOURCE = CORE_SOURCE + '''

class Factory:
    @classmethod
    def make(cls, x):
        return x + 1


class Child(Mixin):
    pass


class GrandChild(Child):
    pass
'''

LOWER, UPPER, TOP = "toy-lower", "toy-upper", "toy-top"


@pytest.fixture
def toy(tmp_path):
    package = make_toy_package(tmp_path, source=LAYERED_SOURCE)
    yield package
    remove_from_path(package)


def _then(step, calls=None):
    """A replacement that calls the function it is given and applies ``step`` to its result."""

    def replace(original, variant):
        if calls is not None:
            calls.append(original)

        @wraps(original)
        def replacement(*args):
            return step(original(*args))

        return replacement

    return replace


def _doubled_built_once():
    """A replace() that doubles, and raises when asked to build its replacement a second time."""
    calls = []

    def once(original, variant):
        if calls:
            raise RuntimeError("built twice")
        calls.append(original)
        return _then(doubled)(original, variant)

    return once


def plus_one(value):
    return value + 1


def doubled(value):
    return value * 2


def _target(toy, qualname, step, *, first_line=None, originals=None, inherited_from=None, calls=None):
    first_line = first_line or f"def {qualname.rpartition('.')[2]}"
    if originals is None:
        originals = {toy.fingerprint(first_line, LAYERED_SOURCE): "1.x"}
    return Target(module=toy.module, qualname=qualname, originals=originals, replace=_then(step, calls),
                  inherited_from=inherited_from)


def _patch(patch_id, *targets):
    return Patch(id=patch_id, title=patch_id, errors=(), why="toy", upstream="toylib#2",
                 affected=">=1.0,<2.0", fixed_in="2.0", targets=targets)


def _compute_patches(toy):
    return _patch(LOWER, _target(toy, "Mixin.compute", plus_one)), _patch(UPPER, _target(toy, "Mixin.compute", doubled))


def _states():
    return {s.id: s.state for s in engine.status()}


def _apply_in_order(order):
    """Apply the patches one at a time in ``order`` (each ``apply(only=...)`` keeps the others)."""
    for patch_id in order:
        engine.apply(only=[patch_id])


# stock 2; lower then upper: (2 + 1) * 2; upper then lower: 2 * 2 + 1
BOTH = {(LOWER, UPPER): 6, (UPPER, LOWER): 5}
ALONE = {LOWER: 3, UPPER: 4}


@pytest.mark.parametrize("order", list(BOTH))
def test_the_second_patch_wraps_the_first_and_both_fixes_are_in_force(toy, order):
    core = toy.import_core()
    stock = vars(core.Mixin)["compute"]
    with engine.isolated(_compute_patches(toy), distribution=toy.name):
        _apply_in_order(order)
        assert core.Mixin().compute(1) == BOTH[order]
        assert _states() == {LOWER: engine.APPLIED, UPPER: engine.APPLIED}
        assert {s.id: s.variants for s in engine.status()} == {LOWER: ("1.x",), UPPER: ("1.x",)}
        outer = vars(core.Mixin)["compute"]
        first, second = order
        assert getattr(outer, PATCH_MARKER) == second
        assert getattr(outer.__wrapped__, PATCH_MARKER) == first
        assert outer.__wrapped__.__wrapped__ is stock  # one level each: no double wrapping
        assert outer.__name__ == "compute" and outer.__doc__ == stock.__doc__


@pytest.mark.parametrize("order", list(BOTH))
@pytest.mark.parametrize("reverted_one", [LOWER, UPPER])
def test_reverting_either_alone_keeps_the_other_in_force_over_stock(toy, order, reverted_one):
    core = toy.import_core()
    stock = vars(core.Mixin)["compute"]
    with engine.isolated(_compute_patches(toy), distribution=toy.name):
        _apply_in_order(order)
        engine.revert(only=[reverted_one])
        kept = UPPER if reverted_one == LOWER else LOWER
        assert core.Mixin().compute(1) == ALONE[kept]
        assert _states() == {reverted_one: engine.INACTIVE, kept: engine.APPLIED}
        current = vars(core.Mixin)["compute"]
        assert getattr(current, PATCH_MARKER) == kept and current.__wrapped__ is stock
        engine.revert()
        assert vars(core.Mixin)["compute"] is stock
        assert core.Mixin().compute(1) == 2
        # Applied again: layered again, in the order the patches are declared.
        engine.apply()
        assert core.Mixin().compute(1) == BOTH[(LOWER, UPPER)]
        assert _states() == {LOWER: engine.APPLIED, UPPER: engine.APPLIED}
        engine.revert(only=[LOWER])
        engine.revert(only=[UPPER])
        assert vars(core.Mixin)["compute"] is stock


@pytest.mark.parametrize("order", list(BOTH))
def test_revert_all_and_the_reverted_block_restore_the_stock_object(toy, order):
    core = toy.import_core()
    stock = vars(core.Mixin)["compute"]
    with engine.isolated(_compute_patches(toy), distribution=toy.name):
        _apply_in_order(order)
        with engine.reverted():
            assert vars(core.Mixin)["compute"] is stock
            assert core.Mixin().compute(1) == 2
        assert core.Mixin().compute(1) in BOTH.values()
        assert _states() == {LOWER: engine.APPLIED, UPPER: engine.APPLIED}
        # Whatever order the records are walked in, revert() takes the layers off top first.
        engine.revert(only=[LOWER, UPPER])
        assert vars(core.Mixin)["compute"] is stock
        assert _states() == {LOWER: engine.INACTIVE, UPPER: engine.INACTIVE}
        _apply_in_order(order)
        assert core.Mixin().compute(1) == BOTH[order]
    assert vars(core.Mixin)["compute"] is stock  # isolated() reverts on exit


def test_an_applied_block_on_top_of_an_applied_patch_takes_only_its_own_layer_off(toy):
    core = toy.import_core()
    with engine.isolated(_compute_patches(toy), distribution=toy.name):
        engine.apply(only=[LOWER])
        lower_replacement = vars(core.Mixin)["compute"]
        with engine.applied(only=[UPPER]):
            assert core.Mixin().compute(1) == BOTH[(LOWER, UPPER)]
        assert vars(core.Mixin)["compute"] is lower_replacement
        assert _states() == {LOWER: engine.APPLIED, UPPER: engine.INACTIVE}


def test_the_middle_of_three_layers_reverted_alone(toy):
    core = toy.import_core()
    stock = vars(core.Mixin)["compute"]
    top = _patch(TOP, _target(toy, "Mixin.compute", lambda value: value - 10))
    with engine.isolated((*_compute_patches(toy), top), distribution=toy.name):
        core = toy.import_core()
        engine.apply()
        assert core.Mixin().compute(1) == (2 + 1) * 2 - 10
        engine.revert(only=[UPPER])
        assert core.Mixin().compute(1) == 2 + 1 - 10
        assert _states() == {LOWER: engine.APPLIED, UPPER: engine.INACTIVE, TOP: engine.APPLIED}
        engine.revert(only=[LOWER])
        assert core.Mixin().compute(1) == 2 - 10
        assert vars(core.Mixin)["compute"].__wrapped__ is stock
        engine.revert()
        assert vars(core.Mixin)["compute"] is stock


def test_a_patch_already_in_the_chain_is_not_wrapped_twice(toy):
    # A second engine copy (or a re-entrant import) meets both layers in place: each patch finds
    # its own replacement in the chain, the lower one under the upper's, and leaves it.
    core = toy.import_core()
    stock = vars(core.Mixin)["compute"]
    with engine.isolated(_compute_patches(toy), distribution=toy.name):
        engine.apply()
        layered = vars(core.Mixin)["compute"]
        with engine.isolated(_compute_patches(toy), distribution=toy.name):
            engine.apply()
            assert vars(core.Mixin)["compute"] is layered
            states = {s.id: s for s in engine.status()}
            assert {pid: s.state for pid, s in states.items()} == {LOWER: engine.APPLIED, UPPER: engine.APPLIED}
            assert all(s.reason == "already applied in this process" for s in states.values())
        assert vars(core.Mixin)["compute"] is layered  # the second engine had nothing to put back
        # The post-import hook called again on the same module (no re-execution): both keep their
        # layers, and revert still finds them.
        engine._on_module_executed(core)
        assert vars(core.Mixin)["compute"] is layered
        assert core.Mixin().compute(1) == BOTH[(LOWER, UPPER)]
        engine.revert()
        assert vars(core.Mixin)["compute"] is stock


def test_a_reload_layers_both_patches_on_the_new_code(toy):
    with engine.isolated(_compute_patches(toy), distribution=toy.name):
        engine.apply()
        core = toy.import_core()
        core = importlib.reload(core)
        stock = vars(core.Mixin)["compute"].__wrapped__.__wrapped__
        assert core.Mixin().compute(1) == BOTH[(LOWER, UPPER)]
        assert _states() == {LOWER: engine.APPLIED, UPPER: engine.APPLIED}
        engine.revert()
        assert vars(core.Mixin)["compute"] is stock


def test_a_foreign_replacement_on_top_displaces_both_and_a_foreign_wrapper_keeps_both(toy):
    core = toy.import_core()
    with engine.isolated(_compute_patches(toy), distribution=toy.name):
        engine.apply()
        layered = core.Mixin.compute

        def compute(self, x):  # someone else's, set after the overlay patched
            return -1

        core.Mixin.compute = compute
        assert _states() == {LOWER: engine.DISPLACED, UPPER: engine.DISPLACED}
        assert all(f"is now {__name__}." in s.reason for s in engine.status())

        @wraps(layered)
        def logged(self, x):
            return layered(self, x)

        core.Mixin.compute = logged
        assert _states() == {LOWER: engine.APPLIED, UPPER: engine.APPLIED}
        assert core.Mixin().compute(1) == BOTH[(LOWER, UPPER)]
        core.Mixin.compute = compute
        engine.revert()  # leaves the other's function where it is
        assert vars(core.Mixin)["compute"] is compute


def test_a_foreign_wrapper_between_is_never_looked_through(toy, caplog):
    # A wrapper another library put around the lower patch's replacement (functools.wraps copies
    # the overlay's marker onto it) is not the overlay's: the upper patch judges it as it is,
    # finds code it does not know, and leaves everything as it was.
    core = toy.import_core()
    lower, upper = _compute_patches(toy)
    with engine.isolated([lower, upper], distribution=toy.name):
        engine.apply(only=[LOWER])
        ours = core.Mixin.compute

        @wraps(ours)
        def logged(self, x):
            return ours(self, x)

        core.Mixin.compute = logged
        with caplog.at_level(logging.WARNING, logger="overlay"):
            engine.apply(only=[UPPER])
        assert vars(core.Mixin)["compute"] is logged
        assert _states() == {LOWER: engine.APPLIED, UPPER: engine.UNRECOGNISED}
        assert core.Mixin().compute(1) == ALONE[LOWER]


def test_a_foreign_function_under_the_overlay_is_still_foreign(toy):
    core = toy.import_core()

    def compute(self, x):  # another library's, in place before the overlay came
        return x + 2

    core.Mixin.compute = compute
    with engine.isolated(_compute_patches(toy), distribution=toy.name):
        engine.apply()
        assert vars(core.Mixin)["compute"] is compute
        states = {s.id: s for s in engine.status()}
        assert {pid: s.state for pid, s in states.items()} == {LOWER: engine.UNRECOGNISED, UPPER: engine.UNRECOGNISED}
        assert all("another library put there" in s.reason for s in states.values())


def test_an_upper_patch_whose_code_check_fails_leaves_the_lower_one_untouched(toy):
    core = toy.import_core()
    lower = _patch(LOWER, _target(toy, "Mixin.compute", plus_one))
    upper = _patch(UPPER, _target(toy, "Mixin.compute", doubled, originals={"0" * 64: "some other release"}))
    with engine.isolated([lower, upper], distribution=toy.name):
        engine.apply()
        replacement = vars(core.Mixin)["compute"]
        assert getattr(replacement, PATCH_MARKER) == LOWER
        states = {s.id: s for s in engine.status()}
        assert states[LOWER].state == engine.APPLIED
        assert states[UPPER].state == engine.UNRECOGNISED
        assert "Mixin.compute is not the code this patch was written for" in states[UPPER].reason
        assert core.Mixin().compute(1) == ALONE[LOWER]


@pytest.mark.parametrize(("qualname", "first_line", "call", "stock_value"), [
    ("Mixin.scale", "@staticmethod", lambda core: core.Mixin.scale(1), 10),
    ("Factory.make", "def make", lambda core: core.Factory.make(1), 2),
])
def test_a_staticmethod_or_classmethod_target_stays_one_through_every_order(toy, qualname, first_line, call, stock_value):
    core = toy.import_core()
    owner_name, name = qualname.split(".")
    owner = getattr(core, owner_name)
    stock = vars(owner)[name]
    kind = type(stock)
    lower = _patch(LOWER, _target(toy, qualname, plus_one, first_line=first_line))
    upper = _patch(UPPER, _target(toy, qualname, doubled, first_line=first_line))
    with engine.isolated([lower, upper], distribution=toy.name):
        engine.apply()
        assert type(vars(owner)[name]) is kind
        assert call(core) == (stock_value + 1) * 2
        assert function_of(vars(owner)[name]).__wrapped__.__wrapped__ is function_of(stock)
        engine.revert(only=[LOWER])
        assert type(vars(owner)[name]) is kind
        assert call(core) == stock_value * 2
        assert _states() == {LOWER: engine.INACTIVE, UPPER: engine.APPLIED}
        engine.apply(only=[LOWER])  # now on top of the upper one
        assert call(core) == stock_value * 2 + 1
        engine.revert(only=[UPPER])
        assert type(vars(owner)[name]) is kind
        assert call(core) == stock_value + 1
        engine.revert()
        assert vars(owner)[name] is stock


@pytest.mark.parametrize("reverted_first", [LOWER, UPPER])
def test_an_inherited_target_layers_on_its_class_and_revert_deletes_it_again(toy, reverted_first):
    core = toy.import_core()
    before = {cls: dict(vars(cls)) for cls in (core.Mixin, core.Child)}
    inherited = f"{toy.module}:Mixin.compute"
    lower = _patch(LOWER, _target(toy, "Child.compute", plus_one, first_line="def compute", inherited_from=inherited))
    upper = _patch(UPPER, _target(toy, "Child.compute", doubled, first_line="def compute", inherited_from=inherited))
    with engine.isolated([lower, upper], distribution=toy.name):
        engine.apply()
        assert core.Child().compute(1) == BOTH[(LOWER, UPPER)]
        assert core.Mixin().compute(1) == 2
        engine.revert(only=[reverted_first])
        kept = UPPER if reverted_first == LOWER else LOWER
        assert core.Child().compute(1) == ALONE[kept]
        assert vars(core.Child)["compute"].__wrapped__ is before[core.Mixin]["compute"]
        engine.revert()
    assert {cls: dict(vars(cls)) for cls in (core.Mixin, core.Child)} == before
    assert "compute" not in vars(core.Child)


def test_an_upper_layer_that_cannot_be_built_again_fails_whole(toy):
    # Reverting the lower patch rebuilds the upper one over stock; when its replace() raises
    # there, the upper patch says so and none of its targets keeps its fix (all or none).
    core = toy.import_core()
    stock = {name: vars(core.Mixin)[name] for name in ("compute", "scale")}
    once = _doubled_built_once()

    lower = _patch(LOWER, _target(toy, "Mixin.compute", plus_one))
    upper_compute = Target(module=toy.module, qualname="Mixin.compute",
                           originals={toy.fingerprint("def compute", LAYERED_SOURCE): "1.x"}, replace=once)
    upper = _patch(UPPER, upper_compute, _target(toy, "Mixin.scale", doubled, first_line="@staticmethod"))
    with engine.isolated([lower, upper], distribution=toy.name):
        engine.apply()
        assert core.Mixin().compute(1) == 6 and core.Mixin.scale(1) == 20
        engine.revert(only=[LOWER])
        states = {s.id: s for s in engine.status()}
        assert states[LOWER].state == engine.INACTIVE
        assert states[UPPER].state == engine.FAILED
        assert "RuntimeError while layering it again after a revert under it: built twice" in states[UPPER].reason
        assert {name: vars(core.Mixin)[name] for name in ("compute", "scale")} == stock


def test_concurrent_first_imports_layer_each_patch_once(toy):
    lower_calls, upper_calls = [], []
    lower = _patch(LOWER, _target(toy, "Mixin.compute", plus_one, calls=lower_calls))
    upper = _patch(UPPER, _target(toy, "Mixin.compute", doubled, calls=upper_calls))
    barrier = threading.Barrier(8)
    results, errors = [], []

    def worker():
        try:
            barrier.wait()
            results.append(importlib.import_module(toy.module).Mixin().compute(1))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with engine.isolated([lower, upper], distribution=toy.name):
        engine.apply()
        run_in_threads(worker, 8)
        assert errors == []
        assert results == [BOTH[(LOWER, UPPER)]] * 8
        assert len(lower_calls) == 1 and len(upper_calls) == 1
        assert getattr(upper_calls[0], PATCH_MARKER) == LOWER  # the upper one was given the lower's


# -- a patch on the base method and patches on subclasses' inherited copies -----------------------
# BASE patches Mixin.compute (+1), SUB Child's inherited copy (x2), GRAND GrandChild's (-10): in any
# order of application each is in force (in its class and below) exactly while its status says
# "applied", each reverts alone, and all reverted leave every namespace as it was.

BASE, SUB, GRAND = "toy-base", "toy-sub", "toy-grand"


def _hierarchy_patches(toy, sub_replace=None):
    inherited = f"{toy.module}:Mixin.compute"
    base = _patch(BASE, _target(toy, "Mixin.compute", plus_one))
    sub = _patch(SUB, _target(toy, "Child.compute", doubled, first_line="def compute", inherited_from=inherited))
    if sub_replace is not None:
        sub = _patch(SUB, Target(module=toy.module, qualname="Child.compute", replace=sub_replace,
                                 originals={toy.fingerprint("def compute", LAYERED_SOURCE): "1.x"},
                                 inherited_from=inherited))
    grand = _patch(GRAND, _target(toy, "GrandChild.compute", lambda value: value - 10, first_line="def compute",
                                  inherited_from=inherited))
    return base, sub, grand


def _hierarchy_value(core, applied):
    """What Child().compute(1) must give with the ``applied`` patches in force (stock 2)."""
    value = 2 + (BASE in applied)
    return value * 2 if SUB in applied else value


def _check_hierarchy(core, applied):
    applied = set(applied)
    assert core.Mixin().compute(1) == 2 + (BASE in applied)
    assert core.Child().compute(1) == _hierarchy_value(core, applied)
    assert core.GrandChild().compute(1) == _hierarchy_value(core, applied) - 10 * (GRAND in applied)
    expected = {pid: engine.APPLIED if pid in applied else engine.INACTIVE for pid in (BASE, SUB, GRAND)}
    assert {pid: state for pid, state in _states().items() if pid in expected} == expected


@pytest.mark.parametrize("order", [(BASE, SUB), (SUB, BASE)])
def test_a_base_patch_and_a_subclass_patch_compose_in_either_order(toy, order):
    core = toy.import_core()
    base, sub, _ = _hierarchy_patches(toy)
    namespaces = {cls: dict(vars(cls)) for cls in (core.Mixin, core.Child, core.GrandChild)}
    with engine.isolated([base, sub], distribution=toy.name):
        _apply_in_order(order)
        assert core.Child().compute(1) == 6  # (2 + 1) * 2 whichever came first
        assert _states() == {BASE: engine.APPLIED, SUB: engine.APPLIED}
        engine.revert(only=[BASE])
        assert core.Child().compute(1) == 4 and core.Mixin().compute(1) == 2
        assert _states() == {BASE: engine.INACTIVE, SUB: engine.APPLIED}
        engine.apply(only=[BASE])
        assert core.Child().compute(1) == 6
        engine.revert(only=[SUB])
        assert core.Child().compute(1) == 3 and "compute" not in vars(core.Child)
        assert _states() == {BASE: engine.APPLIED, SUB: engine.INACTIVE}
        engine.apply(only=[SUB])
        engine.revert()
        assert core.Child().compute(1) == 2
        assert {cls: dict(vars(cls)) for cls in namespaces} == namespaces
        assert _states() == {BASE: engine.INACTIVE, SUB: engine.INACTIVE}


@pytest.mark.parametrize("order", list(itertools.permutations((BASE, SUB, GRAND))))
def test_three_levels_of_inherited_patches_compose_in_every_order_and_revert_alone(toy, order):
    core = toy.import_core()
    patches = _hierarchy_patches(toy)
    namespaces = {cls: dict(vars(cls)) for cls in (core.Mixin, core.Child, core.GrandChild)}
    with engine.isolated(patches, distribution=toy.name):
        applied = set()
        for patch_id in order:
            engine.apply(only=[patch_id])
            applied.add(patch_id)
            _check_hierarchy(core, applied)
        for patch_id in order:  # reverted one at a time, in the order they came
            engine.revert(only=[patch_id])
            applied.discard(patch_id)
            _check_hierarchy(core, applied)
        assert {cls: dict(vars(cls)) for cls in namespaces} == namespaces
        for patch_id in reversed(order):
            engine.apply(only=[patch_id])
        for reverted_one in order:  # each alone, from all three
            engine.revert(only=[reverted_one])
            _check_hierarchy(core, {BASE, SUB, GRAND} - {reverted_one})
            engine.apply(only=[reverted_one])
            _check_hierarchy(core, {BASE, SUB, GRAND})
        with engine.reverted():
            _check_hierarchy(core, set())
            assert {cls: dict(vars(cls)) for cls in namespaces} == namespaces
        _check_hierarchy(core, {BASE, SUB, GRAND})
    assert {cls: dict(vars(cls)) for cls in namespaces} == namespaces


def test_a_subclass_layer_that_cannot_follow_its_base_fails_whole(toy):
    # The base patch comes after the subclass patch, whose replace() raises when built again onto
    # it: the subclass patch says so and leaves the class's namespace as it was; the base stays.
    core = toy.import_core()
    once = _doubled_built_once()

    base, sub, _ = _hierarchy_patches(toy, sub_replace=once)
    with engine.isolated([base, sub], distribution=toy.name):
        engine.apply(only=[SUB])
        assert core.Child().compute(1) == 4
        engine.apply(only=[BASE])
        states = {s.id: s for s in engine.status()}
        assert states[BASE].state == engine.APPLIED
        assert states[SUB].state == engine.FAILED
        assert "RuntimeError while layering it again" in states[SUB].reason
        assert "compute" not in vars(core.Child)
        assert core.Child().compute(1) == 3

