"""``ATTN_OVERLAY_FIXES`` and ``python -m overlay.apply --compare`` (issue 40), for real, on tiny random
models built from configs (``tests/tools/fixes_program.py``):

- on a release where ``generation-config-precedence`` applies (4.55 - 5.0.0rc2, e.g. 4.57.6), an
  explicit ``GenerationConfig(do_sample=False)`` on a model whose generation config says
  ``do_sample=True`` samples on stock; with ``ATTN_OVERLAY_FIXES=errors`` it samples the very same
  ids (stock's output is kept: the fix changes a call that completes), with the default it gives
  the greedy ids of the same weights (the control). A float32 static cache given to a bfloat16 model
  raises on stock and generates with either setting (``kv-cache-dtype`` fixes an error only);
- ``--compare`` on that program exits 1 naming ``generation-config-precedence`` there, 0 with
  ``ATTN_OVERLAY_FIXES=errors``, and 0 on a release where the bug is fixed upstream (5.18.0); it
  exits 2, saying why, where it cannot compare;
- the statuses, the bug-report block and the pytest header say what each patch changes and what
  the setting leaves out.

Marked ``lane``: the release lanes (4.57.6 among them) run it too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import overlay
from overlay import config, engine, environment, pytest_plugin
from overlay.patch import CHANGES_ERRORS
from overlay.registry import load_patches
from overlay.testing.harness import PatchUnderTest

pytestmark = [
    pytest.mark.lane,
    pytest.mark.usefixtures("one_thread"),
    # The float32 cache's cast is reported once per dtype pair: expected here, kept out of the summary.
    pytest.mark.filterwarnings("ignore::overlay.guard.KVCacheDtypeWarning"),
]

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "tests" / "tools" / "fixes_program.py"
PRECEDENCE = PatchUnderTest("generation_config_precedence")
KV_CACHE_DTYPE = PatchUnderTest("kv_cache_dtype")

sys.path.insert(0, str(PROGRAM.parent))
import fixes_program  # noqa: E402


@pytest.fixture
def fixes(monkeypatch):
    """``fixes(value)``: a context in which a fresh engine (this process's may have been activated
    by other tests, with the settings of their time) applies every patch with ``ATTN_OVERLAY_FIXES``
    set to ``value``; the process's own patches are off meanwhile."""
    import contextlib

    @contextlib.contextmanager
    def under(value: str):
        monkeypatch.setenv(config.FIXES_VAR, value)
        with overlay.reverted(), engine.isolated(load_patches()), engine.applied() as statuses:
            yield {s.id: s for s in statuses}

    return under


@pytest.fixture(scope="module")
def runs():
    """What the two calls give on stock, and under each setting (one fresh engine each)."""
    monkeypatch = pytest.MonkeyPatch()
    out = {}
    try:
        with overlay.reverted():
            out["stock"] = {"precedence": fixes_program.precedence(), "kv": fixes_program.kv_cache_dtype(),
                            "reference": fixes_program.reference()}
        for value in (config.FIXES_ALL, config.FIXES_ERRORS):
            monkeypatch.setenv(config.FIXES_VAR, value)
            with overlay.reverted(), engine.isolated(load_patches()), engine.applied() as statuses:
                out[value] = {"precedence": fixes_program.precedence(), "kv": fixes_program.kv_cache_dtype(),
                              "statuses": {s.id: s for s in statuses}}
    finally:
        monkeypatch.undo()
    return out


# -- the calls ----------------------------------------------------------------------------------------


def test_the_control_is_greedy_and_stock_samples_where_the_release_has_the_bug(runs):
    reference = runs["stock"]["reference"]
    assert reference == [reference[0]] * len(fixes_program.SEEDS)  # greedy: the same ids whatever the seed
    if PRECEDENCE.affected:
        assert runs["stock"]["precedence"] != reference  # stock samples despite do_sample=False
    else:
        assert runs["stock"]["precedence"] == reference


def test_errors_keeps_the_stock_output_of_a_call_that_completes(runs):
    # Token ids compared with stock's (sampled, seeded): the output fix is off, nothing else moved them.
    assert runs[config.FIXES_ERRORS]["precedence"] == runs["stock"]["precedence"]
    status = runs[config.FIXES_ERRORS]["statuses"]["generation-config-precedence"]
    if PRECEDENCE.affected:
        assert status.state == engine.DISABLED
        assert f"{config.FIXES_VAR}={config.FIXES_ERRORS}" in status.reason
        assert "changes the output of calls that complete on stock" in status.reason
        assert "GenerationConfig(do_sample=False)" in status.reason  # what it would change, in its own words
        assert runs[config.FIXES_ERRORS]["statuses"]["generation-config-set-keys"].state == engine.DISABLED


