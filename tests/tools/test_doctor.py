"""``python -m overlay.doctor``: the real runs on this machine, and the parts around them.

The doctor is run for real, as users run it: a subprocess (or, where the test needs to look
inside, ``main()`` in this process), whose scenario subprocesses build tiny models and generate.
With no accelerator here it runs on the host-memory fake device, where the device-placement bug
fails for real on an affected transformers. What each scenario must show depends on the
installed release, read from package metadata and from the patch files' own version ranges:

- ``host-inputs-static`` (patch ``device-move-nested``): fails without the overlay on affected
  releases (PyTorch's device-mismatch error, naming ``fakeaccel:0`` and ``cpu``), passes from
  5.20.0 on; passes with the overlay everywhere, with tokens identical to the reference runs;
- ``cache-dtype-static`` / ``cache-dtype-prefix`` (patch ``kv-cache-dtype``): no release fixes
  them, so they fail without the overlay on every release and pass with it;
- ``tp-prefill-chunk`` (patch ``static-cache-tp-heads``): only under torchrun; fails without the
  overlay on affected releases for the plans that leave attention unsharded.

The fake device's pure-Python backend (forced with a compiler that does not exist and an empty
cache folder) must give the same verdict as the C++ one, name itself and say why it was used.
Without torch or transformers the doctor says in one line what to install and exits 3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import overlay.doctor
from overlay.doctor import _env, _runner
from overlay.doctor._env import Accelerator, DeviceChoiceError, choose_device
from overlay.testing.harness import PatchUnderTest, heavy_imports
from tests.tools.test_environment import HPU_PLUGIN_VERSION, write_hpu_stand_in

# The doctor's own tests (a tool): the whole suite runs them; the release lanes run the patches'.
LANE = False
DEVICE_MOVE = PatchUnderTest("device_move")
KV_CACHE_DTYPE = PatchUnderTest("kv_cache_dtype")
TP_HEADS = PatchUnderTest("static_cache_tp_heads")
KEPT_CACHE = PatchUnderTest("kept_static_cache")
CHUNKED_PREFILL = PatchUnderTest("chunked_prefill")
DOCTOR_TIMEOUT_S = 900  # a whole doctor run; each of its subprocesses has its own timeout too
REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_NOTE = (
    "no accelerator found: running on the host-memory fake device `fakeaccel`, which reproduces "
    "device-placement bugs, not performance"
)


DEVICE_BUG = DEVICE_MOVE.affected
TP_BUG = TP_HEADS.affected
# The errors the patches declare, as the doctor's one-line summary starts them.
DEVICE_ERROR = "RuntimeError: " + DEVICE_MOVE.error("neuron:0 and cpu!", device="fakeaccel:0")
DTYPE_TEXT = KV_CACHE_DTYPE.error("index_copy_")
DTYPE_ERROR = "RuntimeError: " + DTYPE_TEXT
SDPA_DTYPE_ERROR = "RuntimeError: " + KV_CACHE_DTYPE.error("Expected query").partition(", but got")[0]
TP_ERROR = "RuntimeError: " + TP_HEADS.error("slice shapes").rstrip(".")


def _machine_has_accelerator() -> bool:
    accelerators, _ = _env.detect_accelerators()
    return bool(accelerators)


def _doctor(args: list[str], tmp_path, env: dict | None = None, launcher: list[str] | None = None):
    """Runs the doctor as a program; (exit code, parsed --json report, stderr)."""
    command = (launcher or [sys.executable, "-m"]) + ["overlay.doctor", "--json", *args]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env=_this_checkout_first(env),
        capture_output=True,
        text=True,
        timeout=DOCTOR_TIMEOUT_S,
    )
    assert done.stdout.strip(), f"no report; stderr:\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(done.stdout), done.stderr


def _this_checkout_first(env: dict | None = None) -> dict:
    """The environment of a doctor subprocess: this checkout's ``overlay`` first on its path,
    also where the interpreter has a (non-editable) copy of the package installed."""
    full = dict(os.environ, **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full.get("PYTHONPATH")) if p)
    return full


def _scenario(report: dict, scenario_id: str) -> dict:
    (found,) = [s for s in report["scenarios"] if s["id"] == scenario_id]
    return found


def _cases(result: dict) -> dict[str, dict]:
    return {case["name"]: case for case in result["cases"]}


def _assert_fixed_with_identical_tokens(scenario: dict) -> None:
    with_ = scenario["with"]
    assert with_["ok"], with_["error"]
    assert with_["overlay_active"] is True
    for case in with_["cases"]:
        assert case["tokens"] == case["reference_tokens"], case["name"]
        # ... and equal to what stock transformers generates in its reference run.
        assert case["identical_to_stock_reference"] is True, case["name"]
    assert scenario["without"]["overlay_active"] is False
    assert scenario["status"] == "pass"


# -- the default run, on the fake device ------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_device_run(tmp_path_factory):
    """Every single-device scenario on the host-memory fake device. ``--device fake`` is what the
    doctor picks by itself on a machine without an accelerator (see the test below), and keeps
    this run the same on a machine that has one."""
    return _doctor(["--device", "fake"], tmp_path_factory.mktemp("doctor"))


def test_fake_device_run_reports_environment_and_says_plainly_what_the_device_is(fake_device_run):
    _, report, _ = fake_device_run
    env = report["environment"]
    assert env["packages"]["transformers"] == version("transformers")
    assert env["packages"]["torch"] == version("torch")
    assert env["device"]["device"] == "fakeaccel:0"
    assert env["device"]["kind"] == "fake"
    if not env["accelerators"]:
        assert env["device"]["notes"] == [FAKE_NOTE]
        assert FAKE_NOTE.split(":")[0] in overlay.doctor.render(report)
    ids = [s["id"] for s in report["overlay_status"]]
    assert {"device-move-nested", "kv-cache-dtype", "static-cache-tp-heads"} <= set(ids)
    assert all(s["state"] != "pending" for s in report["overlay_status"])


def test_host_inputs_with_static_cache_fails_stock_where_affected_and_passes_with_overlay(fake_device_run):
    _, report, _ = fake_device_run
    scenario = _scenario(report, "host-inputs-static")
    without = _cases(scenario["without"])
    controls = [name for name, case in without.items() if case["control"]]
    assert controls == ["llama, static cache (control)", "gemma3, dynamic cache (control)"]
    for name in controls:
        assert without[name]["ok"], without[name]["error"]
    buggy = ["gemma3, static cache", "qwen3, static cache"]
    if DEVICE_BUG:
        for name in buggy:
            assert not without[name]["ok"]
            assert without[name]["error"].startswith(DEVICE_ERROR)
        assert scenario["fixed_by_overlay"] is True
        assert scenario["with"]["patches"] == {"device-move-nested": "applied"}
    else:  # fixed upstream: stock passes, and the overlay steps aside
        assert scenario["without"]["ok"], scenario["without"]["error"]
        assert scenario["with"]["patches"] == {"device-move-nested": "fixed upstream"}
    _assert_fixed_with_identical_tokens(scenario)


def test_cache_in_another_dtype_fails_stock_on_every_release_and_passes_with_overlay(fake_device_run):
    _, report, _ = fake_device_run
    static = _scenario(report, "cache-dtype-static")
    for case in static["without"]["cases"]:
        assert case["error"] == DTYPE_ERROR, case["name"]
    _assert_fixed_with_identical_tokens(static)

    prefix = _scenario(report, "cache-dtype-prefix")
    for name, case in _cases(prefix["without"]).items():
        if "(eager)" in name:
            # Not among kv-cache-dtype's errors: the eager kernel names the dtypes the other way round here.
            assert case["error"] == "RuntimeError: expected scalar type Float but found BFloat16"
        else:
            assert case["error"].startswith(SDPA_DTYPE_ERROR)
    _assert_fixed_with_identical_tokens(prefix)
    assert prefix["with"]["patches"]["kv-cache-dtype"] == "applied"


def test_exit_code_is_zero_when_every_scenario_passes_with_overlay(fake_device_run):
    returncode, report, _ = fake_device_run
    assert report["ok"] is True
    assert returncode == 0
    tp = _scenario(report, "tp-prefill-chunk")
    assert tp["status"] == "skipped" and "torchrun" in tp["why"]


def test_text_report_is_the_verdict_table(fake_device_run):
    _, report, _ = fake_device_run
    text = overlay.doctor.render(report)
    lines = text.splitlines()
    expected_without = "FAIL (2/4 cases)" if DEVICE_BUG else "pass (4/4 cases)"
    assert any(line.split() == ["host-inputs-static", *expected_without.split(), "pass", "(4/4", "cases)"] for line in lines), text
    assert any(line.split()[:4] == ["cache-dtype-static", "FAIL", "(0/3", "cases)"] for line in lines), text
    assert any(line.split()[:2] == ["tp-prefill-chunk", "skipped:"] and line.endswith("needs torchrun with world size > 1")
               for line in lines), text
    assert DTYPE_TEXT.partition(", but got")[0] in text
    ran = [s for s in report["scenarios"] if s["status"] != "skipped"]
    assert lines[-1].startswith(f"result: every scenario passes with the overlay ({len(ran)} of {len(ran)})")


def test_the_report_names_the_fake_backend_and_the_cache_folder(fake_device_run):
    from overlay.testing.fake_device import cache_root

    _, report, _ = fake_device_run
    fake = report["environment"]["device"]["fake_device"]
    lines = overlay.doctor.render(report).splitlines()
    text = " ".join(overlay.doctor.render(report).split())  # the long rows wrap
    assert fake["cache_dir"] == str(cache_root())
    (cache_line,) = [line for line in lines if line.split()[:2] == ["cache", "folder"]]
    assert cache_line.split()[2] == fake["cache_dir"]
    if fake["backend"] == "cpp":
        library = Path(fake["library"])
        assert library.is_file() and library.is_relative_to(fake["cache_dir"])
        assert fake["fallback_reason"] is None
        assert fake["backend_text"] == f"C++ backend (cached in {library.parent})"
        assert fake["cache_bytes"] >= library.stat().st_size
        assert f"pip uninstall leaves it: rm -rf {fake['cache_dir']} removes it)" in text
    else:  # no C++ toolchain on this machine: the reason is named instead
        assert fake["library"] is None and fake["fallback_reason"]
        assert fake["backend_text"] == f"pure-Python backend, because {fake['fallback_reason']}"
    assert any(line.split()[:3] == ["fake", "backend", fake["backend_text"].split()[0]] for line in lines)


def test_without_a_device_flag_the_doctor_picks_an_accelerator_or_the_fake_device():
    accelerators, _ = _env.detect_accelerators()
    choice = choose_device(None, accelerators, prepare_fake=False)
    if accelerators:
        assert choice.kind == "accelerator"
    else:
        assert (choice.device, choice.kind, choice.notes) == ("fakeaccel:0", "fake", [FAKE_NOTE])


# -- the pure-Python fake device backend --------------------------------------------------------------


@pytest.fixture(scope="module")
def python_backend_run(tmp_path_factory):
    """``cache-dtype-prefix`` on the fake device's pure-Python backend, forced the way a machine
    without build tools forces it: a C++ compiler that does not exist and an empty cache folder.
    The scenario's bug is a dtype mismatch after ``model.to(torch.bfloat16)``; the pure-Python
    backend once kept computing in float32 there, and the stock run passed (4/4)."""
    folder = tmp_path_factory.mktemp("doctor-python-backend")
    env = {"CXX": str(folder / "no-such-compiler"), "ATTN_OVERLAY_CACHE_DIR": str(folder / "cache")}
    return (*_doctor(["--device", "fake", "--scenario", "cache-dtype-prefix"], folder, env=env), folder)


def test_python_backend_names_itself_and_why_it_is_used(python_backend_run):
    _, report, _, folder = python_backend_run
    fake = report["environment"]["device"]["fake_device"]
    assert fake["backend"] == "python"
    assert fake["fallback_reason"].startswith(f"no C++ compiler found ('{folder / 'no-such-compiler'}' is not on PATH")
    assert fake["library"] is None
    assert fake["cache_dir"] == str(folder / "cache")
    assert report["environment"]["device"]["description"] == "host-memory fake device, pure-Python backend"
    text = " ".join(overlay.doctor.render(report).split())  # the long rows wrap
    assert "fake backend pure-Python backend, because no C++ compiler found" in text
    assert f"cache folder {folder / 'cache'} (not created)" in text


def test_python_backend_reproduces_the_dtype_bug_as_the_cpp_backend_does(python_backend_run):
    # A real reproduction: every case fails on stock with the errors of a real device (the same
    # ones the C++ backend and CUDA give), and passes with the overlay with identical tokens.
    returncode, report, _, _ = python_backend_run
    prefix = _scenario(report, "cache-dtype-prefix")
    for name, case in _cases(prefix["without"]).items():
        assert not case["ok"], name
        if "(eager)" in name:
            assert case["error"] == "RuntimeError: expected scalar type Float but found BFloat16"
        else:
            assert case["error"].startswith(SDPA_DTYPE_ERROR)
    assert prefix["fixed_by_overlay"] is True
    _assert_fixed_with_identical_tokens(prefix)
    assert returncode == 0
    text = overlay.doctor.render(report)
    assert any(line.split()[:4] == ["cache-dtype-prefix", "FAIL", "(0/4", "cases)"] for line in text.splitlines()), text
    assert text.splitlines()[-1].startswith(
        "result: every scenario passes with the overlay (1 of 1); 1 fail without it (cache-dtype-prefix)"
    )


def test_python_and_cpp_backends_generate_the_same_tokens(python_backend_run, fake_device_run):
    _, cpp_report, _ = fake_device_run
    if cpp_report["environment"]["device"]["fake_device"]["backend"] != "cpp":
        pytest.skip("the C++ fake device cannot be built here: nothing to compare the pure-Python backend with")
    _, python_report, _, _ = python_backend_run
    cpp, python = _scenario(cpp_report, "cache-dtype-prefix"), _scenario(python_report, "cache-dtype-prefix")
    for mode in ("without", "with"):
        for name, case in _cases(cpp[mode]).items():
            other = _cases(python[mode])[name]
            assert (other["ok"], other["error"]) == (case["ok"], case["error"]), (mode, name)
            tokens = (case.get("tokens"), case.get("reference_tokens"))
            assert (other.get("tokens"), other.get("reference_tokens")) == tokens, (mode, name)


# Why the C++ backend was not used, as the doctor reports it: each cause in its own words.


def _cpp_unavailable_reason(monkeypatch, cache_dir: Path, **env: str) -> str:
    from overlay.testing import fake_device

    monkeypatch.setenv("ATTN_OVERLAY_CACHE_DIR", str(cache_dir))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(fake_device.FakeDeviceUnavailable) as caught:
        fake_device._load_cpp_backend(retry_failed_build=False)  # builds or loads nothing here
    return fake_device._one_line_reason(caught.value)


def test_reason_no_compiler_and_no_ninja(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    compiler = str(tmp_path / "no-such-c++")
    assert _cpp_unavailable_reason(monkeypatch, tmp_path / "cache", CXX=compiler).startswith(
        f"no C++ compiler found ({compiler!r} is not on PATH; set CXX to one)"
    )
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    reason = _cpp_unavailable_reason(monkeypatch, tmp_path / "cache", CXX=sys.executable)  # a program that exists
    assert reason.startswith("ninja missing (pip install ninja), and no cached build in ")


def test_reason_cache_folder_not_writable(monkeypatch, tmp_path):
    from overlay.testing import fake_device

    if fake_device._missing_build_tools():
        pytest.skip(f"no C++ build tools here: {fake_device._missing_build_tools()}")
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder cannot be made inside a file, also not by root
    reason = _cpp_unavailable_reason(monkeypatch, blocker / "cache")
    folder = blocker / "cache" / "fake_device"
    assert reason.startswith(f"the cache folder {folder} is not usable (NotADirectoryError")
    assert reason.endswith("set ATTN_OVERLAY_CACHE_DIR to a writable folder")


def test_reason_compile_error_is_the_compilers_first_error_line(monkeypatch, tmp_path):
    from overlay.testing import fake_device

    if fake_device._missing_build_tools():
        pytest.skip(f"no C++ build tools here: {fake_device._missing_build_tools()}")
    # A compiler that reports its version like the real one and fails every compile.
    compiler = tmp_path / "failing-c++"
    compiler.write_text(
        "#!/bin/sh\ncase \"$*\" in *-c\\ *) ;; *) exec c++ \"$@\";; esac\n"
        "echo 'fake_device.cpp:1:1: error: simulated compile error' >&2\nexit 1\n"
    )
    compiler.chmod(0o755)
    error = "fake_device.cpp:1:1: error: simulated compile error"
    first = _cpp_unavailable_reason(monkeypatch, tmp_path / "cache", CXX=str(compiler))
    assert first == f"the C++ build failed: {error}"
    # Later processes do not build again; they say why the earlier build failed.
    again = _cpp_unavailable_reason(monkeypatch, tmp_path / "cache", CXX=str(compiler))
    assert again.startswith(f"an earlier build failed: RuntimeError: {error} (see ")


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"ATTN_OVERLAY_CACHE_DIR": "/srv/overlay-cache", "XDG_CACHE_HOME": "/xdg"}, "/srv/overlay-cache"),
        ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/attn-overlay"),
        ({"XDG_CACHE_HOME": "relative/cache"}, "~/.cache/attn-overlay"),  # the XDG spec: ignored
        ({}, "~/.cache/attn-overlay"),
    ],
)
def test_cache_folder_follows_attn_overlay_cache_dir_then_xdg(monkeypatch, env, expected):
    from overlay.testing.fake_device import cache_root, fake_device_cache_dir

    for name in ("ATTN_OVERLAY_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cache_root() == Path(os.path.expanduser(expected))
    assert fake_device_cache_dir() == cache_root() / "fake_device"


# -- without torch or transformers ---------------------------------------------------------------------

# Runs the doctor with the named modules unimportable, as in an environment without them.
_HIDING_RUNNER = r"""
import runpy, sys
hidden = set(sys.argv[1].split(","))

