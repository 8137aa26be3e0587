"""Tests of overlay.testing: the host-memory fake device.

torch lets a process rename its PrivateUse1 backend only once, and a renamed backend changes
process-wide state (torch.accelerator, torch.<name>), so every test that installs the device runs
in a fresh subprocess. The checks that need the device are batched: one subprocess per backend
runs them all and reports what it observed as JSON; the test functions assert on that report.

The C++ backend is compiled on first use (about a minute) into the per-user cache, which later
runs (and the later subprocesses of this module) reuse.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from overlay.testing import fake_device

REPO_ROOT = Path(__file__).resolve().parents[2]
# A cold C++ build takes about a minute on 2 busy cores; loading a cached one takes milliseconds.
BUILD_TIMEOUT_S = 900
RUN_TIMEOUT_S = 300
MISMATCH = "Expected all tensors to be on the same device, but found at least two devices, {device} and cpu!"


def run_python(code: str, *args: str, timeout: float = RUN_TIMEOUT_S, env: dict | None = None) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout; fail with its stderr."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, f"subprocess failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc.stdout


def result_of(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0][len("RESULT ") :])


# Runs every device check in one process and prints what it saw. argv: backend, device name.
# What both workers below use to read an error: its text, or None when the call worked.
ERROR_OF = r"""

def error_of(fn):
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None
"""

BATTERY = r"""
import json, sys
import torch
torch.set_num_threads(1)
from overlay.testing import install_fake_device, fake_device_backend

backend, name = sys.argv[1], sys.argv[2]
device = install_fake_device(name, backend)
report = {"backend": fake_device_backend(), "device": str(device)}

""" + ERROR_OF + r"""

def same_bits(on_device, on_cpu):
    # Bit for bit: compare the raw bytes (torch.equal would let -0.0 == 0.0 through).
    on_device = on_device.cpu()
    return (
        on_device.dtype == on_cpu.dtype
        and on_device.shape == on_cpu.shape
        and torch.equal(on_device.contiguous().view(torch.uint8), on_cpu.contiguous().view(torch.uint8))
    )


g = torch.Generator().manual_seed(0)
a, b = torch.randn(4, 8, generator=g), torch.randn(8, 3, generator=g)
q = torch.randn(2, 4, 6, 8, generator=g)
k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
mask = torch.randn(2, 1, 6, 6, generator=g)
weight, ids = torch.randn(16, 8, generator=g), torch.tensor([[3, 1, 15], [0, 7, 7]])
cache, index, states = torch.zeros(2, 5, 8), torch.tensor([1, 3]), torch.randn(2, 2, 8, generator=g)
sdpa = torch.nn.functional.scaled_dot_product_attention
d = lambda t: t.to(device)

def writes_through(t):
    base = t.clone()
    base.view(32)[:8].fill_(7.0)  # a view of a view: the write must land in base's memory
    return base.cpu()[0].tolist() == [7.0] * 8


x = d(a)
module = torch.nn.Linear(8, 3).to(device)
report["placement"] = {
    "device": str(x.device),
    "device_type": x.device.type,
    "is_cpu": x.is_cpu,
    "empty_device": str(torch.empty(2, 3, device=device).device),
    "empty_by_type_device": str(torch.empty(2, device=name).device),
    "tensor_device": str(torch.tensor([1, 2], device=device).device),
    "back_to_cpu_device": str(x.to("cpu").device),
    "cpu_method_device": str(x.cpu().device),
    "round_trip_equal": same_bits(x.to("cpu").to(device).cpu(), a),
    "module_weight_device": str(module.weight.device),
    "module_is_parameter": isinstance(module.weight, torch.nn.Parameter),
    "module_output_device": str(module(x).device),
    "cpu_scalar_operand_device": str((x + torch.tensor(2.0)).device),
    "in_place_view_writes_through": writes_through(x),
    "second_index_error": error_of(lambda: torch.empty(1, device=f"{name}:1")),
}

report["mismatch"] = {
    "add": error_of(lambda: d(a) + a),
    "matmul": error_of(lambda: d(a) @ b),
    "cat": error_of(lambda: torch.cat([d(a), a])),
    "embedding": error_of(lambda: torch.nn.functional.embedding(ids, d(weight))),
    "sdpa_cpu_mask": error_of(lambda: sdpa(d(q), d(q), d(q), attn_mask=mask)),
    "index_copy_cpu_source": error_of(lambda: d(cache).index_copy_(1, d(index), states)),
    "where": error_of(lambda: torch.where(d(a) > 0, d(a), a)),
}

