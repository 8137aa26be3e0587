"""Figure 9: the whole ``generate()`` call, instructions per generated token, overlay / stock.

Figures 7 and 8 count the per-layer hot path; this one counts everything ``generate()`` runs (its
set-up, every decoding step's wrappers, the logits processors, the cache), because a wrapper
that runs once per step costs every user every token whether or not its fix acts.

How it counts (the machinery of figure 8, :mod:`scripts.bench.callgrind`): valgrind starts with
instrumentation off; a C marker's client requests switch it on and zero the counters right before
one ``model.generate()`` call and dump them right after it, so importing torch and transformers,
building the model, and applying or reverting the overlay are never counted. The collector is off
in the counted region (collected just before). Per lane (a nox environment: one transformers
release), per model (tiny Llama, hidden 64, 2 and 8 layers) and per mode (:data:`MODES`), each
round counts the call with every patch applied and inside the stock state (``overlay.revert()``,
the same process), in rotated order, after one uncounted warm-up of each: the figure is
``(I[overlay] - I[stock]) / new tokens``, the median over rounds (and their min / max).

Validated three ways, each recorded in the report: the generated token ids of every counted call
are hashed, and must be the same in every round of a variant (the count is of the same work);
with / without must give the same ids where no patch's fix acts (``same_ids``, per mode; where a
fix acts, e.g. the repetition penalty on a padded batch, they differ by design and the hash is
what a before / after comparison of two checkouts, ``--overlay-root``, holds equal); and the
patches that fired in the counted calls are listed (``overlay.fired()``), so "nothing fires" is
a fact of the run, not an assumption. Round-to-round spread is reported with every cell.

Split by object: every dump's own cost is summed per object file that ran it
(:func:`scripts.bench.callgrind.read_object_costs`, checked against the dump's total). The
``native`` part (libtorch, c10, the loader, libstdc++: what torch does for each op and attribute
read) is the same to the instruction in identical calls, so the overlay's share there is exact; the
``interpreter`` part (CPython, its extension modules and the C library) is where identical calls
differ, by up to about 20,000 instructions per token at 8 layers (dict probes, the type attribute
cache and the small-object allocator depend on addresses and on earlier calls). Each cell reports
both beside the total.

Attribution (``--attribute``, slow: one more counted call per applied patch and mode, one round):
each applied patch left out in turn (``overlay.revert(only=[id])``, the rest applied), its share
is ``I[all] - I[all but it]`` per token.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import FIGURES, common, percall
from .callgrind import INTERPRETER, NATIVE, _counted, build_marker, read_object_costs
from .common import NOT_RUN, OK, Case

FIGURE = 9
ID, TITLE = FIGURES[FIGURE]

#: Goals of issue 39, extra instructions per generated token: where nothing fires, and where the
#: repetition-penalty fix acts (padded batch).
GOAL_NOTHING_FIRES = 3000
GOAL_FIX_ACTS = 30000

#: mode -> (label, generate() keyword arguments beyond max/min_new_tokens and pad_token_id).
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "greedy": ("greedy, dynamic cache", {"do_sample": False}),
    "static": ("greedy, static cache", {"do_sample": False, "cache_implementation": "static"}),
    "beam": ("beam search, 4 beams", {"do_sample": False, "num_beams": 4}),
    "beam_sample": ("beam sampling, 4 beams", {"do_sample": True, "num_beams": 4}),
    "penalty": ("sampling + repetition_penalty 1.3, left-padded batch", {"do_sample": True, "repetition_penalty": 1.3}),
    "lookup": ("prompt lookup decoding (3 tokens)", {"do_sample": False, "prompt_lookup_num_tokens": 3}),
}
#: Modes that generate for one prompt only (assisted decoding takes a batch of one).
ONE_ROW = {"lookup"}
#: Modes where a patch's fix acts on the benchmark's batch (ids may differ from stock by design):
#: the goal there (None: information; beam sampling's fix is upstream's own sort, every step).
FIX_ACTS = {"penalty": GOAL_FIX_ACTS, "beam_sample": None}


def settings(smoke: bool, options: dict[str, Any] | None = None) -> dict[str, Any]:
    options = options or {}
    if smoke:
        return {"rounds": 1, "tokens": 2, "layers": [2], "modes": ["greedy", "penalty"], "attribute": False}
    modes = [m for m in (options.get("modes") or "").split(",") if m] or list(MODES)
    layers = [int(x) for x in (options.get("layers") or "2,8").split(",") if x]
    return {"rounds": int(options.get("rounds") or 3), "tokens": 32, "layers": layers, "modes": modes,
            "attribute": bool(options.get("attribute"))}


def run(smoke: bool, options: dict[str, Any]) -> common.Figure:
    figure = common.Figure(FIGURE, ID, TITLE)
    payload = settings(smoke, options)
    figure.details = {"settings": payload, "lanes": {}}
    lanes = percall.lane_pythons(options.get("lanes"), smoke)
    valgrind = shutil.which("valgrind")
    with tempfile.TemporaryDirectory(prefix="bench-whole-") as tmp:
        folder = Path(tmp)
        library, why = build_marker(folder)
        if smoke or library is None or valgrind is None:
            # Dry run without valgrind (client requests are no-ops): the code paths are checked.
            result = common.run_worker("whole", {**payload, "marker": str(library) if library else None},
                                       timeout=600, python=lanes[0][1])
            figure.status = NOT_RUN
            figure.reason = (why or ("valgrind is not installed" if valgrind is None else
                                     "smoke: dry run without valgrind (run without --smoke to count)"))
            figure.details["dry_run"] = result["details"]
            return figure
        payload = {**payload, "marker": str(library)}
        for lane, python in lanes:
            try:
                # One pass over the dumps: the split by object, whose sums are the totals (checked
                # against each dump's own totals line).
                result, by_object = _counted(valgrind, folder / lane, "whole", payload, python, read=read_object_costs)
            except common.WorkerError as exc:
                figure.cases.append(Case(name=f"lane {lane}", unit="instructions", stats=None,
                                         status=common.ERROR, note=str(exc)[-500:]))
                continue
            details = result["details"]
            counts = {label: sum(costs.values()) for label, costs in by_object.items()}
            details["instructions"] = counts
            details["by_object"] = by_object
            figure.details["lanes"][lane] = details
            figure.cases += cases(payload, details, counts)
    return figure


def extra_per_token(payload: dict[str, Any], counts: dict[str, int], layers: int, mode: str,
                    variant: str = "overlay", rounds: int | None = None) -> list[float]:
    """Per round: (I[variant] - I[stock]) / new tokens."""
    tokens = payload["tokens"]
    return [(counts[f"{layers}|{mode}|{variant}|{r}"] - counts[f"{layers}|{mode}|stock|{r}"]) / tokens
            for r in range(payload["rounds"] if rounds is None else rounds)]


def split_per_token(payload: dict[str, Any], by_object: dict[str, dict[str, int]], layers: int,
                    mode: str) -> dict[str, list[float]] | None:
    """Per group of objects (:data:`~scripts.bench.callgrind.NATIVE`, exact; and
    :data:`~scripts.bench.callgrind.INTERPRETER`, where identical calls differ), per round:
    the overlay's extra instructions per token; None for a report without the split."""
    if not by_object:
        return None
    counts = {group: {label: costs[group] for label, costs in by_object.items()} for group in (NATIVE, INTERPRETER)}
    return {group: extra_per_token(payload, counts[group], layers, mode) for group in counts}