class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hidden())
sys.argv = ["overlay.doctor", *sys.argv[2:]]
runpy.run_module("overlay.doctor", run_name="__main__", alter_sys=True)
"""


def _doctor_without(modules: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _HIDING_RUNNER, modules, *args],
        cwd=REPO_ROOT,
        env=_this_checkout_first(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "hidden,says",
    [
        ("torch", "torch is not installed"),
        ("transformers", "transformers is not installed"),
        ("torch,transformers", "torch and transformers are not installed"),
    ],
)
def test_without_torch_or_transformers_one_line_says_what_to_install_and_exit_code_is_3(hidden, says):
    done = _doctor_without(hidden, "--json")
    assert done.returncode == overlay.doctor.EXIT_MISSING_DEPENDENCY == 3, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"python -m overlay.doctor: cannot run here: {says} for the Python at {sys.executable}")
    for module in hidden.split(","):
        assert f'"{module}==<the release you use>"' in line.partition("pip install ")[2], line


def test_help_runs_without_torch_and_states_the_exit_codes():
    done = _doctor_without("torch,transformers", "--help")
    assert done.returncode == 0, done.stderr
    help_text = " ".join(done.stdout.split())
    assert "3 cannot run here: torch or transformers is missing" in help_text
    assert "Exit codes: 0" in overlay.doctor.__doc__ and "3 cannot run here" in " ".join(overlay.doctor.__doc__.split())


# -- --device cpu, a failing run, progress lines -----------------------------------------------------


def test_device_cpu_cannot_show_the_device_bug_and_a_failing_with_run_exits_1(monkeypatch, capsys):
    """On the CPU the host-side inputs already sit on the model's device, so the host-input
    scenario passes even on stock transformers; the doctor says why instead of claiming a fix.
    With ``kv-cache-dtype`` disabled the dtype scenario fails with the overlay too: exit code 1.
    Runs ``main()`` in this process (the CPU needs no fake device here), on a terminal."""
    monkeypatch.setenv("ATTN_OVERLAY_DISABLE", "kv-cache-dtype")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    returncode = overlay.doctor.main(
        ["--device", "cpu", "--json", "--scenario", "host-inputs-static", "--scenario", "cache-dtype-static"]
    )
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert returncode == 1
    assert report["ok"] is False
    assert report["environment"]["device"]["device"] == "cpu"
    (note,) = report["environment"]["device"]["notes"]
    assert "cannot reproduce the device-placement bug here" in note

    host = _scenario(report, "host-inputs-static")
    assert host["without"]["ok"] and host["with"]["ok"]
    assert host["fixed_by_overlay"] is False

    dtype = _scenario(report, "cache-dtype-static")
    assert dtype["status"] == "fail"
    assert dtype["with"]["patches"] == {"kv-cache-dtype": "disabled"}
    assert DTYPE_TEXT.partition(", but got")[0] in dtype["with"]["error"]

    # One progress line per scenario run, on stderr, on a terminal.
    progress = [line for line in captured.err.splitlines() if line.startswith("doctor: [")]
    assert len(progress) == 4, captured.err
    assert any("cache-dtype-static, with overlay: FAIL" in line for line in progress)
    assert "result: 1 of 2 scenarios fail with the overlay (cache-dtype-static)" in overlay.doctor.render(report)


# -- tensor parallelism under torchrun --------------------------------------------------------------


def test_tensor_parallel_scenario_under_torchrun(tmp_path):
    """Two ranks (gloo on the CPU) launched by torchrun, each a doctor process; the scenario's
    rank subprocesses meet through torchrun's store."""
    returncode, report, stderr = _doctor(
        ["--scenario", "tp-prefill-chunk", "--timeout", "400"],
        tmp_path,
        launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"],
    )
    assert returncode == 0, stderr[-3000:]
    scenario = _scenario(report, "tp-prefill-chunk")
    assert report["environment"]["world_size"] == 2
    assert len(scenario["with"]["ranks"]) == 2
    without = _cases(scenario["without"])
    unsharded = ["MLP-only plan (attention unsharded)", "q/k/v colwise_gather_output (OLMo2-style)"]
    control = "attention colwise (control: heads really sharded)"
    assert without[control]["ok"], without[control]["error"]
    if TP_BUG:
        for name in unsharded:
            assert without[name]["error"].startswith(TP_ERROR), without[name]["error"]
        assert scenario["with"]["patches"] == {"static-cache-tp-heads": "applied"}
    else:
        assert scenario["without"]["ok"], scenario["without"]["error"]
        assert scenario["with"]["patches"] == {"static-cache-tp-heads": "fixed upstream"}
    _assert_fixed_with_identical_tokens(scenario)


