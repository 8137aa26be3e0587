"""``python -m overlay.apply`` / ``attn-overlay``: its messages work where they are given.

- next to a stray ``overlay.py`` the startup hook's advice names a command that runs there, and
  ``attn-overlay`` there names the shadowing file;
- ``-m MODULE`` / ``PROGRAM`` that cannot run get Python's own one line and exit status;
- ``-S`` (not ``-I``) is what keeps the startup hook from running;
- the program mode reaches ``multiprocessing`` spawn and forkserver children.

The fresh-environment tests install this tree's wheel into a virtual environment of their own
(``tests/freshenv.py``) and check that environment's overlay is the wheel's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from overlay import install_check
from tests.freshenv import build_wheel, install_wheel, make_fresh_env

REPO = Path(__file__).resolve().parents[2]


def _python(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """This interpreter, on this tree's overlay (PYTHONPATH), the startup hook off (conftest)."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=240)


# -- a program that cannot run: Python's own words ----------------------------------------------------


@pytest.mark.parametrize("module", ["no_such_module_for_attn_overlay", "json.no_such_submodule", "email"])
def test_a_module_that_cannot_run_gets_pythons_own_line(module, tmp_path):
    stock = _python("-m", module, cwd=tmp_path)
    ours = _python("-m", "overlay.apply", "-m", module, cwd=tmp_path)
    assert stock.returncode == 1 and stock.stderr.startswith(f"{sys.executable}: No module named ")
    assert (ours.returncode, ours.stderr) == (stock.returncode, stock.stderr)
    assert "Traceback" not in ours.stderr


def test_without_runpys_private_resolver_the_module_check_steps_aside(monkeypatch):
    # runpy._get_module_details is what `python -m` calls, but private: a Python without it gets no
    # early message, and the program mode leaves the error to runpy.run_module itself.
    import runpy

    from overlay import cli

    assert cli._cannot_run_module("no_such_module_for_attn_overlay").startswith("No module named")
    monkeypatch.delattr(runpy, "_get_module_details")
    assert cli._cannot_run_module("no_such_module_for_attn_overlay") is None


@pytest.mark.parametrize("program", ["no_such_program.py", "a_folder_without_main"])
def test_a_program_that_cannot_run_gets_pythons_own_line(program, tmp_path):
    (tmp_path / "a_folder_without_main").mkdir()
    stock = _python(program, cwd=tmp_path)
    ours = _python("-m", "overlay.apply", program, cwd=tmp_path)
    assert stock.returncode in (1, 2) and "Traceback" not in stock.stderr
    assert (ours.returncode, ours.stderr) == (stock.returncode, stock.stderr)


def test_an_import_error_inside_the_program_is_still_its_own_traceback(tmp_path):
    # Only "cannot start it" is turned into Python's line: the program's own failures stay as they are.
    (tmp_path / "prog.py").write_text("import no_such_module_inside_the_program\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text("import no_such_module_inside_the_program\n")
    for program in (["prog.py"], ["-m", "pkg"]):
        stock = _python(*program, cwd=tmp_path)
        ours = _python("-m", "overlay.apply", *program, cwd=tmp_path)
        assert ours.returncode == stock.returncode == 1
        assert "Traceback" in ours.stderr
        assert ours.stderr.splitlines()[-1] == stock.stderr.splitlines()[-1]


# -- -S, not -I --------------------------------------------------------------------------------------


def test_only_dash_S_is_blamed_for_a_hook_that_does_not_run(tmp_path):
    code = "import overlay.cli as c; print(c.why_the_hook_is_inactive())"
    env = {k: v for k, v in os.environ.items() if k != "ATTN_OVERLAY"}
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(env, PYTHONPATH=str(REPO)))
    why = done.stdout.strip()
    assert why.startswith("python was started with -S:"), (why, done.stderr)
    # -I (isolated mode) reads site-packages' .pth files: the hook runs there (checked for real below)
    assert "or -I" not in why and "-I, isolated mode, does read them" in why


def test_the_hook_check_does_not_activate_what_it_checks(tmp_path):
    # A source tree (or an editable install) makes the startup module importable without any .pth
    # having run it: the check's child imports it too, and must not count its own import.
    script = "import sys; import transformers.generation.utils; print('_attn_overlay_startup' in sys.modules)"
    plain = _python("-c", script, cwd=tmp_path, env={"ATTN_OVERLAY": "1"})
    assert plain.stdout.strip() == "False", plain.stderr
    done = _python("-m", "overlay.apply", "--json", cwd=tmp_path, env={"ATTN_OVERLAY": "1"})
    hook = json.loads(done.stdout)["hook"]
    assert hook["verified"] and hook["active"] is False, hook
    assert "not a site directory" in hook["reason"], hook


