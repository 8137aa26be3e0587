"""The offload-execution-device patch: models offloaded with accelerate, inputs on the host.

Reproduced on a CPU-only machine with the fake second device of ``overlay.testing``: tiny random
Llama and Gemma 3 (sliding + full layer types) models offloaded onto ``fakeaccel:0`` with
``accelerate.cpu_offload`` and ``accelerate.disk_offload`` (weights on ``meta``, moved in by the
leaf modules' hooks; ``model.device`` reads ``meta``), and dispatched with a device map whose
first parts are ``"cpu"`` and ``"disk"`` (``accelerate.dispatch_model``, what
``from_pretrained(device_map=...)`` calls). A left-padded batch of 2 stays on the host; greedy
``generate()`` with a static and with the default cache. The control is the same weights run
whole on the CPU.

On every affected release the stock static-cache run of a cpu/disk-offloaded model fails with
PyTorch's device-mismatch error (the mask, or ``cache_position`` in the static cache's update, on
the host); so does the default cache while ``cache_position`` goes to the forward (up to 5.3.0). With the
patch (alone, and with every patch of the overlay: device-move-nested wraps the same function on
5.13 - 5.19) the ids equal the CPU control's. Device-map offload and inputs on the device pass
with and without the overlay, and the patch does not fire there.

The fake device is named once per process, so the runs are in a subprocess: this file is also
the worker (``python test_patch_offload_execution_device.py``), which prints its results as JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.version import Version

from overlay.testing.harness import PatchUnderTest, assert_generated

PATCH = PatchUnderTest("offload_execution_device")
if not PATCH.affected:
    pytest.skip(f"{PATCH.id} applies on {PATCH.patch.affected}; found {PATCH.transformers}", allow_module_level=True)

WORKER_TIMEOUT_S = 900  # imports, maybe a first build of the fake device (about a minute), ~80 tiny generations
RESULT_MARKER = "OFFLOAD_EXECUTION_DEVICE_RESULT="
MODELS = ("llama", "gemma3")
OFFLOADS = ("cpu_offload", "disk_offload")  # a model-level hook without an execution device: the bug
DISPATCHED = "device_map"  # dispatch_model with "cpu" and "disk" parts: the hook moves the inputs
CACHES = ("static", "dynamic")
STATES = ("stock", "patched", "overlay")  # overlay: every patch of the overlay that applies here
MAX_NEW_TOKENS = 5
#: Up to 5.3.0 prepare_inputs_for_generation passes cache_position to the forward (read in the
#: wheels; 5.4.0 dropped it); made on the host, it reaches the default cache's mask (and the static
#: cache's index_copy_) there. Run: fails on 4.55 - 5.0.0; 5.1 - 5.3 have no lane here (either).
DYNAMIC_FAILS = PATCH.transformers < Version("5.1")
DYNAMIC_PASSES = PATCH.transformers >= Version("5.4")


def _declared_error(error: str, device: str) -> bool:
    """Whether ``error`` is one of the patch's declared texts, with ``device`` for ``cuda:0``."""
    normalised = error.replace(device, "cuda:0")
    return any(PATCH.error(text[:40]) in normalised for text in PATCH.patch.errors[:2])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests._kit import run_module_as_worker

    return run_module_as_worker(__file__, tmp_path_factory, marker=RESULT_MARKER, timeout=WORKER_TIMEOUT_S)


def test_engine_status(results):
    PATCH.assert_reported(results["status"])


def test_offloaded_models_read_meta_and_have_no_execution_device_on_the_model_hook(results):
    for model in MODELS:
        for offload in OFFLOADS:
            assert results["placement"][model][offload] == {"device": "meta", "hook_device": None}
        assert results["placement"][model][DISPATCHED] == {"device": "meta", "hook_device": results["device"]}


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("model", MODELS)
def test_host_inputs_with_static_cache_on_stock_transformers(results, model, offload):
    run = results["runs"][model][offload]["static"]["stock"]
    assert not run["ok"], "stock transformers was expected to fail with an offloaded model and host inputs"
    assert _declared_error(run["error"], results["device"]), run["error"]


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("model", MODELS)
def test_host_inputs_with_default_cache_on_stock_transformers(results, model, offload):
    run = results["runs"][model][offload]["dynamic"]["stock"]
    if DYNAMIC_FAILS:
        assert not run["ok"]
        assert _declared_error(run["error"], results["device"]), run["error"]
    elif DYNAMIC_PASSES:
        assert_generated(run, results["cpu"][model]["dynamic"])
    else:  # 5.1 - 5.3: not run here; either, and only for this reason
        assert run["ok"] or _declared_error(run["error"], results["device"]), run["error"]


