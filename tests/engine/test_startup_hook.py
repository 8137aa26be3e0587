"""The startup hook in a real fresh virtual environment, as users get it from the wheel."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.freshenv import build_wheel, fresh_env_can_import, install_wheel, make_fresh_env

#: Whether the fresh environments can import the patches' target modules: they import torch, and
#: the fresh environments see the runner's site-packages folder only. Without torch there (a
#: Python the machine has no torch wheel for: the torch-free lanes, ``nox -s python_lanes``; or
#: a release lane, whose torch is another path line away) the user program below imports
#: ``transformers`` itself: that import needs no torch and is the one that starts the engine, so
#: the hook does all of its work; the patches' modules cannot be imported there, and their
#: patches rightly stay "pending".
PATCHABLE = fresh_env_can_import("torch", "transformers")
USER_IMPORT = "transformers.generation.utils" if PATCHABLE else "transformers"
#: transformers without torch says so on stderr ("PyTorch was not found"): not the overlay's words.
NO_ADVICE = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}

STATUS_AFTER_IMPORT = f"import json, sys\nimport {USER_IMPORT}  # noqa: F401  (what a user program does)\n"
STATUS_AFTER_IMPORT += textwrap.dedent(
    """
    mods_before = set(sys.modules)
    import overlay.engine as engine
    print(json.dumps({"active": engine.is_active(),
                      "states": {s.id: s.state for s in engine.status()},
                      "startup_error": engine.activation_error()}))
    """
)

SPAWN_CHILD = textwrap.dedent(
    """
    import json, multiprocessing as mp, queue as queues

    def child(queue):
        import USER_IMPORT  # noqa: F401
        import overlay.engine as engine
        queue.put((engine.is_active(), {s.id: s.state for s in engine.status()}))

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=child, args=(queue,))
        proc.start()
        answer = None
        for _ in range(200):  # a child that died is reported now, not after the whole wait
            exited = not proc.is_alive()  # read before the queue: an answer sent before exit is in it
            try:
                answer = queue.get(timeout=1)
                break
            except queues.Empty:
                if exited:
                    raise SystemExit(f"the spawn child exited {proc.exitcode} without an answer")
        if answer is None:
            raise SystemExit("the spawn child gave no answer in 200 s")
        active, states = answer
        proc.join(timeout=60)
        print(json.dumps({"active": active, "states": states, "exitcode": proc.exitcode}))
    """
).replace("USER_IMPORT", USER_IMPORT)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, wheel):
    env = make_fresh_env(tmp_path_factory.mktemp("venv") / "env")
    install_wheel(env, wheel)
    return env


HOOK_FILES = ("attn_overlay.pth", "attn_overlay.start")


@pytest.fixture(scope="module")
def no_pth(tmp_path_factory, fresh):
    """``fresh``'s site-packages without the hook files (copied: a second pip install costs
    seconds): the interpreter never imports the startup module there. ``ATTN_OVERLAY=0`` would not
    do as a baseline: the ``.pth`` line still runs and imports the module."""
    import shutil

    env = make_fresh_env(tmp_path_factory.mktemp("venv-no-pth") / "env")
    shutil.copytree(fresh.site_packages, env.site_packages, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", *HOOK_FILES))
    return env


def _last_json(done):
    return json.loads(done.stdout.strip().splitlines()[-1])


def _expected_active_states():
    """Every patch must end in a good state once its module is imported: never bad, never pending
    (pending only where its module cannot be imported: no torch, see ``PATCHABLE``)."""
    return {"applied", "fixed upstream", "out of range"} | (set() if PATCHABLE else {"pending"})


def test_wheel_puts_the_hook_at_the_root_of_site_packages(fresh):
    files = fresh.files()
    assert "attn_overlay.pth" in files
    assert "attn_overlay.start" in files
    assert "_attn_overlay_startup.py" in files
    assert "overlay/patches/__init__.py" in files
    assert "patches/__init__.py" not in files  # no generic top-level `patches` package


def test_hook_is_active_without_importing_overlay(fresh):
    done = fresh.run("-c", STATUS_AFTER_IMPORT, env=NO_ADVICE)
    result = _last_json(done)
    assert result["active"] is True, result
    assert result["startup_error"] is None
    generation_patches = {k: v for k, v in result["states"].items()}
    assert generation_patches and set(generation_patches.values()) <= _expected_active_states() | {"pending"}
    assert done.stderr == ""


def test_hook_does_not_import_heavy_modules_at_startup(fresh):
    done = fresh.run("-c", "import sys, json; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch','transformers','packaging','overlay','importlib_metadata'))))")
    assert _last_json(done) == []
    # At start the small startup module itself waits on sys.meta_path; the finder takes its place
    # when transformers is first searched for (or when asked for).
    done = fresh.run("-c", "import sys; print([getattr(f, '__name__', type(f).__name__) for f in sys.meta_path][0])")
    assert done.stdout.strip() == "_attn_overlay_startup"
    done = fresh.run("-c", "import sys, transformers; print([type(f).__name__ for f in sys.meta_path][0], "
                           "sys.modules['_attn_overlay_startup'] in sys.meta_path)")
    assert done.stdout.strip() == "PostImportFinder False"


TAKE_OVER = """
import sys, threading
import _attn_overlay_startup as waiting
before = list(sys.meta_path)
at = before.index(waiting)
results = []
def other_imports():  # another thread walks sys.meta_path meanwhile: it must find every module
    for name in ("json", "csv", "email.mime.text", "xml.dom.minidom", "http.client", "tomllib"):
        results.append(__import__(name).__name__)
