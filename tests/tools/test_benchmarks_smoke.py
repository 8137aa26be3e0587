"""The benchmarks in smoke mode (tiny repetitions), so the scripts never rot.

No timing is asserted: the numbers of a smoke run mean nothing. What is asserted is that every
figure runs (or says why it cannot, e.g. no CUDA), and that the JSON report, the markdown summary
and the PNG chart come out well formed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIGURES = {1, 2, 3, 4, 5, 6, 7, 8, 9}
FIGURE_STATUSES = {"ok", "not run"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    command = [sys.executable, "-m", "scripts.bench", "--smoke", "--out", str(out)]
    if not _have_matplotlib():
        command.append("--no-chart")
    done = subprocess.run(command, cwd=str(REPO), capture_output=True, text=True, timeout=1500)
    return out, done


def _report(out: Path) -> dict:
    reports = sorted(out.glob("bench-*-smoke.json"))
    assert len(reports) == 1, sorted(p.name for p in out.iterdir())
    data = json.loads(reports[0].read_text())
    assert json.loads((out / "latest.json").read_text()) == data
    return data


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_smoke_run_exits_cleanly(smoke_run):
    _, done = smoke_run
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"


def test_report_has_machine_and_versions(smoke_run):
    data = _report(smoke_run[0])
    assert data["schema"] == "attn-overlay-bench/1"
    assert data["smoke"] is True
    machine = data["machine"]
    for key in ("python", "torch", "transformers", "attn_overlay", "cpu_count", "platform"):
        assert machine[key], key
    assert set(data["load_average"]) == {"start", "end"}


def test_every_figure_is_present_and_well_formed(smoke_run):
    data = _report(smoke_run[0])
    figures = {fig["figure"]: fig for fig in data["figures"]}
    assert set(figures) == FIGURES
    for number, fig in figures.items():
        assert fig["status"] in FIGURE_STATUSES, (number, fig["status"], fig["reason"])
        assert fig["id"] and fig["title"]
        if fig["status"] == "not run":
            assert fig["reason"], number
            continue
        assert fig["cases"], number
        for case in fig["cases"]:
            where = (number, case["name"])
            assert case["unit"], where
            if case["status"] != "ok":  # a part that cannot run here says why
                assert case["note"], where
                continue
            assert all(_finite(case[k]) for k in ("median", "min", "max")), where
            assert case["min"] <= case["median"] <= case["max"], where
            assert isinstance(case["n"], int) and case["n"] >= 1, where
            if case["goal_value"] is None:
                assert case["pass"] is None, where
            else:
                assert _finite(case["goal_value"]) and case["goal_direction"] in ("<=", ">=", "=="), where
                assert isinstance(case["pass"], bool), where
                assert case["goal"] == f"{case['goal_direction']} {case['goal_value']:g}", where
            if case["unit"] == "ratio":
                assert case["numerator"] and case["denominator"], where
                assert len(case["samples"]) == case["n"], where


def test_figure_premises_hold(smoke_run):
    """What each figure compares is what it says it compares (checked by the figures themselves)."""
    figures = {fig["figure"]: fig for fig in _report(smoke_run[0])["figures"]}
    assert figures[1]["details"]["hook_installed_at_start"] == {"hook": True, "no-pth": False, "ATTN_OVERLAY=0": False}
    assert figures[2]["details"]["startup_error"] is None
    if figures[3]["status"] == "ok":
        on_device = figures[3]["details"]["on_device"]
        assert on_device["attention_mask_type"] == "dict" and on_device["results_identical"] is True
    assert figures[4]["details"]["same_tokens_with_and_without"] is True
    assert figures[4]["details"]["same_tokens_with_and_without_deep"] is True
    if figures[6]["status"] == "not run":
        assert "no CUDA" in figures[6]["reason"]
    # Figure 7 times the overlay's wrappers against stock code, and both give the same tensors.
    assert figures[7]["status"] == "ok"
    for lane, details in figures[7]["details"]["lanes"].items():
        assert details["same_results_with_and_without"] is True, lane
        reverted, applied = details["code_when_reverted"], details["code_when_applied"]
        assert all("transformers" in path for path in reverted.values()), (lane, reverted)
        assert applied != reverted, lane
        assert [row["call"] for row in details["table"]] == [
            "StaticCache.update", "DynamicCache.update (32 cached positions)",
            'get_interface("sdpa", default) + SDPA call', "_ignore_causal_mask_sdpa (per step, not per layer)"], lane
        assert set(details["totals"]) == {"static", "dynamic"}, lane
    # Figure 8 (callgrind) is slow: the smoke run does a dry run of its worker without valgrind.
    assert figures[8]["status"] == "not run" and figures[8]["reason"]
    if "dry run" in figures[8]["reason"]:
        assert figures[8]["details"]["dry_run_regions"] == [
            "tiny-static|overlay|1|0", "tiny-static|overlay|2|0", "tiny-static|without|1|0", "tiny-static|without|2|0"]


def test_whole_generate_dry_run(smoke_run):
    """Figure 9 (whole generate() under callgrind) is slow: the smoke run does a dry run of its
    worker without valgrind, which still checks what the figure validates: every counted call of a
    variant generates the same ids, with and without the overlay where nothing fires, and the
    patches that fire are named (the repetition penalty's on the padded batch)."""
    figures = {fig["figure"]: fig for fig in _report(smoke_run[0])["figures"]}
    assert figures[9]["status"] == "not run" and figures[9]["reason"]
    dry = figures[9]["details"]["dry_run"]
    assert dry["regions"] == ["2|greedy|overlay|0", "2|greedy|stock|0", "2|penalty|overlay|0", "2|penalty|stock|0"]
    assert dry["errors"] == {}
    assert dry["same_ids"]["2|greedy"] is True and dry["fired"]["2|greedy"] == []
    assert dry["fired"]["2|penalty"] in ([], ["repetition-penalty-padding"])  # [] where upstream fixed it


def test_markdown_summary_on_stdout(smoke_run):
    _, done = smoke_run
    assert "| fig | case | median | min | max |" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| fig")]
    assert {int(line.split("|")[1]) for line in rows if line.split("|")[1].strip().isdigit()} == FIGURES
    assert "| transformers | call | stock | with overlay |" in done.stdout
    assert "wrote " in done.stdout


def test_png_chart(smoke_run):
    if not _have_matplotlib():
        pytest.skip("matplotlib is not installed (pip install 'attn-overlay[bench]'): chart not made")
    out, _ = smoke_run
    charts = sorted(out.glob("bench-*-smoke.png"))
    assert len(charts) == 1
    png = charts[0].read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    assert (out / "latest.png").read_bytes() == png


def test_runs_as_a_script_too(tmp_path):
    """``python scripts/bench/run.py`` works as well as ``python -m scripts.bench`` (figure 6 only:
    on a machine without a GPU it is reported as not run at no cost)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench" / "run.py"), "--smoke", "--only", "6", "--no-chart",
         "--out", str(tmp_path)],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (report,) = tmp_path.glob("bench-*.json")
    assert [fig["figure"] for fig in json.loads(report.read_text())["figures"]] == [6]
