"""The engine's word is what is in force, on a throwaway package: a module still executing in
another thread is judged only once it has executed; a replacement someone else displaced is
"displaced", naming what took its place; strict mode makes the import that triggered a failure
raise; one patch's failure never takes another down. (Real transformers, many threads:
tests/engine/test_engine_threads.py.)"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading

import pytest

from overlay import engine
from overlay.engine import OverlayError
from overlay.patch import Target, wraps
from tests.toypkg import CORE_SOURCE, ToyPackage, make_toy_package, remove_from_path, toy_patch

# A module body that stops half-way (before ``Mixin`` is defined) until the test lets it go on.
# ``from .gate import``, as transformers' modules import their siblings: it never waits for the
# package's import lock (``from . import gate`` would, while the package is still initialising).
GATED_SOURCE = "from .gate import reached, release\nreached.set()\nassert release.wait(60)\n" + CORE_SOURCE
GATE_SOURCE = "import threading\nreached = threading.Event()\nrelease = threading.Event()\n"


@pytest.fixture
def toy(tmp_path):
    package = make_toy_package(tmp_path)
    yield package
    remove_from_path(package)


@pytest.fixture
def gated(tmp_path):
    package = make_toy_package(tmp_path, source=GATED_SOURCE)
    (tmp_path / f"site_{package.name}" / package.name / "gate.py").write_text(GATE_SOURCE)
    yield package
    remove_from_path(package)


def _status(patch_id="toy-add-two"):
    return {s.id: s for s in engine.status()}[patch_id]


def _start_import(name):
    """Import ``name`` in a thread of its own: the thread, and the list its error goes to."""
    errors = []

    def run():
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 -- the test asserts on it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def _import_in_thread(package):
    thread, errors = _start_import(package.module)
    gate = importlib.import_module(f"{package.name}.gate")
    assert gate.reached.wait(60), "the other thread never started executing the module"
    return thread, gate, errors


def test_a_module_executing_in_another_thread_is_judged_once_it_has_executed(gated):
    with engine.isolated([toy_patch(gated)], distribution=gated.name):
        engine.apply()  # watching: the other thread's import goes through the finder
        thread, gate, errors = _import_in_thread(gated)
        engine.apply()  # meets the half-executed module in sys.modules: must not judge it
        assert _status().state == engine.PENDING, _status().reason
        gate.release.set()
        thread.join(60)
        assert errors == []
        assert _status().state == engine.APPLIED, _status().reason
        assert importlib.import_module(gated.module).Mixin().compute(1) == 3


def test_activated_while_a_module_executes_unwatched_it_stays_pending_until_apply_again(gated):
    with engine.isolated([toy_patch(gated)], distribution=gated.name):
        thread, gate, errors = _import_in_thread(gated)  # not watched: nothing wraps this import
        engine.apply()
        status = _status()
        assert status.state == engine.PENDING
        assert "still executing in another thread" in status.reason and "overlay.apply() again" in status.reason
        gate.release.set()
        thread.join(60)
        assert errors == []
        engine.apply()
        assert _status().state == engine.APPLIED
        assert importlib.import_module(gated.module).Mixin().compute(1) == 3


def test_a_submodule_imported_while_the_package_hook_activates_is_judged(gated):
    # The startup hook's shape: a hook on the package activates the engine, while another thread
    # is already executing a target submodule (found during the package's hooks: wrapped, so its
    # own post-import hook judges it when it has executed).
    import _attn_overlay_startup as startup

    finder = startup.ensure_finder()
    package_name = gated.name
    seen = {}

    def activate_on_package(module):
        thread, gate, errors = _import_in_thread(gated)
        engine.apply()
        seen["during"] = _status().state
        gate.release.set()
        thread.join(60)
        seen["errors"] = errors

    with engine.isolated([toy_patch(gated)], distribution=gated.name):
        finder.watch(package_name, activate_on_package)
        try:
            importlib.import_module(package_name)
        finally:
            finder.unwatch(package_name, activate_on_package)
        assert seen == {"during": engine.PENDING, "errors": []}
        assert _status().state == engine.APPLIED, _status().reason
        assert importlib.import_module(gated.module).Mixin().compute(1) == 3


# transformers' own import race, one level up (seen once in CI, 5.18.0, a shuffled free start: nine
# generation.utils patches left "pending"): the thread executing the package fails and the import
# system removes the package from sys.modules, while another thread, whose parent (a subpackage,
# like transformers.generation) is still there, goes on importing a target module; then a third
# import of the package succeeds and its hook activates the engine while that module executes.
FAILING_PACKAGE_SOURCE = """from .gate import executions, started, may_fail
executions.append(1)
if len(executions) == 1:  # the first execution fails, as a thread that met a half-initialised sibling
    started.set()
    assert may_fail.wait(60)
    raise ImportError("cannot import name 'x' from partially initialized module (the test's stand-in)")
