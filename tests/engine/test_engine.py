"""The engine, on a throwaway package instead of transformers: gate, fingerprints, hook, revert."""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import threading
from dataclasses import replace

import pytest

from overlay import engine
from overlay.engine import OverlayError
from overlay.patch import PATCH_MARKER, Target, wraps
from tests.toypkg import (
    CORE_SOURCE,
    FIXED_COMPUTE,
    add_two,
    make_toy_package,
    remove_from_path,
    run_in_threads,
    scale_target,
    toy_patch,
)


@pytest.fixture
def toy(tmp_path):
    package = make_toy_package(tmp_path)
    yield package
    remove_from_path(package)


def _toy_at(tmp_path, version, source=CORE_SOURCE):
    return make_toy_package(tmp_path, version=version, source=source)


def _state(patch_id="toy-add-two"):
    return {s.id: s for s in engine.status()}[patch_id]


def _assert_left_stock(toy, distribution, state, reason):
    """Applying the toy patch gated on ``distribution`` leaves compute stock, with this status."""
    with engine.isolated([toy_patch(toy)], distribution=distribution):
        engine.apply()
        core = toy.import_core()
        assert core.Mixin().compute(1) == 2
        status = _state()
        assert status.state == state
        assert reason in status.reason


def test_lazy_import_in_range_applies_then_revert_restores_identity(toy):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        assert _state().state == engine.PENDING
        assert toy.module not in sys.modules
        core = toy.import_core()  # the hook fires right after the module body runs
        original = core.Mixin.__dict__["compute"].__wrapped__
        assert core.Mixin().compute(1) == 3
        assert _state().state == engine.APPLIED
        assert _state().variants == ("1.x",)
        engine.revert()
        assert core.Mixin.__dict__["compute"] is original
        assert core.Mixin().compute(1) == 2
        assert _state().state == engine.INACTIVE


def test_loader_is_the_real_one_after_import(toy):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        core = toy.import_core()
        assert type(core.__loader__).__name__ == "SourceFileLoader"
        assert core.__spec__.loader is core.__loader__
        assert "return x + 1" in inspect.getsource(core.Mixin.__dict__["compute"].__wrapped__)


def test_replacement_keeps_name_doc_signature_and_marker(toy):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        core = toy.import_core()
        patched = core.Mixin.__dict__["compute"]
        assert patched.__name__ == "compute"
        assert patched.__doc__ == "Adds one (the bug: should add two)."
        assert str(inspect.signature(patched)) == "(self, x)"
        assert getattr(patched, PATCH_MARKER) == "toy-add-two"


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.9", engine.OUT_OF_RANGE),
        ("2.0", engine.FIXED_UPSTREAM),
        ("2.3.1", engine.FIXED_UPSTREAM),
        ("1.9.0.dev0", engine.APPLIED),  # dev build of an affected release
        ("1.5.0+neuron", engine.APPLIED),  # vendor local build
        ("2.0.0rc1", engine.FIXED_UPSTREAM),  # pre-release of the fixed one: judged by release number
    ],
)
def test_version_gate(tmp_path, version, expected):
    # The label decides alone where the code is none the patch knows (a release after the data's
    # newest, say): here the installed compute matches neither the original nor the fixed print,
    # except on the in-range labels, whose code the patch knows (the toy's own).
    package = _toy_at(tmp_path, version)
    known = expected == engine.APPLIED
    unknown = {} if known else {"0" * 64: "1.x"}
    try:
        with engine.isolated([toy_patch(package, originals=unknown or None, fixed=unknown and {"1" * 64: "2.x"})],
                             distribution=package.name):
            engine.apply()
            core = package.import_core()
            state = _state()
            assert state.state == expected, state.reason
            assert version in state.reason or expected == engine.APPLIED
            assert core.Mixin().compute(1) == (3 if expected == engine.APPLIED else 2)
    finally:
        remove_from_path(package)


BEFORE_COMPUTE = CORE_SOURCE.replace("return x + 1", "return x + 1  # before the bug, as the data says")


