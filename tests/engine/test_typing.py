"""A type checker sees the public API's real signatures (``overlay/__init__.py`` imports them under
``TYPE_CHECKING``; at run time the names are imported lazily, where a checker would see ``Any``).

Runs mypy in a subprocess where it is installed (``pip install mypy``); skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import overlay


@pytest.fixture(autouse=True)
def _mypy_installed() -> None:
    # Per test, not at import: a release lane (which deselects this module) need not install mypy.
    pytest.importorskip("mypy", reason="mypy is not installed (pip install mypy)")


#: What a user's code asks a type checker, and how what it reveals begins (never ``Any``; a
#: prefix where typeshed's spelling of the standard library varies between mypy releases).
REVEALS = [
    ("overlay.status()", "list[overlay.engine.PatchStatus]"),
    ("overlay.apply()", "list[overlay.engine.PatchStatus]"),
    ("overlay.apply(strict=True, only=['kv-cache-dtype'])", "list[overlay.engine.PatchStatus]"),
    ("overlay.revert()", "list[overlay.engine.PatchStatus]"),
    ("overlay.applied().__enter__()", "list[overlay.engine.PatchStatus]"),
    ("overlay.reverted()", "contextlib._GeneratorContextManager[None"),
    ("overlay.fired()", "dict[str, int]"),
    ("overlay.known_patches()", "tuple[overlay.patch.Patch, ...]"),
    ("overlay.is_active()", "bool"),
    ("overlay.activation_error()", "str | None"),
    ("overlay.status()[0].state", "str"),
    ("overlay.OverlayError('message')", "overlay.engine.OverlayError"),
    ("overlay.run_doctor", "def (device: str | None ="),
    ("overlay.__version__", "str"),
]
# The module behind `python -m overlay.apply`, imported first: overlay.apply stays the function.
HEADER = "import overlay.apply\nimport overlay\n"
USER_CODE = HEADER + "".join(f"reveal_type({expression})\n" for expression, _ in REVEALS)
FIRST_LINE = HEADER.count("\n") + 1


def _mypy(tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "user_code.py").write_text(USER_CODE, encoding="utf-8")
    env = dict(os.environ)
    package_root = Path(overlay.__file__).resolve().parent.parent
    # A source tree (or an editable install, whose import hook mypy cannot follow) is named on
    # MYPYPATH; an installed wheel is found in site-packages by its py.typed (mypy refuses
    # site-packages on MYPYPATH).
    site = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    if package_root not in site:
        env["MYPYPATH"] = str(package_root)
    command = [
        sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-error-summary", "--show-error-codes",
        "--cache-dir", str(tmp_path / "mypy-cache"), "user_code.py",
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)


def test_a_type_checker_sees_the_real_signatures(tmp_path):
    done = _mypy(tmp_path)
    assert done.returncode == 0 and "error:" not in done.stdout, done.stdout + done.stderr
    revealed = {}
    for line in done.stdout.splitlines():
        where, _, note = line.partition(": note: Revealed type is ")
        if note:
            revealed[int(where.rsplit(":", 1)[1]) - FIRST_LINE] = note.strip('"')
    for index, (expression, expected) in enumerate(REVEALS):
        found = revealed.get(index, "nothing")
        assert found.startswith(expected), (expression, found, done.stdout)
