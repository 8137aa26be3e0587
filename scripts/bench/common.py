"""What every benchmark shares: interleaved timing, summaries, figure/case records, workers.

Every ratio is computed per round from runs made side by side in the same round (A then B, the
order rotated from round to round so drift and warm-up favour no variant), and summarised as the
median, min and max over rounds. A ratio of two medians would hide how much the rounds disagree.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

REPO = Path(__file__).resolve().parents[2]

#: Goal directions: the measured median must be at most / at least / exactly the goal value.
AT_MOST = "<="
AT_LEAST = ">="
EQUAL = "=="

#: Figure statuses.
OK = "ok"
NOT_RUN = "not run"
ERROR = "error"
#: A figure run on a stand-in (the fake device instead of a GPU): the code ran, the numbers mean nothing.
CHECK_ONLY = "check only"


# -- statistics ----------------------------------------------------------------------------------


def summary(values: Sequence[float]) -> dict[str, float | int]:
    """median/min/max/n of ``values`` (which must be non-empty), and the quartiles q1/q3."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no samples")
    median = statistics.median(values)
    q1, q3 = (statistics.quantiles(values, n=4, method="inclusive")[::2] if len(values) > 1 else (median, median))
    return {"median": median, "min": min(values), "max": max(values), "n": len(values), "q1": q1, "q3": q3}


STAT_KEYS = ("median", "min", "max", "n", "q1", "q3")


