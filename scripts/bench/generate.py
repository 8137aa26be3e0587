"""Figures 4 and 5: ``generate()`` with every patch active, when there is nothing to fix.

Figure 4 times a tiny Gemma 3 (``layer_types`` sliding + full) generating a fixed number of
tokens greedily, inputs on the model's device and every dtype equal, with the overlay applied
(``overlay.apply()``: every registered patch) and without (``overlay.revert()``), alternately in
one process; tokens/s ratios per round. The decoding-step ratio comes from the same runs: the
time of a long generation minus a short one, divided by the extra tokens, cancels the prefill
and the set-up ``generate`` does once per call. The same runs, interleaved with the tiny model's,
time a Gemma 3 with 8 layers of hidden size 512 (``models.gemma3_deep``), where a decoding step is
mostly the model's own work, as in real use: decoding-step ratio goal <= 1.005. Every decoding
step is also clocked by itself (a streamer timestamps each new token): the median step of each
long run, with / without per round, is robust to disturbances landing on a few steps, which the
long - short difference of whole runs is not on a shared machine; those cases carry the same goals.

Figure 5 counts, instead of timing, what the dtype alignment (patch ``kv-cache-dtype``) and the
attention guard add when dtypes already match: the aten copy operations (``copy_``,
``_to_copy``, ``clone``) seen by a ``TorchDispatchMode`` during ``generate``, with the overlay
minus without, per decoding step (again long minus short generation, so only decoding steps
count). The goal is 0: when nothing needs aligning nothing may be copied.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from . import FIGURES, common
from .common import AT_LEAST, AT_MOST, OK, Case, ratio_case

FIGURE_GENERATE = 4
ID_GENERATE, TITLE_GENERATE = FIGURES[FIGURE_GENERATE]
GOAL_TOKENS = 0.99
GOAL_DECODE_STEP = 1.01
GOAL_DECODE_STEP_DEEP = 1.005

FIGURE_COPIES = 5
ID_COPIES, TITLE_COPIES = FIGURES[FIGURE_COPIES]
COPY_OPS = ("copy_", "_to_copy", "clone")


def generate_settings(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"rounds": 2, "warmup": 1, "long_tokens": 4, "short_tokens": 2, "deep_long_tokens": 3,
                "deep_short_tokens": 2}
    return {"rounds": 40, "warmup": 3, "long_tokens": 48, "short_tokens": 8, "deep_long_tokens": 24,
            "deep_short_tokens": 4}


def copies_settings(smoke: bool) -> dict[str, Any]:
    return {"long_tokens": 4, "short_tokens": 2} if smoke else {"long_tokens": 10, "short_tokens": 4}


def run_generate(smoke: bool, options: dict[str, Any]) -> common.Figure:
    result = common.run_worker("generate", generate_settings(smoke), timeout=300 if smoke else 1800)
    return common.figure_from_worker(FIGURE_GENERATE, ID_GENERATE, TITLE_GENERATE, result)


def run_copies(smoke: bool, options: dict[str, Any]) -> common.Figure:
    result = common.run_worker("copies", copies_settings(smoke), timeout=300 if smoke else 900)
    return common.figure_from_worker(FIGURE_COPIES, ID_COPIES, TITLE_COPIES, result)


# -- worker side ---------------------------------------------------------------------------------


def _patch_report() -> dict[str, Any]:
    from .overlay_access import apply_all, registered_patch_ids, revert_all, unregistered_patch_modules

    states = apply_all()
    revert_all()
    return {
        "registered": registered_patch_ids(),
        "states_when_applied": states,
        "patch_files_not_registered": unregistered_patch_modules(),
    }


def generate_worker(payload: dict[str, Any]) -> dict[str, Any]:
    import time

    import torch

    from . import models
    from .overlay_access import apply_all, revert_all

    model = models.gemma3()
    batch = models.left_padded_batch()
    deep = models.gemma3_deep()
    deep_batch = models.left_padded_batch(vocab=deep.config.vocab_size)
    batch_size = batch["input_ids"].shape[0]
    long_tokens, short_tokens = payload["long_tokens"], payload["short_tokens"]
    deep_long, deep_short = payload["deep_long_tokens"], payload["deep_short_tokens"]

    # Besides the whole generate, every decoding step is clocked: generate hands each new token to
    # a streamer, and the intervals between two hand-overs are decoding steps. Their median within
    # one generate is robust to a disturbance landing on a few steps, which a long - short
    # difference of whole runs is not (on a shared machine its rounds spread 0.5-2).
    step_medians: dict[str, list[float]] = {}

    def sampler(name: str, overlay_on: bool, cache: str | None, tokens: int, model=model, batch=batch):
        kwargs = models.generate_kwargs(tokens, cache=cache)
        step_medians[name] = []

        def sample():
            clock = _StepClock()
            if overlay_on:
                apply_all()
            try:
                with torch.no_grad():
                    start = time.perf_counter()
                    model.generate(**batch, **kwargs, streamer=clock)
                    elapsed = time.perf_counter() - start
            finally:
                if overlay_on:
                    revert_all()
            step_medians[name].append(clock.median_step())
            return elapsed

        return sample

    variants = {}
    for on, side in ((True, "overlay"), (False, "without")):
        for name, args in (("static/long", (on, "static", long_tokens)),
                           ("static/short", (on, "static", short_tokens)),
                           ("dynamic/long", (on, None, long_tokens)),
                           ("deep/long", (on, "static", deep_long, deep, deep_batch)),
                           ("deep/short", (on, "static", deep_short, deep, deep_batch))):
            variants[f"{side}/{name}"] = sampler(f"{side}/{name}", *args)
    samples = common.interleave(variants, payload["rounds"], payload["warmup"])
    step_samples = {name: values[payload["warmup"]:] for name, values in step_medians.items()}  # no warm-up

    # The same tokens with and without the overlay (nothing to fix: it must change nothing).
    outputs = {}
    for on in (True, False):
        if on:
            apply_all()
        try:
            with torch.no_grad():
                outputs[on] = model.generate(**batch, **models.generate_kwargs(long_tokens, cache="static"))
        finally:
            if on:
                revert_all()

    def steps(side: str, which: str = "static", long: int = long_tokens, short: int = short_tokens) -> list[float]:
        delta = long - short
        return [(a - b) / delta for a, b in zip(samples[f"{side}/{which}/long"], samples[f"{side}/{which}/short"])]

    deep_outputs = {}
    for on in (True, False):
        if on:
            apply_all()
        try:
            with torch.no_grad():
                deep_outputs[on] = deep.generate(**deep_batch, **models.generate_kwargs(deep_long, cache="static"))
        finally:
            if on:
                revert_all()

    note = f"{batch_size}x{long_tokens} new tokens per generate, greedy"
    cases = [
        ratio_case("generate tokens/s, static cache: overlay / without",
                   ("overlay", samples["overlay/static/long"]), ("without", samples["without/static/long"]),
                   goal=GOAL_TOKENS, direction=AT_LEAST, invert=True, note=note),
        ratio_case("generate tokens/s, dynamic cache: overlay / without",
                   ("overlay", samples["overlay/dynamic/long"]), ("without", samples["without/dynamic/long"]),
                   goal=GOAL_TOKENS, direction=AT_LEAST, invert=True, note=note),
        ratio_case("decoding step time, static cache: overlay / without",
                   ("overlay", steps("overlay")), ("without", steps("without")),
                   goal=GOAL_DECODE_STEP, direction=AT_MOST,
                   note=f"(t[{long_tokens} tokens] - t[{short_tokens} tokens]) / {long_tokens - short_tokens} per round"),
        ratio_case(f"decoding step time, {models.DEEP_LAYERS} layers of hidden 512, static cache: overlay / without",
                   ("overlay", steps("overlay", "deep", deep_long, deep_short)),
                   ("without", steps("without", "deep", deep_long, deep_short)),
                   goal=GOAL_DECODE_STEP_DEEP, direction=AT_MOST,
                   note=f"(t[{deep_long} tokens] - t[{deep_short} tokens]) / {deep_long - deep_short} per round"),
        ratio_case("decoding step, median step within each generate, static cache: overlay / without",
                   ("overlay", step_samples["overlay/static/long"]), ("without", step_samples["without/static/long"]),
                   goal=GOAL_DECODE_STEP, direction=AT_MOST,
                   note=f"median interval between the streamer's per-token calls, {long_tokens}-token runs"),
        ratio_case("decoding step, median step within each generate, dynamic cache: overlay / without",
                   ("overlay", step_samples["overlay/dynamic/long"]), ("without", step_samples["without/dynamic/long"]),
                   goal=GOAL_DECODE_STEP, direction=AT_MOST,
                   note=f"median interval between the streamer's per-token calls, {long_tokens}-token runs"),
        ratio_case(f"decoding step, median step within each generate, {models.DEEP_LAYERS} layers of hidden 512, "
                   "static cache: overlay / without",
                   ("overlay", step_samples["overlay/deep/long"]), ("without", step_samples["without/deep/long"]),
                   goal=GOAL_DECODE_STEP_DEEP, direction=AT_MOST,
                   note=f"median interval between the streamer's per-token calls, {deep_long}-token runs"),
    ]
    tokens = batch_size * long_tokens
    details = {
        "model": "Gemma3ForCausalLM, hidden 64, 2 layers (sliding + full), float32, cpu",
        "batch": f"{batch_size} prompts of {batch['input_ids'].shape[1]} tokens, left-padded",
        "tokens_per_second_median": {
            name: (batch_size * deep_long if "/deep/" in name else tokens) / common.summary(v)["median"]
            for name, v in samples.items() if name.endswith("/long")
        },
        "deep_model": f"Gemma3ForCausalLM, hidden 512, {models.DEEP_LAYERS} layers (sliding + full), float32, cpu",
        "same_tokens_with_and_without": bool(torch.equal(outputs[True], outputs[False])),
        "same_tokens_with_and_without_deep": bool(torch.equal(deep_outputs[True], deep_outputs[False])),
        "median_step_ms": {name: 1e3 * common.summary(values)["median"]
                           for name, values in step_samples.items() if name.endswith("/long")},
        "step_ms_median": {
            side: {which: 1e3 * common.summary(steps(side, which, *((deep_long, deep_short) if which == "deep" else
                                                                     (long_tokens, short_tokens))))["median"]
                   for which in ("static", "deep")}
            for side in ("overlay", "without")
        },
        "patches": _patch_report(),
    }
    return {"status": OK, "details": details, "cases": [c.as_dict() for c in cases]}


class _StepClock:
    """A generate streamer that only timestamps: ``put`` is called once with the prompt, then once
    per new token; the intervals from the second new token on are decoding steps."""

    def __init__(self) -> None:
        import time

        self._now = time.perf_counter
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(self._now())

    def end(self) -> None:
        pass

    def median_step(self) -> float:
        import statistics

        steps = [b - a for a, b in zip(self.stamps[2:], self.stamps[3:])]
        return statistics.median(steps) if steps else float("nan")


class _OpCounter:
    """Counts every aten op that runs while it is active (a ``TorchDispatchMode``)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: Counter[str] = Counter()
        self.counts = counts

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self) -> "_OpCounter":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def _count_ops(model, batch, kwargs) -> Counter:
    import torch

    with torch.no_grad(), _OpCounter() as counter:
        model.generate(**batch, **kwargs)
    return counter.counts


