"""Figure 7: the overlay's extra time per call, per layer and decoding step, on several releases.

A decoding step of a transformers decoder calls, once per layer, the KV cache's ``update`` and
then ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``
followed by the kernel it returns. Those are the calls the overlay wraps (patches
``kv-cache-dtype`` and ``attention-guard``). This figure times exactly those statements, as the
Llama attention layer writes them, with decode-shaped float32 tensors on the CPU (dtypes and
devices already agree, nothing to fix):

- ``StaticCache.update`` of one new position (cache of ``32 + number`` positions),
- ``DynamicCache.update`` of one new position onto 32 cached ones (the layer's keys/values are
  put back to the 32-position tensors before every call: two attribute stores, in both variants),
- ``ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", eager_attention_forward)`` and the SDPA call
  (query 1 position, 33 key/value positions, no mask);
- once per step, not per layer (information, outside the goal's sums): the SDPA mask builders'
  skip rule ``masking_utils._ignore_causal_mask_sdpa`` on a decoding step's 2D mask, which
  ``xpu-sdpa-mask-skip`` wraps on 4.55.0 - 4.57.6 (``--lanes tf-4-57-6`` to see it).

Each release gets the calls its own modeling_llama makes (:func:`call_statements`): before 5.1.0
the lookup is ``ALL_ATTENTION_FUNCTIONS[...]``, and up to 5.3.0 the update passes
``cache_kwargs`` (``sin``, ``cos``, ``cache_position``), at which the static layers write.

Overlay applied (``overlay.apply()``) and reverted (``overlay.reverted()``) alternate in one
process at every sample, so that the two sides of a pair run milliseconds apart (slow drifts of
the machine's speed hit both): a sample is ``warmup`` calls, then ``number`` back-to-back calls
timed (``timeit``: garbage collector off, the statement compiled into the loop), clocked by the
thread's CPU time (``time.thread_time``, which leaves out the time other processes hold the
core); per call and variant a process keeps its fastest sample (``timeit``'s advice: the minimum
is what the code costs, the rest is noise). The extra time of a process is its fastest with − its
fastest without.

Why several processes: the fastest time of the same call differs between two fresh processes by
up to ~0.5 µs on the SDPA call (where the interpreter and torch happen to lay out their code and
data), and within one process that offset stays put, identical code either side; a single
process's difference can be off by that much, however many rounds it runs. So each release runs
``processes`` fresh workers of ``rounds`` rounds each, and the goal is judged on the **median
over the processes** of the sum per layer and step (cache update + attention call): at most
1.0 µs, static and dynamic cache, on every release measured; the range over the processes is
shown beside it. The instruction counts of figure 8 (same statements) are the deterministic
companion.

Each release runs in its own interpreter: a nox lane (``.nox/tf-5-13-0``, ``.nox/tests`` =
5.18.0, ``.nox/tf-5-24-0`` by default, ``--lanes`` to choose), the figure collects them all.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from . import FIGURES, common
from .common import AT_MOST, ERROR, OK, Case

FIGURE = 7
ID, TITLE = FIGURES[FIGURE]
GOAL_EXTRA_US = 1.0
CACHED = 32
DEFAULT_LANES = ("tf-5-13-0", "tests", "tf-5-24-0")

CALLS = {
    "static": "StaticCache.update",
    "dynamic": f"DynamicCache.update ({CACHED} cached positions)",
    "attention": 'get_interface("sdpa", default) + SDPA call',
    # Once per decoding step, not per layer (outside the totals): the SDPA mask builders' skip rule,
    # which xpu-sdpa-mask-skip wraps on 4.55.0 - 4.57.6.
    "mask_rule": "_ignore_causal_mask_sdpa (per step, not per layer)",
}
TOTALS = {
    "static": ("static", "attention"),
    "dynamic": ("dynamic", "attention"),
}


def settings(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"processes": 2, "rounds": 1, "repeat": 1, "number": 50, "warmup": 10}
    return {"processes": 7, "rounds": 8, "repeat": 20, "number": 200, "warmup": 100}


def lane_pythons(spec: str | None, smoke: bool) -> list[tuple[str, str]]:
    """``[(lane, python)]``: ``spec`` is a comma-separated list of nox lane names (folders under
    ``.nox``) or interpreter paths; default: the three lanes that exist, or (smoke, or no lane
    built) this interpreter only."""
    if spec:
        names = [s.strip() for s in spec.split(",") if s.strip()]
    elif smoke:
        return [("current", sys.executable)]
    else:
        names = list(DEFAULT_LANES)
    lanes = []
    for name in names:
        if name == "current":
            lanes.append((name, sys.executable))
            continue
        python = Path(name) if os.sep in name else common.REPO / ".nox" / name / "bin" / "python"
        if python.exists():
            lanes.append((name, str(python)))
        elif spec:
            raise FileNotFoundError(f"--lanes: no interpreter {python}")
    return lanes or [("current", sys.executable)]


def run(smoke: bool, options: dict[str, Any]) -> common.Figure:
    figure = common.Figure(FIGURE, ID, TITLE)
    payload = settings(smoke)
    figure.details = {"settings": payload, "lanes": {}, "goal_us_per_layer_and_step": GOAL_EXTRA_US}
    errors = []
    for lane, python in lane_pythons(options.get("lanes"), smoke):
        processes = []
        try:
            for _ in range(payload["processes"]):
                processes.append(common.run_worker("percall", payload, timeout=300 if smoke else 900,
                                                   python=python)["details"])
        except common.WorkerError as exc:
            errors.append(f"lane {lane}: {exc}")
            figure.cases.append(Case(name=f"lane {lane}: per-call extra", unit="µs", stats=None,
                                     status=ERROR, note=str(exc)[-500:]))
            continue
        details, cases = combine(processes)
        figure.details["lanes"][lane] = details
        figure.cases += cases
    if errors:
        figure.reason = "; ".join(e.splitlines()[0] for e in errors)
        if not any(c.status == OK for c in figure.cases):
            figure.status = ERROR
    return figure


def combine(processes: list[dict[str, Any]]) -> tuple[dict[str, Any], list[Case]]:
    """One release's cases from its worker processes: per process, fastest with − fastest
    without of each call (and their sums per layer and step); judged on the median over the
    processes, their range shown beside it."""
    first = processes[0]
    release = first["transformers"]
    fastest = [{variant: {name: min(values) for name, values in p["samples_us"][variant].items()}
                for variant in ("overlay", "stock")} for p in processes]
    extra = {name: [f["overlay"][name] - f["stock"][name] for f in fastest] for name in CALLS}
    cases, table, totals = [], [], {}
    for name, label in CALLS.items():
        stats = common.summary(extra[name])
        stock = common.summary([f["stock"][name] for f in fastest])["median"]
        on = common.summary([f["overlay"][name] for f in fastest])["median"]
        table.append({"call": label, "stock_us": stock, "overlay_us": on, "extra_us": stats["median"],
                      "extra_us_min": stats["min"], "extra_us_max": stats["max"]})
        cases.append(Case(name=f"{release}: {label}: extra", unit="µs", stats=stats, numerator="overlay",
                          denominator="stock", samples=[round(x, 4) for x in extra[name]],
                          note=f"per process: fastest with − fastest without; {len(processes)} processes; "
                               f"median of the fastest: stock {stock:.2f} µs, overlay {on:.2f} µs"))
    for total, parts in TOTALS.items():
        per_process = [sum(extra[part][i] for part in parts) for i in range(len(processes))]
        stats = common.summary(per_process)
        totals[total] = {"median_over_processes": stats["median"], "min": stats["min"], "max": stats["max"]}
        cases.append(Case(name=f"{release}: per layer and step, {total} cache (update + attention): extra",
                          unit="µs", stats=stats, goal=GOAL_EXTRA_US, direction=AT_MOST, numerator="overlay",
                          denominator="stock", samples=[round(x, 4) for x in per_process],
                          note="sum of the calls' extras per process (fastest − fastest), judged on the median "
                               f"over {len(processes)} processes"))
    details = {key: first[key] for key in first if key != "samples_us"}
    details.update({"table": table, "totals": totals, "processes": len(processes),
                    "samples_us_per_process": [p["samples_us"] for p in processes],
                    "same_results_with_and_without": all(p["same_results_with_and_without"] for p in processes)})
    return details, cases


# -- worker side ---------------------------------------------------------------------------------


def call_statements(room: int) -> tuple[dict[str, Any], dict[str, tuple[str, Any]]]:
    """``(namespace, {call: (statement, reset or None)})``: the three calls as the installed
    release's modeling_llama writes them, on a one-layer Llama's decode-shaped float32 tensors;
    the static cache has room for ``room`` more positions after its prefix. Shared with figure 8,
    which counts the instructions of the very same statements.

    What differs between releases is read from the installed ``LlamaAttention.forward``:

    - the cache update: ``update(k, v, layer)`` (5.4.0 - 5.23), ``update(k, v, layer,
      kwargs=kwargs)`` (5.24.0 on) or, up to 5.3.0, ``update(k, v, layer, cache_kwargs)`` with
      ``cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}`` built in the
      call (the dict literal is taken from the source): the static layers write at
      ``cache_position`` there, so every call writes at the same place and there is nothing to
      reset; from 5.4.0 they write at their own count (``cumulative_length``), which ``reset``
      puts back;
    - the attention lookup: ``ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)``
      (5.1.0 on) or, before, ``ALL_ATTENTION_FUNCTIONS[impl]`` when ``impl`` is not ``"eager"``
      (the model's ``if`` written as a conditional expression, the same comparison and lookup).

    The caches come from the test kit's builders (``static_cache``, ``dynamic_cache``), which take
    each release's constructor (4.55.x's differ)."""
    import inspect
    import re

    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama

    from overlay.testing.models import dynamic_cache, static_cache

    from . import models

    config = models.llama_config(layers=1, attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(0)
    kv_heads, heads, head_dim = config.num_key_value_heads, config.num_attention_heads, config.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    k_new, v_new = rand(1, kv_heads, 1, head_dim), rand(1, kv_heads, 1, head_dim)
    k_prefix, v_prefix = rand(1, kv_heads, CACHED, head_dim), rand(1, kv_heads, CACHED, head_dim)
    query = rand(1, heads, 1, head_dim)
    keys, values = torch.cat([k_prefix, k_new], dim=-2), torch.cat([v_prefix, v_new], dim=-2)
    module = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
    # The decoding step's rotary embeddings and position (passed to the cache up to 5.3.0).
    position_ids = torch.tensor([[CACHED]])
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config=config)(query, position_ids)
    cache_position = torch.tensor([CACHED])

    source = inspect.getsource(modeling_llama.LlamaAttention.forward)
    update_call = re.search(r"\.update\(key_states, value_states, self\.layer_idx(, kwargs=kwargs|, cache_kwargs)?\)",
                            source)
    passed = update_call.group(1) if update_call else None
    if passed == ", kwargs=kwargs":
        update_args = "k, v, 0, kwargs=kw"
    elif passed == ", cache_kwargs":
        literal = re.search(r"cache_kwargs = (\{[^{}]*\})", source)
        cache_kwargs = literal.group(1) if literal else '{"cache_position": cache_position}'
        update_args = f"k, v, 0, {cache_kwargs}"
    else:
        update_args = "k, v, 0"
    # The prefill's write of the prefix (positions 0 .. CACHED-1 where the cache is told them).
    prefix_kwargs = {"cache_position": torch.arange(CACHED)} if passed == ", cache_kwargs" else None

    static = static_cache(config, 1, CACHED + room + 8, k_prefix.dtype, k_prefix.device)
    static.update(k_prefix, v_prefix, 0, *([prefix_kwargs] if prefix_kwargs else []))
    static_layer = static.layers[0]

    def reset_static():
        length = static_layer.cumulative_length
        if isinstance(length, torch.Tensor):
            length.fill_(CACHED)
        else:
            static_layer.cumulative_length = CACHED

    dynamic = dynamic_cache(config)
    dynamic.update(k_prefix, v_prefix, 0, *([prefix_kwargs] if prefix_kwargs else []))

    # What the attention layer passes on in a decoding step: the decoder layer's position_ids and
    # use_cache arrive in its **kwargs, which go to the kernel, and (from 5.24) to the cache update.
    kw = {"position_ids": position_ids, "use_cache": True}

    if "ALL_ATTENTION_FUNCTIONS.get_interface(" in source or (
            "ALL_ATTENTION_FUNCTIONS[" not in source and hasattr(type(ALL_ATTENTION_FUNCTIONS), "get_interface")):
        lookup = "ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)"
    else:  # before 5.1.0: `if self.config._attn_implementation != "eager": ... = ALL_ATTENTION_FUNCTIONS[...]`
        lookup = ('(ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation] '
                  'if self.config._attn_implementation != "eager" else eager_attention_forward)')

    # The rule as the SDPA mask builders call it in a decoding step (one query, a 2D mask over the
    # cached positions and the new one); 5.14.0 added the query's offset.
    from transformers import masking_utils

    mask_rule_args = (["padding_mask", 1, CACHED + 1, CACHED, 0, None]
                      if "q_offset" in inspect.signature(masking_utils._ignore_causal_mask_sdpa).parameters
                      else ["padding_mask", 1, CACHED + 1, 0, None])

    namespace = {
        "kw": kw, "masking_utils": masking_utils, "padding_mask": torch.ones(1, CACHED + 1, dtype=torch.bool),
        "static": static, "dynamic": dynamic, "layer": dynamic.layers[0], "k_prefix": k_prefix, "v_prefix": v_prefix,
        "k": k_new, "v": v_new, "ALL_ATTENTION_FUNCTIONS": ALL_ATTENTION_FUNCTIONS, "self": module,
        "eager_attention_forward": modeling_llama.eager_attention_forward, "q": query, "keys": keys,
        "values": values, "scaling": module.scaling, "sin": sin, "cos": cos, "cache_position": cache_position,
    }
    # The statements as modeling_llama writes them (the method looked up at every call, so that
    # applying and reverting the overlay takes effect).
    statements = {
        "static": (f"static.update({update_args})",
                   reset_static if hasattr(static_layer, "cumulative_length") else None),
        "dynamic": (f"layer.keys = k_prefix; layer.values = v_prefix; dynamic.update({update_args})", None),
        "attention": (f"{lookup}(self, q, keys, values, None, dropout=0.0, scaling=scaling, **kw)", None),
        "mask_rule": (f"masking_utils._ignore_causal_mask_sdpa({', '.join(map(str, mask_rule_args))})", None),
    }
    return namespace, statements


def percall_worker(payload: dict[str, Any]) -> dict[str, Any]:
    import time
    import timeit

    import torch
    import transformers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import overlay

    from .overlay_access import apply_all

    number, repeat, rounds, warmup = payload["number"], payload["repeat"], payload["rounds"], payload["warmup"]
    states = apply_all()
    namespace, statements = call_statements(room=max(number, warmup))
    static_layer, dynamic_layer = namespace["static"].layers[0], namespace["layer"]
    query, k_new = namespace["q"], namespace["k"]
    # The clock is this thread's CPU time: time other processes hold the core is left out (on a
    # shared machine that is most of the noise); short loops, many of them, keep the fastest.
    timers = {name: (timeit.Timer(stmt, timer=time.thread_time, globals=namespace), reset)
              for name, (stmt, reset) in statements.items()}

    def measure(name: str, count: int) -> float:
        timer, reset = timers[name]
        if reset is not None:
            reset()
        return timer.timeit(count) / count * 1e6  # µs per call

    def timed(name: str, on: bool) -> float:
        """One sample: a short warm-up (the first calls after switching pay for cold caches),
        then ``number`` calls."""
        if on:
            measure(name, warmup)
            return measure(name, number)
        with overlay.reverted():
            measure(name, warmup)
            return measure(name, number)

    def one_round(order: list[str]) -> dict[str, dict[str, float]]:
        """Per call: ``repeat`` samples of each variant, alternating (in ``order``, then swapped),
        so that both sides of a pair run within milliseconds of each other; per variant the
        fastest of its samples."""
        best: dict[str, dict[str, float]] = {variant: {} for variant in order}
        for name in timers:
            for r in range(repeat):
                for variant in (order if r % 2 == 0 else order[::-1]):
                    value = timed(name, variant == "overlay")
                    best[variant][name] = min(value, best[variant].get(name, value))
        return best

    # Premise: the statements reach the overlay's wrappers when applied, stock code when reverted.
    def where() -> dict[str, str]:
        # The registry lookup the statement makes: get_interface (5.1.0 on), or __getitem__.
        lookup = "get_interface" if "get_interface(" in statements["attention"][0] else "__getitem__"
        interface = getattr(type(ALL_ATTENTION_FUNCTIONS), lookup)
        kernel = (ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) if lookup == "get_interface"
                  else ALL_ATTENTION_FUNCTIONS["sdpa"])
        return {
            "Cache.update": transformers.cache_utils.Cache.update.__code__.co_filename,
            "StaticLayer.update": type(static_layer).update.__code__.co_filename,
            "DynamicLayer.update": type(dynamic_layer).update.__code__.co_filename,
            f"AttentionInterface.{lookup}": interface.__code__.co_filename,
            "kernel returned": kernel.__code__.co_filename,
            "_ignore_causal_mask_sdpa": namespace["masking_utils"]._ignore_causal_mask_sdpa.__code__.co_filename,
        }

    code_on = where()
    with overlay.reverted():
        code_off = where()
    same_results = _same_results(statements, namespace, overlay, torch)

    samples: dict[str, dict[str, list[float]]] = {"overlay": {n: [] for n in timers}, "stock": {n: [] for n in timers}}
    for order in common.rotations(["overlay", "stock"], rounds + 1):
        for variant, result in one_round(order).items():
            for name, value in result.items():
                samples[variant][name].append(value)
    for variant in samples:  # the first round warms up both variants
        for name in samples[variant]:
            del samples[variant][name][0]

    release = transformers.__version__
    details = {
        "transformers": release,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "code_when_applied": code_on,
        "code_when_reverted": code_off,
        "states_when_applied": states,
        "same_results_with_and_without": same_results,
        "statements": {name: stmt for name, (stmt, _) in statements.items()},
        "shapes": {"query": list(query.shape), "new_kv": list(k_new.shape), "cached": CACHED, "dtype": "float32"},
        "samples_us": samples,
    }
    return {"status": OK, "details": details, "cases": []}


def _tensors(result) -> list:
    return [t for t in (result if isinstance(result, tuple) else (result,)) if t is not None]


def _same_results(statements, namespace, overlay, torch) -> bool:
    """The statements return the same tensors with the overlay as without (nothing to fix)."""
    ns = namespace

    def outputs():
        out = []
        for name, (stmt, reset) in statements.items():
            if reset is not None:
                reset()
            *setup, call = stmt.split("; ")
            for line in setup:
                exec(line, ns)
            out += [t.clone() if isinstance(t, torch.Tensor) else torch.tensor(t) for t in _tensors(eval(call, ns))]
        return out

    on = outputs()
    with overlay.reverted():
        off = outputs()
    return all(torch.equal(a, b) for a, b in zip(on, off))


worker = percall_worker
