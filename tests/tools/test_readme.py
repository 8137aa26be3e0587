"""The README's set-up commands, run as a newcomer runs them: verbatim, in a fresh clone, from its root.

The main-job line installs torch, transformers and this project into ``.venv`` and runs
``python -m overlay.apply`` and ``python -m overlay.doctor`` with the clone's root as the working
directory, where ``python -m`` puts the source tree's ``overlay/`` first on ``sys.path``, before the
installed wheel. That is the situation this test exists for.

For speed the clone's ``.venv`` is kept under ``.cache/`` of this checkout between runs (the first
run creates it through the README's own command; later runs find torch installed). The clone is
made anew each run, always at the same path, and the kept venv is moved into it, so the venv's
scripts, which record that path, stay valid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
README_TIMEOUT_S = 1800  # first run on a fresh machine: venv, torch from disk, transformers, doctor


def setup_commands() -> tuple[str, str]:
    """The two fenced commands of the README's "Set up on a fresh machine" section, in order."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    blocks = [block.strip() for block in re.findall(r"^```[a-z]*\n(.*?)^```", section, flags=re.S | re.M)]
    assert len(blocks) == 2, f"expected two set-up commands (main job, tests), found {blocks}"
    return blocks[0], blocks[1]


def test_the_readme_names_the_ci_command_as_the_test_command():
    _, tests = setup_commands()
    assert tests == "bash .ci/run"
    assert (REPO / ".ci" / "run").is_file()


def _newcomer_env() -> dict[str, str]:
    # What a newcomer's shell has: none of the test runner's switches (conftest turns the hook
    # off for the tests' own subprocesses), no PYTHONPATH pointing into this checkout.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OVERLAY") and k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


@pytest.fixture(scope="module")
def clone():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    target, kept_venv = CACHE / "readme-clone", CACHE / "readme-venv"
    CACHE.mkdir(exist_ok=True)
    if (target / ".venv").is_dir() and not kept_venv.exists():  # an interrupted earlier run
        (target / ".venv").rename(kept_venv)
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(target)], check=True, timeout=120)
    if kept_venv.is_dir():
        kept_venv.rename(target / ".venv")  # same path as when it was made: its scripts stay valid
    try:
        yield target
    finally:
        if (target / ".venv").is_dir():
            (target / ".venv").rename(kept_venv)


@pytest.fixture(scope="module")
def main_job(clone):
    main_job_line, _ = setup_commands()
    done = subprocess.run(
        ["bash", "-c", main_job_line], cwd=clone, env=_newcomer_env(),
        capture_output=True, text=True, timeout=README_TIMEOUT_S,
    )
    return main_job_line, done


def test_main_job_line_runs_verbatim_from_a_fresh_clone_root(main_job):
    line, done = main_job
    assert done.returncode == 0, f"`{line}` exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "ImportError" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    # python -m overlay.apply: the hook verified active; the doctor: its verdict table, all passing.
    assert "startup hook: active" in done.stdout
    assert "verdict" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].startswith("result: every scenario passes with the overlay")


def _run_json(clone: Path, *args: str) -> dict:
    done = subprocess.run(
        [str(clone / ".venv" / "bin" / "python"), *args], cwd=clone, env=_newcomer_env(),
        capture_output=True, text=True, timeout=README_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout)


FINAL_STATES = {"applied", "fixed upstream", "out of range"}


def test_apply_json_from_the_clone_root_has_every_patch_final(main_job, clone):
    report = _run_json(clone, "-m", "overlay.apply", "--json", "--strict")
    assert report["hook"]["active"] is True, report["hook"]
    assert report["ok"] is True
    states = {row["id"]: row["state"] for row in report["patches"]}
    assert set(states.values()) <= FINAL_STATES, states
    assert states["device-move-nested"] == "applied"  # the README pins an affected release


def test_doctor_json_from_the_clone_root_passes_every_scenario_with_the_overlay(main_job, clone):
    report = _run_json(clone, "-m", "overlay.doctor", "--json")
    assert report["ok"] is True
    ran = [s for s in report["scenarios"] if s.get("status") != "skipped"]
    assert {s["id"] for s in ran} >= {"host-inputs-static", "cache-dtype-static", "cache-dtype-prefix"}
    applied = {row["id"] for row in report["overlay_status"] if row["state"] == "applied"}
    from importlib.metadata import version

    from packaging.version import Version

    from overlay.doctor._scenarios import BY_ID

    installed = Version(version("transformers"))  # the clone's run uses this same environment
    for scenario in ran:
        assert scenario["with"]["ok"], scenario["id"]
        fixed_in = BY_ID[scenario["id"]].fixed_in  # a second bug of its patch, fixed earlier upstream
        if set(scenario["patches"]) & applied and not (fixed_in and installed >= Version(fixed_in)):
            assert scenario["fixed_by_overlay"] is True, scenario["id"]
        else:  # fixed upstream in the README's release (kept-static-cache, gemma4-prefill-chunk): stock passes too
            assert scenario["without"]["ok"] is True, scenario["id"]
    assert all(s["state"] in FINAL_STATES for s in report["overlay_status"]), report["overlay_status"]