# -- CUDA (the lent GPU) ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_run(tmp_path):
    returncode, report, stderr = _doctor(["--device", "cuda"], tmp_path)
    assert report["environment"]["device"]["device"] == "cuda:0"
    host = _scenario(report, "host-inputs-static")
    if DEVICE_BUG:
        for name in ("gemma3, static cache", "qwen3, static cache"):
            error = _cases(host["without"])[name]["error"]
            # SDPA's CUDA kernels word it in either of these ways.
            assert ("cuda:0 and cpu" in error) or ("attn_bias is on cpu" in error), error
    for scenario_id in ("host-inputs-static", "cache-dtype-static", "cache-dtype-prefix"):
        _assert_fixed_with_identical_tokens(_scenario(report, scenario_id))
    assert returncode == 0, stderr[-3000:]


# -- the parts around the runs (in this process, no subprocess) ------------------------------------

ACCELERATORS = [
    Accelerator("cuda:0", "cuda", "GPU A (CUDA)"),
    Accelerator("cuda:1", "cuda", "GPU B (CUDA)"),
    Accelerator("mps:0", "mps", "Apple Metal (MPS)"),
]


def test_choose_device_prefers_cuda_and_follows_the_local_rank():
    assert choose_device(None, ACCELERATORS, prepare_fake=False).device == "cuda:0"
    assert choose_device(None, ACCELERATORS, local_rank=1, prepare_fake=False).device == "cuda:1"
    assert choose_device("cuda", ACCELERATORS, prepare_fake=False).device == "cuda:0"
    assert choose_device("cuda:1", ACCELERATORS, prepare_fake=False).device == "cuda:1"
    assert choose_device("mps", ACCELERATORS, prepare_fake=False).device == "mps:0"