thread = threading.Thread(target=other_imports)
thread.start()
import transformers
thread.join()
after = list(sys.meta_path)
print(len(after) == len(before), type(after[at]).__name__, after[:at] + after[at + 1:] == before[:at] + before[at + 1:],
      waiting in after, len(results))
"""


def test_the_finder_takes_the_startup_modules_place_when_transformers_is_imported(fresh):
    # One item assignment at the same index: the other finders keep their places, so a thread
    # walking sys.meta_path during the hand-over skips none of them.
    done = fresh.run("-c", TAKE_OVER, env=NO_ADVICE)
    assert done.stdout.strip().splitlines()[-1] == "True PostImportFinder True False 6", done.stderr


# Nothing imported before the snapshot: sorted() and print() are builtins.
STARTUP_MODULES = (
    "import sys; print(sorted(sys.modules)); "
    "print([getattr(f, '__name__', type(f).__name__) for f in sys.meta_path])"
)


def test_hook_imports_nothing_a_bare_interpreter_does_not(fresh, no_pth):
    # Every module imported at start is paid by every Python process of the environment: the
    # hook may add itself, and nothing else (no threading, functools, collections...).
    import ast

    def at_start(env):
        modules, finders = env.run("-c", STARTUP_MODULES).stdout.splitlines()[-2:]
        return set(ast.literal_eval(modules)), ast.literal_eval(finders)

    with_hook, finders_with_hook = at_start(fresh)
    without, finders_without = at_start(no_pth)
    assert "_attn_overlay_startup" in finders_with_hook and "_attn_overlay_startup" not in finders_without
    assert sorted(with_hook - without) == ["_attn_overlay_startup"], "imported at start because of the hook"
    assert sorted(without - with_hook) == []


def test_spawn_child_is_patched_too(fresh, tmp_path):
    script = tmp_path / "spawn_child.py"
    script.write_text(SPAWN_CHILD)
    result = _last_json(fresh.run(str(script)))
    assert result["exitcode"] == 0
    assert result["active"] is True


def test_attn_overlay_0_turns_it_off(fresh):
    result = _last_json(fresh.run("-c", STATUS_AFTER_IMPORT, env={"ATTN_OVERLAY": "0"}))
    assert result["active"] is False
    assert set(result["states"].values()) == {"inactive"}


def test_apply_cli_verifies_the_hook(fresh):
    done = fresh.run("-m", "overlay.apply", "--json", "--strict")
    report = json.loads(done.stdout)
    assert report["hook"] == {"active": True, "verified": True, "reason": None}
    assert {row["state"] for row in report["patches"]} <= _expected_active_states()
    done = fresh.run("-m", "overlay.apply", "--strict", env={"ATTN_OVERLAY": "0"}, check=False)
    assert done.returncode == 1
    assert "startup hook: NOT active: ATTN_OVERLAY=0 is set" in done.stdout
    # No process gets the patches: the table never says "applied", but what they would reach.
    report = json.loads(fresh.run("-m", "overlay.apply", "--json", env={"ATTN_OVERLAY": "0"}).stdout)
    assert report["hook"]["active"] is False and "ATTN_OVERLAY=0" in report["hook"]["reason"]
    assert {row["state"] for row in report["patches"]} == {"inactive"}
    assert {row["would_be"] for row in report["patches"]} <= _expected_active_states()


def test_apply_cli_runs_a_program_with_patches_applied(fresh, tmp_path):
    program = tmp_path / "prog.py"
    program.write_text(
        f"import sys, json\nimport {USER_IMPORT}\nimport overlay.engine as e\n"
        "print(json.dumps({'argv': sys.argv, 'active': e.is_active()}))\n"
    )
    result = _last_json(fresh.run("-m", "overlay.apply", str(program), "a", "--b", env={"ATTN_OVERLAY": "0"}))
    assert result == {"argv": [str(program), "a", "--b"], "active": True}


def test_uninstall_leaves_nothing_behind(tmp_path, wheel):
    env = make_fresh_env(tmp_path / "env", with_runner_packages=False)
    before = env.files()
    install_wheel(env, wheel)
    env.run("-c", "import _attn_overlay_startup, _attn_overlay_finder, overlay.engine, overlay.patches")  # write bytecode caches
    env.pip("uninstall", "-y", "attn-overlay")
    assert env.files() == before


def test_transformers_not_installed(tmp_path, wheel):
    env = make_fresh_env(tmp_path / "env", with_runner_packages=False)
    install_wheel(env, wheel)
    # packaging is a dependency; here it comes from the runner through PYTHONPATH-free path line
    done = env.run("-c", "import transformers", check=False)
    assert "No module named 'transformers'" in done.stderr
    assert "attn" not in done.stderr  # the hook itself stays silent
    done = env.run("-m", "overlay.apply", "--json", check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["transformers_version"] is None
    assert report["hook"]["reason"] == "transformers is not installed: nothing to patch"
    assert {row["state"] for row in report["patches"]} == {"inactive"}


def test_hook_file_left_behind_after_the_package_is_gone(tmp_path, wheel):
    env = make_fresh_env(tmp_path / "env")
    install_wheel(env, wheel)
    import shutil

    shutil.rmtree(env.site_packages / "overlay")
    done = env.run("-c", f"import {USER_IMPORT}; print('ok')", env=NO_ADVICE)
    assert done.stdout.strip() == "ok" and done.stderr == ""
    (env.site_packages / "_attn_overlay_startup.py").unlink()
    done = env.run("-c", f"import {USER_IMPORT}; print('ok')", env=NO_ADVICE)
    assert done.stdout.strip() == "ok" and done.stderr == ""


def test_an_isolated_build_environment_reads_entry_points(fresh):
    """pip builds a package from source in an isolated environment: the interpreter starts with
    the environment's site-packages (so the hook runs), then pip's sitecustomize drops that folder
    from sys.path, and setuptools reads entry points (importlib.metadata asks every finder on
    sys.meta_path for ``find_distributions``). The waiting finder must answer "no such attribute"
    without loading the full finder, which cannot be imported there."""
    program = textwrap.dedent(
        """
        import site, sys
        import importlib.metadata as metadata
        assert any(getattr(f, "__name__", "") == "_attn_overlay_startup" for f in sys.meta_path), sys.meta_path
        dropped = set(site.getsitepackages())
        sys.path[:] = [p for p in sys.path if p not in dropped]
        list(metadata.entry_points(group="distutils.setup_keywords"))
        list(metadata.distributions())
        assert "_attn_overlay_finder" not in sys.modules
        import json  # noqa: F401  (imports still pass the waiting finder)
        print("ok")
        """
    )
    done = fresh.run("-c", program)
    assert done.stdout.strip() == "ok" and done.stderr == "", done.stderr


def _read_only_runner():
    """A way to run a command with one directory mounted read-only, as an unprivileged user
    namespace (root in CI ignores file modes, so chmod proves nothing)."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return "unshare" if probe.returncode == 0 else None


