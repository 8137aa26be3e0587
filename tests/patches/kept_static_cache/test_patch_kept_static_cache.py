"""kept-static-cache: a static cache kept on the model across generate() calls, after model.to(),
and after a failed call.

Reproduced for real on a CPU-only machine with the fake second device of ``overlay.testing``:
tiny random Llama and Gemma 3 (sliding + full layers) generate with a static cache on the host,
then ``model.to(device)`` and generate again with on-device inputs. On 4.56.2 - 5.14.1 the stock
run writes into the host cache kept from the first call and fails in ``index_copy_`` (4.55's
layers move themselves to the new keys' device: stock passes there); with the patch the cache is
rebuilt on the device and the ids equal the host run (the fake device computes with the CPU
kernels, bit for bit). The same after ``model.to(torch.bfloat16)`` (4.55.4 - 5.14.1): stock fails
with the dtype error, the patch rebuilds the cache in bfloat16, so ``kv-cache-dtype`` (where it
applies) has nothing to cast (no warning, the cache's dtype is the model's). A second call with
nothing changed reuses the very same cache object (what spares torch.compile a recompilation) and
the patch does not fire. A static generate() that fails before the cache's first write (an input
id outside the vocabulary) leaves the kept cache uninitialised: on 4.56.2 - 5.12.1 every later
static generate() on that model fails with ``'StaticLayer' object has no attribute
'max_batch_size'``; with the patch the next call builds a fresh cache and the ids equal a fresh
model's. The same when the call fails midway through the prefill (a simulated out-of-memory error
in the second layer: the first layer written, the second not), for Llama, Gemma 3 and T5 (an
encoder-decoder cache). 4.55.4 (caches allocated when built) and 5.13.0 - 5.14.1 (the reuse check
skips unwritten layers) pass on stock there, and the patch leaves them alone. On 5.15.0+ every
call builds a new cache: stock passes and the patch reports "fixed upstream".

torch can rename its PrivateUse1 backend once per process, so the generations run in a
subprocess: this file is also the worker (``python test_patch_kept_static_cache.py``), which
prints the results as JSON; the tests read them.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
from packaging.version import Version

from overlay.patch import Variant
from overlay.testing.harness import PatchUnderTest, assert_generated

PATCH = PatchUnderTest("kept_static_cache")
WORKER_TIMEOUT_S = 900  # imports, maybe a first build of the fake device (about a minute), ~75 tiny generations
RESULT_MARKER = "KEPT_STATIC_CACHE_RESULT="
MODELS = ("llama", "gemma3")
MID_PREFILL_MODELS = (*MODELS, "t5")
MAX_NEW_TOKENS = 5
#: 4.55's layers cast the new states to the cache's float32 on write, so SDPA is what fails there.
DTYPE_ERROR = PATCH.error("Expected query" if PATCH.transformers < Version("4.56") else "(self) Float")
POISON_ERROR = "object has no attribute 'max_batch_size'"
#: The class the poisoning error names: the cache's first layer (Gemma 3's is a sliding one).
POISONED_LAYER = {
    "llama": "StaticLayer",
    "gemma3": "SlidingWindowLayer" if PATCH.transformers < Version("4.57") else "StaticSlidingWindowLayer",
}
#: Where each bug is on stock, as observed (the patch covers their union, ``affected``):
#: the device case from 4.56 (4.55's eagerly allocated layers move themselves to the keys' device
#: on write), the dtype case everywhere in range, the failed-call poisoning 4.56 - 5.12 (4.55
#: allocates the cache when it builds it; 5.13's reuse check skips layers never written).
DEVICE_BUG = PATCH.affected and PATCH.transformers >= Version("4.56")
DTYPE_BUG = PATCH.affected
POISON_BUG = PATCH.affected and Version("4.56") <= PATCH.transformers < Version("5.13")
#: ``kv-cache-dtype`` (another patch) hides the dtype case where it applies (its own range).
KV_CACHE_DTYPE = PatchUnderTest("kv_cache_dtype").affected


# -- the patch data -----------------------------------------------------------------------------



def test_variant_params_agree_with_where_the_bugs_are():
    # What the replacement is told about this release's code agrees with what stock does here.
    present = PATCH.present_targets()
    if not PATCH.affected:  # fixed upstream: the code is no original of any variant, and stock is fine
        assert not (POISON_BUG or DEVICE_BUG or DTYPE_BUG)
        assert all(target.variant_of(func) is None for target, func in present)
        return
    ((target, func),) = present
    variant = target.variant_of(func)
    assert (variant["layer_ready"] is not None) == POISON_BUG, variant
    # 4.55 builds the cache on the ``device`` it is given; later releases on the keys' device.
    parameters = inspect.signature(func).parameters
    assert variant["device_argument"] == ("device" if "device" in parameters else None), variant


def test_replacement_keeps_name_docstring_and_signature():
    # Imported here: this file also runs as the fake device's worker script, where tests/ is no package.
    from tests._kit import assert_replacements_keep_the_originals_face

    # Built by hand for whichever code this release ships (also the fixed code: only the
    # wrapper's metadata is checked there).
    assert_replacements_keep_the_originals_face(
        PATCH, otherwise=Variant("this release", {"device_argument": None, "layer_ready": None}))


def _per_model_and_flow(*flows: str):
    """A test per model and flow (a way through one scenario of the worker's record), with the ids
    two stacked parametrizes gave: ``llama-patched``."""
    cases = [(model, flow) for flow in flows for model in MODELS]
    return pytest.mark.parametrize(("model", "flow"), cases, ids=[f"{model}-{flow}" for model, flow in cases])


def _stock_fails(run: dict, bug: bool, control_ids) -> bool:
    """Whether stock's ``run`` is to fail here (the release has the bug: the caller checks how); on a
    release without it, stock already gives the control's ids."""
    if not bug:
        assert_generated(run, control_ids)
    return bug


def _assert_failed_with(run: dict, error: str) -> None:
    """A worker's run record that failed, with ``error`` in its message."""
    assert not run["ok"] and error in run["error"], run


def _scenario(results, model: str, scenario: str, flow: str) -> tuple[dict, dict]:
    """One scenario's runs for ``model`` in the worker's record, and the run of ``flow`` among them."""
    runs = results["runs"][model][scenario]
    return runs, runs[flow]


# -- the real failure and fix, in a subprocess with the fake device -------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests._kit import run_module_as_worker

    return run_module_as_worker(__file__, tmp_path_factory, marker=RESULT_MARKER, timeout=WORKER_TIMEOUT_S)




def test_engine_status(results):
    PATCH.assert_reported(results["status"])
    if Version("5.13") <= PATCH.transformers < Version("5.15"):
        assert results["status"]["variants"] == ["5.13.0-5.14.1"]


def _device_error(results) -> str:
    # The C++ fake device reports index_copy_'s own message; the pure-Python one the generic
    # device-mismatch message (see overlay.testing.fake_device).
    if results["backend"] == "cpp":
        # 5.4+ layers compute the write positions on the cache's device; before, generate() passes
        # them on the model's.
        index = "(index) cpu" if PATCH.transformers >= Version("5.4") else "(index) cuda:0"
        return PATCH.error(index).replace("cuda:0", results["device"])
    return "Expected all tensors to be on the same device"


@pytest.mark.parametrize("model", MODELS)
def test_host_run_then_model_to_device_on_stock_transformers(results, model):
    run = results["runs"][model]["to_device"]["stock"]
    if _stock_fails(run, DEVICE_BUG, results["runs"][model]["to_device"]["host_ids"]):
        assert not run["ok"], "stock transformers was expected to reuse the host cache and fail"
        assert _device_error(results) in run["error"], run["error"]
        if results["backend"] == "cpp":
            assert f"(source) {results['device']}" in run["error"]


@_per_model_and_flow("patched", "patched_after_stock_host_run")
def test_host_run_then_model_to_device_with_the_overlay(results, model, flow):
    runs, run = _scenario(results, model, "to_device", flow)
    assert_generated(run, runs["host_ids"])
    assert run["cache"] == {"device": results["device"], "dtype": "torch.float32"}
    if PATCH.affected:
        # Also on 4.55, where stock moves the old cache on write: a cache built for the device.
        assert run["fired"] > 0
        assert run["actions"] == [f"rebuilt a kept static cache for {results['device']} / torch.float32"]
    else:
        assert run["fired"] == 0


@pytest.mark.parametrize("model", MODELS)
def test_dtype_change_on_stock_transformers(results, model):
    runs = results["runs"][model]["to_bfloat16"]
    stock = runs["stock"]
    if _stock_fails(stock, DTYPE_BUG, runs["control_ids"]):
        assert not stock["ok"], "stock transformers was expected to reuse the float32 cache and fail"
        assert DTYPE_ERROR in stock["error"]
        hidden = runs["kv_cache_dtype_only"]
        if KV_CACHE_DTYPE:
            # kv-cache-dtype alone hides the error, at the price of a cast of the whole cache per step.
            assert hidden["ok"], hidden.get("error")
            assert hidden["cache"]["dtype"] == "torch.float32"
            assert "KVCacheDtypeWarning" in hidden["warnings"]
        else:  # not offered on this release: stock's failure
            _assert_failed_with(hidden, DTYPE_ERROR)


@_per_model_and_flow("patched", "patched_with_kv_cache_dtype")
def test_dtype_change_with_the_overlay_rebuilds_in_the_model_dtype(results, model, flow):
    runs, run = _scenario(results, model, "to_bfloat16", flow)
    assert run["ok"], run.get("error")
    # The same ids as a model that was bfloat16 from the start (a fresh cache), and no cast at all:
    # the cache is in the model's dtype, so kv-cache-dtype has nothing to do.
    assert run["ids"] == runs["control_ids"]
    assert run["cache"] == {"device": results["device"], "dtype": "torch.bfloat16"}
    assert "KVCacheDtypeWarning" not in run["warnings"]
    assert run["kv_cache_dtype_fired"] == 0
    if PATCH.affected:
        assert run["fired"] > 0
    else:
        assert run["fired"] == 0


@pytest.mark.parametrize("model", MODELS)
def test_nothing_changed_reuses_the_same_cache_and_does_not_fire(results, model):
    run = results["runs"][model]["unchanged"]
    assert_generated(run, run["first_ids"])
    assert run["fired"] == 0
    if PATCH.affected:
        assert run["same_cache_object"], "a kept cache that still matches must be reused, as upstream does"


@_per_model_and_flow("stock", "patched", "patched_after_stock_failed_run")
def test_failed_generate_fails_before_the_first_cache_write(results, model, flow):
    # The setup of the next test: the call fails in the embedding, before any attention layer.
    failed = results["runs"][model]["failed_then_valid"][flow]["failed"]
    assert not failed["ok"] and failed["type"] == "IndexError", failed
    assert failed["cache_written"] is False, failed


@pytest.mark.parametrize("model", MODELS)
def test_failed_then_valid_generate_on_stock_transformers(results, model):
    runs = results["runs"][model]["failed_then_valid"]
    run = runs["stock"]["valid"]
    if _stock_fails(run, POISON_BUG, runs["control_ids"]):
        assert not run["ok"], "stock transformers was expected to reuse the uninitialised cache and fail"
        assert run["type"] == "AttributeError", run
        assert f"'{POISONED_LAYER[model]}' {POISON_ERROR}" in run["error"], run["error"]
        # The text the patch declares, with the class of this model's first layer.
        assert PATCH.error("max_batch_size").replace("StaticLayer", POISONED_LAYER[model]) in run["error"]
        # Poisoned for good: one more valid call fails the same way.
        again = runs["stock"]["valid_again"]
        _assert_failed_with(again, POISON_ERROR)


@_per_model_and_flow("patched", "patched_after_stock_failed_run")
def test_failed_then_valid_generate_with_the_overlay(results, model, flow):
    runs, record = _scenario(results, model, "failed_then_valid", flow)
    run = record["valid"]
    # The same ids as a fresh model's first call.
    assert_generated(run, runs["control_ids"])
    assert_generated(runs[flow]["valid_again"], runs["control_ids"])
    if POISON_BUG:
        assert run["fired"] > 0
        assert run["actions"] == ["rebuilt a kept static cache a failed generate() left half-initialised"]
    else:  # nothing to fix: the release copes (4.55, 5.13 - 5.14) or keeps no cache (5.15+)
        assert run["fired"] == 0
    # The cache the valid call built is whole: the call after it reuses it, untouched.
    assert runs[flow]["valid_again"]["fired"] == 0
    if PATCH.affected:
        assert runs[flow]["valid_again"]["same_cache_object"]


@pytest.mark.parametrize("model", MID_PREFILL_MODELS)
def test_failed_mid_prefill_then_valid_generate(results, model):
    runs = results["runs"][model]["failed_mid_prefill"]
    for flow in ("stock", "patched"):
        failed = runs[flow]["failed"]
        _assert_failed_with(failed, "simulated out of memory in layer 1")
        if POISON_BUG:  # the first layer written, the second not
            assert failed["layers_allocated"] == [True, False], failed
    stock = runs["stock"]["valid"]
    if _stock_fails(stock, POISON_BUG, runs["control_ids"]):
        # The second layer (full attention in every model here) has no max_batch_size.
        _assert_failed_with(stock, f"'StaticLayer' {POISON_ERROR}")
        assert not runs["stock"]["valid_again"]["ok"], runs["stock"]["valid_again"]
    patched = runs["patched"]
    assert_generated(patched["valid"], runs["control_ids"])
    assert_generated(patched["valid_again"], runs["control_ids"])
    assert patched["valid"]["fired"] == (1 if POISON_BUG else 0), patched["valid"]
    assert patched["valid"]["actions"] == (
        ["rebuilt a kept static cache a failed generate() left half-initialised"] if POISON_BUG else []
    )
    # The rebuilt cache is whole: the next call reuses it, untouched (no rebuild on every call).
    assert patched["valid_again"]["fired"] == 0
    if PATCH.affected:
        assert patched["valid_again"]["same_cache_object"]


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
    from overlay.testing.models import left_padded_batch, tiny_model
    from overlay.testing.models import on_device as on

    def allocated(layer):
        # 4.56's layers have no is_initialized flag: allocated keys tell (4.55 allocates at once).
        return getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", True)

    def allocated_layers(cache):
        return [layer for layer in getattr(cache, "layers", ()) if allocated(layer)]

    def cache_placement(cache):
        layer = next(iter(allocated_layers(cache)), None)
        return None if layer is None else {"device": str(layer.keys.device), "dtype": str(layer.keys.dtype)}

    def generate(model, batch):
        report.reset()
        guard.reset_warnings()  # the cast warning is once per process: each run gets its own
        caches = []  # the cache the forward passes get (5.15+ keep none on the model)
        kept = vars(model).get("_cache")

        def seen(_module, _args, kwargs):
            caches.append(kwargs.get("past_key_values", kwargs.get("cache")))

        hook = model.register_forward_pre_hook(seen, with_kwargs=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                     cache_implementation="static", disable_compile=True)
                result = {"ok": True, "ids": out.cpu().tolist()}
            except Exception as err:  # noqa: BLE001  (the test reads which one)
                result = {"ok": False, "type": type(err).__name__, "error": str(err)}
            finally:
                hook.remove()
        result["fired"] = report.fired().get(PATCH.id, 0)
        result["kv_cache_dtype_fired"] = report.fired().get("kv-cache-dtype", 0)
        result["actions"] = sorted(report.fired_actions().get(PATCH.id, {}))
        result["warnings"] = sorted({type(w.message).__name__ for w in caught})
        result["cache"] = cache_placement(caches[-1]) if caches else None
        result["same_cache_object"] = kept is not None and vars(model).get("_cache") is kept
        return result

    patched = PATCH.applied

    batch = left_padded_batch((6, 4))
    # The same batch with one id outside the 128-token vocabulary: generate() fails in the
    # embedding, after the static cache is prepared and before any layer writes to it.
    out_of_vocabulary = {name: value.clone() for name, value in batch.items()}
    out_of_vocabulary["input_ids"][0, -1] = 100_000
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
                    status = statuses[PATCH.id]
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

        # 4. A static generate() that fails before the cache's first write, then valid ones.
        failed_then_valid = runs["failed_then_valid"] = {"control_ids": generate(tiny_model(kind), batch)["ids"]}
        for flow in ("stock", "patched", "patched_after_stock_failed_run"):
            model = tiny_model(kind)
            calls = failed_then_valid[flow] = {}
            with (patched() if flow == "patched" else overlay.reverted()):
                calls["failed"] = generate(model, out_of_vocabulary)
            # Nothing written (4.55 allocates at once: a write would have made its keys non-zero).
            calls["failed"]["cache_written"] = any(bool(l.keys.any()) for l in allocated_layers(vars(model).get("_cache")))
            with (overlay.reverted() if flow == "stock" else patched()):
                calls["valid"] = generate(model, batch)
                calls["valid_again"] = generate(model, batch)

    # 5. A call that fails midway through the prefill (an out-of-memory error in the second
    # decoder layer, simulated): the first layer's cache is written, the second's is not. T5 too:
    # an encoder-decoder cache, whose cross-attention half the reuse check does not read.
    for kind in MID_PREFILL_MODELS:
        options = {"attn_implementation": None} if kind == "t5" else {}  # the release's default
        mid_prefill = results["runs"].setdefault(kind, {})["failed_mid_prefill"] = {
            "control_ids": generate(tiny_model(kind, **options), batch)["ids"],
        }
        for flow in ("stock", "patched"):
            model = tiny_model(kind, **options)
            calls = mid_prefill[flow] = {}
            second_layer = model.decoder.block[1] if kind == "t5" else model.model.layers[1]

            def out_of_memory(_module, _args):
                raise RuntimeError("simulated out of memory in layer 1")

            with (patched() if flow == "patched" else overlay.reverted()):
                hook = second_layer.register_forward_pre_hook(out_of_memory)
                try:
                    calls["failed"] = generate(model, batch)
                finally:
                    hook.remove()
                kept = vars(model).get("_cache")
                kept = getattr(kept, "self_attention_cache", kept)
                calls["failed"]["layers_allocated"] = None if kept is None else [allocated(l) for l in kept.layers]
                calls["valid"] = generate(model, batch)
                calls["valid_again"] = generate(model, batch)
    return results


if __name__ == "__main__":
    import json

    print(RESULT_MARKER + json.dumps(_worker()), flush=True)


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_nothing_changed_reuses_the_same_cache_and_does_not_fire',
                    "reuses stock's kept cache unless device or dtype changed, where stock raises")