def cases(payload: dict[str, Any], details: dict[str, Any], counts: dict[str, int]) -> list[Case]:
    release = details["transformers"]
    found = []
    table = []
    for layers in payload["layers"]:
        for mode in payload["modes"]:
            if f"{layers}|{mode}" in details.get("errors", {}):
                extra = []
            else:
                extra = extra_per_token(payload, counts, layers, mode)
            stock = [counts[f"{layers}|{mode}|stock|{r}"] / payload["tokens"] for r in range(payload["rounds"])]
            key = f"{layers}|{mode}"
            if key in details.get("errors", {}):
                found.append(Case(name=f"{release}: {MODES[mode][0]}, {layers} layers: extra instructions per token",
                                  unit="instructions", stats=None, status=common.ERROR, note=details["errors"][key]))
                continue
            goal = FIX_ACTS[mode] if mode in FIX_ACTS else GOAL_NOTHING_FIRES
            stats = common.summary(extra)
            split = split_per_token(payload, details.get("by_object") or {}, layers, mode)
            parts = {group: common.summary(values) for group, values in (split or {}).items()}
            found.append(Case(
                name=f"{release}: {MODES[mode][0]}, {layers} layers: extra instructions per token",
                unit="instructions", stats=stats, goal=goal, direction=None if goal is None else common.AT_MOST,
                numerator="overlay", denominator="stock", samples=[round(x, 1) for x in extra],
                note=(f"stock {common.summary(stock)['median']:,.0f} per token; fired: "
                      f"{', '.join(details['fired'][key]) or 'nothing'}; same ids with/without: "
                      f"{details['same_ids'][key]}"
                      + "".join(f"; {group} {parts[group]['median']:+,.0f} ({parts[group]['min']:+,.0f} .. "
                                f"{parts[group]['max']:+,.0f})" for group in parts))))
            row = {"transformers": release, "layers": layers, "mode": mode, "extra": round(stats["median"]),
                   "min": round(stats["min"]), "max": round(stats["max"]),
                   "stock": round(common.summary(stock)["median"]), "fired": details["fired"][key],
                   "same_ids": details["same_ids"][key], "ids": details["ids"][key]}
            for group, part in parts.items():
                row[group] = round(part["median"])
                row[f"{group}_range"] = [round(part["min"]), round(part["max"])]
            if payload.get("attribute"):
                row["by_patch"] = {pid: round(counts[f"{layers}|{mode}|overlay|0"] / payload["tokens"]
                                              - counts[f"{layers}|{mode}|without:{pid}|0"] / payload["tokens"])
                                   for pid in details["applied"]}
            table.append(row)
    details["table"] = table
    return found