def copies_worker(payload: dict[str, Any]) -> dict[str, Any]:
    import torch

    from . import models
    from .overlay_access import apply_all, revert_all

    long_tokens, short_tokens = payload["long_tokens"], payload["short_tokens"]
    delta = long_tokens - short_tokens
    setups = [
        ("Gemma3, static cache, float32", lambda: models.gemma3(), "static"),
        ("Gemma3, dynamic cache, float32", lambda: models.gemma3(), None),
        ("Qwen3, static cache, bfloat16", lambda: models.qwen3(dtype=torch.bfloat16), "static"),
    ]
    cases = []
    details: dict[str, Any] = {"copy_ops": list(COPY_OPS), "per_setup": {}}
    for label, build, cache in setups:
        model = build()
        batch = models.left_padded_batch()
        counts = {}
        for on in (True, False):
            for tokens in (long_tokens, short_tokens):
                if on:
                    apply_all()
                try:
                    counts[on, tokens] = _count_ops(model, batch, models.generate_kwargs(tokens, cache=cache))
                finally:
                    if on:
                        revert_all()

        def per_step(on: bool, ops: tuple[str, ...] | None) -> float:
            long, short = counts[on, long_tokens], counts[on, short_tokens]
            names = ops if ops is not None else set(long) | set(short)
            return sum(long[n] - short[n] for n in names) / delta

        extra_copies = per_step(True, COPY_OPS) - per_step(False, COPY_OPS)
        extra_ops = per_step(True, None) - per_step(False, None)
        cases.append(Case(name=f"{label}: extra copies per decoding step", unit="copies/step",
                          stats=common.summary([extra_copies]), goal=0.0, direction=AT_MOST,
                          numerator="overlay", denominator="without",
                          note=f"aten {'/'.join(COPY_OPS)}, (t[{long_tokens}] - t[{short_tokens}]) / {delta}"))
        details["per_setup"][label] = {
            "copies_per_step": {"overlay": per_step(True, COPY_OPS), "without": per_step(False, COPY_OPS)},
            "extra_aten_ops_per_step": extra_ops,
            "extra_copies_whole_generate_short": sum(counts[True, short_tokens][n] - counts[False, short_tokens][n]
                                                     for n in COPY_OPS),
            "model_dtype": str(model.dtype),
        }
    details["patches"] = _patch_report()
    return {"status": OK, "details": details, "cases": [c.as_dict() for c in cases]}