def test_choose_device_fake_names_and_cpu():
    neuron = choose_device("fake:neuron", [], prepare_fake=False)
    assert (neuron.device, neuron.kind, neuron.fake_name) == ("neuron:0", "fake", "neuron")
    assert "`neuron`" in neuron.notes[0]
    on_gpu_machine = choose_device("fake", ACCELERATORS, prepare_fake=False)
    assert on_gpu_machine.notes[0].startswith("--device fake: running on the host-memory fake device `fakeaccel`")
    cpu = choose_device("cpu", ACCELERATORS, prepare_fake=False)
    assert (cpu.device, cpu.kind) == ("cpu", "cpu")


def test_choose_device_refuses_a_device_that_is_not_here():
    with pytest.raises(DeviceChoiceError, match=r"'xla': not found on this machine \(found: cuda:0, cuda:1, mps:0\).*--device fake:xla"):
        choose_device("xla", ACCELERATORS, prepare_fake=False)
    with pytest.raises(DeviceChoiceError, match="not found"):
        choose_device("cuda:7", ACCELERATORS, prepare_fake=False)
    with pytest.raises(DeviceChoiceError, match="index must be a number"):
        choose_device("cuda:x", ACCELERATORS, prepare_fake=False)


# -- Intel Gaudi (HPU): a plug-in, probed in a subprocess like Neuron's and Ascend's ------------------------