report["bitwise"] = {
    "matmul": same_bits(d(a) @ d(b), a @ b),
    "sdpa_mask": same_bits(sdpa(d(q), d(q), d(q), attn_mask=d(mask)), sdpa(q, q, q, attn_mask=mask)),
    "sdpa_causal_gqa": same_bits(
        sdpa(d(q), d(k), d(v), is_causal=True, enable_gqa=True), sdpa(q, k, v, is_causal=True, enable_gqa=True)
    ),
    "softmax": same_bits(torch.softmax(d(a), dim=-1), torch.softmax(a, dim=-1)),
    "index_copy_": same_bits(d(cache).index_copy_(1, d(index), d(states)), cache.clone().index_copy_(1, index, states)),
    "cat": same_bits(torch.cat([d(a), d(a) * 2], dim=0), torch.cat([a, a * 2], dim=0)),
    "embedding": same_bits(torch.nn.functional.embedding(d(ids), d(weight)), torch.nn.functional.embedding(ids, weight)),
}

# Autograd: gradients computed on the device against the CPU ones.
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
mlp_on_device = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
mlp_on_device.load_state_dict(mlp.state_dict())
mlp_on_device.to(device)
torch.softmax(mlp(a), -1).sum().backward()
torch.softmax(mlp_on_device(d(a)), -1).sum().backward()
q_grad = q.clone().requires_grad_()
q_grad_on_device = d(q).requires_grad_()
sdpa(q_grad, q_grad, q_grad, attn_mask=mask).sum().backward()
sdpa(q_grad_on_device, q_grad_on_device, q_grad_on_device, attn_mask=d(mask)).sum().backward()
report["autograd"] = {
    "mlp_bitwise": all(same_bits(p.grad, ref.grad) for p, ref in zip(mlp_on_device.parameters(), mlp.parameters())),
    "sdpa_grad_device": str(q_grad_on_device.grad.device),
    "sdpa_bitwise": same_bits(q_grad_on_device.grad, q_grad.grad),
    "sdpa_close": torch.allclose(q_grad_on_device.grad.cpu(), q_grad.grad, rtol=1e-5, atol=1e-6),
}

from overlay.testing.models import tiny_model

# Heads of 8; Gemma 3 with a sliding (window 4) and a full layer.
sizes = dict(hidden_size=32, intermediate_size=64, max_position_embeddings=64, sliding_window=4)
# Left-padded batch, as generation with a padding tokenizer produces.
input_ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
report["generate"] = {}
for model_name in ("llama", "qwen3", "gemma3"):
    model = tiny_model(model_name, **sizes)
    for cache_implementation in (None, "static"):
        kwargs = dict(max_new_tokens=5, do_sample=False, disable_compile=True)
        if cache_implementation:
            kwargs["cache_implementation"] = cache_implementation
        expected = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        on_device = model.to(device)
        got = on_device.generate(input_ids=d(input_ids), attention_mask=d(attention_mask), **kwargs)
        report["generate"][f"{model_name}/{cache_implementation or 'dynamic'}"] = {
            "device": str(got.device), "same_tokens": torch.equal(got.cpu(), expected),
            "expected": expected.tolist(), "got": got.cpu().tolist(),
        }
        model = on_device.to("cpu")

