"""One scenario in a fresh process, with or without the overlay: ``python -m overlay.doctor._child SPEC OUT``.

``SPEC`` is a JSON file written by the parent; ``OUT`` receives the JSON result. The parent
starts this with ``ATTN_OVERLAY=0``, so the startup hook never activates the overlay here: the
"without" run is stock transformers, and the "with" run activates it explicitly with
``overlay.apply()`` before transformers is imported, which is also how it works where the
startup hook is not installed at all.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    started = time.perf_counter()
    result: dict = {"scenario": spec["scenario"], "mode": spec["mode"], "cases": [], "error": None}
    try:
        if spec["mode"] == "with":
            from overlay import engine

            # Not strict: a patch that does not apply must show up in the report, not kill the run.
            engine.apply(strict=False)
        result["cases"] = _run(spec, result)
    except BaseException as exc:  # everything is reported to the parent
        from overlay.doctor._scenarios import one_line, where

        result["error"] = one_line(exc)
        result["where"] = where(exc)
        result["traceback"] = traceback.format_exc(limit=-12)
    finally:
        result["seconds"] = round(time.perf_counter() - started, 2)
        _add_overlay_status(spec, result)
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(result, f)
    return 0


def _run(spec: dict, result: dict) -> list[dict]:
    import importlib

    import torch

    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    for plugin in spec.get("plugins", ()):
        importlib.import_module(plugin)
    fake = spec.get("fake_device")
    if fake:
        from overlay.testing import install_fake_device

        install_fake_device(fake["name"], backend=fake.get("backend") or "auto")

    import transformers

    from overlay.doctor._scenarios import RUNNERS

    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:  # progress bars of weight loading would only clutter the log
        transformers.utils.logging.disable_progress_bar()
    except Exception:
        pass
    runner = RUNNERS[spec["scenario"]]
    distributed = spec.get("distributed")
    if distributed is None:
        return runner(torch.device(spec["device"]), workdir=spec["workdir"])
    from overlay.doctor._scenarios import PREPARERS

    prepare = PREPARERS.get(spec["scenario"])
    if prepare is not None:
        prepare(workdir=spec["workdir"], world_size=int(distributed["world_size"]))
    return _run_distributed(spec, distributed, runner)


def _run_distributed(spec: dict, distributed: dict, runner) -> list[dict]:
    """This process is one rank. The ranks meet through the store of the torchrun job that
    launched the doctor (a client connection under a prefix of their own), so no port is chosen
    here and nothing from earlier runs can collide."""
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=float(distributed["timeout_s"]))
    store = dist.TCPStore(distributed["master_addr"], int(distributed["master_port"]), is_master=False, timeout=timeout)
    store = dist.PrefixStore(distributed["prefix"], store)
    accelerator = torch._C._get_accelerator().type if hasattr(torch._C, "_get_accelerator") else "cpu"
    # transformers puts the tensor-parallel model on the accelerator torch reports (CPU if none).
    backend = {"cuda": "cpu:gloo,cuda:nccl", "cpu": "gloo"}.get(accelerator)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=int(distributed["rank"]),
        world_size=int(distributed["world_size"]),
        timeout=timeout,
    )
    try:
        return runner(None, workdir=spec["workdir"], world_size=int(distributed["world_size"]))
    finally:
        dist.destroy_process_group()


def _add_overlay_status(spec: dict, result: dict) -> None:
    try:
        import importlib

        from overlay import engine

        result["overlay_active"] = engine.is_active()
        if spec["mode"] == "with" and spec.get("import_all_targets"):
            # Import every module a patch targets, so that each status is final (applied, fixed
            # upstream, ...) rather than "pending".
            for module in sorted({p.module for p in engine.known_patches()}):
                try:
                    importlib.import_module(module)
                except Exception:
                    pass
        result["patch_status"] = [s.as_dict() for s in engine.status()]
        from overlay import report

        result["fired"] = report.fired_actions()
    except Exception as exc:
        result["status_error"] = f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