def test_the_fallback_flags_keep_dash_S_under_dash_I(monkeypatch):
    def unavailable():
        raise AttributeError("no such private helper")

    monkeypatch.setattr(subprocess, "_args_from_interpreter_flags", unavailable)
    flags = types.SimpleNamespace(no_site=1, isolated=1, ignore_environment=1, no_user_site=1, safe_path=1)
    monkeypatch.setattr(install_check, "sys", types.SimpleNamespace(flags=flags))
    assert install_check.interpreter_flags() == ["-S", "-I"]
    flags.isolated = 0
    assert install_check.interpreter_flags() == ["-S", "-E", "-s", "-P"]


# -- --no-verify ----------------------------------------------------------------------------------------


def test_no_verify_shows_the_states_the_patches_reach_and_the_hook_not_checked(tmp_path):
    # The hook is off here (conftest): the verified report says "inactive (would be: ...)"; without
    # the fresh process, the patches are judged in the reporting process, where the overlay is
    # activated, and reach those same states; the hook is reported as not checked.
    verified = json.loads(_python("-m", "overlay.apply", "--json", cwd=tmp_path).stdout)
    done = _python("-m", "overlay.apply", "--json", "--no-verify", cwd=tmp_path)
    unverified = json.loads(done.stdout)
    assert set(unverified) == set(verified), "the same schema's keys"
    would_be = {row["id"]: row["would_be"] or row["state"] for row in verified["patches"]}
    reached = {row["id"]: row["state"] for row in unverified["patches"]}
    assert reached == would_be
    assert unverified["hook"] == {"active": None, "verified": False, "reason": install_check.HOOK_NOT_CHECKED}
    assert "inactive" not in reached.values() and "applied" in reached.values()
    assert {row["would_be"] for row in unverified["patches"]} == {None}
    assert unverified["import_errors"] == verified["import_errors"]
    assert unverified["ok"] is verified["ok"]

    table = _python("-m", "overlay.apply", "--no-verify", cwd=tmp_path).stdout
    assert "(would be:" not in table and " inactive " not in table, table
    assert f"\nstartup hook: {install_check.HOOK_NOT_CHECKED}\n" in table


# -- in a fresh environment, as users get it --------------------------------------------------------


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    wheel = build_wheel(tmp_path_factory.mktemp("wheel"))
    env = make_fresh_env(tmp_path_factory.mktemp("venv") / "env")
    install_wheel(env, wheel)
    where = env.run("-c", "import overlay, _attn_overlay_startup as s; print(overlay.__file__); print(s.__file__)")
    assert all(line.startswith(str(env.site_packages)) for line in where.stdout.split()), where.stdout
    return env


def _advice(stderr: str) -> tuple[str, str]:
    (line,) = [line for line in stderr.splitlines() if line.startswith("attn-overlay: NOT active")]
    (command,) = re.findall(r"`([^`]+)` checks the result", line)
    return line, command


def _without_overlay_settings() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OVERLAY")}