@pytest.fixture
def gaudi_stand_in(tmp_path, monkeypatch):
    """Puts a stand-in ``habana_frameworks.torch`` (see ``write_hpu_stand_in``) where this process
    and the doctor's probe subprocess find it; afterwards its modules leave ``sys.modules`` (finding
    the plug-in imports its parent package), so later detection does not see it."""

    def install(**kwargs) -> Path:
        folder = write_hpu_stand_in(tmp_path / "gaudi", **kwargs)
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))
        return folder

    yield install
    for name in [m for m in sys.modules if m.partition(".")[0] == "habana_frameworks"]:
        del sys.modules[name]


def test_gaudi_cards_are_found_through_their_plugin_and_chosen_with_device_hpu(gaudi_stand_in):
    gaudi_stand_in(cards=2)
    assert "habana_frameworks.torch" in _env.installed_plugins()
    accelerators, problems = _env.detect_accelerators()
    assert problems == []
    hpus = [a.as_dict() for a in accelerators if a.type == "hpu"]
    assert hpus == [
        {"device": f"hpu:{i}", "type": "hpu", "name": "GAUDI2 (Intel Gaudi)", "plugins": ["habana_frameworks.torch"]}
        for i in (0, 1)
    ]
    chosen = choose_device("hpu", accelerators, prepare_fake=False)
    assert (chosen.device, chosen.kind, chosen.plugins) == ("hpu:0", "accelerator", ["habana_frameworks.torch"])
    assert choose_device("hpu:1", accelerators, prepare_fake=False).device == "hpu:1"
    only_gaudi = [a for a in accelerators if a.type == "hpu"]  # a machine with a GPU would prefer it
    assert choose_device(None, only_gaudi, local_rank=1, prepare_fake=False).device == "hpu:1"
    assert _runner._default_jobs(chosen) == 1  # a Gaudi card belongs to one process at a time
    assert _env.package_versions()["habana-torch-plugin"] == HPU_PLUGIN_VERSION


