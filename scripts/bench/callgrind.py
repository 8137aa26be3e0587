"""Figure 8: instructions per decoding step under ``valgrind --tool=callgrind``, overlay / without.

Timings on a shared machine move with whatever else runs; instruction counts do not. But whole
process counts still vary by ~0.2% between identical runs (hash seeds, import order, allocator
state), far more than a microsecond per step, so only the decode loop is counted:

- valgrind starts with instrumentation off (``--instr-atstart=no``): importing torch and
  transformers runs at valgrind's uninstrumented speed and counts nothing;
- a 5-line C helper (``mark.c`` below, compiled at run time with ``cc`` against valgrind's
  ``callgrind.h``) issues callgrind's client requests: ``region_start`` switches instrumentation
  on and zeroes the counters, ``region_stop(label)`` dumps them to a file labelled ``label``
  and switches instrumentation off again;
- each region is one ``model.generate()`` call of ``short`` or ``long`` new tokens (greedy,
  exactly that many, the figure-4 batch of 2 left-padded prompts); instructions per decoding step
  are ``(I[long] - I[short]) / (long - short)``, which cancels the prefill and ``generate``'s
  per-call set-up; the overlay is applied or reverted outside the regions.

Reported per setup (tiny Gemma 3, hidden 64, with 2 layers and static or dynamic cache, and with
8 layers and static cache): the ratio overlay / without of instructions per decoding step, and the
extra instructions per step divided by the layers; and, from the two static-cache models (2 and 8
layers, otherwise the same), the extra per layer (slope) and per step whatever the layers
(intercept, e.g. generate's input preparation). The width stays small: the overlay's cost is
Python per call, independent of the width, and a wide model's matmuls take minutes under valgrind
(figure 4 times the hidden-512 model instead).
Per call, too (the deterministic companion of figure 7, on figure 7's releases: one nox lane
each, ``--lanes``): the same three statements figure 7 times (``StaticCache.update``,
``DynamicCache.update``, ``get_interface`` + the SDPA call, built by
:func:`scripts.bench.percall.call_statements`), ``calls`` times in a loop per counted region,
overlay applied and reverted, in each release's own interpreter: extra instructions per call and
their sums per layer and step.
The garbage collector is off in the counted regions (collected just before each). Counts are near-deterministic: rounds repeat the measurement to show it.
Information only (the goals are figure 4's and figure 7's), and slow: importing torch under
valgrind takes one to a few minutes, so ``--smoke`` does a dry run of the worker without valgrind
(client requests are no-ops outside valgrind) and reports the figure as not run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import FIGURES, common, percall
from .common import NOT_RUN, OK, Case

FIGURE = 8
ID, TITLE = FIGURES[FIGURE]

MARK_C = r"""
#include <valgrind/callgrind.h>
void region_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void region_stop(const char *label) { CALLGRIND_DUMP_STATS_AT(label); CALLGRIND_STOP_INSTRUMENTATION; }
int on_valgrind(void) { return RUNNING_ON_VALGRIND; }
"""

SETUPS = {
    "tiny-static": ("Gemma3 hidden 64, 2 layers, static cache", {}, "static"),
    "tiny-dynamic": ("Gemma3 hidden 64, 2 layers, dynamic cache", {}, None),
    "tiny8-static": ("Gemma3 hidden 64, 8 layers, static cache", {"layers": 8}, "static"),
}


def settings(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"rounds": 1, "short_tokens": 1, "long_tokens": 2, "setups": ["tiny-static"], "calls": 5}
    return {"rounds": 2, "short_tokens": 8, "long_tokens": 16, "setups": list(SETUPS), "calls": 200}


def build_marker(folder: Path) -> tuple[Path | None, str]:
    """Compile the marker library; ``(None, why)`` when it cannot be."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc) to build the callgrind marker"
    source = folder / "mark.c"
    source.write_text(MARK_C)
    library = folder / "libmark.so"
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return None, f"cannot build the callgrind marker (valgrind/callgrind.h missing?): {done.stderr.strip()[-300:]}"
    return library, ""