"""
FAILING_PACKAGE_GATE = GATE_SOURCE + "executions = []\nstarted = threading.Event()\nmay_fail = threading.Event()\n"


def test_a_target_imported_after_its_package_failed_in_another_thread_is_judged(tmp_path):
    import _attn_overlay_startup as startup

    package = make_toy_package(tmp_path, source=GATED_SOURCE)
    folder = tmp_path / f"site_{package.name}" / package.name
    (folder / "gate.py").write_text(FAILING_PACKAGE_GATE)
    (folder / "__init__.py").write_text(FAILING_PACKAGE_SOURCE)
    (folder / "sub").mkdir()
    (folder / "sub" / "__init__.py").write_text("")
    (folder / "core.py").rename(folder / "sub" / "core.py")
    (folder / "sub" / "core.py").write_text(GATED_SOURCE.replace("from .gate", "from ..gate"))
    target = ToyPackage(name=package.name, root=package.root, module=f"{package.name}.sub.core")
    finder = startup.ensure_finder()

    def activate_on_package(module):  # the startup hook's watch on transformers
        engine.apply()

    try:
        with engine.isolated([toy_patch(target)], distribution=package.name):
            finder.watch(package.name, activate_on_package)
            failing, failed = _start_import(package.name)
            gate = importlib.import_module(f"{package.name}.gate")  # the package's, half-executed
            assert gate.started.wait(60)
            importlib.import_module(f"{package.name}.sub")  # the parent the target will find
            gate.may_fail.set()
            failing.join(60)
            assert [type(exc) for exc in failed] == [ImportError] and package.name not in sys.modules
            assert package.name in finder._failed_open
            late, late_errors = _start_import(target.module)  # its parent is there: the package is not imported again
            assert gate.reached.wait(60)
            importlib.import_module(package.name)  # succeeds: the hook activates, the target half-executed
            assert _status().state == engine.PENDING
            # The package's hooks ran to the end: its other submodules go unwrapped again.
            assert package.name not in finder._failed_open
            gate.release.set()
            late.join(60)
            assert late_errors == []
            assert _status().state == engine.APPLIED, _status().reason
            assert importlib.import_module(target.module).Mixin().compute(1) == 3
    finally:
        finder.unwatch(package.name, activate_on_package)
        remove_from_path(package)


def test_a_plain_reassignment_is_displaced_naming_what_replaced_it(toy):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        core = toy.import_core()
        ours = core.Mixin.__dict__["compute"]

        def compute(self, x):  # someone else's, set after the overlay patched
            return -1

        core.Mixin.compute = compute
        status = _status()
        assert status.state == engine.DISPLACED
        assert f"{toy.module}:Mixin.compute is now {__name__}.{compute.__qualname__}" in status.reason
        assert "ATTN_OVERLAY_DISABLE=toy-add-two" in status.reason
        assert engine.DISPLACED in engine.BAD_STATES
        with pytest.raises(OverlayError, match="displaced"):
            engine.apply(strict=True)  # strict reads the same status
        core.Mixin.compute = ours  # put back: applied again (derived when read, never stored)
        assert _status().state == engine.APPLIED
        core.Mixin.compute = compute
        engine.revert()  # leaves the other's function where it is, and says so
        assert core.Mixin.__dict__["compute"] is compute


def test_a_wrapper_that_keeps_the_replacement_is_still_applied(toy):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        core = toy.import_core()
        ours = core.Mixin.compute

        @wraps(ours)
        def logged(self, x):
            return ours(self, x)

        core.Mixin.compute = logged
        assert _status().state == engine.APPLIED
        assert core.Mixin().compute(1) == 3


def test_reapplying_never_patches_over_the_foreign_function(toy):
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        core = toy.import_core()

        def compute(self, x):
            return -1

        core.Mixin.compute = compute
        engine.apply()
        assert core.Mixin.__dict__["compute"] is compute
        assert _status().state == engine.DISPLACED


def test_strict_mode_makes_the_triggering_import_raise(toy):
    patch = toy_patch(toy, originals={"0" * 64: "some other release"})
    with engine.isolated([patch], distribution=toy.name):
        engine.apply(strict=True)
        with pytest.raises(OverlayError, match=r"toy-add-two not applied: .*not the code this patch was written for.*strict mode") as raised:
            toy.import_core()
        assert getattr(raised.value, "raise_through_import", False)  # the startup hook lets it through


def _raising_replace(original, variant):
    raise RuntimeError("this patch is broken")


def test_one_broken_patch_never_takes_the_others_down(toy):
    broken = toy_patch(toy, patch_id="toy-broken", replace=_raising_replace)
    scale_fp = toy.fingerprint("@staticmethod")

    def times_100(original, variant):
        @wraps(original)
        def scale(x):
            return x * 100

        return scale

    working = toy_patch(toy, patch_id="toy-scale")
    working = type(working)(**{**working.__dict__, "targets": (
        Target(module=toy.module, qualname="Mixin.scale", originals={scale_fp: "1.x"}, replace=times_100),
    )})
    # A failure that escapes the patch's own replace() guard (a broken locate, say) is isolated too.
    escaping = toy_patch(toy, patch_id="toy-escaping")
    bad_target = Target(module=toy.module, qualname="Mixin.compute", originals={}, replace=_raising_replace)
    object.__setattr__(bad_target, "locate", lambda module: (_ for _ in ()).throw(LookupError("locate broke")))
    escaping = type(escaping)(**{**escaping.__dict__, "targets": (bad_target,)})
    with engine.isolated([broken, escaping, working], distribution=toy.name):
        engine.apply()
        core = toy.import_core()  # not strict: the import works
        states = {s.id: (s.state, s.reason) for s in engine.status()}
        assert states["toy-broken"][0] == engine.FAILED and "this patch is broken" in states["toy-broken"][1]
        assert states["toy-escaping"][0] == engine.FAILED and "locate broke" in states["toy-escaping"][1]
        assert states["toy-scale"][0] == engine.APPLIED
        assert core.Mixin.scale(2) == 200
        assert core.Mixin().compute(1) == 2  # the broken patch left its target stock


@pytest.mark.parametrize(
    ("introduced_in", "says"),
    [
        ("1.0", "0.9 does not have this bug: the code that causes it arrived in 1.0"),
        (None, "0.9 is older than 1.0, the oldest release this patch was written for: not checked (the bug may be there)"),
    ],
)
def test_out_of_range_says_whether_the_release_has_the_bug(tmp_path, introduced_in, says):
    package = make_toy_package(tmp_path, version="0.9")
    try:
        patch = toy_patch(package)
        patch = type(patch)(**{**patch.__dict__, "introduced_in": introduced_in})
        with engine.isolated([patch], distribution=package.name):
            engine.apply()
            status = _status()
            assert status.state == engine.OUT_OF_RANGE
            assert status.reason == f"{package.name} {says}"
    finally:
        remove_from_path(package)


def test_code_another_library_put_there_first_is_unrecognised_and_named(toy):
    core = toy.import_core()

    def compute(self, x):  # another library's, set before the overlay was activated
        return -1

    core.Mixin.compute = compute
    with engine.isolated([toy_patch(toy)], distribution=toy.name):
        engine.apply()
        status = _status()
        assert status.state == engine.UNRECOGNISED
        assert f"{toy.module}:Mixin.compute is {__name__}.{compute.__qualname__}, which another library put there" in status.reason
        assert core.Mixin.__dict__["compute"] is compute


STRICT_STARTUP = """
import sys
sys.path.insert(0, {repo!r})
import _attn_overlay_startup  # the .pth line's import
from overlay.patches import kv_cache_dtype  # make its code unrecognisable: no fingerprint matches
for target in kv_cache_dtype.PATCH.targets:
    object.__setattr__(target, "originals", {{}})