@pytest.mark.parametrize(
    ("version", "source", "expected", "disagrees"),
    [
        # The bug's code under labels outside the range: the patch applies, and says why.
        ("0.9", CORE_SOURCE, engine.APPLIED, "outside >=1.0,<2.0"),
        ("2.3.1", CORE_SOURCE, engine.APPLIED, "outside >=1.0,<2.0"),
        # Upstream's fix, or code from before the bug, under a label inside the range.
        ("1.5.0", FIXED_COMPUTE, engine.FIXED_UPSTREAM, "inside >=1.0,<2.0"),
        ("1.5.0", BEFORE_COMPUTE, engine.OUT_OF_RANGE, "inside >=1.0,<2.0"),
        # The fix under a label from before the range: fixed upstream, not "out of range".
        ("0.9", FIXED_COMPUTE, engine.FIXED_UPSTREAM, "outside >=1.0,<2.0"),
        # Where they agree, nothing is said of the label.
        ("2.3.1", FIXED_COMPUTE, engine.FIXED_UPSTREAM, None),
        ("1.5.0", CORE_SOURCE, engine.APPLIED, None),
        ("0.9", BEFORE_COMPUTE, engine.OUT_OF_RANGE, None),
    ],
    ids=["bug-under-older-label", "bug-under-newer-label", "fix-under-affected-label", "before-under-affected-label",
         "fix-under-older-label", "fix-agrees", "bug-agrees", "before-agrees"],
)
def test_the_code_decides_where_the_release_facts_know_it(tmp_path, version, source, expected, disagrees):
    package = _toy_at(tmp_path, version, source=source)
    before = {package.fingerprint("def compute", BEFORE_COMPUTE): "0.x"}
    patch = toy_patch(package)
    patch = replace(patch, targets=(replace(patch.targets[0], before=before),))
    try:
        with engine.isolated([patch], distribution=package.name):
            engine.apply()
            core = package.import_core()
            state = _state()
            assert state.state == expected, state.reason
            patched = getattr(vars(core.Mixin)["compute"], PATCH_MARKER, None)
            assert patched == ("toy-add-two" if expected == engine.APPLIED else None)
            if disagrees is None:
                assert "the code decides" not in state.reason
            else:
                assert f"the code decides, though the package metadata of {package.name} says {version}, {disagrees}" \
                    in state.reason
    finally:
        remove_from_path(package)


def test_distribution_not_installed_is_not_affected_and_import_still_works(toy):
    _assert_left_stock(toy, "surely-not-installed-dist", engine.NOT_INSTALLED, "surely-not-installed-dist is not installed")


def test_fingerprint_mismatch_is_unrecognised_and_untouched(toy, caplog):
    patch = toy_patch(toy, originals={"0" * 64: "some other release"})
    with engine.isolated([patch], distribution=toy.name):
        engine.apply()
        with caplog.at_level(logging.WARNING, logger="overlay"):
            core = toy.import_core()
        assert core.Mixin().compute(1) == 2
        assert not hasattr(core.Mixin.__dict__["compute"], PATCH_MARKER)
        state = _state()
        assert state.state == engine.UNRECOGNISED
        assert "Mixin.compute is not the code this patch was written for" in state.reason
        assert any("not applied" in r.getMessage() for r in caplog.records)


def test_fingerprint_mismatch_raises_in_strict_mode(toy):
    patch = toy_patch(toy, originals={"0" * 64: "some other release"})
    with engine.isolated([patch], distribution=toy.name):
        engine.apply(strict=True)
        with pytest.raises(OverlayError, match="not the code this patch was written for.*strict mode"):
            toy.import_core()


def test_strict_mode_from_environment(toy, monkeypatch):
    monkeypatch.setenv("ATTN_OVERLAY_STRICT", "1")
    patch = toy_patch(toy, originals={"0" * 64: "some other release"})
    with engine.isolated([patch], distribution=toy.name):
        engine.apply()
        with pytest.raises(OverlayError):
            toy.import_core()


def test_fixed_fingerprint_inside_range_reports_fixed_upstream(tmp_path):
    # e.g. a 1.x point release that backported the fix
    package = _toy_at(tmp_path, "1.7.0", source=FIXED_COMPUTE)
    try:
        with engine.isolated([toy_patch(package)], distribution=package.name):
            engine.apply()
            core = package.import_core()
            assert core.Mixin().compute(1) == 3  # upstream's own fix, not ours
            assert not hasattr(core.Mixin.__dict__["compute"], PATCH_MARKER)
            state = _state()
            assert state.state == engine.FIXED_UPSTREAM
            assert "already the fixed code (as in 2.x)" in state.reason
    finally:
        remove_from_path(package)