def test_a_gaudi_plugin_that_does_not_import_is_a_problem_not_a_crash(gaudi_stand_in):
    gaudi_stand_in(broken="no Gaudi driver loaded")
    accelerators, problems = _env.detect_accelerators()
    assert [a for a in accelerators if a.type == "hpu"] == []
    assert problems == ["habana_frameworks.torch: cannot import: RuntimeError: no Gaudi driver loaded"]
    with pytest.raises(DeviceChoiceError, match=r"'hpu': not found on this machine.*--device fake:hpu"):
        choose_device("hpu", accelerators, prepare_fake=False)


def test_unknown_device_on_the_command_line_exits_2(capsys):
    assert overlay.doctor.main(["--device", "tpu9"]) == 2
    assert "--device 'tpu9': not found on this machine" in capsys.readouterr().err


def test_unknown_scenario_is_refused():
    with pytest.raises(ValueError, match="unknown scenario"):
        _runner.select_scenarios(["no-such-scenario"])
    with pytest.raises(SystemExit):
        overlay.doctor.main(["--scenario", "no-such-scenario"])


def test_exit_code_follows_the_with_overlay_verdict(monkeypatch, capsys):
    report = {"ok": True, "environment": {"rank": 0}}
    monkeypatch.setattr(overlay.doctor, "run_doctor", lambda *a, **k: report)
    monkeypatch.setattr(overlay.doctor, "render", lambda r: "rendered")
    assert overlay.doctor.main([]) == 0
    report["ok"] = False
    assert overlay.doctor.main([]) == 1
    # Only rank 0 of a torchrun job prints the report.
    report["environment"]["rank"] = 1
    capsys.readouterr()
    assert overlay.doctor.main([]) == 1
    assert capsys.readouterr().out == ""


