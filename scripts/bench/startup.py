"""Figures 1 and 2: what the startup hook costs, in real fresh virtual environments.

Two environments are made from the same freshly built wheel (``tests/freshenv.py``, the helpers
the startup-hook tests use): ``hook``, the wheel as users install it, and ``no-pth``, the same
installation with ``attn_overlay.pth`` and ``attn_overlay.start`` deleted -- identical
site-packages except the hook files, so the interpreter never imports the startup module there.
That is the true baseline: with ``ATTN_OVERLAY=0`` the ``.pth`` line still runs and imports
``_attn_overlay_startup`` (which then installs nothing), so ``ATTN_OVERLAY=0`` is measured as a
third variant, for information. Both environments see torch and transformers through one path
line to the bench interpreter's site-packages (a path line only: no other ``.pth`` is processed).
The wheel is built from this checkout, or from ``--overlay-root DIR`` when given (a BEFORE: e.g.
``git archive OLD | tar -x -C DIR``), measured by this same benchmark code.

    python -m scripts.bench --only 1 --no-chart                          # this checkout's hook
    python -m scripts.bench --only 1 --no-chart --overlay-root /tmp/old  # another checkout's

Figure 1: ``python -c pass``, wall time of the whole process, variants interleaved.
Figure 2: the first ``import transformers.generation.utils`` in a fresh interpreter, timed inside
the process; in ``hook`` the engine also reports how long applying the patches took
(``overlay.engine.apply_timings()``, summed over the patched modules).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import FIGURES, common
from .common import AT_MOST, Case, Figure, ratio_case

FIGURE_START = 1
ID_START, TITLE_START = FIGURES[FIGURE_START]
GOAL_START = 1.03

FIGURE_IMPORT = 2
ID_IMPORT, TITLE_IMPORT = FIGURES[FIGURE_IMPORT]
GOAL_APPLY_MS = 5.0

HOOK_FILES = ("attn_overlay.pth", "attn_overlay.start")

_IMPORT_PROBE = """\
import json, sys, time
start = time.perf_counter()
import transformers.generation.utils
seconds = time.perf_counter() - start
engine = sys.modules.get("overlay.engine")  # only there if the hook activated the overlay
result = {"import_s": seconds, "active": bool(engine and engine.is_active())}
if engine is not None:
    result["apply_s"] = engine.apply_timings()
    result["states"] = {s.id: s.state for s in engine.status()}
    result["startup_error"] = engine.activation_error()