def test_already_imported_module_is_patched_at_once_with_a_warning(toy, caplog):
    core = toy.import_core()
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        with caplog.at_level(logging.INFO, logger="overlay"):
            engine.apply()
        assert core.Mixin().compute(1) == 3
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(toy.module in w and "imported before the overlay was activated" in w for w in warnings)
        infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        assert len(infos) == 1 and "patched toy-add-two in " + toy.module in infos[0]


def test_apply_a_thousand_times_is_one_wrapper_level(toy):
    core = toy.import_core()
    original = core.Mixin.__dict__["compute"]
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        for _ in range(1000):
            engine.apply()
        patched = core.Mixin.__dict__["compute"]
        assert patched.__wrapped__ is original
        assert not hasattr(original, PATCH_MARKER)
        assert core.Mixin().compute(1) == 3
        engine.revert()
        assert core.Mixin.__dict__["compute"] is original


def test_a_patch_that_raises_leaves_every_target_untouched(toy):
    def broken(original, variant):
        raise RuntimeError("replacement exploded")

    core = toy.import_core()
    compute_before = core.Mixin.__dict__["compute"]
    scale_before = core.Mixin.__dict__["scale"]
    patch = toy_patch(toy, extra_targets=(scale_target(toy, broken),))
    with engine.isolated([patch], distribution=toy.name):
        engine.apply()
        assert core.Mixin.__dict__["compute"] is compute_before
        assert core.Mixin.__dict__["scale"] is scale_before
        state = _state()
        assert state.state == engine.FAILED
        assert "RuntimeError: replacement exploded" in state.reason


def test_staticmethod_target_stays_a_staticmethod(toy):
    def times_hundred(original, variant):
        @wraps(original)
        def scale(x):
            return original(x) * 10

        return scale

    patch = toy_patch(toy, extra_targets=(scale_target(toy, times_hundred),))
    with engine.isolated([patch], distribution=toy.name):
        engine.apply()
        core = toy.import_core()
        assert isinstance(core.Mixin.__dict__["scale"], staticmethod)
        assert core.Mixin.scale(2) == 200
        engine.revert()
        assert core.Mixin.scale(2) == 20


def test_concurrent_first_imports_from_threads_apply_once(toy):
    calls = []

    def counting(original, variant):
        calls.append(1)
        return add_two(original, variant)

    barrier = threading.Barrier(8)
    results, errors = [], []

    def worker():
        try:
            barrier.wait()
            core = importlib.import_module(toy.module)
            results.append(core.Mixin().compute(1))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with engine.isolated([toy_patch(toy, replace=counting)], distribution=toy.name):
        engine.apply()
        run_in_threads(worker, 8)
        assert not errors
        assert results == [3] * 8
        assert len(calls) == 1
        assert _state().state == engine.APPLIED


def test_applied_context_reverts_only_what_it_applied(toy):
    core = toy.import_core()
    original = core.Mixin.__dict__["compute"]
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        with engine.applied() as statuses:
            assert [s.state for s in statuses] == [engine.APPLIED]
            assert core.Mixin().compute(1) == 3
        assert core.Mixin.__dict__["compute"] is original
        engine.apply()
        with engine.applied():
            pass
        assert core.Mixin().compute(1) == 3  # applied before the block: still applied after
        with engine.reverted():
            assert core.Mixin().compute(1) == 2
        assert core.Mixin().compute(1) == 3


def test_applied_context_leaves_a_module_first_imported_after_it_stock(toy):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        with engine.applied() as statuses:
            assert [s.state for s in statuses] == [engine.PENDING]
        assert toy.module not in sys.modules
        core = toy.import_core()  # after the block: nothing asked for the patch any more
        assert core.Mixin().compute(1) == 2
        assert _state().state == engine.INACTIVE
        engine.apply()  # a later activation still patches it
        assert core.Mixin().compute(1) == 3