# -- worker side (runs under valgrind) ---------------------------------------------------------


def whole_worker(payload: dict[str, Any]) -> dict[str, Any]:
    import ctypes
    import gc

    import torch
    import transformers

    import overlay
    from overlay import report
    from overlay.testing.models import PAD_TOKEN_ID, left_padded_batch, tiny_model

    marker = ctypes.CDLL(payload["marker"]) if payload.get("marker") else None
    if marker is not None:
        marker.region_stop.argtypes = [ctypes.c_char_p]
    tokens = payload["tokens"]
    overlay.apply()
    applied: list[str] = []
    regions: list[str] = []
    fired: dict[str, list[str]] = {}
    ids: dict[str, dict[str, str]] = {}
    same_ids: dict[str, bool] = {}
    errors: dict[str, str] = {}

    for layers in payload["layers"]:
        model = tiny_model("llama", num_hidden_layers=layers, max_position_embeddings=512)
        # Two prompts, the first left-padded by 2 (what a tokenizer with padding_side="left" gives).
        batch = left_padded_batch((6, 8), vocab_size=model.config.vocab_size, seed=1234)

        for mode in payload["modes"]:
            kwargs = {"max_new_tokens": tokens, "min_new_tokens": tokens, "pad_token_id": PAD_TOKEN_ID,
                      "disable_compile": True, **MODES[mode][1]}
            key = f"{layers}|{mode}"
            # Prompt lookup (assisted decoding) takes one prompt: the unpadded row.
            inputs = {name: value[1:] for name, value in batch.items()} if mode in ONE_ROW else batch

            def call(variant: str, label: str | None) -> str:
                if variant == "stock":
                    overlay.revert()
                elif variant.startswith("without:"):
                    overlay.revert(only=[variant.split(":", 1)[1]])
                torch.manual_seed(0)
                gc.collect()
                gc.disable()
                try:
                    with torch.no_grad():
                        if label is not None and marker is not None:
                            marker.region_start()
                        out = model.generate(**inputs, **kwargs)
                        if label is not None and marker is not None:
                            marker.region_stop(label.encode())
                finally:
                    gc.enable()
                    if variant != "overlay":
                        overlay.apply()
                if label is not None:
                    regions.append(label)
                return hashlib.sha256(out.numpy().tobytes() + str(tuple(out.shape)).encode()).hexdigest()[:12]

            report.reset()
            try:
                seen = {variant: {call(variant, None)} for variant in ("overlay", "stock")}  # warm-up
            except Exception as exc:  # a mode this release cannot run: said, the others still counted
                errors[key] = f"{type(exc).__name__}: {exc}"
                continue
            fired[key] = sorted(report.fired())
            # Patches wait for their modules' first import: read the states once the model ran.
            applied = sorted({s.id for s in overlay.apply() if s.state == "applied"} | set(applied))
            for r, order in enumerate(common.rotations(["overlay", "stock"], payload["rounds"])):
                for variant in order:
                    seen[variant].add(call(variant, f"{key}|{variant}|{r}"))
            if payload.get("attribute"):
                for pid in applied:
                    seen.setdefault("left out", set()).add(call(f"without:{pid}", f"{key}|without:{pid}|0"))
            # One hash per variant: every counted call of a variant did the same work.
            ids[key] = {variant: ",".join(sorted(hashes)) for variant, hashes in seen.items()}
            same_ids[key] = seen["overlay"] == seen["stock"]
            if any(len(hashes) != 1 for variant, hashes in seen.items() if variant != "left out"):
                raise RuntimeError(f"{key}: a variant's calls generated different ids: {ids[key]}")
    return {"status": OK, "cases": [], "details": {
        "on_valgrind": bool(marker.on_valgrind()) if marker is not None else False,
        "regions": regions, "transformers": transformers.__version__, "torch": torch.__version__,
        "applied": applied, "fired": fired, "ids": ids, "same_ids": same_ids, "errors": errors,
        "modes": {m: MODES[m][0] for m in payload["modes"]},
    }}


worker = whole_worker


# -- publishing (docs/whole_generate.json, read by scripts/benchmarks_doc.py) -------------------