def test_read_only_site_packages(tmp_path, wheel):
    import subprocess

    if _read_only_runner() is None:
        pytest.skip("needs `unshare -rm` (user + mount namespaces) to mount site-packages read-only")
    env = make_fresh_env(tmp_path / "env")
    install_wheel(env, wheel)
    # No bytecode caches: the interpreter must compile in memory and cannot write them back.
    for cache in env.site_packages.rglob("__pycache__"):
        import shutil

        shutil.rmtree(cache)
    import shlex

    site = shlex.quote(str(env.site_packages))
    program = tmp_path / "status_after_import.py"
    program.write_text(STATUS_AFTER_IMPORT)
    script = (
        f"mount --bind {site} {site} && mount -o remount,bind,ro {site} && "
        f"{{ touch {site}/probe 2>/dev/null && echo WRITABLE; }}; "
        f"exec {shlex.quote(str(env.python))} {shlex.quote(str(program))}"
    )
    import os

    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OVERLAY")}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True,
                          timeout=240, env=clean_env)
    assert "WRITABLE" not in done.stdout
    assert done.returncode == 0, done.stderr
    result = _last_json(done)
    assert result["active"] is True and result["startup_error"] is None
    assert not list(env.site_packages.rglob("__pycache__"))


#: The keys schema 1 started with: within one schema number keys are only ever added (overlay/cli.py).
REPORT_KEYS = {"schema", "overlay_version", "python", "transformers_version", "hook", "patches", "import_errors", "ok"}