def test_applied_context_reverts_a_module_first_imported_inside_it(toy):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        with engine.applied():
            core = toy.import_core()  # patched on import, inside the block
            assert core.Mixin().compute(1) == 3
        assert core.Mixin().compute(1) == 2
        assert _state().state == engine.INACTIVE


def test_unknown_patch_id_is_a_clear_error(toy):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        with pytest.raises(OverlayError, match=r"unknown patch id\(s\) \['nope'\]; known: \['toy-add-two'\]"):
            engine.apply(only=["nope"])


def test_disable_variable_leaves_a_patch_out(toy, monkeypatch):
    monkeypatch.setenv("ATTN_OVERLAY_DISABLE", "toy-add-two")
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        core = toy.import_core()
        assert core.Mixin().compute(1) == 2
        assert _state().state == engine.DISABLED


def test_invalid_version_string_is_reported_not_raised(tmp_path):
    package = _toy_at(tmp_path, "not-a-version")
    unknown = {"0" * 64: "1.x"}
    try:
        with engine.isolated([toy_patch(package, originals=unknown, fixed=unknown)], distribution=package.name):
            engine.apply()
            core = package.import_core()
            assert core.Mixin().compute(1) == 2
            assert _state().state == engine.UNRECOGNISED
            assert "not a PEP 440 version" in _state().reason
        # Code the patch knows decides, whatever the label is (a fork's own version string).
        with engine.isolated([toy_patch(package)], distribution=package.name):
            engine.apply()
            assert core.Mixin().compute(1) == 3
            assert _state().state == engine.APPLIED
            assert "metadata of {} says not-a-version, which is not a PEP 440 version".format(package.name) in _state().reason
    finally:
        remove_from_path(package)


def test_a_patch_spanning_two_modules_is_refused():
    from overlay.patch import Patch

    with pytest.raises(ValueError, match="split it into one patch per module"):
        Patch(
            id="x", title="x", errors=(), why="", upstream="", affected=">=1", fixed_in=None,
            targets=(
                Target(module="a", qualname="f", originals={}, replace=lambda f, variant: f),
                Target(module="b", qualname="g", originals={}, replace=lambda f, variant: f),
            ),
        )


def _post_import_finders():
    return [f for f in sys.meta_path if type(f).__name__ == "PostImportFinder"]


def test_one_finder_serves_every_engine_and_isolation_restores_its_watches(toy):
    # The real engine watches through the one finder on sys.meta_path; an isolated engine (the
    # tests' own) registers on the same finder and gives back exactly what was there.
    import _attn_overlay_startup as startup

    finder = startup.ensure_finder()
    finder.watch("some.module.nobody.imports", print)
    before = finder.watched()
    try:
        with engine.isolated([toy_patch(toy)], distribution=toy.name):
            engine.apply()
            assert _post_import_finders() == [finder]
            assert toy.module in finder.watched()
            core = toy.import_core()
            assert core.Mixin().compute(1) == 3
        assert finder.watched() == before
        assert _post_import_finders() == [finder]
    finally:
        finder.unwatch("some.module.nobody.imports", print)


def test_reload_of_a_patched_module_patches_the_new_code(toy):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        core = toy.import_core()
        assert core.Mixin().compute(1) == 3
        core = importlib.reload(core)
        # Stock would compute 2 here: the reload re-executed the module with the original code.
        assert core.Mixin().compute(1) == 3
        assert getattr(core.Mixin.__dict__["compute"], PATCH_MARKER) == "toy-add-two"
        assert _state().state == engine.APPLIED
        engine.revert()
        assert core.Mixin().compute(1) == 2


def test_reverted_block_keeps_a_module_first_imported_inside_it_stock(toy, caplog):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        caplog.set_level(logging.INFO, logger="overlay")
        with engine.reverted():
            core = toy.import_core()  # pending when the block started
            assert core.Mixin().compute(1) == 2
        assert core.Mixin().compute(1) == 3
        assert _state().state == engine.APPLIED
        assert "imported before the overlay was activated" not in caplog.text


def test_reverted_block_and_a_second_apply_log_no_late_import_warning(toy, caplog):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        core = toy.import_core()
        caplog.set_level(logging.INFO, logger="overlay")
        with engine.reverted():
            assert core.Mixin().compute(1) == 2
        assert core.Mixin().compute(1) == 3
        engine.apply()  # a program calling apply() in a process the startup hook patched
        assert core.Mixin().compute(1) == 3
        assert "imported before the overlay was activated" not in caplog.text


