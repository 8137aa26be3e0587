"""``python -m overlay.doctor``: does generation work on *this* machine, without and with the overlay?

It finds the accelerator torch sees (CUDA, XPU, Ascend NPU, Intel Gaudi HPU, MPS, a PrivateUse1
backend such as Neuron, XLA through ``torch_xla``), builds tiny randomly initialised models from configs (nothing
is downloaded) and runs each scenario twice, each time in a fresh subprocess: once on stock
transformers, once with the overlay applied. A scenario passes when every one of its cases
finishes and generates the same tokens as its reference run.

Exit codes: 0 every scenario that ran passes with the overlay; 1 one fails with the overlay (or
none ran); 2 bad usage (an unknown scenario, a device this machine does not have, a fake device
that cannot be installed); 3 cannot run here, a dependency is missing (torch or transformers is
not installed, or does not import): one line on stderr says what to install, and nothing runs.

With no accelerator it uses the host-memory fake device of :mod:`overlay.testing`, on which
device-placement bugs fail exactly as on an accelerator: the without-overlay column then shows
the real failures of the installed transformers, and the with-overlay column shows them fixed.
The report names the fake device's implementation: its C++ backend (compiled once, cached in
attn-overlay's cache folder, ``~/.cache/attn-overlay`` by default, which the report names too),
or its pure-Python backend and why the C++ one was not used (no C++ compiler, ninja missing,
the cache folder not writable, the compiler's first error). Both compute what the CPU computes
and fail where a real device fails.

The tensor-parallel scenario runs when the doctor is itself launched by torchrun with a world
size above one (``torchrun --nproc-per-node 2 -m overlay.doctor``).

API: :func:`run_doctor` (also ``overlay.run_doctor``) returns the report (the ``--json``
document) without printing anything. Importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["run_doctor", "render", "main", "SCENARIO_IDS", "MissingDependencyError", "EXIT_MISSING_DEPENDENCY"]

from ._env import MissingDependencyError
from ._scenarios import SCENARIO_IDS  # scenario ids, in report order

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_MISSING_DEPENDENCY = 0, 1, 2, 3


def run_doctor(
    device: str | None = None,
    *,
    scenarios: Iterable[str] | None = None,
    timeout: float = 300.0,
    jobs: int | None = None,
    threads: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the scenarios and return the report (a JSON-able dict; ``report["ok"]`` is the verdict).

    ``device``: ``None`` (the best accelerator found, else the fake device), ``"cpu"``,
    ``"fake"`` / ``"fake:NAME"``, or a device such as ``"cuda"``, ``"cuda:1"``, ``"xla"``.
    ``scenarios``: ids from :data:`SCENARIO_IDS` (default: all). ``timeout``: seconds per scenario
    subprocess. ``jobs``: scenario subprocesses at once (default: 2 on CPU, CUDA, XPU and MPS; 1 on
    devices a process holds exclusively). ``threads``: torch threads in each subprocess.
    ``progress``: called with one line per finished scenario run.
    Raises ``ValueError`` for an unknown scenario or a device this machine does not have, and
    :class:`MissingDependencyError` (an ``ImportError``) when torch or transformers is missing.
    """
    from ._runner import run

    return run(device, scenarios=scenarios, timeout=timeout, jobs=jobs, threads=threads, progress=progress)


def render(report: dict[str, Any]) -> str:
    """The report as the text ``python -m overlay.doctor`` prints."""
    from ._render import render as render_text

    return render_text(report)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m overlay.doctor",
        description=(
            "Check that generation works on this machine's accelerator, without and with the overlay: "
            "tiny random models, each scenario in a fresh subprocess on stock transformers and with "
            "the overlay applied."
        ),
        epilog=(
            "Scenarios: " + ", ".join(SCENARIO_IDS) + ". The tensor-parallel one runs under torchrun "
            "with world size > 1: torchrun --nproc-per-node 2 -m overlay.doctor. "
            "Exit codes: 0 every scenario passes with the overlay; 1 a scenario fails with it; "
            "2 bad usage (unknown scenario, a device not on this machine); 3 cannot run here: "
            "torch or transformers is missing (stderr says what to install)."
        ),
    )
    parser.add_argument(
        "--device",
        help="device to test: cuda, cuda:1, xpu, npu, hpu, mps, xla, neuron, cpu, or fake[:NAME] for the "
        "host-memory fake device (default: the accelerator found, else the fake device)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIO_IDS,
        metavar="ID",
        help="run only this scenario (repeatable): " + ", ".join(SCENARIO_IDS),
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per scenario subprocess (default 300)")
    parser.add_argument("--jobs", type=int, help="scenario subprocesses run at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per subprocess (default 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Progress lines are for a person watching: on a terminal only, never into a captured log.
    progress = _print_progress if not args.quiet and sys.stderr.isatty() else None
    try:
        report = run_doctor(
            args.device,
            scenarios=args.scenario,
            timeout=args.timeout,
            jobs=args.jobs,
            threads=args.threads,
            progress=progress,
        )
    except MissingDependencyError as exc:  # torch or transformers not installed here
        print(f"python -m overlay.doctor: {exc}", file=sys.stderr)
        return EXIT_MISSING_DEPENDENCY
    except ValueError as exc:  # a device that is not here, ...
        print(f"python -m overlay.doctor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if report["environment"].get("rank", 0) == 0:
        print(json.dumps(report, indent=2) if args.json else render(report))
    return EXIT_PASS if report["ok"] else EXIT_FAIL


def _print_progress(line: str) -> None:
    print(f"doctor: {line}", file=sys.stderr, flush=True)