def table_of(report_path: Path) -> dict[tuple[str, int, str], dict[str, Any]]:
    """``{(transformers, layers, mode): row}`` of figure 9 in a ``python -m scripts.bench`` report."""
    import json

    data = json.loads(Path(report_path).read_text(encoding="utf-8"))
    rows = {}
    for figure in data["figures"]:
        if figure["figure"] != FIGURE:
            continue
        for details in figure["details"].get("lanes", {}).values():
            for row in details.get("table", []):
                rows[row["transformers"], row["layers"], row["mode"]] = row
    return rows


def publish(before: Path | None, after: Path, *, measured: str, overlay: str,
            machine: str, command: str) -> dict[str, Any]:
    """The page's data: each cell of ``after`` with its ``before`` (the same benchmark code run on
    the overlay of another checkout, ``--overlay-root``) where there is one."""
    earlier = table_of(before) if before is not None else {}
    rows = []
    for key, row in sorted(table_of(after).items(), key=lambda kv: (kv[0][0], kv[0][1], list(MODES).index(kv[0][2]))):
        old = earlier.get(key)
        rows.append({
            "transformers": row["transformers"], "layers": row["layers"], "mode": row["mode"],
            "label": MODES[row["mode"]][0], "stock": row["stock"],
            "before": None if old is None else old["extra"], "after": row["extra"],
            "after_range": [row["min"], row["max"]],
            # The split by object (None where the report predates it): native code exactly,
            # the interpreter and the C library with the spread of identical calls.
            "after_native": row.get(NATIVE), "after_native_range": row.get(f"{NATIVE}_range"),
            "after_interpreter": row.get(INTERPRETER), "after_interpreter_range": row.get(f"{INTERPRETER}_range"),
            "goal": FIX_ACTS[row["mode"]] if row["mode"] in FIX_ACTS else GOAL_NOTHING_FIRES,
            "fired": row["fired"], "same_ids_with_and_without": row["same_ids"],
            "ids_as_before": None if old is None else old["ids"] == row["ids"],
        })
    return {"measured": measured, "overlay": overlay, "machine": machine, "command": command, "rows": rows}


def plot(data: dict[str, Any], path: Path) -> Path:
    """Bars per cell: extra instructions per token before and after, with the goals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    labels = [f"{r['transformers']} {r['layers']}L {r['mode']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.45), 5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["before"] or 0 for r in rows], width=0.4, label="before", color="#bbbbbb")
    ax.bar([x + 0.2 for x in xs], [r["after"] for r in rows], width=0.4, label="after", color="#3070b0")
    for x, r in zip(xs, rows):
        if r["goal"] is not None:
            ax.plot([x - 0.45, x + 0.45], [r["goal"], r["goal"]], color="#c03030", linewidth=1)
    ax.set_yscale("symlog", linthresh=1000)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("extra instructions per generated token (overlay - stock)")
    ax.set_title("whole generate() under callgrind: before / after (red: goal)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m scripts.bench.whole --after AFTER.json [--before BEFORE.json] ...``: write
    docs/whole_generate.json (and its chart) from figure 9 of benchmark reports; several
    ``--after`` (or ``--before``) files are merged, a later one's cell replacing an earlier one's."""
    import argparse
    import json
    import tempfile as _tempfile

    parser = argparse.ArgumentParser(prog="python -m scripts.bench.whole", description=main.__doc__)
    parser.add_argument("--after", nargs="+", type=Path, required=True)
    parser.add_argument("--before", nargs="*", type=Path, default=[])
    parser.add_argument("--measured", required=True)
    parser.add_argument("--overlay", required=True, help="what was measured, e.g. a commit and 'dirty tree'")
    parser.add_argument("--machine", default="2-core AMD EPYC, torch 2.13.0 CPU, Python 3.11")
    parser.add_argument("--command", default="python -m scripts.bench --only 9 --lanes LANE,... --rounds 2")
    parser.add_argument("--out", type=Path, default=common.REPO / "docs" / "whole_generate.json")
    parser.add_argument("--no-chart", action="store_true")
    args = parser.parse_args(argv)

    def merged(paths: list[Path]) -> Path | None:
        if not paths:
            return None
        lanes: dict[str, Any] = {}
        for path in paths:
            for figure in json.loads(path.read_text(encoding="utf-8"))["figures"]:
                if figure["figure"] == FIGURE:
                    # Keyed by the whole path: reports of several runs are often all named latest.json.
                    lanes.update({f"{path}:{lane}": d for lane, d in figure["details"].get("lanes", {}).items()})
        handle = _tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"figures": [{"figure": FIGURE, "details": {"lanes": lanes}}]}, handle)
        handle.close()
        return Path(handle.name)

    after = merged(args.after)
    assert after is not None
    data = publish(merged(args.before), after, measured=args.measured, overlay=args.overlay,
                   machine=args.machine, command=args.command)
    args.out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    if not args.no_chart:
        print(f"wrote {plot(data, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
