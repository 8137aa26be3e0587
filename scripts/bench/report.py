"""The outputs of one run: machine information, the JSON file, the markdown summary, the chart."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from . import common
from .common import AT_LEAST, AT_MOST, CHECK_ONLY, EQUAL, OK, REPO

SCHEMA = "attn-overlay-bench/1"


def _version(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=str(REPO), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """Versions come from package metadata: the parent process never imports torch."""
    status = _git("status", "--porcelain")
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "attn_overlay": _version("attn-overlay"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
    }


def build_report(figures: list[Any], *, smoke: bool, started: datetime, load_start, argv: list[str]) -> dict[str, Any]:
    figures = sorted(figures, key=lambda f: f.number)
    return {
        "schema": SCHEMA,
        "started_utc": started.isoformat(timespec="seconds"),
        "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "smoke": smoke,
        "command": " ".join(argv),
        "machine": machine_info(),
        "load_average": {"start": load_start, "end": load_average()},
        "overlay_root": common.OVERLAY_ROOT,
        "figures": [f.as_dict() for f in figures],
    }


def write_json(report: dict[str, Any], out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "latest.json").write_text(path.read_text())
    return path


# -- markdown ------------------------------------------------------------------------------------


def _number(value: Any, unit: str) -> str:
    if value is None:
        return "–"
    if unit == "ratio":
        return f"{value:.3f}"
    if unit.startswith("ms"):
        return f"{value:.2f} ms"
    if unit == "µs":
        return f"{value:+.2f} µs"
    if unit == "instructions":
        return f"{value:+,.0f}"
    return f"{value:g}"


def per_call_table(report: dict[str, Any]) -> list[str]:
    """Figure 7 as the issue's table: per release, each call's stock and overlay time (median over
    the processes of their fastest) and the extra, plus the sums per layer and step (median over
    the processes, and their range)."""
    lines = []
    for fig in report["figures"]:
        if fig["id"] != "per_call" or not fig["details"].get("lanes"):
            continue
        lines += ["", "Figure 7, per call (µs; per fresh process: fastest with − fastest without; "
                  "median over the processes, and their range):", "",
                  "| transformers | call | stock | with overlay | extra (median) | range over processes |",
                  "|---|---|---|---|---|---|"]
        for lane, details in fig["details"]["lanes"].items():
            release = details.get("transformers", lane)
            for row in details["table"]:
                lines.append(f"| {release} | {row['call']} | {row['stock_us']:.2f} | {row['overlay_us']:.2f} | "
                             f"{row['extra_us']:+.2f} | {row['extra_us_min']:+.2f} … {row['extra_us_max']:+.2f} |")
            for total, values in details["totals"].items():
                lines.append(f"| {release} | **sum per layer and step, {total} cache** | | | "
                             f"**{values['median_over_processes']:+.2f}** | {values['min']:+.2f} … {values['max']:+.2f} |")
    return lines


def per_call_instructions_table(report: dict[str, Any]) -> list[str]:
    """Figure 8's per-call part: instructions per call (median of rounds) with and without."""
    lines = []
    for fig in report["figures"]:
        if fig["id"] != "callgrind" or not fig["details"].get("per_call"):
            continue
        lines += ["", "Figure 8, per call (instructions per call, callgrind; median of rounds):", "",
                  "| transformers | call | stock | with overlay | extra |", "|---|---|---|---|---|"]
        for lane, details in fig["details"]["per_call"].items():
            release = details.get("transformers", lane)
            for row in details.get("table", []):
                lines.append(f"| {release} | {row['call']} | {row['stock']:,.0f} | {row['overlay']:,.0f} | "
                             f"{row['extra']:+,.0f} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        f"## attn-overlay benchmarks{' (smoke: tiny repetitions, numbers mean nothing)' if report['smoke'] else ''}",
        "",
        f"{report['started_utc']} · {machine['cpu']} ×{machine['cpu_count']} · python {machine['python']} · "
        f"torch {machine['torch']} · transformers {machine['transformers']} · attn-overlay {machine['attn_overlay']} "
        f"({(machine['git_commit'] or '?')[:10]}{', dirty tree' if machine['git_dirty'] else ''}) · "
        f"load average {report['load_average']['start']} → {report['load_average']['end']}"
        + (f" · overlay imported from {report['overlay_root']}" if report.get("overlay_root") else "")
        + (f" · merged from {', '.join(report['merged_from'])}" if report.get("merged_from") else ""),
        "",
        "| fig | case | median | min | max | n | best/best | goal | result |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for fig in report["figures"]:
        if fig["status"] != OK and not fig["cases"]:
            lines.append(f"| {fig['figure']} | {fig['title']} | | | | | | | {fig['status']}: {fig['reason']} |")
            continue
        for case in fig["cases"]:
            unit = case["unit"]
            if case["status"] != OK:
                result = f"{case['status']}: {case['note']}"
            elif fig["status"] == CHECK_ONLY:
                result = "check only"
            elif case["pass"] is None:
                result = "info"
            else:
                result = "pass" if case["pass"] else "**FAIL**"
            lines.append(
                f"| {fig['figure']} | {case['name']} | {_number(case['median'], unit)} | {_number(case['min'], unit)} | "
                f"{_number(case['max'], unit)} | {case['n']} | "
                f"{_number(case.get('best_ratio') if case.get('best') is None else case['best'], unit)} | "
                f"{case['goal'] or ''}{' (on best)' if case.get('judged_on') == 'best' and case['goal'] else ''} | {result} |"
            )
        if fig["status"] not in (OK,):
            notes.append(f"- figure {fig['figure']}: {fig['status']}: {fig['reason']}")
        unregistered = (fig["details"].get("patches") or {}).get("patch_files_not_registered")
        if unregistered:
            notes.append(f"- figure {fig['figure']}: patch files not listed in patches/__init__.py (not applied): "
                         f"{', '.join(unregistered)}")
    lines += ["", "median/min/max: of the per-round ratios (each round runs every variant once, side by side); "
              "best/best: ratio of each variant's fastest sample (figure 7: fastest with − fastest without). "
              "Goals are judged on the median, or where marked on best/best."]
    lines += per_call_table(report)
    lines += per_call_instructions_table(report)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


# -- chart ---------------------------------------------------------------------------------------

_PANELS = (
    ("ratio", "ratio per round: dot = median, thick = quartiles, thin = min…max"),
    ("ms", "milliseconds"),
    ("ms, whole import", "milliseconds, whole import (information)"),
    ("copies/step", "extra copies per decoding step"),
    ("µs", "µs extra, overlay − reverted: dot = median of rounds, ◇ = fastest − fastest (goal judged on ◇)"),
    ("instructions", "extra instructions per layer and decoding step (callgrind)"),
)


def _x_limits(entries: list[tuple[str, dict[str, Any], bool]]) -> tuple[float, float]:
    """Room for every median, quartile and goal; a min…max range reaching further is cut at the
    edge (and labelled), so one disturbed round cannot squash the whole panel."""
    anchors = [c[k] for _, c, _ in entries for k in ("median", "q1", "q3") if c.get(k) is not None]
    anchors += [c["goal_value"] for _, c, _ in entries if c["goal_value"] is not None]
    anchors += [c["best"] for _, c, _ in entries if c.get("best") is not None]
    low, high = min(anchors), max(anchors)
    span = max(high - low, 0.05 * max(abs(high), abs(low), 1e-9), 0.02)
    return low - 0.6 * span, high + 0.6 * span


def _colour(case: dict[str, Any], check_only: bool) -> str:
    if check_only or case["pass"] is None:
        return "#7f7f7f"
    return "#2ca02c" if case["pass"] else "#d62728"


def chart(report: dict[str, Any], path: Path) -> Path:
    """One panel per unit; every case a dot at its median, a thick bar over its quartiles and a thin
    one over min…max; its goal a black tick on the same row (green: goal met, red: missed, grey:
    information only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[str, list[tuple[str, dict[str, Any], bool]]] = {unit: [] for unit, _ in _PANELS}
    skipped = []
    for fig in report["figures"]:
        if not fig["cases"] or all(c["median"] is None for c in fig["cases"]):
            skipped.append(f"fig {fig['figure']}: {fig['status']}" + (f": {fig['reason']}" if fig["reason"] else ""))
        for case in fig["cases"]:
            if case["median"] is None:
                skipped.append(f"fig {fig['figure']} {case['name']}: {case['status']}")
                continue
            rows.setdefault(case["unit"], []).append((f"{fig['figure']}. {case['name']}", case,
                                                      fig["status"] == CHECK_ONLY))
    panels = [(unit, label) for unit, label in _PANELS if rows.get(unit)]
    panels += [(unit, unit) for unit in rows if rows[unit] and unit not in dict(_PANELS)]
    heights = [max(1.2, 0.42 * len(rows[unit]) + 0.6) for unit, _ in panels] or [1.0]
    figure, axes = plt.subplots(len(heights), 1, figsize=(11, sum(heights) + 1.6),
                                gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (unit, label) in zip(axes[:, 0], panels):
        entries = rows[unit]
        left, right = _x_limits(entries)
        ax.set_xlim(left, right)
        for y, (name, case, check_only) in enumerate(entries):
            colour = _colour(case, check_only)
            median, low, high = case["median"], case["min"], case["max"]
            q1, q3 = case.get("q1", median), case.get("q3", median)
            ax.plot([low, high], [y, y], color=colour, linewidth=1, alpha=0.6)
            ax.plot([q1, q3], [y, y], color=colour, linewidth=5, alpha=0.45, solid_capstyle="butt")
            ax.plot([median], [y], "o", color=colour, markersize=6)
            if case.get("best") is not None:
                ax.plot([case["best"]], [y], "D", color=colour, markersize=5, markerfacecolor="white")
            if high > right:
                ax.annotate(f"max {high:.3g} →", (right, y), xytext=(-4, -11), textcoords="offset points",
                            ha="right", fontsize=7, color=colour)
            if low < left:
                ax.annotate(f"← min {low:.3g}", (left, y), xytext=(4, -11), textcoords="offset points",
                            fontsize=7, color=colour)
            if case["goal_value"] is not None:
                ax.plot([case["goal_value"]], [y], marker="|", markersize=18, markeredgewidth=2.5, color="black")
                direction = {AT_MOST: "≤", AT_LEAST: "≥", EQUAL: "="}.get(case["goal_direction"], "")
                ax.annotate(f"goal {direction} {case['goal_value']:g}", (case["goal_value"], y),
                            xytext=(6, 6), textcoords="offset points", fontsize=7)
        ax.set_yticks(range(len(entries)))
        ax.set_yticklabels([name for name, _, _ in entries], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(label, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        if unit == "ratio":
            ax.axvline(1.0, color="#999999", linewidth=0.8, linestyle="--")
    machine = report["machine"]
    title = (f"attn-overlay overhead · transformers {machine['transformers']} · torch {machine['torch']} · "
             f"{machine['cpu_count']} CPUs · {report['started_utc']}{' · SMOKE (tiny repetitions)' if report['smoke'] else ''}")
    figure.suptitle(title, fontsize=10)
    footer = "; ".join(skipped)
    if footer:
        figure.text(0.01, 0.005, f"not shown: {footer}", fontsize=7, color="#555555", wrap=True)
    figure.tight_layout(rect=(0, 0.03 if footer else 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path



def merge(paths: list[Path]) -> dict[str, Any]:
    """One report from several runs' JSON files (a figure measured in a later file replaces the
    same figure of an earlier one): e.g. the slow start-up figures run earlier, the hot-path
    figures on the final code. Each figure keeps the run it came from (``details.run``)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    figures: dict[int, dict[str, Any]] = {}
    for path, data in zip(paths, reports):
        for fig in data["figures"]:
            fig = dict(fig)
            fig["details"] = {**fig.get("details", {}), "run": {
                "file": Path(path).name, "started_utc": data["started_utc"], "git_commit": data["machine"]["git_commit"],
                "git_dirty": data["machine"]["git_dirty"], "load_average": data["load_average"],
                "overlay_root": data.get("overlay_root")}}
            figures[fig["figure"]] = fig
    last = reports[-1]
    return {
        **last,
        "started_utc": min(r["started_utc"] for r in reports),
        "finished_utc": max(r["finished_utc"] for r in reports),
        "smoke": any(r["smoke"] for r in reports),
        "command": " + ".join(r["command"] for r in reports),
        "merged_from": [Path(p).name for p in paths],
        "load_average": {"start": reports[0]["load_average"]["start"], "end": last["load_average"]["end"]},
        "figures": [figures[n] for n in sorted(figures)],
    }
