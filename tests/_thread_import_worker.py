"""Worker for tests/engine/test_engine_threads.py: a fresh interpreter with the startup hook installed, whose
threads import transformers' modules in the order given, at once; prints what the overlay then says.

    python tests/_thread_import_worker.py MODULE,MODULE,... barrier|free|sequential [generate]

Each name is imported by a thread of its own (a name given twice: two threads). ``barrier``: the
threads start importing together; ``free``: each starts as soon as it is created, in that order;
``sequential``: the main thread imports them one after the other (the control). Then the main
thread imports every target module the threads did not.
``generate``: then a bfloat16 Llama generates with a float32 StaticCache it built
(``early_initialization``), against the same cache built in bfloat16 (the kv-cache-dtype fix).
"""

import importlib
import json
import os
import sys
import threading
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _attn_overlay_startup  # noqa: E402 -- the .pth line's import (lanes install the project editable, without it)

names, start = sys.argv[1].split(","), sys.argv[2]
together = threading.Barrier(len(names)) if start == "barrier" else None
errors = {}
raised_in = {}  # name -> "file:function" of the frame that raised (the innermost one)


def import_one(name):
    if together is not None:
        together.wait()
    try:
        importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 -- reported, the test decides
        errors[name] = f"{type(exc).__name__}: {exc}"
        frames = traceback.extract_tb(exc.__traceback__)
        raised_in[name] = f"{frames[-1].filename}:{frames[-1].name}" if frames else "?"


if start == "sequential":
    for name in names:
        import_one(name)
else:
    threads = [threading.Thread(target=import_one, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

import overlay  # noqa: E402

# The program goes on: it imports what the threads did not (or failed to), so every patch is judged.
late_errors = {}
for name in ["transformers", *sorted({patch.module for patch in overlay.known_patches()})]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 -- reported, the test decides
        late_errors[name] = f"{type(exc).__name__}: {exc}"

finder = _attn_overlay_startup.finder()
watched = finder.watched()
result = {
    "errors": errors,
    "raised_in": raised_in,
    "late_errors": late_errors,
    "states": {s.id: s.state for s in overlay.status()},
    "reasons": {s.id: s.reason for s in overlay.status()},
    "activation_error": overlay.activation_error(),
    # What the finder knows of each target module, for a run whose states differ from the control's.
    "finder": {
        name: {
            "executed": finder.executed(name),
            "watched": name in watched,
            "imported": name in sys.modules,
        }
        for name in sorted({patch.module for patch in overlay.known_patches()})
    },
}
if "generate" in sys.argv[3:]:
    import torch

    from overlay.testing.models import left_padded_batch, static_cache, tiny_model, greedy_ids, cache_argument_name

    torch.set_num_threads(1)
    model = tiny_model("llama", dtype=torch.bfloat16)
    batch = left_padded_batch((6, 4))
    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        cache = static_cache(model.config, 2, batch["input_ids"].shape[1] + 4, dtype)
        try:
            runs[str(dtype)] = greedy_ids(model, batch, 4, **{cache_argument_name(model): cache})
        except Exception as exc:  # noqa: BLE001
            runs[str(dtype)] = f"{type(exc).__name__}: {exc}"
    result["generate"] = runs
print("RESULT " + json.dumps(result))