def _rewrite_core(toy, source):
    """Change the toy module's code on disk (for a reload), past any cached bytecode."""
    import shutil
    from pathlib import Path

    folder = Path(toy.root) / toy.name
    (folder / "core.py").write_text(source)
    shutil.rmtree(folder / "__pycache__", ignore_errors=True)
    importlib.invalidate_caches()


@pytest.mark.parametrize("block", ["none", "reverted", "applied-non-strict"])
def test_strict_mode_survives_reverted_and_applied_blocks(toy, monkeypatch, block):
    # The caller chose strict; a block that re-applies must not fall back to the environment's
    # (or its own) mode afterwards: unrecognised code met after the block still raises.
    monkeypatch.delenv("ATTN_OVERLAY_STRICT", raising=False)
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply(strict=True)
        core = toy.import_core()
        assert core.Mixin().compute(1) == 3
        if block == "reverted":
            with engine.reverted():
                assert core.Mixin().compute(1) == 2
        elif block == "applied-non-strict":
            with engine.applied(strict=False):
                assert engine.settings().strict is False
        assert core.Mixin().compute(1) == 3
        assert engine.settings().strict is True
        _rewrite_core(toy, CORE_SOURCE.replace("return x + 1", "return x + 10"))
        with pytest.raises(OverlayError, match="not the code this patch was written for.*strict mode"):
            importlib.reload(core)


def test_apply_without_strict_keeps_the_mode_in_force(toy, monkeypatch):
    monkeypatch.setenv("ATTN_OVERLAY_STRICT", "1")
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply(strict=False)  # the caller's choice beats the environment
        engine.apply()  # and a later apply() without one keeps it
        assert engine.settings().strict is False


INHERITING_SOURCE = CORE_SOURCE + '''

class Child(Mixin):
    pass


class Other(Mixin):
    pass
'''


def _inherited_target(toy, unless=None):
    """``Child.compute``, which ``Child`` inherits from ``Mixin`` (Target.inherited_from)."""
    return Target(
        module=toy.module,
        qualname="Child.compute",
        inherited_from=f"{toy.module}:Mixin.compute",
        unless=unless,
        optional=True,
        originals={toy.fingerprint("def compute"): "1.x"},
        replace=add_two,
    )


def test_an_inherited_target_is_set_on_its_class_only_and_revert_deletes_it(tmp_path):
    toy = _toy_at(tmp_path, "1.5.0", INHERITING_SOURCE)
    try:
        core = toy.import_core()
        before = {cls: dict(vars(cls)) for cls in (core.Mixin, core.Child, core.Other)}
        patch = toy_patch(toy, extra_targets=(_inherited_target(toy),))
        with engine.isolated([patch], distribution=toy.name):
            engine.apply()
            assert _state().state == engine.APPLIED and _state().variants == ("1.x", "1.x")
            replacement = vars(core.Child)["compute"]
            assert replacement.__wrapped__ is before[core.Mixin]["compute"]
            assert "compute" not in vars(core.Other)
            engine.revert()
        assert {cls: dict(vars(cls)) for cls in (core.Mixin, core.Child, core.Other)} == before
        assert "compute" not in vars(core.Child) and core.Child().compute(1) == 2
    finally:
        remove_from_path(toy)


def test_a_target_is_absent_where_its_unless_function_exists(tmp_path):
    # Child.compute stands in only where Mixin.scale does not exist (here it does): absent, not
    # read, not patched; the patch applies with its other target.
    toy = _toy_at(tmp_path, "1.5.0", INHERITING_SOURCE)
    try:
        core = toy.import_core()
        target = _inherited_target(toy, unless="Mixin.scale")
        assert target.locate(core).raw is None
        assert _inherited_target(toy, unless="Mixin.no_such_method").locate(core).raw is vars(core.Mixin)["compute"]
        with engine.isolated([toy_patch(toy, extra_targets=(target,))], distribution=toy.name):
            engine.apply()
            assert _state().state == engine.APPLIED and _state().variants == ("1.x",)
            assert "compute" not in vars(core.Child)
    finally:
        remove_from_path(toy)