def test_run_doctor_is_the_api(monkeypatch):
    import overlay

    calls = []
    monkeypatch.setattr(_runner, "run", lambda device, **kwargs: calls.append((device, kwargs)) or {"ok": True})
    assert overlay.run_doctor(device="cuda", scenarios=["cache-dtype-static"]) == {"ok": True}
    assert calls[0][0] == "cuda" and calls[0][1]["scenarios"] == ["cache-dtype-static"]


def test_importing_the_doctor_imports_neither_torch_nor_transformers():
    assert heavy_imports("overlay.doctor") == []


def test_every_scenario_is_proven_by_a_patch_and_every_declared_scenario_exists():
    # The patches say which scenarios prove them (Patch.doctor); the doctor keeps no list of ids.
    from overlay.doctor._scenarios import BY_ID, SCENARIOS, patches_proving
    from overlay.engine import known_patches

    patches = known_patches()
    declared = {scenario_id for p in patches for scenario_id in p.doctor}
    assert declared <= set(BY_ID), f"patches name unknown doctor scenarios: {sorted(declared - set(BY_ID))}"
    for scenario in SCENARIOS:
        assert patches_proving(scenario.id, patches), f"no patch names the doctor scenario {scenario.id!r}"


@pytest.mark.parametrize(
    "release,not_here",
    [
        ("5.18.0", set()),  # every scenario's bug is there
        ("5.24.0", set()),  # fixed upstream: still run (stock must pass, and so must the overlay)
        ("4.0.0", {"host-inputs-static", "cache-dtype-static", "cache-dtype-prefix", "kept-static-cache", "chunked-prefill",
                   "tp-prefill-chunk", "gemma4-prefill-chunk", "zero-kv-shared-static-cache"}),
        ("4.57.6", {"host-inputs-static", "tp-prefill-chunk", "gemma4-prefill-chunk"}),  # the bugs of 5.13+ code
        ("4.55.4", {"host-inputs-static", "tp-prefill-chunk", "gemma4-prefill-chunk", "zero-kv-shared-static-cache"}),
    ],
)
def test_scenarios_whose_bug_is_not_in_the_release_are_skipped_with_the_reason(monkeypatch, release, not_here):
    from overlay import engine
    from overlay.doctor._scenarios import SCENARIOS

    monkeypatch.setattr(engine, "installed_transformers_version", lambda: release)
    skipped = _runner._not_on_this_release(SCENARIOS)
    assert set(skipped) == not_here
    for why in skipped.values():
        assert why.startswith(f"outside the overlay's releases for it on transformers {release} (")
        assert "covers transformers" in why