def test_the_hooks_advice_next_to_a_stray_overlay_py_runs_there(fresh, tmp_path):
    (tmp_path / "overlay.py").write_text("USERS_OWN = True\n")
    done = fresh.run("-c", "import transformers", cwd=str(tmp_path))
    line, command = _advice(done.stderr)
    assert str(tmp_path / "overlay.py") in line
    # The command the line gives works in that very folder (`python -m overlay.apply` cannot start
    # there: -m finds the user's overlay.py first) and says which file is in the way.
    argv = shlex.split(command)
    if argv[0] == "attn-overlay":
        argv[0] = str(fresh.python.parent / "attn-overlay")
    checked = subprocess.run([*argv, "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env=_without_overlay_settings())
    report = json.loads(checked.stdout)
    assert report["hook"]["active"] is False and report["hook"]["verified"] is True
    assert str(tmp_path / "overlay.py") in report["hook"]["reason"] and "Rename" in report["hook"]["reason"]


def test_attn_overlay_next_to_a_stray_overlay_py_names_it(fresh, tmp_path):
    (tmp_path / "overlay.py").write_text("USERS_OWN = True\n")
    script = str(fresh.python.parent / "attn-overlay")
    done = subprocess.run([script, "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=_without_overlay_settings())
    report = json.loads(done.stdout)
    assert report["hook"]["reason"].startswith(f"`import overlay` finds {tmp_path / 'overlay.py'}, not attn-overlay")
    # what the patches would reach there, never "applied"
    assert {row["state"] for row in report["patches"]} == {"inactive"}
    assert {row["would_be"] for row in report["patches"]} <= {"applied", "fixed upstream", "out of range"}
    table = subprocess.run([script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env=_without_overlay_settings()).stdout
    assert f"startup hook: NOT active: `import overlay` finds {tmp_path / 'overlay.py'}" in table
    assert "except through `python -m overlay.apply" not in table  # that cannot run there either


def test_dash_I_keeps_the_hook_active(fresh, tmp_path):
    report = json.loads(fresh.run("-I", "-m", "overlay.apply", "--json", cwd=str(tmp_path)).stdout)
    assert report["hook"] == {"active": True, "verified": True, "reason": None}


#: A program that says where its overlay comes from and whether the patches are in force there.
WHERE_AND_WHETHER = textwrap.dedent(
    """
    import json, sys
    import transformers.generation.utils  # noqa: F401  (what a program does)
    import overlay
    print(json.dumps({"overlay": overlay.__file__, "active": overlay.is_active(),
                      "applied": sum(s.state == "applied" for s in overlay.status()),
                      "no_site": bool(sys.flags.no_site)}))
    """
)


def test_the_readmes_python_dash_S_line_runs_as_written_in_a_venv(fresh, tmp_path):
    # `python -S` leaves site-packages (with the overlay, torch and transformers) off the path: the
    # bare `python -S -m overlay.apply PROGRAM.py` cannot start. The README's line names the path.
    text = (REPO / "README.md").read_text(encoding="utf-8")
    (line,) = re.findall(r"`(PYTHONPATH=[^`]* -S -m overlay\.apply PROGRAM\.py)`", text)
    (tmp_path / "prog.py").write_text(WHERE_AND_WHETHER)
    # An activated venv: its `python` first on PATH.
    env = dict(_without_overlay_settings(), PATH=f"{fresh.python.parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    bare = subprocess.run(["python", "-S", "-m", "overlay.apply", "prog.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert bare.returncode == 1 and "No module named 'overlay'" in bare.stderr, bare.stderr
    done = subprocess.run(["bash", "-c", line.replace("PROGRAM.py", "prog.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    assert ran["no_site"], ran
    assert ran["overlay"].startswith(str(fresh.site_packages)), "the venv's overlay, not this checkout's"
    assert ran["active"] is True and ran["applied"] > 0, ran


SPAWNING_PROGRAM = textwrap.dedent(
    """
    import json, multiprocessing, sys

    def child(queue):
        import transformers.generation.utils  # noqa: F401  (what a worker does)
        import overlay
        queue.put(overlay.is_active())

    if __name__ == "__main__":
        results = {}
        for method in sys.argv[1:]:
            context = multiprocessing.get_context(method)
            queue = context.Queue()
            process = context.Process(target=child, args=(queue,))
            process.start()
            results[method] = queue.get(timeout=200)
            process.join(timeout=60)
            results[method + " exit"] = process.exitcode
        print(json.dumps(results))
    """
)


def test_the_program_mode_reaches_spawn_and_forkserver_children(fresh, tmp_path):
    # ATTN_OVERLAY=0: the hook is off, the program mode is how the user asks for the patches.
    (tmp_path / "prog.py").write_text(SPAWNING_PROGRAM)
    done = fresh.run("-m", "overlay.apply", "prog.py", "spawn", "forkserver", cwd=str(tmp_path),
                     env={"ATTN_OVERLAY": "0"}, timeout=400)
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == {"spawn": True, "spawn exit": 0, "forkserver": True, "forkserver exit": 0}, done.stderr


# -- what each patch changes (issue 40) ------------------------------------------------------------------


def test_the_table_and_json_say_what_each_patch_changes_and_errors_leaves_out_the_others(tmp_path):
    from overlay import engine

    declared = {patch.id: patch.changes for patch in engine.known_patches()}
    done = _python("-m", "overlay.apply", "--json", "--no-verify", cwd=tmp_path, env={"ATTN_OVERLAY_FIXES": "errors"})
    report = json.loads(done.stdout)
    assert {row["id"]: row["changes"] for row in report["patches"]} == declared
    assert report["settings"]["ATTN_OVERLAY_FIXES"]["value"] == "errors"
    assert not [row["id"] for row in report["patches"] if row["state"] == "applied" and row["changes"] != "errors"]
    table = _python("-m", "overlay.apply", "--no-verify", cwd=tmp_path, env={"ATTN_OVERLAY_FIXES": "errors"}).stdout
    header = next(line for line in table.splitlines() if line.startswith("patch "))
    assert header.split() == ["patch", "status", "changes", "why"]
    for row in report["patches"]:
        line = next(line for line in table.splitlines() if line.startswith(row["id"] + " "))
        assert f"  {row['changes']}  " in line, line
    assert "ATTN_OVERLAY_FIXES=errors keeps only the first" in table


def test_help_and_usage_name_compare():
    done = subprocess.run([sys.executable, "-m", "overlay.apply", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert "--compare PROGRAM.py [ARGS...]" in done.stdout and "--compare -m MODULE [ARGS...]" in done.stdout
    assert "exit 0: identical, 1: different, 2: could" in " ".join(done.stdout.split())
