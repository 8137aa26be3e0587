"""Figure 9's split by object: the callgrind dump reader sums each object's own cost exactly.

The split is what makes part of the figure exact (native code does the same work in identical
calls, the interpreter does not), so the reader is held to the dump's own total: a dump it
misreads must raise, never give a plausible wrong split.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.bench.callgrind import INTERPRETER, NATIVE, object_costs, object_group, read_object_costs  # noqa: E402

# The format's parts the reader must get right: compressed names defined on first use (also in a
# cob= line, then referred to by id alone), a call's inclusive cost (the line after calls=, which
# belongs to the callee, not to the caller's object), relative and repeated positions (+2, *).
DUMP = """\
version: 1
creator: callgrind-3.19.0
pid: 4242
cmd: python -m scripts.bench.worker whole
part: 3
desc: I1 cache:
desc: Trigger: Client Request: 2|greedy|stock|0
positions: line
events: Ir
summary: 100
ob=(1) /usr/lib/libpython3.11.so.1.0
fl=(1) Python/ceval.c
fn=(1) _PyEval_EvalFrameDefault
10 30
+2 5
cob=(2) /opt/venv/torch/lib/libtorch_cpu.so
cfi=(2) aten/add.cpp
cfn=(2) at::add
calls=1 5
12 40
ob=(2)
fl=(2)
fn=(2)
5 40
ob=(3) /usr/lib/x86_64-linux-gnu/libc.so.6
fl=(3) malloc/malloc.c
fn=(3) malloc
* 25

totals: 100
"""


def test_each_object_counts_its_own_instructions(tmp_path):
    dump = tmp_path / "cg.4242.3"
    dump.write_text(DUMP)
    label, costs = object_costs(dump)
    assert label == "2|greedy|stock|0"
    # libpython 30 + 5 and libc 25; libtorch 40 once (the call's inclusive 40 is not the caller's).
    assert costs == {INTERPRETER: 60, NATIVE: 40}
    assert read_object_costs(tmp_path) == {"2|greedy|stock|0": costs}


def test_a_dump_read_wrongly_raises(tmp_path):
    dump = tmp_path / "cg.4242.3"
    dump.write_text(DUMP.replace("totals: 100", "totals: 140"))  # as if the call's cost were the caller's
    with pytest.raises(ValueError, match="sum to 100, the dump's totals say 140"):
        object_costs(dump)


@pytest.mark.parametrize(
    ("path", "group"),
    [
        ("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0", INTERPRETER),
        ("/usr/bin/python3.11", INTERPRETER),
        ("/usr/lib/python3.11/lib-dynload/_json.cpython-311-x86_64-linux-gnu.so", INTERPRETER),
        ("/usr/lib/x86_64-linux-gnu/libc.so.6", INTERPRETER),
        ("/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so", NATIVE),
        ("/venv/lib/python3.11/site-packages/torch/lib/libtorch_python.so", NATIVE),
        ("/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", NATIVE),
        ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", NATIVE),
    ],
)
def test_object_groups(path, group):
    assert object_group(path) == group


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_a_real_dump_adds_up(tmp_path):
    """A dump callgrind writes itself (a Python start, instrumented throughout) passes the reader's
    check against its total, and puts the start's work in the interpreter's group."""
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp_path}/cg.%p", sys.executable, "-S", "-c", "pass"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (dump,) = tmp_path.glob("cg.*")
    _, costs = object_costs(dump)
    assert costs[INTERPRETER] > costs[NATIVE] > 0
