"""Entry point of a figure's worker process: ``python -m scripts.bench.worker NAME PAYLOAD_JSON``.

Prints one JSON line (the worker's result) as the last line of stdout. Started by
:func:`scripts.bench.common.run_worker`; not meant to be run by hand, except to debug a figure.
"""

from __future__ import annotations

import importlib
import json
import sys

WORKERS = {
    "prepare_inputs": "scripts.bench.prepare_inputs",
    "generate": "scripts.bench.generate",
    "copies": "scripts.bench.generate",
    "gpu": "scripts.bench.gpu",
    "percall": "scripts.bench.percall",
    "callgrind": "scripts.bench.callgrind",
    "callgrind_percall": "scripts.bench.callgrind",
    "whole": "scripts.bench.whole",
}


def main(argv: list[str]) -> int:
    name, payload = argv[0], json.loads(argv[1])
    import torch

    # One thread: the CPU figures measure Python-level overhead, and a shared machine's other
    # processes disturb one thread less than a pool of them.
    torch.set_num_threads(int(payload.get("threads", 1)))

    from .overlay_access import ensure_overlay_importable, overlay_files, quiet_overlay_logs

    found = ensure_overlay_importable(payload.get("overlay_root"))
    quiet_overlay_logs()
    module = importlib.import_module(WORKERS[name])
    function = getattr(module, f"{name}_worker", None) or module.worker
    result = function(payload)
    result.setdefault("details", {})["overlay"] = found
    result["details"]["overlay_files"] = overlay_files()
    result["details"]["torch_threads"] = torch.get_num_threads()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