print(json.dumps(result))
"""

# At start the startup module itself waits on sys.meta_path (the full finder takes over at `import transformers`);
# an overlay from before that change (``--overlay-root``) put its PostImportFinder there at once.
_HOOK_PROBE = ("import sys; print(any(getattr(f, '__name__', '') == '_attn_overlay_startup' "
               "or type(f).__name__ == 'PostImportFinder' for f in sys.meta_path))")


def settings(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"start_rounds": 3, "start_warmup": 1, "import_rounds": 1, "import_warmup": 0}
    return {"start_rounds": 300, "start_warmup": 10, "import_rounds": 20, "import_warmup": 1}


class Environments:
    """The two fresh environments, made once for both figures and removed afterwards."""

    def __init__(self) -> None:
        if str(common.REPO) not in sys.path:  # `tests` is a folder of the checkout, not installed
            sys.path.insert(0, str(common.REPO))
        from tests.freshenv import build_wheel, install_wheel, make_fresh_env

        # --overlay-root: the other checkout's wheel, so that figures 1-2 measure the same overlay
        # as the workers of the other figures (and as the report's header says).
        self.source = Path(common.OVERLAY_ROOT) if common.OVERLAY_ROOT else common.REPO
        if not any((self.source / name).is_file() for name in ("setup.py", "pyproject.toml")):
            raise RuntimeError(f"--overlay-root {self.source} is not a checkout of attn-overlay (no setup.py or "
                               "pyproject.toml): figures 1-2 build the startup hook's wheel from it")
        self.root = Path(tempfile.mkdtemp(prefix="attn-overlay-bench-"))
        started = time.perf_counter()
        try:
            wheel = build_wheel(self.root / "wheel", self.source)
            self.hook = make_fresh_env(self.root / "hook")
            install_wheel(self.hook, wheel)
            self.no_pth = make_fresh_env(self.root / "no-pth")
            install_wheel(self.no_pth, wheel)
            for name in HOOK_FILES:
                (self.no_pth.site_packages / name).unlink()
        except subprocess.CalledProcessError as exc:
            self.close()
            raise RuntimeError(f"{' '.join(map(str, exc.cmd))} exited {exc.returncode}: {(exc.stderr or '')[-2000:]}") from exc
        except BaseException:
            self.close()
            raise
        self.wheel = wheel.name
        self.setup_seconds = time.perf_counter() - started
        self.base_env = common.clean_environment()
        self.base_env.pop("PYTHONPATH", None)

    def env(self, **extra: str) -> dict[str, str]:
        return {**self.base_env, **extra}

    def check_hook(self) -> dict[str, bool]:
        """Is the startup finder installed at start in each variant (the measurement's premise)?"""

        def probe(python, env):
            out = subprocess.run([str(python), "-c", _HOOK_PROBE], env=env, capture_output=True, text=True,
                                 timeout=60, check=True)
            return out.stdout.strip() == "True"

        return {
            "hook": probe(self.hook.python, self.env()),
            "no-pth": probe(self.no_pth.python, self.env()),
            "ATTN_OVERLAY=0": probe(self.hook.python, self.env(ATTN_OVERLAY="0")),
        }

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _wall_seconds(python: Path, args: list[str], env: dict[str, str]):
    command = [str(python), *args]

    def sample() -> float:
        start = time.perf_counter_ns()
        subprocess.run(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True, timeout=120)
        return (time.perf_counter_ns() - start) / 1e9

    return sample


def figure_start(envs: Environments, cfg: dict[str, Any]) -> Figure:
    figure = Figure(FIGURE_START, ID_START, TITLE_START)
    premise = envs.check_hook()
    figure.details["hook_installed_at_start"] = premise
    if premise != {"hook": True, "no-pth": False, "ATTN_OVERLAY=0": False}:
        figure.status, figure.reason = common.ERROR, f"the variants are not what they claim: {premise}"
        return figure
    samples = common.interleave(
        {
            "hook": _wall_seconds(envs.hook.python, ["-c", "pass"], envs.env()),
            "no-pth": _wall_seconds(envs.no_pth.python, ["-c", "pass"], envs.env()),
            "ATTN_OVERLAY=0": _wall_seconds(envs.hook.python, ["-c", "pass"], envs.env(ATTN_OVERLAY="0")),
        },
        cfg["start_rounds"],
        cfg["start_warmup"],
    )
    figure.cases = [
        ratio_case("python -c pass: hook active / no .pth", ("hook", samples["hook"]), ("no-pth", samples["no-pth"]),
                   goal=GOAL_START, direction=AT_MOST,
                   note="same venv contents; baseline has attn_overlay.pth/.start deleted"),
        ratio_case("python -c pass: ATTN_OVERLAY=0 / no .pth", ("ATTN_OVERLAY=0", samples["ATTN_OVERLAY=0"]),
                   ("no-pth", samples["no-pth"]),
                   note="information: the .pth still imports _attn_overlay_startup, which then installs nothing"),
        ratio_case("python -c pass: hook active / ATTN_OVERLAY=0", ("hook", samples["hook"]),
                   ("ATTN_OVERLAY=0", samples["ATTN_OVERLAY=0"]), note="information"),
    ]
    figure.details["milliseconds_median"] = {k: 1e3 * common.summary(v)["median"] for k, v in samples.items()}
    return figure


def figure_import(envs: Environments, cfg: dict[str, Any]) -> Figure:
    figure = Figure(FIGURE_IMPORT, ID_IMPORT, TITLE_IMPORT)
    probe = envs.root / "import_probe.py"
    probe.write_text(_IMPORT_PROBE)
    reports: dict[str, list[dict[str, Any]]] = {"hook": [], "no-pth": []}

    def sampler(name: str, python: Path):
        def sample() -> float:
            done = subprocess.run([str(python), str(probe)], env=envs.env(), capture_output=True, text=True,
                                  timeout=600, cwd=str(envs.root))
            if done.returncode != 0:
                raise RuntimeError(f"the import probe exited {done.returncode} in {name!r}: {done.stderr[-2000:]}")
            report = json.loads(done.stdout.strip().splitlines()[-1])
            reports[name].append(report)
            return report["import_s"]

        return sample

    samples = common.interleave(
        {"hook": sampler("hook", envs.hook.python), "no-pth": sampler("no-pth", envs.no_pth.python)},
        cfg["import_rounds"],
        cfg["import_warmup"],
    )
    # Reports of the measured rounds only (warm-up rounds come first).
    hook_reports = reports["hook"][-cfg["import_rounds"]:]
    if not all(r["active"] for r in hook_reports) or any(r["active"] for r in reports["no-pth"]):
        figure.status, figure.reason = common.ERROR, "the overlay was not active in 'hook' (or active in 'no-pth')"
        figure.details["reports"] = reports
        return figure
    apply_ms = [1e3 * sum(r["apply_s"].values()) for r in hook_reports]
    per_module: dict[str, list[float]] = {}
    for r in hook_reports:
        for module, seconds in r["apply_s"].items():
            per_module.setdefault(module, []).append(1e3 * seconds)
    differences_ms = [1e3 * (a - b) for a, b in zip(samples["hook"], samples["no-pth"])]
    figure.cases = [
        ratio_case("import transformers.generation.utils: overlay / without", ("hook", samples["hook"]),
                   ("no-pth", samples["no-pth"]), note="information: dominated by importing torch and transformers"),
        Case(name="time applying patches at that import (engine.apply_timings, summed)", unit="ms",
             stats=common.summary(apply_ms), goal=GOAL_APPLY_MS, direction=AT_MOST,
             note="fingerprint checks and swaps, in the target modules' post-import hooks",
             samples=[round(v, 4) for v in apply_ms]),
        Case(name="overlay's whole extra import time (hook - without, per round)", unit="ms, whole import",
             stats=common.summary(differences_ms),
             note="information: activation (loading patch files, version gate) + patching; noisy",
             samples=[round(v, 3) for v in differences_ms]),
    ]
    figure.details.update({
        "import_seconds_median": {k: common.summary(v)["median"] for k, v in samples.items()},
        "apply_ms_median_per_module": {m: common.summary(v)["median"] for m, v in sorted(per_module.items())},
        "patch_states": hook_reports[-1].get("states"),
        "startup_error": hook_reports[-1].get("startup_error"),
    })
    return figure


def run(smoke: bool, options: dict[str, Any], wanted: set[int]) -> list[Figure]:
    cfg = settings(smoke)
    try:
        envs = Environments()
    except Exception as exc:  # no pip/setuptools/venv here: both figures say why
        reason = f"could not build the wheel or the fresh environments: {type(exc).__name__}: {exc}"
        return [Figure(n, i, t, status=common.ERROR, reason=reason)
                for n, i, t in ((FIGURE_START, ID_START, TITLE_START), (FIGURE_IMPORT, ID_IMPORT, TITLE_IMPORT))
                if n in wanted]
    figures = []
    try:
        setup = {"wheel": envs.wheel, "wheel_source": str(envs.source), "setup_seconds": round(envs.setup_seconds, 1)}
        for number, build in ((FIGURE_START, figure_start), (FIGURE_IMPORT, figure_import)):
            if number not in wanted:
                continue
            t0 = time.perf_counter()
            try:
                figure = build(envs, cfg)
            except Exception as exc:
                figure = Figure(number, ID_START if number == FIGURE_START else ID_IMPORT,
                                TITLE_START if number == FIGURE_START else TITLE_IMPORT,
                                status=common.ERROR, reason=f"{type(exc).__name__}: {exc}")
            figure.details["environments"] = setup
            figure.seconds = time.perf_counter() - t0
            figures.append(figure)
    finally:
        envs.close()
    return figures