print("RESULT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def cpp_available() -> bool:
    # A cached build, or a compiler and ninja to make one. (Imports torch in this process, which
    # is harmless: only installing the device changes process-wide state.)
    return fake_device.fake_device_available("cpp")


_battery_reports: dict[str, dict] = {}


def battery_report(backend: str) -> dict:
    """The battery's report for ``backend``, run once per test session (the first cpp run
    builds the library into the cache)."""
    if backend not in _battery_reports:
        _battery_reports[backend] = result_of(run_python(BATTERY, backend, "fakeaccel", timeout=BUILD_TIMEOUT_S))
    return _battery_reports[backend]


@pytest.fixture(scope="module", params=["cpp", "python"])
def report(request: pytest.FixtureRequest, cpp_available: bool) -> dict:
    if request.param == "cpp" and not cpp_available:
        pytest.skip("no C++ compiler/ninja and no cached build: the cpp fake device cannot be built here")
    return battery_report(request.param)


def test_import_does_not_import_torch() -> None:
    out = run_python(
        """
        import sys
        import overlay.testing
        print("torch" in sys.modules)
        """
    )
    assert out.strip() == "False"


def test_installed_backend_is_the_requested_one(report: dict, request: pytest.FixtureRequest) -> None:
    assert report["backend"] == request.node.callspec.params["report"]
    assert report["device"] == "fakeaccel:0"


def test_tensors_and_modules_live_on_the_fake_device(report: dict) -> None:
    placement = report["placement"]
    assert placement["device"] == "fakeaccel:0"
    assert placement["device_type"] == "fakeaccel"
    assert placement["is_cpu"] is False
    assert placement["empty_device"] == "fakeaccel:0"
    assert placement["empty_by_type_device"] == "fakeaccel:0"
    assert placement["tensor_device"] == "fakeaccel:0"
    assert placement["back_to_cpu_device"] == "cpu"
    assert placement["cpu_method_device"] == "cpu"
    assert placement["round_trip_equal"] is True
    assert placement["module_weight_device"] == "fakeaccel:0"
    assert placement["module_is_parameter"] is True
    assert placement["module_output_device"] == "fakeaccel:0"
    assert placement["in_place_view_writes_through"] is True


def test_cpu_scalars_mix_with_device_tensors_as_on_real_accelerators(report: dict) -> None:
    assert report["placement"]["cpu_scalar_operand_device"] == "fakeaccel:0"


def test_there_is_a_single_device_by_default(report: dict) -> None:
    message = report["placement"]["second_index_error"]
    assert message is not None and "Invalid device index 1" in message and "has 1 device" in message, message


@pytest.mark.parametrize("op", ["add", "matmul", "cat", "embedding", "sdpa_cpu_mask", "where"])
def test_mixed_devices_raise_pytorchs_device_mismatch_error(report: dict, op: str) -> None:
    message = report["mismatch"][op]
    assert message is not None, f"{op} with a CPU operand did not raise"
    assert message.startswith(MISMATCH.format(device="fakeaccel:0")), message


def test_index_copy_with_a_cpu_source_raises(report: dict) -> None:
    # The cpp backend reaches torch's own index_copy_ check, whose text differs from the generic
    # one (as on CUDA); both name the two devices.
    message = report["mismatch"]["index_copy_cpu_source"]
    assert message is not None
    assert "fakeaccel:0" in message and "cpu" in message, message


@pytest.mark.parametrize("op", ["matmul", "sdpa_mask", "sdpa_causal_gqa", "softmax", "index_copy_", "cat", "embedding"])
def test_same_device_ops_equal_cpu_bit_for_bit(report: dict, op: str) -> None:
    assert report["bitwise"][op] is True


def test_gradients_on_the_fake_device_match_cpu(report: dict) -> None:
    autograd = report["autograd"]
    assert autograd["mlp_bitwise"] is True
    assert autograd["sdpa_grad_device"] == "fakeaccel:0"
    assert autograd["sdpa_close"] is True
    if report["backend"] == "cpp":
        # Same fused CPU kernel and backward as on CPU.
        assert autograd["sdpa_bitwise"] is True


@pytest.mark.parametrize(
    "case", ["llama/dynamic", "llama/static", "qwen3/dynamic", "qwen3/static", "gemma3/dynamic", "gemma3/static"]
)
def test_generate_on_the_fake_device_matches_cpu(report: dict, case: str) -> None:
    result = report["generate"][case]
    assert result["device"] == "fakeaccel:0"
    assert result["got"] == result["expected"]


def test_device_renamed_neuron_in_a_fresh_process(cpp_available: bool) -> None:
    backend = "cpp" if cpp_available else "python"
    out = run_python(
        """
        import json, sys
        import torch
        from overlay.testing import install_fake_device
        device = install_fake_device("neuron", sys.argv[1])
        q = torch.randn(1, 2, 4, 8)
        try:
            torch.nn.functional.scaled_dot_product_attention(
                q.to(device), q.to(device), q.to(device), attn_mask=torch.zeros(1, 1, 4, 4))
            error = None
        except RuntimeError as exc:
            error = str(exc)
        x = torch.ones(3, device="neuron")
        print("RESULT " + json.dumps({
            "device": str(device), "tensor_device": str(x.device), "type": x.device.type,
            "module": hasattr(torch, "neuron") and torch.neuron.is_available(), "error": error,
        }))
        """,
        backend,
        timeout=BUILD_TIMEOUT_S,
    )
    result = result_of(out)
    assert result["device"] == result["tensor_device"] == "neuron:0"
    assert result["type"] == "neuron"
    assert result["module"] is True
    assert result["error"].startswith(MISMATCH.format(device="neuron:0")), result["error"]


def test_installing_twice_is_idempotent_and_another_name_needs_a_fresh_process(cpp_available: bool) -> None:
    backend = "cpp" if cpp_available else "python"
    out = run_python(
        """
        import json, sys
        from overlay.testing import install_fake_device, fake_device_backend
        first = install_fake_device("fakeaccel", sys.argv[1])
        again = install_fake_device("fakeaccel")
        other_backend = "python" if fake_device_backend() == "cpp" else "cpp"
        errors = {}
        for key, call in (
            ("other_name", lambda: install_fake_device("neuron")),
            ("other_backend", lambda: install_fake_device("fakeaccel", other_backend)),
        ):
            try:
                call()
                errors[key] = None
            except RuntimeError as exc:
                errors[key] = str(exc)
        print("RESULT " + json.dumps({"same": first == again, "device": str(again), **errors}))
        """,
        backend,
        timeout=BUILD_TIMEOUT_S,
    )
    result = result_of(out)
    assert result["same"] is True and result["device"] == "fakeaccel:0"
    assert "already named 'fakeaccel'" in result["other_name"]
    assert "fresh process" in result["other_name"]
    assert "fresh process" in result["other_backend"]


def test_a_backend_renamed_by_someone_else_is_refused() -> None:
    out = run_python(
        """
        import torch
        from overlay.testing import install_fake_device
        torch.utils.rename_privateuse1_backend("otherdev")
        try:
            install_fake_device("fakeaccel")
        except RuntimeError as exc:
            print(exc)
        """
    )
    assert "already named 'otherdev'" in out
    assert "fresh process" in out


def test_auto_uses_python_where_no_compiler_is_found(tmp_path: Path) -> None:
    # An empty cache and a compiler that does not exist: as on a machine without build tools.
    out = run_python(
        """
        import json
        import overlay.testing as t
        available = {b: t.fake_device_available(b) for b in ("cpp", "python", "auto")}
        try:
            t.install_fake_device(backend="cpp")
            cpp_error = None
        except t.FakeDeviceUnavailable as exc:
            cpp_error = str(exc)
        device = t.install_fake_device()
        print("RESULT " + json.dumps({
            "available": available, "cpp_error": cpp_error, "device": str(device), "backend": t.fake_device_backend(),
        }))
        """,
        env={"ATTN_OVERLAY_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")},
    )
    result = result_of(out)
    assert result["available"] == {"cpp": False, "python": True, "auto": True}
    assert "no C++ compiler" in result["cpp_error"]
    assert result["device"] == "fakeaccel:0"
    assert result["backend"] == "python"


