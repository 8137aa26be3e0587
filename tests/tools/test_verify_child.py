"""``overlay/_verify_child.py``, the install check's child program: a module like any other when
imported, the one-JSON-line protocol ``overlay.install_check`` reads when run by path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from overlay import engine, install_check

REPO = Path(__file__).resolve().parents[2]


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ATTN_OVERLAY", "PYTHONPATH")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def test_importing_the_child_runs_nothing(tmp_path):
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); before = (list(sys.path), dict(os.environ), set(sys.modules))\n"
        "import overlay._verify_child\n"
        "after = (list(sys.path), dict(os.environ), set(sys.modules))\n"
        "print(before[:2] == after[:2], sorted(m for m in after[2] - before[2] if not m.startswith('overlay')))\n"
    )
    done = _python("-c", code, str(REPO), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True []\n" and done.stderr == ""


def test_run_by_path_it_prints_the_document_the_parent_reads(tmp_path):
    # -S: no site, so no editable install and no startup hook: the overlay comes from PACKAGE_ROOT,
    # appended last, and is reported inactive with every patch at the state it would reach.
    done = _python("-S", install_check.VERIFY_CHILD, str(REPO), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(document) == {"hook_active", "activation_error", "import_errors", "patches", "shadowed"}
    assert document["hook_active"] is False and document["shadowed"] is None
    assert [row["id"] for row in document["patches"]] == [p.id for p in engine.known_patches()]
