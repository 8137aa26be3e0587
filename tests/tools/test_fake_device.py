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
BATTERY = r"""
import json, sys
import torch
torch.set_num_threads(1)
from overlay.testing import install_fake_device, fake_device_backend

backend, name = sys.argv[1], sys.argv[2]
device = install_fake_device(name, backend)
report = {"backend": fake_device_backend(), "device": str(device)}


def error_of(fn):
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


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


def test_there_is_a_single_device(report: dict) -> None:
    assert "single device, index 0" in report["placement"]["second_index_error"]


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
