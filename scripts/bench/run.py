"""Run the benchmarks: ``python -m scripts.bench`` (or ``python scripts/bench/run.py``) from the repo root.

    python -m scripts.bench                 # every figure, full repetitions (minutes)
    python -m scripts.bench --smoke         # tiny repetitions: checks the scripts, numbers mean nothing
    python -m scripts.bench --only 1,2      # some figures
    python -m scripts.bench --out DIR       # default: results/ (git-ignored)
    python -m scripts.bench --only 7 --lanes tf-5-13-0,tests,tf-5-24-0   # figure 7's releases (nox lanes)
    python -m scripts.bench --only 7 --overlay-root /tmp/before          # the overlay of another checkout
    python -m scripts.bench --only 9 --lanes tf-4-57-6,tests --layers 2 --modes greedy,beam   # whole generate()
    python -m scripts.bench --merge A.json B.json --out DIR   # one report from several runs (later wins)

Writes ``DIR/bench-<UTC time>.json`` and ``.png`` (plus ``latest.json`` / ``latest.png``) and
prints a markdown summary. Exit status 1 when a figure could not be measured (status "error");
goals missed are reported, not turned into a failing exit, since timings depend on the machine.
Run it on a quiet machine: every ratio compares runs made side by side, but other processes
still widen the spread.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable, then run as a package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "scripts.bench"

from . import FIGURES, callgrind, common, generate, gpu, percall, prepare_inputs, report, startup, whole  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny repetitions (what the test suite runs)")
    parser.add_argument("--out", type=Path, default=common.REPO / "results", help="output folder (default: results/)")
    parser.add_argument("--only", default="", help="comma-separated figure numbers, e.g. 1,2 (default: all)")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument("--host-device", default="auto", choices=("auto", "cuda", "fakeaccel"),
                        help="figure 3's accelerator for host-side inputs: CUDA if present, else the fake device")
    parser.add_argument("--gpu-device", default="cuda",
                        help="figure 6's device: cuda; a fake-device name (e.g. fakeaccel) only checks the script")
    parser.add_argument("--lanes", default=None,
                        help="figure 7: comma-separated nox lanes (folders under .nox) or interpreters; "
                             "default: tf-5-13-0,tests,tf-5-24-0 where built (smoke: this interpreter)")
    parser.add_argument("--modes", default=None,
                        help=f"figure 9: comma-separated modes (default: all of {','.join(whole.MODES)})")
    parser.add_argument("--layers", default=None, help="figure 9: comma-separated model depths (default: 2,8)")
    parser.add_argument("--rounds", default=None, type=int, help="figure 9: counted rounds (default: 3)")
    parser.add_argument("--attribute", action="store_true",
                        help="figure 9: also leave each applied patch out in turn (one round; slow)")
    parser.add_argument("--overlay-root", default=None, type=Path,
                        help="workers import the overlay from this checkout (e.g. a git worktree of an older "
                             "commit: a BEFORE measured with the same benchmark code)")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                        help="measure nothing: combine these runs' JSON reports (a figure of a later file "
                             "replaces the same figure of an earlier one) into one JSON, chart and summary")
    args = parser.parse_args(argv)
    try:
        args.figures = {int(x) for x in args.only.split(",") if x.strip()} or set(FIGURES)
    except ValueError:
        parser.error(f"--only takes figure numbers 1-{max(FIGURES)}, e.g. --only 1,3; got {args.only!r}")
    unknown = args.figures - set(FIGURES)
    if unknown:
        parser.error(f"no figure {sorted(unknown)}; figures are {sorted(FIGURES)}")
    if not args.no_chart:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("the chart needs matplotlib: pip install 'attn-overlay[bench]' (or pass --no-chart)")
    return args


def _guarded(number: int, run) -> list[common.Figure]:
    """A figure that breaks is reported as an error; the other figures still run."""
    started = time.perf_counter()
    try:
        figures = run()
    except Exception as exc:
        figure_id, title = FIGURES[number]
        figures = [common.Figure(number, figure_id, title, status=common.ERROR, reason=f"{type(exc).__name__}: {exc}")]
    for figure in figures:
        figure.seconds = figure.seconds or time.perf_counter() - started
    return figures


def _write(data: dict, args: argparse.Namespace, stem: str) -> None:
    json_path = report.write_json(data, args.out, stem)
    outputs = [json_path]
    if not args.no_chart:
        png = report.chart(data, args.out / f"{stem}.png")
        (args.out / "latest.png").write_bytes(png.read_bytes())
        outputs.append(png)
    sys.stdout.write(report.markdown(data))
    sys.stdout.write("\n" + "\n".join(f"wrote {p}" for p in outputs) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if args.merge:
        data = report.merge(args.merge)
        _write(data, args, f"bench-merged-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}")
        return 1 if any(f["status"] == common.ERROR for f in data["figures"]) else 0
    started = datetime.now(timezone.utc)
    load_start = report.load_average()
    options = {"host_device": args.host_device, "gpu_device": args.gpu_device, "lanes": args.lanes,
               "modes": args.modes, "layers": args.layers, "rounds": args.rounds, "attribute": args.attribute}
    if args.overlay_root is not None:
        common.OVERLAY_ROOT = str(args.overlay_root.resolve())
    wanted = args.figures
    plan = []
    if wanted & {1, 2}:
        plan.append((min(wanted & {1, 2}), lambda: startup.run(args.smoke, options, wanted)))
    single = {
        3: prepare_inputs.run,
        4: generate.run_generate,
        5: generate.run_copies,
        6: gpu.run,
        7: percall.run,
        8: callgrind.run,
        9: whole.run,
    }
    for number, run in single.items():
        if number in wanted:
            plan.append((number, lambda run=run: [run(args.smoke, options)]))

    figures: list[common.Figure] = []
    for number, run in plan:
        print(f"[bench] figure {number}{' and 2' if number == 1 and 2 in wanted else ''} ...", file=sys.stderr, flush=True)
        done = _guarded(number, run)
        for figure in done:
            print(f"[bench]   figure {figure.number}: {figure.status} ({figure.seconds:.0f} s)", file=sys.stderr, flush=True)
        figures.extend(done)

    data = report.build_report(figures, smoke=args.smoke, started=started, load_start=load_start,
                               argv=["python -m scripts.bench", *argv])
    stem = f"bench-{started.strftime('%Y%m%dT%H%M%SZ')}{'-smoke' if args.smoke else ''}"
    _write(data, args, stem)
    return 1 if any(f.status == common.ERROR for f in figures) else 0


if __name__ == "__main__":
    sys.exit(main())
