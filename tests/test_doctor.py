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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

import overlay.doctor
from overlay.doctor import _env, _runner
from overlay.doctor._env import Accelerator, DeviceChoiceError, choose_device
from overlay.testing.harness import PatchUnderTest, heavy_imports

# The doctor's own tests (a tool): the whole suite runs them; the release lanes run the patches'.
LANE = False
DEVICE_MOVE = PatchUnderTest("device_move")
KV_CACHE_DTYPE = PatchUnderTest("kv_cache_dtype")
TP_HEADS = PatchUnderTest("static_cache_tp_heads")
KEPT_CACHE = PatchUnderTest("kept_static_cache")
CHUNKED_PREFILL = PatchUnderTest("chunked_prefill")
DOCTOR_TIMEOUT_S = 900  # a whole doctor run; each of its subprocesses has its own timeout too
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
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=DOCTOR_TIMEOUT_S,
    )
    assert done.stdout.strip(), f"no report; stderr:\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(done.stdout), done.stderr


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
    assert "tp-prefill-chunk    skipped: needs torchrun with world size > 1" in text
    assert DTYPE_TEXT.partition(", but got")[0] in text
    assert lines[-1].startswith("result: every scenario passes with the overlay (5 of 5)")


def test_without_a_device_flag_the_doctor_picks_an_accelerator_or_the_fake_device():
    accelerators, _ = _env.detect_accelerators()
    choice = choose_device(None, accelerators, prepare_fake=False)
    if accelerators:
        assert choice.kind == "accelerator"
    else:
        assert (choice.device, choice.kind, choice.notes) == ("fakeaccel:0", "fake", [FAKE_NOTE])


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
                   "tp-prefill-chunk"}),
        ("4.57.6", {"host-inputs-static", "chunked-prefill", "tp-prefill-chunk"}),  # the bugs of 5.x code
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
    # the default cache); 5.3.0 on: fixed upstream, stock passes. The overlay passes either way.
    _, report, _ = fake_device_run
    scenario = _scenario(report, "chunked-prefill")
    assert [c["name"] for c in scenario["with"]["cases"]] == ["llama, static cache", "gemma3, static cache", "llama, default cache"]
    fixed_upstream = CHUNKED_PREFILL.fixed_upstream
    assert scenario["without"]["ok"] is fixed_upstream
    assert scenario["with"]["patches"] == {"chunked-prefill": "fixed upstream" if fixed_upstream else "applied"}
    _assert_fixed_with_identical_tokens(scenario)