def test_json_report_has_one_schema_in_every_case(fresh, tmp_path):
    import overlay

    cases = {
        "active": fresh.run("-m", "overlay.apply", "--json"),
        "off": fresh.run("-m", "overlay.apply", "--json", env={"ATTN_OVERLAY": "0"}),
        "no-verify": fresh.run("-m", "overlay.apply", "--json", "--no-verify"),
    }
    reports = {name: json.loads(done.stdout) for name, done in cases.items()}
    for name, report in reports.items():
        assert set(report) == set(reports["active"]) and REPORT_KEYS <= set(report), name
        assert report["schema"] == 1 and report["overlay_version"] == overlay.__version__, name
    assert fresh.run("-m", "overlay", "--version").stdout.strip() == f"attn-overlay {overlay.__version__}"


def test_piping_into_head_prints_no_traceback(fresh):
    import subprocess

    done = subprocess.run(
        f"{fresh.python} -m overlay.apply --json --no-verify | head -n 1", shell=True,
        capture_output=True, text=True, timeout=240, cwd=str(fresh.root),
    )
    assert done.stdout.strip() == "{"
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_a_stray_overlay_py_next_to_the_script_is_named_on_stderr(fresh, tmp_path):
    # The user's own overlay.py shadows the package name: the fixes cannot load, and the user
    # is told which file does it instead of running unpatched in silence.
    cache_module = "transformers.cache_utils" if PATCHABLE else "transformers"
    # Is Cache.update the overlay's? None where transformers.cache_utils cannot be imported (no torch).
    patched = ("c = sys.modules.get('transformers.cache_utils'); "
               "print(None if c is None else hasattr(c.Cache.update, '__overlay_patch__'))")
    (tmp_path / "overlay.py").write_text("USERS_OWN = True\n")
    (tmp_path / "prog.py").write_text(f"import sys, overlay, {cache_module}\nprint(overlay.USERS_OWN)\n{patched}\n")
    done = fresh.run(str(tmp_path / "prog.py"), cwd=str(tmp_path), env=NO_ADVICE)
    assert done.stdout.split() == ["True", "False" if PATCHABLE else "None"]  # the user's module stays theirs
    (line,) = [l for l in done.stderr.splitlines() if l.startswith("attn-overlay:")]
    assert str(tmp_path / "overlay.py") in line and "NOT active" in line and "Rename" in line
    # Elsewhere the same script's process is patched.
    (tmp_path / "overlay.py").unlink()
    done = fresh.run("-c", f"import sys, {cache_module}; {patched}", cwd=str(tmp_path), env=NO_ADVICE)
    assert done.stdout.split() == ["True" if PATCHABLE else "None"] and "attn-overlay" not in done.stderr


@pytest.mark.parametrize("flag, active", [("-S", False), ("-I", True), ("-E", True)])
def test_verification_runs_with_the_callers_interpreter_flags(fresh, flag, active):
    # With -S site-packages (and the startup hook) are not read at all: the verification child
    # must get -S too, or it reports a hook the caller's processes never run.
    import overlay

    package_root = str(__import__("pathlib").Path(overlay.__file__).parent.parent)
    code = (
        "import sys, json; sys.path[:0] = [%r]; sys.argv = ['x', '--json'];"
        "import overlay.install_check as c; from overlay import engine;"
        "print(json.dumps({'flags': c.interpreter_flags(), 'active': c.verify_in_subprocess().get('hook_active'),"
        " 'why': c.why_the_hook_is_inactive()}))"
    ) % package_root
    result = _last_json(fresh.run(flag, "-c", code))
    assert flag in result["flags"] or (flag == "-I" and "-I" in result["flags"])
    if flag == "-S":
        assert result["active"] in (False, None)
        assert "-S" in result["why"]
    else:
        assert result["active"] is True