def test_a_failed_build_is_not_retried_by_auto_in_later_processes(tmp_path: Path) -> None:
    # A compiler that exists but fails, as when a new torch breaks the C++ source.
    broken_compiler = tmp_path / "broken-c++"
    broken_compiler.write_text("#!/bin/sh\necho 'simulated compiler failure' >&2\nexit 1\n")
    broken_compiler.chmod(0o755)
    env = {"ATTN_OVERLAY_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(broken_compiler)}
    first = run_python(
        "import overlay.testing as t; t.install_fake_device(); print(t.fake_device_backend())", env=env
    )
    assert first.split() == ["python"]
    assert list((tmp_path / "cache").rglob("build-failed.txt")), "the failed build left no note"
    second = run_python(
        """
        import torch.utils.cpp_extension as cpp_extension
        def no_compiling(*args, **kwargs):
            raise AssertionError("auto retried a build known to fail")
        cpp_extension.load = no_compiling
        import overlay.testing as t
        t.install_fake_device()
        print(t.fake_device_backend())
        """,
        env=env,
    )
    assert second.split() == ["python"]


def test_cached_cpp_build_is_loaded_without_compiling(cpp_available: bool) -> None:
    if not cpp_available:
        pytest.skip("no C++ compiler/ninja and no cached build: the cpp fake device cannot be built here")
    if not fake_device._cpp_library_path().exists():
        battery_report("cpp")  # builds and caches the library
    assert fake_device._cpp_library_path().exists()
    out = run_python(
        """
        import torch.utils.cpp_extension as cpp_extension
        def no_compiling(*args, **kwargs):
            raise AssertionError("the cached fake device library was rebuilt")
        cpp_extension.load = no_compiling
        from overlay.testing import install_fake_device, fake_device_backend
        print(install_fake_device(backend="cpp"), fake_device_backend())
        """
    )
    assert out.split() == ["fakeaccel:0", "cpp"]


def test_torchs_own_device_types_are_refused_as_names() -> None:
    # torch itself would let PrivateUse1 be renamed "meta", breaking the real meta device.
    with pytest.raises(ValueError, match="torch's own device types"):
        fake_device.install_fake_device("meta")


def test_invalid_arguments_are_rejected_before_touching_torch() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        fake_device.install_fake_device(backend="cuda")
    with pytest.raises(ValueError, match="device name"):
        fake_device.install_fake_device("Fake:0")


# ---------------------------------------------------------------- allocator, devices, accelerate

# Two devices; the device allocator's numbers; accelerate. argv: backend. Prints one report.
ACCELERATE_BATTERY = r"""
import json, sys, tempfile
import torch
torch.set_num_threads(1)
from overlay.testing.fake_device import install_fake_device, fake_device_backend, safetensors_via_host

backend = sys.argv[1]
CAPACITY = 200_000  # bytes per device: the tiny model (about 0.36 MB) does not fit on one
extra = {"memory_per_device": CAPACITY} if backend == "cpp" else {}
d0 = install_fake_device("fakeaccel", backend, device_count=2, **extra)
d1 = torch.device("fakeaccel:1")
A = torch.accelerator
report = {"backend": fake_device_backend(), "device_count": A.device_count(), "module_count": torch.fakeaccel.device_count()}

""" + ERROR_OF + r"""

report["empty_cache_error"] = error_of(A.empty_cache)
report["accelerate_clear_error"] = error_of(lambda: __import__("accelerate.utils.memory").utils.memory.clear_device_cache())

memory = {}
if backend == "cpp":
    before = A.memory_allocated(0)
    x = torch.empty(1024, dtype=torch.float32, device=d0)
    memory["rise"] = A.memory_allocated(0) - before
    memory["stats_current_equal"] = A.memory_stats(0)["allocated_bytes.all.current"] == A.memory_allocated(0)
    memory["module_equal"] = torch.fakeaccel.memory_allocated(0) == A.memory_allocated(0)
    memory["info"] = list(A.get_memory_info(0))
    memory["mem_get_info"] = list(torch.fakeaccel.mem_get_info(0))
    memory["expected_free"] = CAPACITY - A.memory_allocated(0)
    device1_before = A.memory_allocated(1)
    y = torch.empty(256, dtype=torch.float32, device=d1)
    memory["device1_rise"] = A.memory_allocated(1) - device1_before
    memory["device0_unchanged_by_device1"] = A.memory_allocated(0) - before == 4096
    peak = A.max_memory_allocated(0)
    del x
    memory["fall"] = before - A.memory_allocated(0) + 4096
    memory["peak_kept_after_free"] = A.max_memory_allocated(0) == peak and peak >= before + 4096
    A.reset_peak_memory_stats(0)
    memory["peak_after_reset"] = A.max_memory_allocated(0) - A.memory_allocated(0)
    memory["reserved_equals_allocated"] = A.memory_reserved(1) == A.memory_allocated(1)
    del y
else:
    memory["allocated_error"] = error_of(lambda: A.memory_allocated(0))
    memory["stats_error"] = error_of(lambda: A.memory_stats(0))
    memory["info_error"] = error_of(lambda: A.get_memory_info(0))
    memory["set_device_error"] = error_of(lambda: torch.fakeaccel.set_device(1))
report["memory"] = memory

a = torch.arange(6.0).reshape(2, 3)
on0, on1 = a.to(d0), a.to(d1)
report["devices"] = {
    "on1": str(on1.device),
    "on1_result": str((on1 * 2 + 1).device),
    "on1_matmul": str((on1 @ on1.T).device),
    "copy_1_to_0": str(on1.to(d0).device),
    "copy_equal": torch.equal(on1.to(d0).cpu(), a),
    "mix_add": error_of(lambda: on0 + on1),
    "mix_cat": error_of(lambda: torch.cat([on0, on1])),
    "index_2": error_of(lambda: torch.empty(1, device="fakeaccel:2")),
}
if backend == "cpp":
    with torch.fakeaccel.device(1):
        report["devices"]["current_in_context"] = [A.current_device_index(), str(torch.empty(1, device="fakeaccel").device)]
    report["devices"]["current_after"] = A.current_device_index()

import accelerate
import transformers
from overlay.testing.models import save_tiny_model, tiny_model

input_ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
kwargs = dict(max_new_tokens=5, do_sample=False, disable_compile=True)


def generate(model, device):
    return model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs).cpu().tolist()


expected = tiny_model("llama").generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs).tolist()
report["expected"] = expected
offloaded = tiny_model("llama")
accelerate.cpu_offload(offloaded, execution_device=d0)
report["cpu_offload"] = generate(offloaded, d0)
dispatched = tiny_model("llama")
device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
              "model.rotary_emb": 1, "lm_head": 1}
accelerate.dispatch_model(dispatched, device_map=device_map)
report["dispatch_devices"] = sorted({str(p.device) for p in dispatched.parameters()})
report["dispatch_layer1"] = str(dispatched.model.layers[1].self_attn.q_proj.weight.device)
report["dispatch"] = generate(dispatched, d0)

path = save_tiny_model(tempfile.mkdtemp(), "llama")
mixed_map = {"model.embed_tokens": 0, "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": 1,
             "model.rotary_emb": 1, "lm_head": 1}
loaded = transformers.AutoModelForCausalLM.from_pretrained(path, device_map=mixed_map, offload_folder=tempfile.mkdtemp())
report["cpu_disk_map"] = generate(loaded, d0)
# transformers 4.x opens the checkpoint on the target device, which safetensors refuses: the hook.
import contextlib
hook = safetensors_via_host() if int(transformers.__version__.split(".")[0]) < 5 else contextlib.nullcontext()
with hook:
    whole = transformers.AutoModelForCausalLM.from_pretrained(path, device_map={"": "fakeaccel:0"})
report["whole_devices"] = sorted({str(p.device) for p in whole.parameters()})
report["whole"] = generate(whole, d0)
if backend == "cpp":
    # The capacity each device reports, less what it holds, decides where accelerate puts the
    # layers: free the models above first (a model on a device would leave it no room).
    del offloaded, dispatched, loaded, whole
    __import__("gc").collect()
    report["held_before_auto"] = [A.memory_allocated(0), A.memory_allocated(1)]
    auto = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    report["auto_map"] = sorted({str(v) for v in getattr(auto, "hf_device_map", {"": "one device"}).values()})
    report["auto"] = generate(auto, d0)

import safetensors
shard = next(__import__("pathlib").Path(path).glob("*.safetensors"))
report["safe_open_error"] = None
try:
    safetensors.safe_open(str(shard), framework="pt", device="fakeaccel:0")
except Exception as exc:
    report["safe_open_error"] = str(exc)
with safetensors_via_host():
    with safetensors.safe_open(str(shard), framework="pt", device="fakeaccel:0") as handle:
        report["safe_open_via_host"] = str(handle.get_tensor(next(iter(handle.keys()))).device)
    report["patched_inside"] = transformers.modeling_utils.__dict__.get("safe_open") is not None and getattr(transformers.modeling_utils.__dict__.get("safe_open"), "_attn_overlay_fake_device", False)
report["restored"] = safetensors.safe_open is transformers.modeling_utils.__dict__.get("safe_open", safetensors.safe_open)
print("RESULT " + json.dumps(report))
"""

_accelerate_reports: dict[str, dict] = {}


@pytest.fixture(scope="module", params=["cpp", "python"])
def accel(request: pytest.FixtureRequest, cpp_available: bool) -> dict:
    if request.param == "cpp" and not cpp_available:
        pytest.skip("no C++ compiler/ninja and no cached build: the cpp fake device cannot be built here")
    pytest.importorskip("accelerate")
    if request.param not in _accelerate_reports:
        _accelerate_reports[request.param] = result_of(
            run_python(ACCELERATE_BATTERY, request.param, timeout=BUILD_TIMEOUT_S)
        )
    return _accelerate_reports[request.param]


def test_empty_cache_works_as_accelerate_calls_it(accel: dict) -> None:
    assert accel["empty_cache_error"] is None
    assert accel["accelerate_clear_error"] is None


def test_cpp_memory_counts_follow_allocations(accel: dict) -> None:
    if accel["backend"] != "cpp":
        pytest.skip("the python backend has no device allocator (see the next test)")
    memory = accel["memory"]
    assert memory["rise"] == 4096  # 1024 float32 allocated on fakeaccel:0
    assert memory["fall"] == 4096  # and released with the tensor
    assert memory["device1_rise"] == 1024 and memory["device0_unchanged_by_device1"] is True
    assert memory["peak_kept_after_free"] is True
    assert memory["peak_after_reset"] == 0
    assert memory["stats_current_equal"] is True and memory["module_equal"] is True
    assert memory["reserved_equals_allocated"] is True
    assert memory["info"] == [memory["expected_free"], 200_000]
    assert memory["mem_get_info"] == memory["info"]


def test_python_backend_memory_statistics_fail_clearly(accel: dict) -> None:
    if accel["backend"] != "python":
        pytest.skip("the cpp backend has the statistics")
    memory = accel["memory"]
    for key in ("allocated_error", "stats_error", "info_error"):
        assert memory[key] is not None and "no device allocator" in memory[key], memory[key]
        assert "INTERNAL ASSERT" not in memory[key]
    assert "backend='cpp'" in memory["set_device_error"]


def test_two_devices_exist_and_do_not_mix(accel: dict) -> None:
    assert accel["device_count"] == accel["module_count"] == 2
    devices = accel["devices"]
    assert devices["on1"] == devices["on1_result"] == devices["on1_matmul"] == "fakeaccel:1"
    assert devices["copy_1_to_0"] == "fakeaccel:0" and devices["copy_equal"] is True
    for key in ("mix_add", "mix_cat"):
        expected = "Expected all tensors to be on the same device, but found at least two devices, fakeaccel:0 and fakeaccel:1!"
        assert devices[key] is not None and devices[key].startswith(expected), devices[key]
    assert devices["index_2"] is not None and "Invalid device index 2" in devices["index_2"]
    if accel["backend"] == "cpp":
        assert devices["current_in_context"] == [1, "fakeaccel:1"]
        assert devices["current_after"] == 0


@pytest.mark.parametrize("case", ["cpu_offload", "dispatch", "cpu_disk_map", "whole"])
def test_accelerate_placements_generate_the_cpu_tokens(accel: dict, case: str) -> None:
    assert accel[case] == accel["expected"]


def test_dispatch_model_spans_both_devices(accel: dict) -> None:
    assert accel["dispatch_devices"] == ["fakeaccel:0", "fakeaccel:1"]
    assert accel["dispatch_layer1"] == "fakeaccel:1"
    assert accel["whole_devices"] == ["fakeaccel:0"]


def test_auto_device_map_uses_the_reported_capacity(accel: dict) -> None:
    if accel["backend"] != "cpp":
        pytest.skip("the python backend reports no device memory")
    assert max(accel["held_before_auto"]) < 1000, accel["held_before_auto"]  # the models are freed
    assert {"0", "1"} <= set(accel["auto_map"]), accel["auto_map"]
    assert accel["auto"] == accel["expected"]


def test_safetensors_via_host(accel: dict) -> None:
    assert "fakeaccel:0 is invalid" in accel["safe_open_error"]
    assert accel["safe_open_via_host"] == "cpu"
    assert accel["patched_inside"] is True
    assert accel["restored"] is True


def test_device_count_and_capacity_are_checked() -> None:
    with pytest.raises(ValueError, match="device_count"):
        fake_device.install_fake_device(device_count=0)
    with pytest.raises(ValueError, match="device_count"):
        fake_device.install_fake_device(device_count=fake_device.MAX_DEVICES + 1)
    with pytest.raises(ValueError, match="memory_per_device needs the C\\+\\+ backend"):
        fake_device.install_fake_device(backend="python", memory_per_device=1 << 20)


def test_another_device_count_needs_a_fresh_process(cpp_available: bool) -> None:
    backend = "cpp" if cpp_available else "python"
    out = run_python(
        """
        import sys
        from overlay.testing import install_fake_device
        install_fake_device("fakeaccel", sys.argv[1], device_count=2)
        install_fake_device("fakeaccel", sys.argv[1], device_count=2)  # the same: fine
        try:
            install_fake_device("fakeaccel", sys.argv[1])
        except RuntimeError as exc:
            print(exc)
        """,
        backend,
        timeout=BUILD_TIMEOUT_S,
    )
    assert "device_count=2" in out and "fresh process" in out


# ------------------------------------------------------------------------- a broken build cache

INSTALL_AND_SAY = """
import torch.utils.cpp_extension as cpp_extension
from overlay.testing import fake_device
print("RESULT", __import__("json").dumps({"device": str(fake_device.install_fake_device()), **fake_device.fake_device_details()}))
"""


def _copy_cached_build(cache: Path) -> Path:
    """The cached library of the user cache, copied (with its checksum) into ``cache``."""
    if not fake_device._cpp_library_path().exists():
        battery_report("cpp")  # builds and caches the library
    source = fake_device._cpp_library_path()
    target = cache / "fake_device" / source.parent.name / source.name
    target.parent.mkdir(parents=True)
    for path in (source, fake_device._digest_path(source)):
        (target.parent / path.name).write_bytes(path.read_bytes())
    return target


def _fake_device_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("fake device:")]