@pytest.mark.parametrize("state", ["patched", "overlay"])
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("model", MODELS)
def test_host_inputs_with_the_patch_generate_the_cpu_ids(results, model, offload, cache, state):
    run = results["runs"][model][offload][cache][state]
    assert_generated(run, results["cpu"][model][cache])
    assert run["forward_devices"] == [results["device"]]  # every tensor the forward got: none on the host
    # Every step's inputs are on the host: moved and counted, whether or not stock would have failed
    # (the default cache passes on 5.13+: there the move only does what the embedding's hook did).
    assert run["fired"] == MAX_NEW_TOKENS
    assert run["actions"] == [f"moved inputs to the offload execution device {results['device']}"]


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("model", MODELS)
def test_device_map_offload_passes_with_and_without_the_overlay(results, model, cache, state):
    run = results["runs"][model][DISPATCHED][cache][state]
    assert_generated(run, results["cpu"][model][cache])
    assert run["fired"] == 0  # the model-level hook has an execution device: the patch steps aside


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("model", MODELS)
def test_inputs_on_the_device_pass_with_and_without_the_overlay(results, model, offload, cache, state):
    run = results["runs"][model][offload][cache][f"device_inputs_{state}"]
    assert_generated(run, results["cpu"][model][cache])
    assert run["fired"] == 0


@pytest.mark.parametrize("model", MODELS)
def test_a_model_that_is_not_offloaded_is_untouched(results, model):
    run = results["runs"][model]["whole"]
    assert_generated(run, results["cpu"][model]["static"])
    assert run["fired"] == 0


def test_composes_with_device_move_nested_in_either_order(results):
    if not results["composition"]:
        pytest.skip(f"device-move-nested does not apply on {PATCH.transformers}")
    for order, record in results["composition"].items():
        assert set(record["both"].values()) == {"applied"}, (order, record["both"])
        assert_generated(record["run"], results["cpu"]["gemma3"]["static"])
        assert record["alone"][record["reverted"]] == "inactive", (order, record["alone"])
        assert {state for patch_id, state in record["alone"].items() if patch_id != record["reverted"]} == {"applied"}
        if record["reverted"] == PATCH.id:
            assert not record["after"]["ok"]  # device-move-nested alone: the bug is back
        else:
            assert_generated(record["after"], results["cpu"]["gemma3"]["static"])


class _Hook:
    """Stands in for accelerate's AlignDevicesHook: what the replacement reads is execution_device."""

    def __init__(self, execution_device=None):
        self.execution_device = execution_device


