"""What the overlay runs at each decoding step of a generate() call where no fix acts: only the
code declared here, on every release lane (issue 39: a patch costs nothing where it does not fire).

Counted, not timed: every call of the overlay's own code (``overlay/``, ``patches/`` and the
kernel forwarders :mod:`overlay.call_forwarding` generates) is traced with ``sys.setprofile`` in
a call of 4 and one of 8 new tokens; the difference over 4 is what runs per step. A new patch
whose wrapper runs at every step fails here, naming itself and what to do: declare when a call can
need it (``Target(needed_by_call=...)``, :mod:`overlay.call_scope`), or add it below with the reason
it cannot be decided per call.
"""

from __future__ import annotations

import importlib
import os

import pytest

import overlay
from overlay import engine, report
from overlay.patch import wraps
from overlay.testing.models import greedy_ids, left_padded_batch, tiny_model
from tests._kit import count_calls, lane_share, toy_generation_patch

pytestmark = pytest.mark.lane

FORWARDER = "<attn-overlay forwarder"
ROOTS = tuple(
    os.path.realpath(os.path.dirname(module.__file__)) + os.sep
    for module in (overlay, importlib.import_module("overlay.patches"))
)

#: (file, function) -> why it runs once per layer and step: the hot path (docs/benchmarks.md,
#: figures 7 and 8), which is what the KV-dtype fix and the attention guard are.
PER_LAYER = {
    ("kv_cache_dtype.py", "update"): "kv-cache-dtype: each layer's cache update checks the dtypes it stores",
    ("attention_guard.py", "get_interface"): "attention-guard: the kernel lookup (5.1.0 on)",
    ("attention_guard.py", "__getitem__"): "attention-guard: the kernel lookup (4.55.0 - 5.0.0)",
    ("attention_guard.py", "_compiling"): "attention-guard: whether dynamo traces the lookup",
    (FORWARDER, "guarded_attention"): "attention-guard: the kernel's wrapper, built for the model's call shape",
}
#: (file, function) -> why it runs once per decoding step, whatever the call.
PER_STEP = {
    ("xpu_sdpa_mask_skip.py", "_ignore_causal_mask_sdpa"): (
        "masking_utils calls it once per forward (4.55 - 4.57): a module function, nothing on the model to bind"
    ),
    ("decoder_text_config_layers.py", "get_text_config"): (
        "the static cache's mask builder reads the decoder text config at every step (4.57 on); the fix "
        "depends on the config, not on the call"
    ),
    ("prompt_lookup_no_eos.py", "get_candidates"): (
        "prompt lookup asks its candidate generator at every step (before 5.13.0); the generator is built "
        "inside generate()"
    ),
}

#: Calls where no fix acts on the test model, each a different decoding loop or cache. A release
#: lane runs the first three and one of the others, in turn (``tests._kit.lane_share``: every mode
#: runs over CI's lanes); the whole suite and a lane run by hand run all.
MODES = {
    "greedy": ({}, (6, 4)),
    "static cache": ({"cache_implementation": "static"}, (6, 4)),
    "beam search": ({"num_beams": 3}, (6, 4)),
    "sampling": ({"do_sample": True}, (6, 4)),
    "repetition penalty, no padding": ({"repetition_penalty": 1.3}, (6, 6)),
    "prompt lookup": ({"prompt_lookup_num_tokens": 3}, (6,)),
}


def _function_key(code) -> tuple[str, str]:
    filename = code.co_filename
    name = code.co_qualname.rsplit(".", 1)[-1]
    return (FORWARDER if filename.startswith(FORWARDER) else os.path.basename(filename)), name


def overlay_calls(run, roots=ROOTS) -> dict[tuple[str, str], int]:
    """``{(file, function): calls}`` of code under ``roots`` (and the generated forwarders) during ``run()``."""
    def key_of(code):
        filename = code.co_filename
        if filename.startswith(FORWARDER) or os.path.realpath(filename).startswith(roots):
            return _function_key(code)
        return None

    return count_calls(key_of, run)


def per_step(model, batch, roots=ROOTS, **kwargs) -> dict[tuple[str, str], float]:
    """What runs per decoding step: (calls with 8 new tokens - calls with 4) / 4, where it grew,
    after a first call (which builds what is built once: the kernel forwarders, caches of code)."""
    greedy_ids(model, batch, 2, min_new_tokens=2, **kwargs)
    short, long = (overlay_calls(lambda n=n: greedy_ids(model, batch, n, min_new_tokens=n, **kwargs), roots)
                   for n in (4, 8))
    return {key: (long.get(key, 0) - short.get(key, 0)) / 4 for key in long if long.get(key, 0) > short.get(key, 0)}


def over_budget(steps: dict[tuple[str, str], float], layers: int) -> list[str]:
    """What runs per step beyond :data:`PER_LAYER` (once per layer) and :data:`PER_STEP` (once)."""
    found = []
    for key, count in sorted(steps.items()):
        allowed = layers if key in PER_LAYER else 1 if key in PER_STEP else 0
        if count > allowed:
            found.append(
                f"{key[0]}: {key[1]}: {count:g} calls per decoding step (allowed: {allowed}); declare when a "
                "generate() call can need it (Target(needed_by_call=...), overlay/call_scope.py) or, if no call "
                "can decide it, add it to PER_STEP in tests/engine/test_per_step_budget.py with the reason"
            )
    return found


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("mode", lane_share(list(MODES), always=3))
def test_where_nothing_fires_only_the_declared_code_runs_per_step(model, mode):
    kwargs, lengths = MODES[mode]
    with engine.applied():
        report.reset()
        steps = per_step(model, left_padded_batch(lengths), **kwargs)
        fired = report.fired()
    assert not fired, f"{mode}: a fix acted ({sorted(fired)}), so this call does not show what costs nothing"
    problems = over_budget(steps, model.config.num_hidden_layers)
    assert not problems, "\n".join(problems)
    # The hot path is really traced (the test sees the overlay's code at all).
    assert any(key in PER_LAYER for key in steps), f"{mode}: no per-layer overlay code seen: {steps}"


def test_an_undeclared_per_step_wrapper_is_named(model):
    """The check above can fail: a patch wrapping a method the loop calls at every step, without
    saying when a call needs it, is reported by file and function."""
    name = "prepare_inputs_for_generation"

    def replace(original, variant):
        @wraps(original)
        def prepare_inputs_for_generation(self, *args, **kwargs):
            return original(self, *args, **kwargs)

        return prepare_inputs_for_generation

    toy = toy_generation_patch("test-per-step-toy", name, replace)
    with engine.reverted(), engine.isolated([toy]):
        engine.apply(only=[toy.id])
        steps = per_step(model, left_padded_batch(), roots=(os.path.realpath(os.path.dirname(__file__)) + os.sep,))
    problems = over_budget(steps, model.config.num_hidden_layers)
    assert len(problems) == 1 and problems[0].startswith(f"{os.path.basename(__file__)}: {name}: 1 calls per decoding step")