def read_dumps(folder: Path) -> dict[str, int]:
    """``{label: instructions}`` of every dump a client request triggered."""
    counts: dict[str, int] = {}
    for path in folder.glob("cg.*"):
        label = total = None
        with path.open(errors="replace") as handle:
            for line in handle:
                if line.startswith("desc: Trigger: Client Request: "):
                    label = line.split(": ", 2)[2].split("Client Request: ", 1)[-1].strip()
                elif line.startswith("totals:"):
                    total = int(line.split()[1])
                    break
        if label is not None and total is not None:
            counts[label] = total
    return counts


#: The groups :func:`read_object_costs` sums a dump's instructions into, by the object (shared
#: library or executable) that ran them. ``interpreter``: CPython itself, its extension modules and
#: the C library (``malloc`` serves the interpreter's allocations); identical calls in one process
#: differ there (dict probes, the type attribute cache and the small-object allocator depend on
#: addresses and on what earlier calls left behind). ``native``: everything else (libtorch, c10, the
#: dynamic loader's thread-local lookups, libstdc++, libm, OpenMP): what torch does for each op and
#: attribute read, the same to the instruction in identical calls.
INTERPRETER, NATIVE = "interpreter", "native"


def object_group(path: str) -> str:
    """:data:`INTERPRETER` or :data:`NATIVE` for an object file named in a callgrind dump."""
    name = Path(path).name
    if name.startswith(("libpython", "python", "libc.so", "libc-")) or ".cpython-" in name:
        return INTERPRETER
    return NATIVE


def _compressed_name(value: str, names: dict[str, str]) -> str:
    """A callgrind name field: ``(id) name`` defines id, ``(id)`` refers to it, ``name`` is plain."""
    value = value.strip()
    if value.startswith("("):
        ident, _, name = value[1:].partition(")")
        name = name.strip()
        if name:
            names[ident] = name
            return name
        return names.get(ident, f"({ident})")
    return value


def object_costs(path: Path) -> tuple[str | None, dict[str, int]]:
    """One dump's label (the client request that wrote it) and its first event's self cost per
    :func:`object_group`. The sum is checked against the dump's own ``totals:`` line: a dump this
    reader does not understand raises instead of giving a wrong split."""
    label = totals = None
    costs = {INTERPRETER: 0, NATIVE: 0}
    names: dict[str, str] = {}
    group = NATIVE
    positions = 1
    call_cost_next = False
    with path.open(errors="replace") as handle:
        for line in handle:
            first = line[:1]
            if first.isdigit() or first in "+-*":
                if call_cost_next:  # the inclusive cost of the call just named: not this object's own
                    call_cost_next = False
                    continue
                fields = line.split()
                if len(fields) > positions:
                    costs[group] += int(fields[positions])
            elif line.startswith("ob="):
                group = object_group(_compressed_name(line[3:], names))
            elif line.startswith("cob="):
                _compressed_name(line[4:], names)  # may define an id a later ob= refers to
            elif line.startswith("calls="):
                call_cost_next = True
            elif line.startswith("positions:"):
                positions = len(line.split()) - 1
            elif line.startswith("desc: Trigger: Client Request: "):
                label = line.split("Client Request: ", 1)[1].strip()
            elif line.startswith("totals:"):
                totals = int(line.split()[1])
    if totals is not None and sum(costs.values()) != totals:
        raise ValueError(f"{path}: per-object costs sum to {sum(costs.values())}, the dump's totals say {totals}")
    return label, costs


def read_object_costs(folder: Path) -> dict[str, dict[str, int]]:
    """``{label: {group: instructions}}`` of every dump a client request triggered (see
    :func:`object_costs`)."""
    found = {}
    for path in folder.glob("cg.*"):
        label, costs = object_costs(path)
        if label is not None:
            found[label] = costs
    return found