def test_all_fixes_the_explicit_greedy_config(runs):
    assert runs[config.FIXES_ALL]["precedence"] == runs["stock"]["reference"]
    if PRECEDENCE.affected:
        assert runs[config.FIXES_ALL]["statuses"]["generation-config-precedence"].state == engine.APPLIED


def test_errors_still_fixes_a_float32_static_cache_in_a_bfloat16_model(runs):
    if not KV_CACHE_DTYPE.affected:
        pytest.skip(f"kv-cache-dtype does not apply to transformers {KV_CACHE_DTYPE.transformers}")
    assert runs["stock"]["kv"]["ok"] is False and runs["stock"]["kv"]["type"] == "RuntimeError", runs["stock"]["kv"]
    assert runs[config.FIXES_ERRORS]["kv"]["ok"] is True, runs[config.FIXES_ERRORS]["kv"]
    assert runs[config.FIXES_ALL]["kv"]["ok"] is True, runs[config.FIXES_ALL]["kv"]
    assert runs[config.FIXES_ERRORS]["kv"]["ids"] == runs[config.FIXES_ALL]["kv"]["ids"]
    assert runs[config.FIXES_ERRORS]["statuses"]["kv-cache-dtype"].state == engine.APPLIED


def test_errors_applies_exactly_the_patches_that_change_errors_only(fixes):
    with fixes(config.FIXES_ERRORS) as statuses:
        for patch in load_patches():
            status = statuses[patch.id]
            assert status.changes == patch.changes
            # A patch the release would get is left out; one fixed upstream or out of range keeps that state.
            would_get = engine.gate(patch, str(PRECEDENCE.transformers))[0] == engine.PENDING
            if patch.changes != CHANGES_ERRORS:
                assert status.state != engine.APPLIED, patch.id
                if would_get:
                    assert status.state == engine.DISABLED, (patch.id, status.state)
                    assert status.reason.startswith(f"disabled by {config.FIXES_VAR}={config.FIXES_ERRORS}: "), status.reason
            else:
                assert config.FIXES_VAR not in status.reason
    with fixes(config.FIXES_ALL) as statuses:
        assert not any(config.FIXES_VAR in s.reason for s in statuses.values())


# -- a battery of ordinary calls: under errors, whatever stock completes is stock ---------------------

#: generate() keyword arguments of calls users make every day, on a left-padded batch of a tiny Llama
#: (seeded where they sample). Several of them meet an output fix on 4.55 - 5.x (the repetition
#: penalty with padding, beam sampling, position_ids, encoder_repetition_penalty with several
#: return sequences, chunked prefill of a padded batch, prompt lookup).
BATTERY = {
    "greedy": {},
    "sampling": {"do_sample": True, "top_k": 20},
    "beam search": {"num_beams": 3},
    "beam sampling": {"do_sample": True, "num_beams": 3},
    "repetition penalty": {"repetition_penalty": 1.3},
    "encoder repetition penalty": {"encoder_repetition_penalty": 1.3, "do_sample": True, "num_return_sequences": 2},
    "static cache": {"cache_implementation": "static"},
    "prompt lookup": {"prompt_lookup_num_tokens": 2},
    "chunked prefill": {"prefill_chunk_size": 2},
    "stop string free sampling, several sequences": {"do_sample": True, "num_return_sequences": 3},
}


def _battery_outcomes() -> dict:
    import torch

    from overlay.testing.models import PAD_TOKEN_ID, left_padded_batch, tiny_model

    model = tiny_model("llama")
    batch = left_padded_batch((6, 3), seed=3)
    out = {}
    for name, kwargs in BATTERY.items():
        vars(model).pop("_cache", None)
        if name == "prompt lookup":  # prompt lookup takes one row
            inputs = {key: value[:1] for key, value in batch.items()}
        else:
            inputs = batch
        torch.manual_seed(0)
        try:
            with torch.no_grad():
                ids = model.generate(**inputs, max_new_tokens=6, pad_token_id=PAD_TOKEN_ID, disable_compile=True,
                                     **kwargs)
            out[name] = {"ok": True, "ids": ids.tolist()}
        except Exception as exc:  # noqa: BLE001  (what stock raises is an outcome too)
            out[name] = {"ok": False, "type": type(exc).__name__}
    return out


