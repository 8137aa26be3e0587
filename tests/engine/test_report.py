"""What the overlay fixed, per process: ``overlay.fired()`` and ``ATTN_OVERLAY_REPORT=1``.

Each patch's own tests check that its slow path counts (and its hot path does not); here the
mechanism: the counts, the exit report with the upgrade advice from the patch metadata, and
silence when nothing fired.
"""

from __future__ import annotations

import os
import subprocess
import sys

import overlay
from overlay import report

RECORD_THEN_EXIT = """
import overlay
overlay.apply()
from overlay import report
for _ in range(3):
    report.record("device-move-nested", "moved nested tensors to neuron:0")
report.record("kv-cache-dtype", "cast a float32 cache for bfloat16 attention")
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)


def test_fired_counts_calls_per_patch_and_reset_forgets():
    report.reset()
    try:
        report.record("x", "moved a")
        report.record("x", "moved a")
        report.record("x", "cast b")
        assert overlay.fired() == {"x": 3}
        assert report.fired_actions() == {"x": {"moved a": 2, "cast b": 1}}
    finally:
        report.reset()
    assert overlay.fired() == {}


def test_the_exit_report_names_each_patch_that_fired_with_upgrade_advice():
    done = _run(RECORD_THEN_EXIT, ATTN_OVERLAY_REPORT="1")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("attn-overlay:")]
    assert lines == [
        "attn-overlay: device-move-nested fired in 3 call(s): moved nested tensors to neuron:0 (3x); "
        "fixed upstream in transformers 5.20.0",
        "attn-overlay: kv-cache-dtype fired in 1 call(s): cast a float32 cache for bfloat16 attention (1x); "
        "no transformers release fixes this yet",
    ]


def test_an_idle_process_and_a_process_without_the_variable_print_nothing():
    idle = _run("import overlay; overlay.apply(); import transformers.cache_utils", ATTN_OVERLAY_REPORT="1")
    assert idle.returncode == 0 and "attn-overlay" not in idle.stderr, idle.stderr
    quiet = _run(RECORD_THEN_EXIT, ATTN_OVERLAY_REPORT="0")
    assert quiet.returncode == 0 and "fired" not in quiet.stderr, quiet.stderr


DISPLACE_THEN_EXIT = """
import importlib
import overlay
overlay.apply()
for patch in overlay.known_patches():
    importlib.import_module(patch.module)
# A target only one applied patch replaces (several patches can fix one function, e.g.
# GenerationMixin.prepare_inputs_for_generation on 5.13 - 5.19): one patch displaced, one line.
patches = {p.id: p for p in overlay.known_patches()}
in_force = [patches[s.id] for s in overlay.status() if s.state == "applied"]
def replaced_by(target):
    return [p.id for p in in_force for t in p.targets
            if target.key in (t.key, t.inherited_from) or t.key == target.inherited_from]
patch, target = next((p, t) for p in in_force for t in p.targets if replaced_by(t) == [p.id])
applied = next(s for s in overlay.status() if s.id == patch.id)
owner_path, _, name = target.qualname.rpartition(".")
owner = importlib.import_module(target.module)
for part in owner_path.split("."):
    owner = getattr(owner, part)

def someone_elses(*args, **kwargs):
    raise AssertionError("not called")

setattr(owner, name, someone_elses)
print(applied.id)
"""


def test_the_exit_report_names_a_displaced_patch():
    done = _run(DISPLACE_THEN_EXIT, ATTN_OVERLAY_REPORT="1")
    assert done.returncode == 0, done.stderr
    patch_id = done.stdout.split()[-1]
    lines = [line for line in done.stderr.splitlines() if line.startswith("attn-overlay:")]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"attn-overlay: {patch_id} is displaced: ")
    assert "is now __main__.someone_elses, set after the overlay patched it" in lines[0]