def run(smoke: bool, options: dict[str, Any]) -> common.Figure:
    figure = common.Figure(FIGURE, ID, TITLE)
    payload = settings(smoke)
    figure.details = {"settings": payload}
    valgrind = shutil.which("valgrind")
    with tempfile.TemporaryDirectory(prefix="bench-callgrind-") as tmp:
        folder = Path(tmp)
        library, why = build_marker(folder)
        if library is None or valgrind is None:
            figure.status, figure.reason = NOT_RUN, why or "valgrind is not installed"
            return figure
        payload = {**payload, "marker": str(library)}
        lanes = percall.lane_pythons(options.get("lanes"), smoke)
        if smoke:
            # Dry run without valgrind: the client requests are no-ops, the code paths are checked.
            result = common.run_worker("callgrind", payload, timeout=300)
            figure.status = NOT_RUN
            figure.reason = ("smoke: dry run without valgrind (importing torch under callgrind takes minutes); "
                             "run without --smoke to count")
            figure.details["dry_run_regions"] = result["details"]["regions"]
            per_call = common.run_worker("callgrind_percall", payload, timeout=300, python=lanes[0][1])
            figure.details["dry_run_per_call_regions"] = per_call["details"]["regions"]
            return figure
        result, counts = _counted(valgrind, folder / "decode", "callgrind", payload, None)
        details = result["details"]
        figure.details.update(details)
        figure.details["instructions"] = counts
        figure.cases = _cases(payload, details, counts)
        figure.details["per_call"] = {}
        for lane, python in lanes:
            result, counts = _counted(valgrind, folder / lane, "callgrind_percall", payload, python)
            lane_details = {**result["details"], "instructions": counts}
            figure.details["per_call"][lane] = lane_details
            figure.cases += _per_call_cases(payload, lane_details, counts)
    return figure