@pytest.fixture(scope="module")
def battery():
    monkeypatch = pytest.MonkeyPatch()
    out = {}
    try:
        with overlay.reverted():
            out["stock"] = _battery_outcomes()
        for value in (config.FIXES_ALL, config.FIXES_ERRORS):
            monkeypatch.setenv(config.FIXES_VAR, value)
            with overlay.reverted(), engine.isolated(load_patches()), engine.applied():
                out[value] = _battery_outcomes()
    finally:
        monkeypatch.undo()
    return out


@pytest.mark.parametrize("call", list(BATTERY))
def test_errors_gives_stocks_ids_wherever_stock_completes(battery, call):
    stock, errors_only = battery["stock"][call], battery[config.FIXES_ERRORS][call]
    if stock["ok"]:
        assert errors_only == stock, (call, stock, errors_only)
    else:  # where stock raises, an errors-only fix may make it work; it never raises anything else
        assert errors_only["ok"] or errors_only["type"] == stock["type"], (call, stock, errors_only)


def test_the_battery_meets_output_fixes_where_the_release_has_them(battery):
    # Without this, the test above could pass on calls no fix ever touches: with every fix, beam
    # sampling gives other ids than stock where beam-sample-sorted-candidates applies (4.57.6 among them).
    if not PatchUnderTest("beam_sample_sorted_candidates").affected:
        pytest.skip("beam sampling's order is fixed upstream here")
    changed = [call for call in BATTERY if battery[config.FIXES_ALL][call] != battery["stock"][call]]
    assert "beam sampling" in changed, changed


# -- --compare ---------------------------------------------------------------------------------------


def _compare(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(REPO))
    full_env.pop(config.FIXES_VAR, None)
    full_env.update(env)
    return subprocess.run([sys.executable, "-m", "overlay.apply", "--compare", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=600)


def test_compare_names_the_output_fix_that_changed_the_program(tmp_path):
    # Two runs of a program, each importing torch and transformers: on a release lane it runs where
    # generation-config-precedence's status changes (its verdict turns on nothing else), everywhere
    # in the whole suite.
    from tests._kit import at_a_patch_edge

    if not at_a_patch_edge(PRECEDENCE.id):
        pytest.skip(f"lanes run it where {PRECEDENCE.id}'s status changes (tests/_kit.py, at_a_patch_edge)")
    done = _compare(str(PROGRAM), "precedence", cwd=tmp_path)
    if PRECEDENCE.affected:
        assert done.returncode == 1, done.stdout + done.stderr
        assert "DIFFERENT: stdout differs at line 1" in done.stdout
        assert "fired: generation-config-precedence (3 call(s); changes output)" in done.stdout, done.stdout
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "identical: the same stdout and exit status" in done.stdout


# -- what the reports say ----------------------------------------------------------------------------


def test_the_bug_report_block_says_what_each_patch_changes(monkeypatch):
    monkeypatch.setenv(config.FIXES_VAR, config.FIXES_ERRORS)
    (line,) = environment.changes_lines().values()
    for patch in load_patches():
        assert patch.id in line
    assert "errors only (calls that raise on stock): " in line and "generation-config-precedence" in line
    assert line.endswith(f"({config.FIXES_VAR}={config.FIXES_ERRORS}: only the errors-only ones apply)")
    assert environment.CHANGES_KEY in environment.collect()


def test_the_pytest_header_counts_what_the_applied_patches_change(monkeypatch):
    # The gate's view, as before transformers is imported (this process's engine may be active).
    monkeypatch.setattr(engine, "is_active", lambda: False)
    monkeypatch.setattr(engine, "settings", lambda: None)
    monkeypatch.setenv(config.FIXES_VAR, config.FIXES_ALL)
    everything = pytest_plugin.changes_line()
    monkeypatch.setenv(config.FIXES_VAR, config.FIXES_ERRORS)
    errors_only = pytest_plugin.changes_line()
    assert everything is not None and errors_only is not None
    assert everything.endswith(f"({config.FIXES_VAR}={config.FIXES_ALL}: every fix)"), everything
    assert errors_only.endswith(f"({config.FIXES_VAR}={config.FIXES_ERRORS}: only fixes of calls that raise on stock)")
    assert "output" not in errors_only and "both" not in errors_only, errors_only
    # The counts of the first header line are the patches this line sorts by what they change.
    expected = [patch.changes for patch, state in zip(load_patches(), pytest_plugin._states(), strict=True)
                if state in (engine.APPLIED, engine.PENDING, pytest_plugin.PENDING_IMPORT)]
    assert expected and set(expected) == {CHANGES_ERRORS}
    assert f"change: {len(expected)} errors only (" in errors_only, errors_only
    if PRECEDENCE.affected:
        assert " output" in everything
