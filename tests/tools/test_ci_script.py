"""``.ci/run`` and the noxfile's disk handling, with a stand-in nox (no environment is built):

- the sessions run in two groups side by side, and the closing lines add up every pytest summary;
- a failing session fails the run and is named at the end;
- on CI (``CI`` set) each session is told to delete its environment when it ends, not with ``-R``
  (which reuses them) and not outside CI;
- a run that fails on a full disk says so at the end;
- ``noxfile._environment_dropped_after`` deletes the environment when asked, also when the session
  fails, and keeps it otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SESSIONS = ["lint", "tests", "tf-1.0.0", "tf-2.0.0", "tf-3.0.0", "tf-4.0.0"]

# Prints what nox prints around each session, records what it was asked and with which setting.
FAKE_NOX = """\
import json, os, sys
args = sys.argv[1:]
if "-l" in args:
    print(json.dumps([{"session": name} for name in SESSIONS]))
    sys.exit(0)
sessions = args[args.index("-s") + 1:]
with open(os.environ["FAKE_NOX_RECORD"], "a") as record:
    record.write(json.dumps({"sessions": sessions, "args": args,
                             "drop": os.environ.get("ATTN_OVERLAY_DROP_ENVIRONMENTS")}) + "\\n")
for name in sessions:
    print(f"nox > Running session {name}")
    if name == "lint":
        print("nox > Session lint was successful in 1 seconds.")
    elif name == os.environ.get("FAKE_NOX_FAIL"):
        print("E   OSError: [Errno 28] No space left on device")
        print(f"FAILED tests/test_x.py::test_{name.replace('.', '_')} - OSError")
        print("======== 1 failed, 2 passed in 1.00s ========")
        print(f"nox > Session {name} failed.")
        sys.exit(1)
    else:
        print("======== 3 passed, 1 skipped in 1.00s ========")
        print(f"nox > Session {name} was successful in 1 seconds.")
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A folder with this tree's .ci/run and a stand-in .venv-ci (nox above, this Python)."""
    (tmp_path / ".ci").mkdir()
    shutil.copy2(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_dir = tmp_path / ".venv-ci" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    nox = bin_dir / "nox"
    nox.write_text(f"#!{sys.executable}\nSESSIONS = {SESSIONS!r}\n" + FAKE_NOX)
    nox.chmod(0o755)
    return tmp_path


def _ci(checkout: Path, *args: str, **settings: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    record = checkout / "record.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "ATTN_OVERLAY_DROP_ENVIRONMENTS")}
    env.update({"FAKE_NOX_RECORD": str(record), "CI_STAGGER_S": "0", "TMPDIR": str(checkout)}, **settings)
    done = subprocess.run(["bash", ".ci/run", *args], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return done, calls


def test_two_groups_run_every_session_and_the_totals_add_up(checkout):
    done, calls = _ci(checkout, CI_JOBS="2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(name for call in calls for name in call["sessions"]) == sorted(SESSIONS)
    # The suite with the last third of the lanes, beside the other lanes (and lint).
    assert sorted(call["sessions"] for call in calls) == [["lint", "tf-1.0.0", "tf-2.0.0", "tf-3.0.0"], ["tests", "tf-4.0.0"]]
    last = done.stdout.strip().splitlines()
    assert last[-1] == "ci: 15 passed, 0 failed, 5 skipped", last[-8:]  # 5 pytest sessions, lint has none
    assert "ci: lint: successful (no pytest in it)" in done.stdout


def test_a_failing_session_fails_the_run_and_is_named_at_the_end(checkout):
    done, _ = _ci(checkout, CI_JOBS="1", FAKE_NOX_FAIL="tf-2.0.0")
    assert done.returncode == 1
    tail = done.stdout.strip().splitlines()[-8:]
    assert any(line.startswith("ci: tf-2.0.0: FAILED tests/test_x.py::test_tf-2_0_0") for line in tail), tail
    assert "ci: the disk may have filled up" in done.stdout  # the failure's log says "No space left"


@pytest.mark.parametrize(
    ("args", "settings", "dropped"),
    [((), {"CI": "true"}, "1"), (("-R",), {"CI": "true"}, None), ((), {}, None),
     ((), {"CI": "true", "ATTN_OVERLAY_DROP_ENVIRONMENTS": "0"}, "0")],
    ids=["on CI", "on CI with -R", "outside CI", "on CI, asked to keep"],
)
def test_sessions_delete_their_environments_on_ci_only(checkout, args, settings, dropped):
    done, calls = _ci(checkout, *args, CI_JOBS="1", **settings)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [call["drop"] for call in calls] == [dropped]
    needed = "4" if dropped == "1" else "9"
    assert "GB free here" in done.stdout and f"about {needed} GB needed" in done.stdout
    assert "ci: the disk may have filled up" not in done.stdout


def _noxfile() -> types.ModuleType:
    pytest.importorskip("nox", reason="nox is not installed (the test extra installs it)")
    sys.path.insert(0, str(REPO))
    try:
        import noxfile
    finally:
        sys.path.remove(str(REPO))
    return noxfile


@pytest.mark.parametrize("drop", ["1", None])
@pytest.mark.parametrize("fails", [False, True], ids=["passes", "fails"])
def test_the_noxfile_deletes_a_sessions_environment_only_when_asked(tmp_path, monkeypatch, drop, fails):
    noxfile = _noxfile()
    environment = tmp_path / "tf-1-0-0"
    (environment / "bin").mkdir(parents=True)
    (tmp_path / "_shared").mkdir()
    session = types.SimpleNamespace(virtualenv=types.SimpleNamespace(location=str(environment)), log=lambda text: None)
    if drop is None:
        monkeypatch.delenv("ATTN_OVERLAY_DROP_ENVIRONMENTS", raising=False)
    else:
        monkeypatch.setenv("ATTN_OVERLAY_DROP_ENVIRONMENTS", drop)
    try:
        with noxfile._environment_dropped_after(session):
            if fails:
                raise RuntimeError("a test failed")
    except RuntimeError:
        assert fails
    assert environment.exists() is (drop is None)
    assert (tmp_path / "_shared").exists()  # the shared torch stays for the next lane