def _counted(valgrind: str, folder: Path, worker: str, payload: dict[str, Any],
             python: str | None, read: Callable[[Path], dict[str, Any]] | None = None
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``worker`` under callgrind (instrumentation off until a region starts); its result and
    what ``read`` makes of the dumps (default :func:`read_dumps`: ``{region label: instructions}``)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [valgrind, "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/cg.%p",
               *common.worker_command(worker, payload, python=python)]
    env = common.worker_environment()
    env.update({"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"})
    done = subprocess.run(command, cwd=str(common.REPO), env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise common.WorkerError(f"{worker} worker exited {done.returncode}:\n{(done.stderr or done.stdout)[-3000:]}")
    return json.loads(lines[-1]), (read or read_dumps)(folder)


def _per_call_cases(payload: dict[str, Any], details: dict[str, Any], counts: dict[str, int]) -> list[Case]:
    """Extra instructions per call (overlay − reverted, per round) and their sums per layer and step."""
    calls, release = payload["calls"], details["transformers"]
    extra: dict[str, list[float]] = {}
    table = []
    for name, label in percall.CALLS.items():
        per_round = {variant: [counts[f"percall|{name}|{variant}|{r}"] / calls for r in range(payload["rounds"])]
                     for variant in ("overlay", "stock")}
        extra[name] = [a - b for a, b in zip(per_round["overlay"], per_round["stock"])]
        table.append({"call": label, "stock": common.summary(per_round["stock"])["median"],
                      "overlay": common.summary(per_round["overlay"])["median"],
                      "extra": common.summary(extra[name])["median"]})
    details["table"] = table
    cases = [Case(name=f"{release}: {label}: extra instructions per call", unit="instructions",
                  stats=common.summary(extra[name]), numerator="overlay", denominator="stock",
                  samples=[round(x, 1) for x in extra[name]],
                  note=f"{calls} calls per counted region; instructions per call: stock "
                       f"{row['stock']:,.0f}, overlay {row['overlay']:,.0f}")
             for (name, label), row in zip(percall.CALLS.items(), table)]
    for total, parts in percall.TOTALS.items():
        per_round = [sum(extra[p][i] for p in parts) for i in range(payload["rounds"])]
        cases.append(Case(name=f"{release}: per layer and step, {total} cache (update + attention): extra instructions",
                          unit="instructions", stats=common.summary(per_round), numerator="overlay",
                          denominator="stock", samples=[round(x, 1) for x in per_round],
                          note="sum of the calls' extra instructions, per round"))
    return cases


def _cases(payload: dict[str, Any], details: dict[str, Any], counts: dict[str, int]) -> list[Case]:
    short, long = payload["short_tokens"], payload["long_tokens"]
    cases = []
    per_step: dict[str, dict[str, list[float]]] = {}
    for setup in payload["setups"]:
        label, _, _ = SETUPS[setup]
        layers = details["layers"][setup]
        steps = {}
        for variant in ("overlay", "without"):
            steps[variant] = [
                (counts[f"{setup}|{variant}|{long}|{r}"] - counts[f"{setup}|{variant}|{short}|{r}"]) / (long - short)
                for r in range(payload["rounds"])
            ]
        per_step[setup] = steps
        ratios = [a / b for a, b in zip(steps["overlay"], steps["without"])]
        extra = [(a - b) / layers for a, b in zip(steps["overlay"], steps["without"])]
        note = (f"(I[{long} tokens] - I[{short} tokens]) / {long - short}; instructions per step: overlay "
                f"{common.summary(steps['overlay'])['median']:,.0f}, without {common.summary(steps['without'])['median']:,.0f}")
        cases.append(Case(name=f"{label}: instructions per decoding step, overlay / without", unit="ratio",
                          stats=common.summary(ratios), numerator="overlay", denominator="without", note=note,
                          samples=[round(r, 6) for r in ratios]))
        cases.append(Case(name=f"{label}: extra instructions per step / {layers} layers", unit="instructions",
                          stats=common.summary(extra), numerator="overlay", denominator="without",
                          note=f"(overlay - without) per decoding step / {layers} layers",
                          samples=[round(x, 1) for x in extra]))
    details["instructions_per_step"] = per_step
    if "tiny-static" in per_step and "tiny8-static" in per_step:
        # The overlay's extra per step is a per-step part (e.g. generate's input preparation) plus a
        # per-layer part (cache update, attention entry): the two static-cache models (same code,
        # 2 and 8 layers) separate them: slope = per layer, intercept = per step.
        small, large = details["layers"]["tiny-static"], details["layers"]["tiny8-static"]
        rounds = range(payload["rounds"])
        extra_small = [per_step["tiny-static"]["overlay"][r] - per_step["tiny-static"]["without"][r] for r in rounds]
        extra_large = [per_step["tiny8-static"]["overlay"][r] - per_step["tiny8-static"]["without"][r] for r in rounds]
        slope = [(b - a) / (large - small) for a, b in zip(extra_small, extra_large)]
        intercept = [a - small * k for a, k in zip(extra_small, slope)]
        cases.append(Case(name=f"static cache, per layer: extra instructions (slope {small} -> {large} layers)",
                          unit="instructions", stats=common.summary(slope), numerator="overlay",
                          denominator="without", samples=[round(x, 1) for x in slope],
                          note="(extra per step with 8 layers - with 2 layers) / 6, per round"))
        cases.append(Case(name="static cache, per step whatever the layers: extra instructions (intercept)",
                          unit="instructions", stats=common.summary(intercept), numerator="overlay",
                          denominator="without", samples=[round(x, 1) for x in intercept],
                          note="extra per step with 2 layers - 2 x the per-layer slope, per round"))
    return cases


# -- worker side (runs under valgrind) ---------------------------------------------------------


def callgrind_worker(payload: dict[str, Any]) -> dict[str, Any]:
    import ctypes
    import gc

    import torch
    import transformers

    from . import models
    from .overlay_access import apply_all, revert_all

    marker = ctypes.CDLL(payload["marker"])
    marker.region_stop.argtypes = [ctypes.c_char_p]
    short, long = payload["short_tokens"], payload["long_tokens"]
    regions, layers, same_tokens = [], {}, {}
    states = apply_all()
    revert_all()
    for setup in payload["setups"]:
        _, build_kwargs, cache = SETUPS[setup]
        model = models.gemma3(**build_kwargs)
        layers[setup] = model.config.num_hidden_layers
        batch = models.left_padded_batch(vocab=model.config.vocab_size)

        def generate(on: bool, tokens: int, label: str | None = None):
            if on:
                apply_all()
            # The collector off in the counted region (collected just before): where a collection
            # lands is the largest run-to-run difference in a Python loop's instruction count.
            gc.collect()
            gc.disable()
            try:
                with torch.no_grad():
                    if label is not None:
                        marker.region_start()
                    out = model.generate(**batch, **models.generate_kwargs(tokens, cache=cache))
                    if label is not None:
                        marker.region_stop(label.encode())
                return out
            finally:
                gc.enable()
                if on:
                    revert_all()

        outputs = {on: generate(on, long) for on in (True, False)}  # warm-up, uninstrumented
        same_tokens[setup] = bool(torch.equal(outputs[True], outputs[False]))
        for r, order in enumerate(common.rotations(["overlay", "without"], payload["rounds"])):
            for variant in order:
                for tokens in (short, long):
                    label = f"{setup}|{variant}|{tokens}|{r}"
                    generate(variant == "overlay", tokens, label)
                    regions.append(label)
    details = {
        "on_valgrind": bool(marker.on_valgrind()),
        "regions": regions,
        "layers": layers,
        "same_tokens_with_and_without": same_tokens,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "states_when_applied": states,
        "setups": {s: SETUPS[s][0] for s in payload["setups"]},
    }
    return {"status": OK, "details": details, "cases": []}


def callgrind_percall_worker(payload: dict[str, Any]) -> dict[str, Any]:
    """Figure 7's three statements, ``calls`` times per counted region, overlay applied and
    reverted (switched outside the regions; each region preceded by one uncounted run)."""
    import ctypes
    import gc

    import torch
    import transformers

    from .overlay_access import apply_all, revert_all
    from .percall import call_statements

    marker = ctypes.CDLL(payload["marker"])
    marker.region_stop.argtypes = [ctypes.c_char_p]
    calls = payload["calls"]
    states = apply_all()
    namespace, statements = call_statements(room=calls)
    loops = {name: (compile(f"for _ in range({calls}): {statement}", f"<{name} x {calls}>", "exec"), reset)
             for name, (statement, reset) in statements.items()}
    regions = []
    for r, order in enumerate(common.rotations(["overlay", "stock"], payload["rounds"])):
        for variant in order:
            if variant == "stock":
                revert_all()
            try:
                for name, (loop, reset) in loops.items():
                    for counted in (False, True):
                        if reset is not None:
                            reset()
                        gc.collect()
                        gc.disable()
                        try:
                            if counted:
                                marker.region_start()
                            exec(loop, namespace)
                            if counted:
                                label = f"percall|{name}|{variant}|{r}"
                                marker.region_stop(label.encode())
                                regions.append(label)
                        finally:
                            gc.enable()
            finally:
                if variant == "stock":
                    apply_all()
    details = {
        "on_valgrind": bool(marker.on_valgrind()),
        "regions": regions,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "states_when_applied": states,
        "statements": {name: statement for name, (statement, _) in statements.items()},
    }
    return {"status": OK, "details": details, "cases": []}


worker = callgrind_worker
if __name__ == "__main__":  # pragma: no cover - run by the worker
    sys.exit("run through python -m scripts.bench --only 8")
