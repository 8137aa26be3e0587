"""``python -m overlay.apply --compare``'s mechanics: a module run with ``-m``, an errors-only run,
programs the overlay does not touch, what it says when it cannot compare. Release-independent, so
they run in the whole suite only (``tests``); the one release-dependent claim, which patch changed a
program's output on which release, runs on every release lane (``tests/tools/test_fixes.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from overlay import config
from overlay.testing.harness import PatchUnderTest
# Names only, no PatchUnderTest at module level: one would make every release lane run this module.
from tests.tools.test_fixes import PROGRAM, REPO, _compare

pytestmark = pytest.mark.usefixtures("one_thread")


def test_compare_with_errors_only_is_identical_where_stock_completes(tmp_path):
    done = _compare(str(PROGRAM), "precedence", cwd=tmp_path, **{config.FIXES_VAR: config.FIXES_ERRORS})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "generation-config-precedence" not in done.stdout


def test_compare_runs_a_module_and_says_an_error_became_a_run(tmp_path):
    kv_cache_dtype = PatchUnderTest("kv_cache_dtype")
    if not kv_cache_dtype.affected:
        pytest.skip(f"kv-cache-dtype does not apply to transformers {kv_cache_dtype.transformers}")
    (tmp_path / "fixes_program.py").write_text(PROGRAM.read_text(encoding="utf-8"), encoding="utf-8")
    done = _compare("-m", "fixes_program", "kv-cache-dtype", cwd=tmp_path, **{config.FIXES_VAR: config.FIXES_ERRORS})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "stock:   'kv-cache-dtype: raised RuntimeError'" in done.stdout, done.stdout
    assert "fired: kv-cache-dtype" in done.stdout
    assert "each of them changes only calls that raise on stock" in done.stdout


def test_compare_of_a_program_the_overlay_does_not_touch_is_identical(tmp_path):
    program = tmp_path / "hello.py"
    program.write_text("import sys\nprint('hello', sys.argv[1:])\nsys.exit(3)\n", encoding="utf-8")
    done = _compare(str(program), "a", "b", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "exit status 3" in done.stdout and "fired: none" in done.stdout


def test_compare_says_what_differs_when_nothing_fired(tmp_path):
    program = tmp_path / "env.py"
    program.write_text("import os\nprint(os.environ.get('ATTN_OVERLAY'))\n", encoding="utf-8")
    done = _compare(str(program), cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no patch fired" in done.stdout


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("missing.py",), "can't open file"),
        (("-m", "no_such_module_here"), "No module named no_such_module_here"),
    ],
)
def test_compare_exits_2_saying_why_it_could_not_compare(tmp_path, args, said):
    done = _compare(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "attn-overlay --compare: could not compare: " in done.stderr and said in done.stderr, done.stderr


def test_compare_exits_2_where_a_fresh_process_cannot_import_this_overlay(tmp_path, monkeypatch, capsys):
    # As `attn-overlay --compare` (a console script: its own folder first on sys.path, not the working
    # directory) started next to a stray overlay.py: the fresh processes would import that file.
    from overlay import cli

    program = tmp_path / "hello.py"
    program.write_text("print('hello')\n", encoding="utf-8")
    (tmp_path / "overlay.py").write_text("", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--compare", str(program)]) == 2
    err = capsys.readouterr().err
    assert "could not compare: a fresh process of" in err and "does not import this overlay" in err, err
    assert str(tmp_path / "overlay.py") in err or str(tmp_path) in err


def test_compare_needs_a_program():
    done = subprocess.run([sys.executable, "-m", "overlay.apply", "--compare"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 2 and "--compare needs a program" in done.stderr