import overlay
try:
    import transformers.cache_utils
except overlay.OverlayError as exc:
    print("RAISED", exc)
else:
    print("IMPORTED", {{s.id: s.state for s in overlay.status()}})
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="imports transformers.cache_utils, which imports torch")
@pytest.mark.parametrize("strict", ["1", "0"])
def test_strict_mode_makes_a_real_import_raise_through_the_startup_hook(strict):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, ATTN_OVERLAY="1", ATTN_OVERLAY_STRICT=strict)
    done = subprocess.run([sys.executable, "-c", STRICT_STARTUP.format(repo=repo)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=repo)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    if strict == "1":
        assert last.startswith("RAISED attn-overlay: patch kv-cache-dtype not applied: ")
        assert "not the code this patch was written for" in last and last.endswith("(strict mode)")
    else:  # warned, and every other patch of the module still applied
        assert last.startswith("IMPORTED ") and "'kv-cache-dtype': 'unrecognised code'" in last
        assert "not applied" in done.stderr


def test_a_release_older_than_every_patch_gets_one_summary_line():
    from overlay import install_check

    # What the patches are there, as the verification would find them: out of range, all.
    states = {engine.gate(p, "4.40.0")[0] for p in engine.known_patches()}
    assert states == {engine.OUT_OF_RANGE}
    line = install_check._older_than_every_patch("4.40.0", states)
    assert line.startswith("transformers 4.40.0 is older than 4.55.0, the oldest release any patch was written for")
    assert install_check._older_than_every_patch("5.18.0", {engine.APPLIED, engine.OUT_OF_RANGE}) is None
