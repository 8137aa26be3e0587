"""``.ci/run`` and the noxfile's disk handling, with a stand-in nox (no environment is built):

- the sessions run in two groups side by side, balanced by each session's estimated minutes, and
  the closing lines add up every pytest summary;
- the log's path is printed first, and a line per session as each finishes (while the others run);
- the cores come from the machine, not from OMP_NUM_THREADS;
- stopping .ci/run (SIGINT, SIGTERM) stops nox and what it started;
- a failing session fails the run and is named at the end;
- on CI (``CI`` set) each session is told to delete its environment when it ends, not with ``-R``
  (which reuses them) and not outside CI;
- a run that fails on a full disk says so at the end;
- ``noxfile._environment_dropped_after`` deletes the environment when asked, also when the session
  fails, and keeps it otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SESSIONS = ["lint", "tests", "tf-1.0.0", "tf-2.0.0", "tf-3.0.0", "tf-4.0.0"]
# What nox -l says of each lane: the patches it applies (20, 10, 5 and none) set its estimate.
DESCRIPTIONS = {f"tf-{n}.0.0": "expected " + ", ".join([f"p{i} applied" for i in range(k)] + ["q fixed upstream"])
                for n, k in ((1, 20), (2, 10), (3, 5), (4, 0))}

# Prints what nox prints around each session, records what it was asked and with which setting.
FAKE_NOX = """\
import json, os, sys
args = sys.argv[1:]
if "-l" in args:
    print(json.dumps([{"session": name, "description": DESCRIPTIONS.get(name, "")} for name in SESSIONS]))
    sys.exit(0)
sessions = args[args.index("-s") + 1:]
with open(os.environ["FAKE_NOX_RECORD"], "a") as record:
    record.write(json.dumps({"sessions": sessions, "args": args,
                             "drop": os.environ.get("ATTN_OVERLAY_DROP_ENVIRONMENTS")}) + "\\n")
for name in sessions:
    print(f"nox > Running session {name}", flush=True)
    if name == os.environ.get("FAKE_NOX_HANG"):
        # A session that never ends, with a child of its own (pytest under nox): both pids noted.
        import subprocess, time
        child = subprocess.Popen(["sleep", "300"])
        with open(os.environ["FAKE_NOX_PIDS"], "w") as pids:
            pids.write(f"{os.getpid()} {child.pid}")
        time.sleep(300)
    if name == os.environ.get("FAKE_NOX_WAIT_FOR"):
        # Held until the test has seen an earlier session's progress line.
        import time
        deadline = time.time() + 60
        while not os.path.exists(os.environ["FAKE_NOX_GATE"]) and time.time() < deadline:
            time.sleep(0.1)
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
    nox.write_text(f"#!{sys.executable}\nSESSIONS = {SESSIONS!r}\nDESCRIPTIONS = {DESCRIPTIONS!r}\n" + FAKE_NOX)
    nox.chmod(0o755)
    return tmp_path


def _env(checkout: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "ATTN_OVERLAY_DROP_ENVIRONMENTS", "OMP_NUM_THREADS")}
    env.update({"FAKE_NOX_RECORD": str(checkout / "record.jsonl"), "CI_STAGGER_S": "0", "TMPDIR": str(checkout),
                "CI_SUITE_MINUTES": "4"}, **settings)
    return env