def run_install(env: dict, prelude: str = "") -> tuple[dict, str]:
    full_env = dict(os.environ, **env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", prelude + INSTALL_AND_SAY], capture_output=True, text=True,
        timeout=BUILD_TIMEOUT_S, env=full_env, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return result_of(proc.stdout), proc.stderr


def test_a_truncated_cached_library_is_reported_once_and_rebuilt(tmp_path: Path, cpp_available: bool) -> None:
    if not cpp_available:
        pytest.skip("no C++ compiler/ninja: the cpp fake device cannot be built here")
    library = _copy_cached_build(tmp_path)
    good = library.read_bytes()
    library.write_bytes(good[: len(good) // 3])  # as a full disk or a killed copy leaves it
    result, stderr = run_install({"ATTN_OVERLAY_CACHE_DIR": str(tmp_path)})
    warnings = _fake_device_warnings(stderr)
    assert len(warnings) == 1, stderr
    assert str(library) in warnings[0] and "sha256 differs" in warnings[0] and "rebuilding" in warnings[0]
    assert result["backend"] == "cpp" and result["library"] == str(library)
    assert fake_device._library_problem(library) is None  # a complete library with its checksum
    assert len(library.read_bytes()) > len(good) // 2
    # The next process loads the rebuilt library without a word.
    again, stderr = run_install({"ATTN_OVERLAY_CACHE_DIR": str(tmp_path)})
    assert again["backend"] == "cpp" and not _fake_device_warnings(stderr)


@pytest.mark.parametrize("blocked", ["fake_device", "key"])
def test_a_file_where_a_cache_folder_should_be_is_reported_once_and_replaced(
    tmp_path: Path, cpp_available: bool, blocked: str
) -> None:
    if not cpp_available:
        pytest.skip("no C++ compiler/ninja: the cpp fake device cannot be built here")
    good = _copy_cached_build(tmp_path / "good")
    folder = tmp_path / "cache" / "fake_device"
    if blocked == "key":
        folder = folder / good.parent.name
    folder.parent.mkdir(parents=True)
    folder.write_text("not a folder")
    # The compile itself is the previous test's; here cpp_extension.load loads and hands back a
    # copy of the good library, and everything else (checksum, move into place) runs for real.
    prelude = f"""
import shutil, torch, torch.utils.cpp_extension as cpp_extension
def load(name, sources, build_directory, **kwargs):
    built = shutil.copy({str(good)!r}, build_directory + "/copied.so")
    torch.ops.load_library(built)  # as cpp_extension.load does
    return built
cpp_extension.load = load
"""
    result, stderr = run_install({"ATTN_OVERLAY_CACHE_DIR": str(tmp_path / "cache")}, prelude)
    warnings = _fake_device_warnings(stderr)
    assert len(warnings) == 1, stderr
    assert str(folder) in warnings[0] and "is a file" in warnings[0]
    assert result["backend"] == "cpp"
    assert Path(result["library"]).parent.is_dir()
    assert fake_device._library_problem(Path(result["library"])) is None
