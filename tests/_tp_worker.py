"""One rank of the CPU tensor-parallel check for the ``static-cache-tp-heads`` patch.

Run by ``tests/patches/static_cache_tp_heads/test_patch_static_cache_tp_heads.py`` as two processes (ranks 0 and 1) that share a
gloo process group through a store file. For every case in the spec it loads a tiny model saved
with ``save_pretrained`` under tensor parallelism (``DistributedConfig(tp_size=world_size)`` with
the case's plan put in the config's ``base_model_tp_plan``) and runs three greedy generations with
a static cache:

- ``unchunked``: no ``prefill_chunk_size`` (the cache is allocated lazily, from the real keys);
- ``chunked_stock``: ``prefill_chunk_size`` smaller than the prompt, stock transformers;
- ``chunked_patched``: the same with the patch applied by this process.

It writes one JSON file per rank: the generated ids or the error of each run. The parent test
makes the assertions. One process runs every case, because each process pays for importing
torch and transformers.

Usage: python _tp_worker.py RANK WORLD_SIZE STORE_FILE SPEC_JSON OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

# A rank that hangs in a collective fails after this long instead of waiting forever. Generous: on a
# loaded 2-core CI machine (two nox groups side by side) one rank can lag the other by minutes.
COLLECTIVE_TIMEOUT_S = 300
# Printed between writing the results and tearing down the process group; the parent test looks
# for it to tell a crash in the teardown from a crash in the work.
TEARDOWN_STARTED = "tp worker: results written; tearing down the process group"


def _generate(model, torch, case: dict, chunked: bool) -> dict:
    from overlay import report
    from overlay.testing.models import greedy_ids

    input_ids = torch.tensor(case["prompt"], dtype=torch.long)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    kwargs = {"prefill_chunk_size": case["prefill_chunk_size"]} if chunked else {}
    report.reset()
    try:
        # greedy_ids drops a static cache 5.13-5.17 keep on the model from a previous run
        # (possibly allocated with the wrong head count), so it cannot leak into this one.
        result = {"ids": greedy_ids(model, inputs, case["max_new_tokens"], cache_implementation="static", **kwargs)}
    except Exception as exc:  # the stock run is expected to fail on affected releases
        result = {"error": {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}}
    # Calls in which the patch changed the cache shape (overlay.report, the patch's slow path).
    result["fired"] = report.fired().get("static-cache-tp-heads", 0)
    result["actions"] = sorted(report.fired_actions().get("static-cache-tp-heads", {}))
    return result


def run_case(case: dict, world_size: int, torch) -> dict:
    from overlay.testing.harness import PatchUnderTest
    from overlay.testing.tensor_parallel import load_sharded, local_rows

    model = load_sharded(case["model_dir"], case["plan"], world_size, dtype=torch.float32)
    result = {
        "name": case["name"],
        "tp_size": model._tp_size,
        "effective_tp_plan": dict(model.tp_plan),
        # Rows of layer 0's weights held by this rank: shows what the plan really sharded.
        "local_rows": {name: local_rows(model, name) for name in ("self_attn.k_proj", "mlp.gate_proj")},
        "runs": {},
    }
    result["runs"]["unchunked"] = _generate(model, torch, case, chunked=False)
    result["runs"]["chunked_stock"] = _generate(model, torch, case, chunked=True)
    with PatchUnderTest("static_cache_tp_heads").applied(strict=True) as statuses:
        result["patch_status"] = statuses["static-cache-tp-heads"].as_dict()
        result["runs"]["chunked_patched"] = _generate(model, torch, case, chunked=True)
    return result


def main(argv: list[str]) -> int:
    process_started = time.perf_counter()
    rank, world_size, store_file, spec_path, out_path = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    # transformers reads these when it sets up the device mesh.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import transformers

    import_seconds = time.perf_counter() - process_started
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    results: dict = {"rank": rank, "transformers": transformers.__version__, "cases": []}
    results["import_seconds"] = round(import_seconds, 2)
    started = time.perf_counter()
    # A file store instead of a TCP port: nothing to pick, nothing another run can take.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        for case in spec["cases"]:
            results["cases"].append(run_case(case, world_size, torch))
            results["cases"][-1]["seconds_since_start"] = round(time.perf_counter() - started, 2)
    except Exception:
        results["fatal"] = traceback.format_exc()
    # The results are complete here, so they are written before the process group is torn down:
    # what the parent asserts on cannot be lost to a crash in torch's teardown (below).
    _write_atomically(out_path, results)
    print(TEARDOWN_STARTED, flush=True)
    _tear_down(dist, wait_for_the_other_ranks="fatal" not in results)
    return 1 if "fatal" in results else 0


def _write_atomically(path: str, results: dict) -> None:
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(results, f)
    os.replace(partial, path)  # the parent sees the whole file or none


def _tear_down(dist, wait_for_the_other_ranks: bool) -> None:
    """Both ranks leave their collectives before either destroys the group, and the models (whose
    device meshes hold the group) are collected while the interpreter is whole. Seen once in CI
    before this order: rank 1 aborted ("terminate called without an active exception", SIGABRT)
    after its last model had loaded, with nothing written, so where is not known; a crash in the
    teardown now leaves the results and tells itself apart from a crash in the work.

    A rank that failed does not wait: the other may be stuck in a collective it will never join,
    and destroying the group at once ends that wait with an error instead of the timeout."""
    import gc

    try:
        if wait_for_the_other_ranks:
            dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter finalization: nothing is left to do, and it is where gloo's threads can abort.
    os._exit(exit_code)