def _ci(checkout: Path, *args: str, **settings: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    record = checkout / "record.jsonl"
    env = _env(checkout, **settings)
    done = subprocess.run(["bash", ".ci/run", *args], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return done, calls


def test_two_groups_run_every_session_and_the_totals_add_up(checkout):
    done, calls = _ci(checkout, CI_JOBS="2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(name for call in calls for name in call["sessions"]) == sorted(SESSIONS)
    # Longest first, each to the group with fewer minutes so far: the suite (4) and the lanes
    # (2.4, 2.1, 1.95, 1.8 minutes; lint 1.0) end at 6.95 and 6.3 minutes. Each group starts with
    # lint where it falls, then the suite, then its lanes oldest first.
    # The two groups run side by side: which stand-in nox records first is the machine's timing, so the
    # groups are compared as a set; the order they were started in is the line below.
    assert sorted(call["sessions"] for call in calls) == [["lint", "tests", "tf-3.0.0"], ["tf-1.0.0", "tf-2.0.0", "tf-4.0.0"]]
    assert "ci: two groups side by side: tf-1.0.0 tf-2.0.0 tf-4.0.0 | lint tests tf-3.0.0" in done.stdout
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


def test_the_log_path_comes_first_and_a_line_per_session_as_each_finishes(checkout):
    # tf-2.0.0 (second in its group) is held until the test has read tf-1.0.0's progress line: the
    # line is printed while nox still runs, not at the end.
    gate = checkout / "gate"
    env = _env(checkout, CI_JOBS="2", FAKE_NOX_WAIT_FOR="tf-2.0.0", FAKE_NOX_GATE=str(gate))
    run = subprocess.Popen(["bash", ".ci/run"], cwd=checkout, env=env, stdout=subprocess.PIPE, text=True,
                           stdin=subprocess.DEVNULL)
    try:
        seen = []
        for line in run.stdout:
            seen.append(line.rstrip("\n"))
            if line.startswith("ci: tf-1.0.0 passed in "):
                assert not gate.exists() and run.poll() is None
                gate.touch()
        run.wait(timeout=60)
    finally:
        run.kill()
    assert gate.exists(), seen
    log = next(line.split(": ", 2)[2].split(" ")[0] for line in seen if line.startswith("ci: the whole log: "))
    assert seen.index(next(line for line in seen if line.startswith("ci: the whole log: "))) <= 2, seen[:4]
    assert Path(log).parent == checkout and "nox > Running session tf-4.0.0" in Path(log).read_text()
    done = [line for line in seen if " done, " in line]
    assert sorted(line.split()[1] for line in done) == sorted(SESSIONS)
    # tf-2.0.0, held back, finishes after tf-1.0.0's line was read. (Not necessarily last: the other
    # group's lines can reach the monitor after it on a loaded machine; tail reads two logs.)
    finished = [line.split()[1] for line in done]
    assert finished.index("tf-1.0.0") < finished.index("tf-2.0.0"), done
    assert "ci: tf-1.0.0 passed in 0.0 min: 3 passed, 1 skipped (" in "\n".join(done)
    assert any(line.startswith("ci: lint passed in ") for line in done)
    assert done[-1].endswith(f"({len(SESSIONS)} of {len(SESSIONS)} done, 0 min in)"), done
    assert run.returncode == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a machine with 2 cores or more")
def test_the_cores_are_the_machines_whatever_omp_num_threads_says(checkout):
    # GNU nproc honours OMP_NUM_THREADS: read from it, OMP_NUM_THREADS=1 would run one group.
    done, calls = _ci(checkout, OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f", {len(os.sched_getaffinity(0))} cores, " in done.stdout.splitlines()[0]
    assert len(calls) == 2  # two groups
    assert "OMP_NUM_THREADS=1 limits each test's threads" in done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (ended, not yet reaped by its parent) has ended too.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_stopping_the_script_stops_nox_and_its_tests(checkout, signal_number, jobs):
    pids_file = checkout / "pids"
    env = _env(checkout, CI_JOBS=jobs, FAKE_NOX_HANG="tf-1.0.0", FAKE_NOX_PIDS=str(pids_file))
    run = subprocess.Popen(["bash", ".ci/run"], cwd=checkout, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not (pids_file.exists() and pids_file.read_text().count(" ") == 1) and time.time() < deadline:
            time.sleep(0.1)
        nox_pid, test_pid = map(int, pids_file.read_text().split())
        assert _alive(nox_pid) and _alive(test_pid)
        run.send_signal(signal_number)
        out, _ = run.communicate(timeout=30)
        assert run.returncode == 128 + signal_number, out
        assert "stopping nox and its tests" in out
        deadline = time.time() + 10
        while (_alive(nox_pid) or _alive(test_pid)) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(nox_pid) and not _alive(test_pid)
    finally:
        run.kill()
        for pid in map(int, pids_file.read_text().split()) if pids_file.exists() else ():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


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
