"""Runs every scenario twice, each time in a fresh subprocess (stock, then with the overlay), and
assembles the report."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from ..engine import known_patches
from . import _env
from ._scenarios import BY_ID, SCENARIOS, Scenario, patches_proving

MODES = ("without", "with")
DEFAULT_TIMEOUT_S = 300.0

# Variables of the torchrun job the doctor runs in; single-device scenario subprocesses must not
# inherit them (they would believe they are a rank of a job).
_LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)

Progress = Callable[[str], None]


class _Launch:
    """Who this process is in a torchrun job (world size 1 outside one)."""

    def __init__(self) -> None:
        env = os.environ
        self.world_size = int(env.get("WORLD_SIZE", "1") or 1)
        self.rank = int(env.get("RANK", "0") or 0)
        self.local_rank = int(env.get("LOCAL_RANK", "0") or 0)
        self.master_addr = env.get("MASTER_ADDR")
        self.master_port = env.get("MASTER_PORT")
        self.distributed = self.world_size > 1 and bool(self.master_addr) and bool(self.master_port)
        if not self.distributed:  # stray variables without a job to rendezvous with: on our own
            self.world_size, self.rank = 1, 0


def select_scenarios(ids: Iterable[str] | None) -> list[Scenario]:
    if not ids:
        return list(SCENARIOS)
    unknown = [i for i in ids if i not in BY_ID]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; known: {', '.join(BY_ID)}")
    wanted = set(ids)
    return [s for s in SCENARIOS if s.id in wanted]


def run(
    device: str | None = None,
    *,
    scenarios: Iterable[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    jobs: int | None = None,
    threads: int = 1,
    progress: Progress | None = None,
) -> dict[str, Any]:
    started = time.perf_counter()
    chosen = select_scenarios(scenarios)
    # Before anything else: without torch or transformers every scenario would fail for that
    # one reason, after minutes of subprocesses; say it once instead.
    _env.check_dependencies()
    launch = _Launch()
    say = progress or (lambda line: None)

    report: dict[str, Any] = {"doctor": 1, "ok": False}
    from overlay._version import __version__

    accelerators, problems = _env.detect_accelerators()
    choice = _env.choose_device(device, accelerators, local_rank=launch.local_rank, announce=say)
    report["environment"] = {
        "python": _env.python_description(),
        "platform": _env.platform_description(),
        "packages": _env.package_versions(),
        "overlay_version": __version__,
        "accelerators": [a.as_dict() for a in accelerators],
        "detection_problems": problems,
        "device": choice.as_dict(),
        "world_size": launch.world_size,
        "rank": launch.rank,
    }
    notes: list[str] = []  # the device's own notes are in environment.device.notes

    workdir = tempfile.mkdtemp(prefix="attn-overlay-doctor-")
    group = None
    try:
        if launch.distributed:
            group = _init_parent_group(launch, timeout, len(chosen))
        results: dict[tuple[str, str], dict] = {}
        runnable: list[Scenario] = []
        not_here = _not_on_this_release(chosen)
        for scenario in chosen:
            if scenario.id in not_here:
                continue
            if scenario.distributed and not launch.distributed:
                continue
            if not scenario.distributed and launch.rank != 0:
                continue  # single-device scenarios run once, on rank 0
            runnable.append(scenario)

        single = [s for s in runnable if not s.distributed]
        first_with = next((s.id for s in single), None)
        tasks = [(s, mode) for s in single for mode in MODES]
        total = len(tasks) + 2 * sum(1 for s in runnable if s.distributed)
        done_count = 0

        def announce(scenario: Scenario, mode: str, result: dict) -> None:
            nonlocal done_count
            done_count += 1
            verdict = "pass" if result["ok"] else "FAIL"
            error = str(result["error"])
            detail = "" if result["ok"] else f" ({error if len(error) <= 110 else error[:109] + '…'})"
            say(f"[{done_count}/{total}] {scenario.id}, {mode} overlay: {verdict}{detail} [{result['seconds']:.1f} s]")

        # Distributed scenarios first, every rank at once, in the same order on every rank.
        # (`runnable` holds distributed scenarios only under torchrun, where the group exists.)
        if group is not None:
            for scenario in (s for s in runnable if s.distributed):
                for mode in MODES:
                    spec = _spec(scenario, mode, choice, workdir, threads, import_all=first_with is None and mode == "with")
                    spec["distributed"] = {
                        "master_addr": launch.master_addr,
                        "master_port": launch.master_port,
                        "rank": launch.rank,
                        "world_size": launch.world_size,
                        "prefix": f"attn-overlay-doctor/{group['run_id']}/{scenario.id}/{mode}/",
                        "timeout_s": timeout,
                    }
                    # transformers puts a tensor-parallel model on the accelerator torch reports; the
                    # fake device is no accelerator for torch.distributed, so TP runs on the CPU there.
                    spec["device"] = None
                    spec["fake_device"] = None
                    own = _run_child(spec, timeout, workdir, distributed=True)
                    merged = _merge_ranks(_gather(group, own), launch.world_size)
                    if launch.rank == 0:
                        results[(scenario.id, mode)] = merged
                        announce(scenario, mode, merged)

        if tasks:
            if jobs is None:
                jobs = _default_jobs(choice)
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                futures = {
                    pool.submit(
                        _run_child,
                        _spec(s, mode, choice, workdir, threads, import_all=(s.id == first_with and mode == "with")),
                        timeout,
                        workdir,
                    ): (s, mode)
                    for s, mode in tasks
                }
                for future in as_completed(futures):
                    scenario, mode = futures[future]
                    results[(scenario.id, mode)] = future.result()
                    announce(scenario, mode, results[(scenario.id, mode)])

        report["scenarios"] = [_scenario_report(s, results, not_here.get(s.id)) for s in chosen]
        report["overlay_status"] = _overlay_status(results)
        if any(s.distributed and s.id not in not_here for s in chosen) and not launch.distributed:
            notes.append(
                "tp-prefill-chunk needs tensor parallelism: run the doctor under torchrun with "
                "world size > 1, e.g. `torchrun --nproc-per-node 2 -m overlay.doctor`"
            )
        if launch.distributed and any(s.distributed for s in chosen):
            notes.append(
                f"tp-prefill-chunk ran on {launch.world_size} ranks; its tensor-parallel model sits on the "
                "device transformers picks for TP (the CPU with gloo when there is no CUDA)"
            )
        ran = [s for s in report["scenarios"] if s["status"] != "skipped"]
        report["ok"] = bool(ran) and all(s["with"]["ok"] for s in ran)
        if not ran:
            notes.append("no scenario ran")
        report["notes"] = notes
        report["seconds"] = round(time.perf_counter() - started, 1)
        if group is not None:
            report["ok"] = _broadcast(group, report["ok"])
        return report
    finally:
        if group is not None:
            _close_parent_group()
        shutil.rmtree(workdir, ignore_errors=True)


def _default_jobs(choice: _env.DeviceChoice) -> int:
    # Plug-in accelerators (TPU, NeuronCore) belong to one process at a time: one scenario at once.
    if choice.kind == "accelerator" and choice.device.split(":")[0] not in ("cuda", "xpu", "mps"):
        return 1
    return max(1, min(2, os.cpu_count() or 1))


def _spec(scenario: Scenario, mode: str, choice: _env.DeviceChoice, workdir: str, threads: int, *, import_all: bool) -> dict:
    return {
        "scenario": scenario.id,
        "mode": mode,
        "device": choice.device,
        "plugins": list(choice.plugins),
        "fake_device": None if choice.fake_name is None else {"name": choice.fake_name, "backend": choice.fake_backend},
        "threads": threads,
        "import_all_targets": import_all,
        "workdir": workdir,
    }


def _child_environment(distributed: bool) -> dict[str, str]:
    env = dict(os.environ)
    # Stock in both runs; the "with" run applies the overlay itself (see _child.py).
    env["ATTN_OVERLAY"] = "0"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    if not distributed:
        for name in _LAUNCHER_VARIABLES:
            env.pop(name, None)
    # The child runs in a scratch directory: make sure it imports this very overlay package, also
    # when this process found it through its working directory or PYTHONPATH (a plain checkout).
    # An overlay installed in site-packages is found there anyway; that folder must not be put
    # in front of the standard library.
    import site

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    site_folders = {os.path.abspath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}
    if root not in site_folders:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _run_child(spec: dict, timeout: float, workdir: str, distributed: bool = False) -> dict:
    """Runs one scenario subprocess; always returns a result (a crash or a timeout is a result)."""
    key = f"{spec['scenario']}-{spec['mode']}-{uuid.uuid4().hex[:8]}"
    folder = os.path.join(workdir, key)
    os.makedirs(folder)
    spec = dict(spec, workdir=folder)
    spec_path, out_path, log_path = (os.path.join(folder, n) for n in ("spec.json", "result.json", "log.txt"))
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "overlay.doctor._child", spec_path, out_path],
            cwd=folder,
            env=_child_environment(distributed),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a timeout kills it and its helpers
        )
        try:
            returncode = process.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            returncode = process.wait()
    seconds = round(time.perf_counter() - started, 2)
    result: dict
    try:
        with open(out_path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {"scenario": spec["scenario"], "mode": spec["mode"], "cases": []}
        if timed_out:
            result["error"] = f"the scenario subprocess did not finish in {timeout:.0f} s (killed)"
        else:
            result["error"] = f"the scenario subprocess died (exit code {returncode}): {_last_line(log_path)}"
    result["wall_seconds"] = seconds
    result.setdefault("seconds", seconds)
    result["returncode"] = returncode
    if result.get("error") is None and result.get("cases") == []:
        result["error"] = "the scenario ran no case"
    result["ok"] = result.get("error") is None and all(c["ok"] for c in result["cases"])
    if result.get("error") is None and not result["ok"]:
        failing = [c for c in result["cases"] if not c["ok"]]
        result["error"] = f"{failing[0]['name']}: {failing[0]['error']}" + (
            f" (and {len(failing) - 1} more case{'s' if len(failing) > 2 else ''})" if len(failing) > 1 else ""
        )
    result["log_tail"] = _tail(log_path, 20)
    return result


def _last_line(path: str) -> str:
    lines = _tail(path, 1)
    return lines[0] if lines else "no output"


def _tail(path: str, count: int) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return []
    return lines[-count:]


# -- report assembly -------------------------------------------------------------------------------


def _not_on_this_release(scenarios: Iterable[Scenario]) -> dict[str, str]:
    """``{scenario id: why}`` for the scenarios the overlay does not cover on the installed
    transformers: every patch that names the scenario is out of its range there (e.g. the
    nested-mask device move on releases before 5.13.0, which never moved inputs at all, so no
    failure is counted there). Decided by the engine's
    own version gate; a release where a patch is fixed upstream still runs it (stock must pass)."""
    from .. import config
    from ..engine import OUT_OF_RANGE, PENDING, gate, installed_transformers_version, left_out_by_fixes

    version = installed_transformers_version()
    patches = known_patches()
    # The children read ATTN_OVERLAY_FIXES from the environment they inherit (engine.apply), so
    # the "with" run leaves out what the setting leaves out: a scenario only such patches prove
    # would fail by design, and is skipped, saying why.
    fixes = config.fixes()
    out: dict[str, str] = {}
    for scenario in scenarios:
        proven_by = [p for p in patches if scenario.id in p.doctor]
        left_out = [p for p in proven_by if gate(p, version)[0] == PENDING and left_out_by_fixes(p, fixes) is not None]
        if proven_by and len(left_out) == len(proven_by):
            out[scenario.id] = (
                f"{config.FIXES_VAR}={fixes} disables {', '.join(p.id for p in left_out)}, which change the output "
                f"of calls that complete on stock ({config.FIXES_VAR}={config.FIXES_ALL} runs it)"
            )
            continue
        if version is not None and proven_by and all(gate(p, version)[0] == OUT_OF_RANGE for p in proven_by):
            ranges = "; ".join(f"{p.id} covers transformers {p.affected}" for p in proven_by)
            # Not "not a bug": outside a patch's range the bug may be absent (the device move
            # before 5.13.0) or present but not covered (kv-cache-dtype on 4.55.x); both say so.
            out[scenario.id] = f"outside the overlay's releases for it on transformers {version} ({ranges})"
    return out


def _scenario_report(scenario: Scenario, results: dict, not_here: str | None = None) -> dict:
    proven_by = patches_proving(scenario.id, known_patches())
    entry: dict[str, Any] = {"id": scenario.id, "title": scenario.title, "patches": list(proven_by)}
    if (scenario.id, "with") not in results:
        entry["status"] = "skipped"
        entry["why"] = not_here or (
            "needs torchrun with world size > 1" if scenario.distributed else "not run on this rank"
        )
        entry["without"] = entry["with"] = None
        return entry
    without, with_ = results[(scenario.id, "without")], results[(scenario.id, "with")]
    for result in (without, with_):
        result["patches"] = {
            s["id"]: s["state"] for s in result.get("patch_status", ()) if s["id"] in proven_by
        }
    # The overlay's tokens against the stock reference runs of the other process: the fix must
    # give what upstream gives where upstream works.
    stock_reference = {c["name"]: c.get("reference_tokens") for c in without.get("cases", ())}
    for case in with_.get("cases", ()):
        reference = stock_reference.get(case["name"])
        if case.get("tokens") is not None and reference is not None:
            case["identical_to_stock_reference"] = case["tokens"] == reference
    entry["without"], entry["with"] = without, with_
    entry["status"] = "pass" if with_["ok"] else "fail"
    entry["fixed_by_overlay"] = with_["ok"] and not without["ok"]
    return entry


def _overlay_status(results: dict) -> list[dict] | None:
    """The per-patch status the "with" subprocesses saw (one that imported every target module)."""
    for (_, mode), result in results.items():
        if mode == "with" and result.get("patch_status"):
            if all(s["state"] != "pending" for s in result["patch_status"]):
                return result["patch_status"]
    for (_, mode), result in results.items():
        if mode == "with" and result.get("patch_status"):
            return result["patch_status"]
    return None


# -- torchrun ------------------------------------------------------------------------------------


def _init_parent_group(launch: _Launch, timeout: float, scenario_count: int) -> dict:
    """The doctor processes of a torchrun job form a gloo group of their own: to agree on a run id,
    wait for each other, and bring every rank's results to rank 0."""
    from datetime import timedelta

    import torch.distributed as dist

    # Rank 0 runs the single-device scenarios while the others wait at the final broadcast.
    patience = timedelta(seconds=timeout * 2 * (scenario_count + 1) + 120)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=patience)
    box = [uuid.uuid4().hex[:12] if launch.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return {"run_id": box[0]}


def _gather(group: dict, result: dict) -> list[dict] | None:
    import torch.distributed as dist

    everyone: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(result, everyone, dst=0)
    return everyone


def _merge_ranks(per_rank: list[dict] | None, world_size: int) -> dict:
    """One result from every rank's: a case passes when it passes on every rank with the same
    tokens everywhere."""
    if per_rank is None:  # not rank 0
        return {}
    first = dict(per_rank[0])
    first["ranks"] = [
        {k: r.get(k) for k in ("ok", "error", "seconds", "returncode", "log_tail")} for r in per_rank
    ]
    bad = next((i for i, r in enumerate(per_rank) if not r["ok"]), None)
    first["seconds"] = max(r.get("seconds", 0) for r in per_rank)
    if bad is not None:
        first["ok"] = False
        first["error"] = first["error"] if bad == 0 else f"rank {bad}: {per_rank[bad]['error']}"
    else:
        token_sets = [[c.get("tokens") for c in r["cases"]] for r in per_rank]
        if any(t != token_sets[0] for t in token_sets):
            first["ok"] = False
            first["error"] = "the ranks generated different tokens"
    return first


def _broadcast(group: dict, ok: bool) -> bool:
    import torch.distributed as dist

    box = [ok]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def _close_parent_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