def test_decides_from_accelerates_hooks_and_walks_once_per_hook():
    import torch

    from overlay.patch import Variant

    walks = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(2, 2))

        def modules(self):
            walks.append(1)
            return super().modules()

    def original(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": {"full_attention": attention_mask}}

    replacement = PATCH.patch.targets[0].replace(original, Variant("synthetic"))
    host = torch.ones(1, 3)
    model = Model()
    assert replacement(model, host, host)["input_ids"] is host  # no hook: nothing read past the lookup
    model._hf_hook = _Hook("cpu")  # dispatched: accelerate's own hook moves the inputs
    assert replacement(model, host, host)["input_ids"] is host and walks == []
    model._hf_hook = _Hook()  # offloaded: the leaf's hook names the device
    model.inner[0]._hf_hook = _Hook("meta")
    for _ in range(3):
        out = replacement(model, host, host)
        assert out["input_ids"].device.type == "meta" and out["attention_mask"]["full_attention"].device.type == "meta"
    assert walks == [1]  # once for this model-level hook
    model._hf_hook = _Hook()  # offloaded again: a new hook, a new walk
    replacement(model, host, host)
    assert walks == [1, 1]


def test_replacement_keeps_signature_docstring_and_wraps_the_original():
    import inspect

    from transformers.generation.utils import GenerationMixin

    from overlay.patch import Variant

    original = GenerationMixin.__dict__["prepare_inputs_for_generation"]
    replacement = PATCH.patch.targets[0].build(original, otherwise=Variant("installed code, wrapped by hand"))
    assert replacement.__wrapped__ is original
    assert replacement.__doc__ == original.__doc__ and replacement.__name__ == original.__name__
    assert inspect.signature(replacement) == inspect.signature(original)


# -- the worker ------------------------------------------------------------------------------------


def _worker() -> dict:
    import tempfile

    import torch

    torch.set_num_threads(1)
    from overlay.testing import install_fake_device

    device = install_fake_device()
    device_name = str(torch.empty(0, device=device).device)
    import accelerate
    import transformers
    import transformers.generation.utils  # noqa: F401  (the target's module: judged once imported)

    import overlay
    from overlay.testing.models import generate_seeing_devices, left_padded_batch, on_device, tiny_model

    batch = left_padded_batch()

    def generate(model, inputs, cache) -> dict:
        vars(model).pop("_cache", None)  # a static cache kept from an earlier call (up to 5.14)
        kwargs = {"cache_implementation": "static"} if cache == "static" else {}
        return generate_seeing_devices(model, PATCH.id, **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                       disable_compile=True, pad_token_id=0, **kwargs)

    def offloaded(kind: str, how: str):
        model = tiny_model(kind)  # the same seed: the CPU control's weights
        if how == "cpu_offload":
            accelerate.cpu_offload(model, execution_device=device)
        elif how == "disk_offload":
            accelerate.disk_offload(model, tempfile.mkdtemp(), execution_device=device)
        else:
            # The embeddings and the layers on "cpu" and "disk" (model.device reads meta), the rest on the device.
            names = [name for name, _ in model.named_children()]
            inner = getattr(model, names[0])
            device_map = {f"{names[0]}.{name}": str(device) for name, _ in inner.named_children()}
            # One entry per decoder layer, as from_pretrained writes them (4.55 - 4.57 map the static
            # cache's layers through these names).
            del device_map[f"{names[0]}.layers"]
            device_map.update({f"{names[0]}.embed_tokens": "cpu", f"{names[0]}.layers.0": "disk",
                               f"{names[0]}.layers.1": "cpu"})
            device_map.update({name: str(device) for name in names[1:]})
            accelerate.dispatch_model(model, device_map, main_device=device, offload_dir=tempfile.mkdtemp())
        return model

    contexts = {
        "stock": overlay.reverted,
        "patched": lambda: PATCH.applied(expect="applied"),
        "overlay": overlay.applied,
    }
    results: dict = {"device": device_name, "transformers": transformers.__version__, "cpu": {}, "runs": {},
                     "placement": {}}
    with PATCH.applied() as statuses:
        status = statuses[PATCH.id]
        results["status"] = {"state": status.state, "reason": status.reason, "variants": list(status.variants)}
    for kind in MODELS:
        whole = tiny_model(kind)
        results["cpu"][kind] = {cache: generate(whole, batch, cache)["ids"] for cache in CACHES}
        runs: dict = {}
        results["placement"][kind] = {}
        for how in (*OFFLOADS, DISPATCHED):
            model = offloaded(kind, how)
            hook = vars(model).get("_hf_hook")
            results["placement"][kind][how] = {
                "device": str(model.device),
                "hook_device": None if hook.execution_device is None else str(torch.device(hook.execution_device)),
            }
            runs[how] = {}
            for cache in CACHES:
                runs[how][cache] = {}
                for state, context in contexts.items():
                    with context():
                        runs[how][cache][state] = generate(model, batch, cache)
                        runs[how][cache][f"device_inputs_{state}"] = generate(model, on_device(batch, device), cache)
        # Not offloaded: the patch in force looks for accelerate's hook, finds none, and stops there.
        with PATCH.applied(expect="applied"):
            runs["whole"] = generate(tiny_model(kind, device=device), on_device(batch, device), "static")
        results["runs"][kind] = runs
    results["composition"] = _composition(generate, offloaded, batch)
    return results


def _composition(generate, offloaded, batch) -> dict:
    """With device-move-nested (which wraps the same function on 5.13 - 5.19), applied in either
    order: both in force, the offloaded Gemma 3 generates; each reverted alone leaves the other."""
    from overlay import engine

    device_move = PatchUnderTest("device_move")  # built here, not at module level (not a declaration)
    if not device_move.affected:
        return {}
    model = offloaded("gemma3", "cpu_offload")
    ids = [device_move.id, PATCH.id]
    results = {}
    for order in (ids, ids[::-1]):
        with engine.reverted(), engine.isolated([device_move.patch, PATCH.patch]):
            for patch_id in order:
                engine.apply(only=[patch_id])
            both = {s.id: s.state for s in engine.status()}
            run = generate(model, batch, "static")
            engine.revert(only=[order[0]])  # the lower layer alone: the upper one is built again
            alone = {s.id: s.state for s in engine.status()}
            after = generate(model, batch, "static")
        results[" then ".join(order)] = {"both": both, "run": run, "alone": alone, "after": after,
                                           "reverted": order[0]}
    return results


if __name__ == "__main__":
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(RESULT_MARKER + json.dumps(_worker()), flush=True)


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ("errors", "test_device_map_offload_passes_with_and_without_the_overlay",
                    "moves inputs only for a model whose hook leaves them on the host, where stock's kernels refuse them")