def rotations(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the variants in each round: rotated by one every round (A B, B A, A B...)."""
    orders = []
    for r in range(rounds):
        k = r % len(names)
        orders.append(list(names[k:]) + list(names[:k]))
    return orders


def interleave(
    variants: Mapping[str, Callable[[], float]],
    rounds: int,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Run each variant once per round, in rotated order; each call returns one sample.

    ``warmup`` rounds run first and are thrown away (bytecode caches, lazy imports, allocator).
    Returns the samples per variant, index i of every list belonging to round i.
    """
    names = list(variants)
    for order in rotations(names, warmup):
        for name in order:
            variants[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for order in rotations(names, rounds):
        for name in order:
            samples[name].append(variants[name]())
    return samples


def per_round_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(numerator, denominator) if b > 0]


def timed_loop(call: Callable[[], Any], inner: int) -> float:
    """Mean seconds of one ``call()`` over ``inner`` back-to-back calls, garbage collector paused
    (as ``timeit`` does: a collection landing in one variant's loop is noise, not cost)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for _ in range(inner):
            call()
        elapsed = time.perf_counter_ns() - start
    finally:
        if enabled:
            gc.enable()
    return elapsed / inner / 1e9


# -- result records ------------------------------------------------------------------------------


@dataclass
class Case:
    """One measured quantity of a figure: a ratio, a time or a count, with its goal if it has one."""

    name: str
    unit: str  # "ratio", "ms", "copies/step", ...
    stats: dict[str, float | int] | None
    goal: float | None = None
    direction: str | None = None  # AT_MOST, AT_LEAST, EQUAL
    numerator: str | None = None
    denominator: str | None = None
    note: str = ""
    status: str = OK
    samples: list[float] | None = None
    best_ratio: float | None = None
    """For ratios: the ratio of each variant's fastest sample, the estimate least disturbed by
    other processes (``timeit``'s advice); reported next to the per-round median."""
    best: float | None = None
    """For differences (figure 7): fastest sample with − fastest sample without."""
    judged_on: str = "median"
    """What the goal is judged on: ``"median"`` (of the per-round values) or ``"best"``."""

    @property
    def passed(self) -> bool | None:
        if self.goal is None or self.stats is None or self.status != OK:
            return None
        median = float(self.best if self.judged_on == "best" and self.best is not None else self.stats["median"])
        if self.direction == AT_MOST:
            return median <= self.goal
        if self.direction == AT_LEAST:
            return median >= self.goal
        if self.direction == EQUAL:
            return median == self.goal
        raise ValueError(f"unknown goal direction {self.direction!r}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "unit": self.unit,
            "status": self.status,
            **({k: self.stats.get(k) for k in STAT_KEYS} if self.stats else
               {"median": None, "min": None, "max": None, "n": 0, "q1": None, "q3": None}),
            "goal": None if self.goal is None else f"{self.direction} {self.goal:g}",
            "goal_value": self.goal,
            "goal_direction": self.direction,
            "pass": self.passed,
            "numerator": self.numerator,
            "denominator": self.denominator,
            "note": self.note,
            "best_ratio": self.best_ratio,
            "best": self.best,
            "judged_on": self.judged_on,
            "samples": self.samples,
        }


def ratio_case(
    name: str,
    numerator: tuple[str, Sequence[float]],
    denominator: tuple[str, Sequence[float]],
    *,
    goal: float | None = None,
    direction: str | None = None,
    note: str = "",
    invert: bool = False,
) -> Case:
    """Per-round ratio numerator/denominator of two sample lists (``invert``: of their reciprocals,
    e.g. tokens/s from seconds)."""
    (num_name, num), (den_name, den) = numerator, denominator
    ratios = per_round_ratios(den, num) if invert else per_round_ratios(num, den)
    best = None
    if min(num) > 0 and min(den) > 0:
        best = min(den) / min(num) if invert else min(num) / min(den)
    return Case(
        name=name,
        unit="ratio",
        stats=summary(ratios),
        goal=goal,
        direction=direction,
        numerator=num_name,
        denominator=den_name,
        note=note,
        samples=[round(r, 6) for r in ratios],
        best_ratio=best,
    )


@dataclass
class Figure:
    number: int
    id: str
    title: str
    status: str = OK
    reason: str = ""
    cases: list[Case] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        passes = [c.passed for c in self.cases if c.passed is not None]
        return {
            "figure": self.number,
            "id": self.id,
            "title": self.title,
            "status": self.status,
            "reason": self.reason,
            "pass": (all(passes) if passes else None) if self.status == OK else None,
            "cases": [c.as_dict() for c in self.cases],
            "details": self.details,
            "seconds": round(self.seconds, 3),
        }


def case_from_dict(data: Mapping[str, Any]) -> Case:
    """Rebuild a :class:`Case` a worker sent back as JSON."""
    stats = None
    if data.get("median") is not None:
        stats = {k: data.get(k) for k in STAT_KEYS}
    return Case(
        name=data["name"],
        unit=data["unit"],
        stats=stats,
        goal=data.get("goal_value"),
        direction=data.get("goal_direction"),
        numerator=data.get("numerator"),
        denominator=data.get("denominator"),
        note=data.get("note", ""),
        status=data.get("status", OK),
        samples=data.get("samples"),
        best_ratio=data.get("best_ratio"),
        best=data.get("best"),
        judged_on=data.get("judged_on", "median"),
    )


# -- workers -------------------------------------------------------------------------------------


class WorkerError(RuntimeError):
    pass


def clean_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The bench's environment without any overlay switch, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OVERLAY")}
    env.update(extra or {})
    return env


#: ``--overlay-root DIR``: the workers import ``overlay`` (and ``patches/`` as ``overlay.patches``)
#: from another checkout of the project, e.g. a ``git worktree`` of an older commit, to measure a
#: BEFORE next to an AFTER with the same benchmark code. None: this checkout (or the installed one).
OVERLAY_ROOT: str | None = None


def worker_command(name: str, payload: Mapping[str, Any], python: str | None = None) -> list[str]:
    payload = dict(payload)
    if OVERLAY_ROOT and "overlay_root" not in payload:
        payload["overlay_root"] = OVERLAY_ROOT
    return [python or sys.executable, "-m", "scripts.bench.worker", name, json.dumps(payload)]


def worker_environment() -> dict[str, str]:
    env = clean_environment({"ATTN_OVERLAY": "0", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def run_worker(name: str, payload: Mapping[str, Any], *, timeout: float, python: str | None = None) -> dict[str, Any]:
    """Run ``scripts.bench.worker`` for figure worker ``name`` in a fresh interpreter (``python``:
    another environment's interpreter, e.g. a nox lane with another transformers release).

    A fresh process per figure: torch allows renaming its PrivateUse1 backend (the fake device)
    once per process, and each figure starts from the same cold state. The overlay's automatic
    activation is off there (``ATTN_OVERLAY=0``): the workers apply and revert it themselves.
    """
    env = worker_environment()
    command = worker_command(name, payload, python)
    try:
        done = subprocess.run(command, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise WorkerError(f"worker {name} ran past {timeout:.0f} s") from exc
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout)[-3000:]
        raise WorkerError(f"worker {name} exited {done.returncode}:\n{tail}")
    return json.loads(lines[-1])


def figure_from_worker(number: int, id: str, title: str, result: Mapping[str, Any]) -> Figure:
    figure = Figure(number=number, id=id, title=title, status=result.get("status", OK),
                    reason=result.get("reason", ""), details=dict(result.get("details", {})))
    figure.cases = [case_from_dict(c) for c in result.get("cases", [])]
    return figure


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
