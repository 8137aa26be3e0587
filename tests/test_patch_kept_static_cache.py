"""kept-static-cache: a static cache kept on the model across generate() calls, after model.to().

Reproduced for real on a CPU-only machine with the fake second device of ``overlay.testing``:
tiny random Llama and Gemma 3 (sliding + full layers) generate with a static cache on the host,
then ``model.to(device)`` and generate again with on-device inputs. On 5.13.0 - 5.14.1 the stock
run writes into the host cache kept from the first call and fails in ``index_copy_``; with the
patch the cache is rebuilt on the device and the ids equal the host run (the fake device computes
with the CPU kernels, bit for bit). The same after ``model.to(torch.bfloat16)``: stock fails with
the dtype error, the patch rebuilds the cache in bfloat16, so ``kv-cache-dtype`` has nothing to
cast (no warning, the cache's dtype is the model's). A second call with nothing changed reuses the
very same cache object (what spares torch.compile a recompilation) and the patch does not fire.
On 5.15.0+ every call builds a new cache: stock passes and the patch reports "fixed upstream".

torch can rename its PrivateUse1 backend once per process, so the generations run in a
subprocess: this file is also the worker (``python test_patch_kept_static_cache.py``), which
prints the results as JSON; the tests read them.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest

from overlay.patch import Variant, fingerprint
from overlay.testing.harness import PatchUnderTest, assert_generated, heavy_imports, run_json_worker

PATCH = PatchUnderTest("kept_static_cache")
PATCH_ID = PATCH.id
TRANSFORMERS_VERSION = PATCH.transformers
WORKER_TIMEOUT_S = 900  # imports, maybe a first build of the fake device (about a minute), ~40 tiny generations
RESULT_MARKER = "KEPT_STATIC_CACHE_RESULT="
MODELS = ("llama", "gemma3")
MAX_NEW_TOKENS = 5
AFFECTED = PATCH.affected
FIXED_UPSTREAM = PATCH.fixed_upstream
DTYPE_ERROR = PATCH.error("same dtype")


# -- the patch data -----------------------------------------------------------------------------


def test_installed_code_is_a_known_variant():
    (target,) = PATCH.patch.targets
    digest = fingerprint(PATCH.stock())
    if AFFECTED:
        assert digest in target.originals, f"transformers {TRANSFORMERS_VERSION}: unknown original {digest}"
    elif FIXED_UPSTREAM:
        assert digest in target.fixed, f"transformers {TRANSFORMERS_VERSION}: unknown fixed code {digest}"
    else:
        pytest.fail(f"transformers {TRANSFORMERS_VERSION} predates the releases this patch covers (5.13.0+)")


def test_replacement_keeps_name_docstring_and_signature():
    stock = PATCH.stock()
    # Built by hand for whichever code this release ships (also the fixed code: only the
    # wrapper's metadata is checked here).
    replacement = PATCH.patch.targets[0].replace(stock, Variant("this release"))
    assert replacement.__wrapped__ is stock
    assert (replacement.__name__, replacement.__doc__) == (stock.__name__, stock.__doc__)
    assert inspect.signature(replacement) == inspect.signature(stock)


def test_patch_module_imports_neither_torch_nor_transformers():
    assert heavy_imports("overlay.patches.kept_static_cache") == []


# -- the real failure and fix, in a subprocess with the fake device -------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_json_worker(
        Path(__file__).resolve(), marker=RESULT_MARKER, timeout=WORKER_TIMEOUT_S,
        cwd=str(tmp_path_factory.mktemp("kept-static-cache")),
    )


def test_engine_status(results):
    status = results["status"]
    if AFFECTED:
        assert status["state"] == "applied", status
        assert status["variants"] == ["5.13.0-5.14.1"]
    else:
        assert status["state"] == "fixed upstream", status


def _device_error(results) -> str:
    # The C++ fake device reports index_copy_'s own message; the pure-Python one the generic
    # device-mismatch message (see overlay.testing.fake_device).
    if results["backend"] == "cpp":
        return PATCH.error("same device", device=results["device"])
    return "Expected all tensors to be on the same device"


@pytest.mark.parametrize("model", MODELS)
def test_host_run_then_model_to_device_on_stock_transformers(results, model):
    run = results["runs"][model]["to_device"]["stock"]
    if AFFECTED:
        assert not run["ok"], "stock transformers was expected to reuse the host cache and fail"
        assert _device_error(results) in run["error"], run["error"]
        if results["backend"] == "cpp":
            assert f"(source) {results['device']}" in run["error"]
    else:
        assert_generated(run, results["runs"][model]["to_device"]["host_ids"])


@pytest.mark.parametrize("flow", ["patched", "patched_after_stock_host_run"])
@pytest.mark.parametrize("model", MODELS)
def test_host_run_then_model_to_device_with_the_overlay(results, model, flow):
    runs = results["runs"][model]["to_device"]
    run = runs[flow]
    assert_generated(run, runs["host_ids"])
    assert run["cache"] == {"device": results["device"], "dtype": "torch.float32"}
    if AFFECTED:
        assert run["fired"] > 0
        assert run["actions"] == [f"rebuilt a kept static cache for {results['device']} / torch.float32"]
    else:
        assert run["fired"] == 0


@pytest.mark.parametrize("model", MODELS)
def test_dtype_change_on_stock_transformers(results, model):
    runs = results["runs"][model]["to_bfloat16"]
    stock = runs["stock"]
    if AFFECTED:
        assert not stock["ok"], "stock transformers was expected to reuse the float32 cache and fail"
        assert DTYPE_ERROR in stock["error"]
        # kv-cache-dtype alone hides the error, at the price of a cast of the whole cache per step.
        hidden = runs["kv_cache_dtype_only"]
        assert hidden["ok"], hidden.get("error")
        assert hidden["cache"]["dtype"] == "torch.float32"
        assert "KVCacheDtypeWarning" in hidden["warnings"]
    else:
        assert_generated(stock, runs["control_ids"])


@pytest.mark.parametrize("flow", ["patched", "patched_with_kv_cache_dtype"])
@pytest.mark.parametrize("model", MODELS)
def test_dtype_change_with_the_overlay_rebuilds_in_the_model_dtype(results, model, flow):
    runs = results["runs"][model]["to_bfloat16"]
    run = runs[flow]
    assert run["ok"], run.get("error")
    # The same ids as a model that was bfloat16 from the start (a fresh cache), and no cast at all:
    # the cache is in the model's dtype, so kv-cache-dtype has nothing to do.
    assert run["ids"] == runs["control_ids"]
    assert run["cache"] == {"device": results["device"], "dtype": "torch.bfloat16"}
    assert "KVCacheDtypeWarning" not in run["warnings"]
    assert run["kv_cache_dtype_fired"] == 0
    if AFFECTED:
        assert run["fired"] > 0
    else:
        assert run["fired"] == 0


@pytest.mark.parametrize("model", MODELS)
def test_nothing_changed_reuses_the_same_cache_and_does_not_fire(results, model):
    run = results["runs"][model]["unchanged"]
    assert_generated(run, run["first_ids"])
    assert run["fired"] == 0
    if AFFECTED:
        assert run["same_cache_object"], "a kept cache that still matches must be reused, as upstream does"


# -- the worker -------------------------------------------------------------------------------------


def _worker() -> dict:
    import torch

    torch.set_num_threads(1)
    from overlay.testing import fake_device_backend, install_fake_device

    device = install_fake_device()
    device_name = str(torch.empty(0, device=device).device)

    import transformers

    import overlay
    from overlay import guard, report
    from overlay.testing.models import left_padded_batch, on_device as on, tiny_model

    def cache_placement(cache):
        layer = next((l for l in getattr(cache, "layers", ()) if getattr(l, "is_initialized", False)), None)
        return None if layer is None else {"device": str(layer.keys.device), "dtype": str(layer.keys.dtype)}

    def generate(model, batch):
        report.reset()
        guard.reset_warnings()  # the cast warning is once per process: each run gets its own
        caches = []  # the cache the forward passes get (5.15+ keep none on the model)

        def seen(_module, _args, kwargs):
            caches.append(kwargs.get("past_key_values", kwargs.get("cache")))

        hook = model.register_forward_pre_hook(seen, with_kwargs=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                     cache_implementation="static", disable_compile=True)
                result = {"ok": True, "ids": out.cpu().tolist()}
            except RuntimeError as err:
                result = {"ok": False, "error": str(err)}
            finally:
                hook.remove()
        result["fired"] = report.fired().get(PATCH_ID, 0)
        result["kv_cache_dtype_fired"] = report.fired().get("kv-cache-dtype", 0)
        result["actions"] = sorted(report.fired_actions().get(PATCH_ID, {}))
        result["warnings"] = sorted({type(w.message).__name__ for w in caught})
        result["cache"] = cache_placement(caches[-1]) if caches else None
        return result

    patched = PATCH.applied

    batch = left_padded_batch((6, 4))
    results = {"device": device_name, "backend": fake_device_backend(), "transformers": transformers.__version__,
               "runs": {}}
    for kind in MODELS:
        runs = results["runs"][kind] = {}

        # 1. Host run, model.to(device), on-device inputs.
        to_device = runs["to_device"] = {}
        model = tiny_model(kind)
        to_device["host_ids"] = generate(model, batch)["ids"]
        model.to(device)
        to_device["stock"] = generate(model, on(batch, device))
        for flow in ("patched", "patched_after_stock_host_run"):
            model = tiny_model(kind)
            if flow == "patched":
                with patched() as statuses:
                    status = statuses[PATCH_ID]
                    results["status"] = {"state": status.state, "variants": list(status.variants)}
                    generate(model, batch)
                    model.to(device)
                    to_device[flow] = generate(model, on(batch, device))
            else:  # the kept cache was built before the overlay was applied: judged by its tensors
                generate(model, batch)
                model.to(device)
                with patched():
                    to_device[flow] = generate(model, on(batch, device))

        # 2. A float32 run on the device, then model.to(torch.bfloat16).
        to_bf16 = runs["to_bfloat16"] = {}
        to_bf16["control_ids"] = generate(tiny_model(kind, dtype=torch.bfloat16, device=device), on(batch, device))["ids"]
        for flow, extra in (("stock", None), ("kv_cache_dtype_only", ()), ("patched", ()),
                            ("patched_with_kv_cache_dtype", ("kv-cache-dtype",))):
            model = tiny_model(kind, device=device)
            generate(model, on(batch, device))
            model.to(torch.bfloat16)
            if flow == "stock":
                to_bf16[flow] = generate(model, on(batch, device))
            elif flow == "kv_cache_dtype_only":
                with overlay.applied(only=["kv-cache-dtype"]):
                    to_bf16[flow] = generate(model, on(batch, device))
            else:
                with patched(*extra):
                    to_bf16[flow] = generate(model, on(batch, device))

        # 3. Nothing changed between two calls: nothing to fix, the same cache object comes back.
        model = tiny_model(kind, device=device)
        with patched():
            first = generate(model, on(batch, device))
            kept = vars(model).get("_cache")
            second = generate(model, on(batch, device))
        second.update(first_ids=first.get("ids"), same_cache_object=kept is not None and vars(model).get("_cache") is kept)
        runs["unchanged"] = second
    return results


if __name__ == "__main__":
    import json

    print(RESULT_MARKER + json.dumps(_worker()), flush=True)