def test_kept_static_cache_scenario_on_the_installed_release(fake_device_run):
    # Up to 5.14.x stock fails (the kept cache after .to(dtype) / .to(device), and up to 5.12.x
    # after a failed call); from 5.15.0 generate builds a cache per call and stock passes. Either
    # way the overlay passes, with the fresh model's tokens.
    _, report, _ = fake_device_run
    kept = _scenario(report, "kept-static-cache")
    assert kept["with"]["ok"], kept["with"]
    assert [c["name"] for c in kept["with"]["cases"]] == [
        f"{kind}, {case}" for kind in ("llama", "gemma3")
        for case in ("kept cache after .to(torch.bfloat16)", "kept cache after .to(fakeaccel:0)", "valid call after a failed one")
    ]
    fixed_upstream = KEPT_CACHE.fixed_upstream
    assert kept["without"]["ok"] is fixed_upstream
    assert kept["fixed_by_overlay"] is (not fixed_upstream)


def test_chunked_prefill_scenario_on_the_installed_release(fake_device_run):
    # 5.0.0rc1 - 5.2.0: stock fails (the static cache's last write past its end; 5.0.0 also refuses
    # the default cache); up to 5.20.2 the kept prefix cache is chunked from position 0 again (other
    # tokens); 5.21.0 on: fixed upstream, stock passes. The overlay passes either way.
    _, report, _ = fake_device_run
    scenario = _scenario(report, "chunked-prefill")
    assert [c["name"] for c in scenario["with"]["cases"]] == [
        "llama, static cache", "gemma3, static cache", "llama, default cache", "llama, kept prefix cache",
    ]
    fixed_upstream = CHUNKED_PREFILL.fixed_upstream
    assert scenario["without"]["ok"] is fixed_upstream
    assert scenario["with"]["patches"] == {"chunked-prefill": "fixed upstream" if fixed_upstream else "applied"}
    _assert_fixed_with_identical_tokens(scenario)


# -- ATTN_OVERLAY_FIXES (issue 40) -----------------------------------------------------------------


def test_fixes_errors_skips_a_scenario_only_output_fixes_prove_and_says_why(monkeypatch):
    # The doctor's children inherit ATTN_OVERLAY_FIXES (engine.apply reads it there): a scenario that
    # only patches the setting leaves out prove would fail by design. It is skipped, naming them;
    # scenarios of errors-only fixes still run. Decided for the installed release by the engine's gate.
    from overlay import config, engine
    from overlay.doctor._scenarios import SCENARIOS

    patches = engine.known_patches()
    version_here = engine.installed_transformers_version()
    monkeypatch.setenv(config.FIXES_VAR, config.FIXES_ALL)
    every = _runner._not_on_this_release(SCENARIOS)
    monkeypatch.setenv(config.FIXES_VAR, config.FIXES_ERRORS)
    errors_only = _runner._not_on_this_release(SCENARIOS)
    assert not any(config.FIXES_VAR in why for why in every.values())
    for scenario in SCENARIOS:
        proven_by = [p for p in patches if scenario.id in p.doctor]
        left_out = [p for p in proven_by if engine.gate(p, version_here)[0] == engine.PENDING and p.changes != "errors"]
        if proven_by and len(left_out) == len(proven_by):
            why = errors_only[scenario.id]
            assert why.startswith(f"{config.FIXES_VAR}={config.FIXES_ERRORS} disables "), why
            assert all(p.id in why for p in left_out) and "change the output of calls that complete" in why
        else:
            assert config.FIXES_VAR not in errors_only.get(scenario.id, ""), scenario.id
    # chunked-prefill is proven by one patch, which changes both errors and output: where it applies,
    # the setting skips it.
    chunked = next(p for p in patches if p.id == "chunked-prefill")
    if engine.gate(chunked, version_here)[0] == engine.PENDING:
        assert "chunked-prefill" in errors_only and "chunked-prefill" not in every
