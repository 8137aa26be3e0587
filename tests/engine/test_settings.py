"""Every setting comes from one table (``overlay/config.py``); a value outside it is named, never
silently replaced; ``python -m overlay.apply`` shows what is in force and ``--strict`` fails on a
bad setting; the README's settings table is generated from the table."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from overlay import cli, config, engine, guard

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import readme_table  # noqa: E402

PATCH_IDS = [patch.id for patch in engine.known_patches()]


@pytest.fixture
def clean_env(monkeypatch):
    """No ATTN_OVERLAY_* variable (nor a distributed rank) but the ones a test sets; every warning
    seen afresh."""
    for name in (*config.BY_NAME, *config.RANK_VARS):
        monkeypatch.delenv(name, raising=False)
    config.reset_warnings()
    yield monkeypatch
    config.reset_warnings()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "overlay" and r.levelno == logging.WARNING]


# -- the table -------------------------------------------------------------------------------------


def test_every_variable_the_overlay_reads_is_a_row_of_the_table():
    # A new ATTN_OVERLAY_* read anywhere in the shipped code must get its row (and so its README line).
    shipped = [*(REPO / "overlay").rglob("*.py"), *(REPO / "patches").glob("*.py"), REPO / "_attn_overlay_startup.py",
               REPO / "_attn_overlay_finder.py"]
    named = set()
    for path in shipped:
        named |= set(re.findall(r"\bATTN_OVERLAY(?:_[A-Z]+)*\b", path.read_text(encoding="utf-8")))
    assert named and named <= set(config.BY_NAME), sorted(named - set(config.BY_NAME))
    assert [s.name for s in config.SETTINGS] == list(config.BY_NAME)  # one row per variable


@pytest.mark.parametrize("setting", config.SETTINGS, ids=lambda s: s.name)
def test_each_row_reads_its_own_default_as_written(setting, clean_env):
    assert setting.values and setting.meaning and setting.default_text
    clean_env.delenv(setting.name, raising=False)
    unset = setting.read()
    assert (unset.value, unset.source, unset.problem) == (setting.default, config.FROM_DEFAULT, None)
    clean_env.setenv(setting.name, "  ")  # empty counts as unset
    assert setting.read().source == config.FROM_DEFAULT
    if isinstance(setting.default, (bool, str)):  # the default, written as documented, is accepted
        clean_env.setenv(setting.name, setting.default_text)
        written = setting.read()
        assert (written.value, written.source, written.problem) == (setting.default, config.FROM_ENVIRONMENT, None)


def test_the_startup_hook_reads_ATTN_OVERLAY_with_the_same_words():
    import _attn_overlay_finder as finder
    import _attn_overlay_startup as startup

    assert tuple(startup._OFF) == tuple(finder._OFF) == config.FALSE_WORDS


# -- values outside the table ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "raw", "used"),
    [
        (config.ENABLE_VAR, "maybe", True),  # was silently "on"
        (config.STRICT_VAR, "2", False),  # was silently "off"
        (config.REPORT_VAR, "yes please", False),
        (config.GUARD_VAR, "bogus", "align"),
        (config.LOG_LEVEL_VAR, "verbose", "warning"),
        (config.LOG_LEVEL_VAR, "20", "warning"),  # logging's numbers are not levels here
        (config.LOG_RANKS_VAR, "1", "0"),
    ],
)
def test_a_value_outside_the_table_is_named_once_with_what_is_used_instead(name, raw, used, clean_env, caplog):
    clean_env.setenv(name, raw)
    with caplog.at_level(logging.WARNING, logger="overlay"):
        assert config.value(name).value == used
        assert config.value(name).value == used  # read again: no second warning
    (message,) = _warnings(caplog)
    setting = config.BY_NAME[name]
    assert f"{name}={raw!r}" in message
    assert f"(accepted: {setting.values})" in message
    assert f"using the default, {setting.default_text}" in message
    assert config.problems() == [message]


def test_accessors_the_engine_calls_keep_their_names_and_types(clean_env):
    clean_env.setenv(config.STRICT_VAR, " TRUE ")
    clean_env.setenv(config.REPORT_VAR, "On")
    clean_env.setenv(config.ENABLE_VAR, "no")
    clean_env.setenv(config.DISABLE_VAR, "kv-cache-dtype, attention-guard")
    assert config.strict_from_env() is True and config.report_at_exit() is True and config.auto_enabled() is False
    assert config.disabled_patch_ids() == frozenset({"kv-cache-dtype", "attention-guard"})
    assert config.problems(PATCH_IDS) == []


def test_disable_reads_underscores_and_case_as_the_patch_id_silently(clean_env, caplog):
    clean_env.setenv(config.DISABLE_VAR, "KV_Cache_Dtype")
    with caplog.at_level(logging.WARNING, logger="overlay"):
        assert config.disabled_patch_ids() == {"kv-cache-dtype"}
        assert config.disabled_patch_ids(PATCH_IDS) == {"kv-cache-dtype"}
    assert _warnings(caplog) == [] and config.problems(PATCH_IDS) == []
    # and the engine leaves that patch out (it used to stay applied, with nothing said); in a
    # process of its own: this one's engine has been activated by other tests
    code = "import json, overlay; print(json.dumps({s.id: s.reason for s in overlay.status()}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, **{config.DISABLE_VAR: "KV_Cache_Dtype"}), check=True)
    reasons = json.loads(done.stdout)
    assert "would be: disabled" in reasons["kv-cache-dtype"]
    assert "would be: disabled" not in reasons["attention-guard"]


def test_an_unknown_patch_id_is_named_with_the_valid_ids_and_the_closest(clean_env, caplog):
    clean_env.setenv(config.DISABLE_VAR, "kv-cachedtype,attention-guard,zzz")
    with caplog.at_level(logging.WARNING, logger="overlay"):
        assert config.disabled_patch_ids(PATCH_IDS) == {"attention-guard"}
    (message,) = _warnings(caplog)
    assert "'kv-cachedtype' (did you mean 'kv-cache-dtype'?)" in message and "'zzz'" in message
    assert f"valid ids: {', '.join(sorted(PATCH_IDS))} (or all)" in message
    assert "the patches left out are attention-guard" in message
    assert config.problems(PATCH_IDS) == [message]


def test_the_old_guard_mode_strict_is_check_with_a_note_not_a_problem(clean_env, caplog):
    clean_env.setenv(config.GUARD_VAR, "strict")
    with caplog.at_level(logging.WARNING, logger="overlay"):
        assert config.guard_mode() == "check"
    (message,) = _warnings(caplog)
    assert "'strict' is deprecated: that mode is now called 'check'" in message
    assert config.problems() == []  # accepted: --strict does not fail on it


# -- logging: ATTN_OVERLAY_LOG_LEVEL and ATTN_OVERLAY_LOG_RANKS (what they print: test_logging.py) --


@pytest.mark.parametrize("raw", ["debug", "INFO", " Warning ", "error"])
def test_log_level_accepts_the_four_levels_in_any_case(raw, clean_env, caplog):
    clean_env.setenv(config.LOG_LEVEL_VAR, raw)
    with caplog.at_level(logging.WARNING, logger="overlay"):
        assert config.value(config.LOG_LEVEL_VAR).value == raw.strip().lower()
        assert config.log_level() == getattr(logging, raw.strip().upper())
    assert _warnings(caplog) == [] and config.problems() == []


def test_log_level_default_is_warning_as_without_the_setting(clean_env):
    assert config.BY_NAME[config.LOG_LEVEL_VAR].default == "warning"
    assert config.log_level() == logging.WARNING


@pytest.mark.parametrize(
    ("environment", "level"),
    [
        ({"RANK": "0"}, logging.INFO),
        ({"RANK": "1"}, logging.WARNING),  # below warning on rank 0 only
        ({"RANK": "1", config.LOG_RANKS_VAR: "all"}, logging.INFO),
        ({"RANK": "3", config.LOG_RANKS_VAR: "ALL"}, logging.INFO),
        ({"LOCAL_RANK": "2"}, logging.WARNING),  # a launcher that sets LOCAL_RANK only
        ({"RANK": "0", "LOCAL_RANK": "1"}, logging.INFO),  # RANK (the job's) comes first
        ({"RANK": "node-a"}, logging.INFO),  # not a number: no rank
    ],
)
def test_only_rank_0_logs_below_warning_unless_every_rank_is_asked(environment, level, clean_env):
    clean_env.setenv(config.LOG_LEVEL_VAR, "info")
    for name, raw in environment.items():
        clean_env.setenv(name, raw)
    assert config.log_level() == level


def test_error_applies_on_every_rank(clean_env):
    clean_env.setenv(config.LOG_LEVEL_VAR, "error")
    clean_env.setenv("RANK", "5")
    assert config.log_level() == logging.ERROR


def test_the_rank_is_read_from_the_environment_without_torch_distributed(clean_env):
    assert config.process_rank() is None
    clean_env.setenv("LOCAL_RANK", "3")
    assert config.process_rank() == 3
    clean_env.setenv("RANK", " 7 ")
    assert config.process_rank() == 7
    clean_env.setenv("RANK", "x")
    assert config.process_rank() is None


def test_the_package_logs_on_one_documented_logger():
    assert config.LOGGER_NAME == "overlay" == engine.logger.name == config.logger.name
    assert f"``{config.LOGGER_NAME}``" in config.__doc__ and config.LOG_LEVEL_VAR in config.__doc__
    assert f"`{config.LOGGER_NAME}` logger" in config.BY_NAME[config.LOG_LEVEL_VAR].meaning


def test_the_guard_reads_its_mode_once_not_per_call(clean_env):
    before = guard.get_mode()
    clean_env.setenv(config.GUARD_VAR, "off" if before != "off" else "check")
    assert guard.get_mode() == before  # read when overlay.guard was imported, not again
    previous = guard.set_mode(None)  # None: the setting, read again
    try:
        assert guard.get_mode() == config.guard_mode() != before
    finally:
        guard.set_mode(previous)


# -- python -m overlay.apply: the settings in force, and --strict --------------------------------------


def _report(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    code = cli.main(list(args))
    return code, capsys.readouterr().out


def test_the_report_shows_every_setting_and_where_it_comes_from(clean_env, capsys):
    clean_env.setenv(config.GUARD_VAR, "check")
    code, out = _report(clean_env, capsys, "--json", "--no-verify")
    document = json.loads(out)
    assert code == 0 and document["schema"] == cli.SCHEMA == 1
    assert list(document["settings"]) == [s.name for s in config.SETTINGS]
    assert document["settings"][config.GUARD_VAR] == {
        "value": "check", "source": "environment", "raw": "check", "default": "align", "problem": None,
        "deprecated": None,
    }
    assert document["settings"][config.STRICT_VAR]["source"] == "default"
    assert document["settings"][config.DISABLE_VAR]["value"] == []
    code, out = _report(clean_env, capsys, "--no-verify")
    assert re.search(rf"^  {config.GUARD_VAR} +check +from the environment$", out, re.M), out
    assert re.search(rf"^  {config.STRICT_VAR} +0 +default$", out, re.M), out


@pytest.mark.parametrize(("name", "raw"), [(config.DISABLE_VAR, "kv-cachedtype"), (config.STRICT_VAR, "2")])
def test_strict_fails_on_a_bad_setting_and_the_report_names_it(name, raw, clean_env, capsys):
    clean_env.setenv(name, raw)
    code, out = _report(clean_env, capsys, "--json", "--no-verify")
    document = json.loads(out)
    assert code == 0 and document["ok"] is True  # not strict: reported, not failed
    problem = document["settings"][name]["problem"]
    assert problem and f"{name}={raw!r}" in problem
    code, out = _report(clean_env, capsys, "--json", "--no-verify", "--strict")
    assert code == 1 and json.loads(out)["ok"] is False
    code, out = _report(clean_env, capsys, "--no-verify", "--strict")
    assert code == 1 and problem.removeprefix("attn-overlay: ") in out


# -- the README's settings table --------------------------------------------------------------------


def _settings_block(text: str) -> str:
    start, end = text.index(readme_table.SETTINGS_START), text.index(readme_table.SETTINGS_END)
    return text[start + len(readme_table.SETTINGS_START) : end].strip("\n")


def test_the_readme_settings_table_is_the_generated_one():
    text = readme_table.README.read_text(encoding="utf-8")
    assert readme_table.SETTINGS_START in text, "README.md has no settings markers (see scripts/readme_table.py)"
    assert _settings_block(text) == readme_table.render_settings()


def test_check_fails_on_a_stale_settings_table_and_the_script_repairs_it(tmp_path, capsys):
    text = readme_table.README.read_text(encoding="utf-8")
    if readme_table.SETTINGS_START not in text:  # the markers as the README is to hold them
        text += f"\n{readme_table.SETTINGS_START}\n{readme_table.SETTINGS_END}\n"
    current = readme_table.render_readme(text)
    rows = _settings_block(current).splitlines()
    assert len(rows) == 3 + len(config.SETTINGS)
    for setting in config.SETTINGS:
        assert any(row.startswith(f"| `{setting.name}` | {readme_table.cell(setting.values)} |") for row in rows)
    readme = tmp_path / "README.md"
    readme.write_text(current.replace(f"| `{config.STRICT_VAR}` |", f"| `{config.STRICT_VAR}_OLD` |"), encoding="utf-8")
    assert readme_table.main(["--check", "--readme", str(readme)]) == 1
    assert "stale" in capsys.readouterr().err
    assert readme_table.main(["--readme", str(readme)]) == 0
    assert readme.read_text(encoding="utf-8") == current
    readme.write_text(current.replace(readme_table.SETTINGS_END, ""), encoding="utf-8")  # half a pair
    assert readme_table.main(["--check", "--readme", str(readme)]) == 2


# -- ATTN_OVERLAY_FIXES (issue 40) -------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["all", "errors", " ERRORS ", "All"])
def test_fixes_takes_all_or_errors(raw, clean_env, caplog):
    clean_env.setenv(config.FIXES_VAR, raw)
    with caplog.at_level(logging.WARNING, logger="overlay"):
        assert config.fixes() == raw.strip().lower()
    assert _warnings(caplog) == [] and config.problems() == []


def test_fixes_defaults_to_all(clean_env):
    assert config.fixes() == config.FIXES_ALL == config.BY_NAME[config.FIXES_VAR].default


@pytest.mark.parametrize(("raw", "closest"), [("error", "errors"), ("eror", "errors"), ("al", "all"), ("crashes", None)])
def test_a_fixes_value_outside_the_table_is_named_with_the_closest_and_keeps_outputs_stock(raw, closest, clean_env, caplog):
    # Not the default: a typo of someone choosing what changes must not bring the output changes back.
    clean_env.setenv(config.FIXES_VAR, raw)
    with caplog.at_level(logging.WARNING, logger="overlay"):
        assert config.fixes() == config.FIXES_ERRORS
        assert config.fixes() == config.FIXES_ERRORS  # read again: no second warning
    (message,) = _warnings(caplog)
    assert f"{config.FIXES_VAR}={raw!r} is not a choice of fixes" in message
    assert f"(accepted: {config.BY_NAME[config.FIXES_VAR].values})" in message
    assert ("(did you mean " + repr(closest) + "?)" in message) if closest else "did you mean" not in message
    assert "using errors, which changes no call that completes on the stock release" in message
    assert config.problems() == [message]


def test_the_engine_reads_fixes_once_with_the_other_settings(clean_env):
    clean_env.setenv(config.FIXES_VAR, "errors")
    assert engine.Settings.from_env().fixes == config.FIXES_ERRORS
    clean_env.delenv(config.FIXES_VAR)
    assert engine.Settings.from_env().fixes == config.FIXES_ALL


def test_status_before_activation_says_what_fixes_would_leave_out():
    # In a process of its own (this one's engine has been activated by other tests): the patches the
    # release would get that change completed calls would be disabled, naming the setting; the
    # errors-only ones would not.
    code = "import json, overlay; print(json.dumps({s.id: [s.reason, s.changes] for s in overlay.status()}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, **{config.FIXES_VAR: "errors"}), check=True)
    reasons = json.loads(done.stdout)
    patches = {p.id: p for p in engine.known_patches()}
    version_here = engine.installed_transformers_version()
    for pid, (reason, changes) in reasons.items():
        assert changes == patches[pid].changes
        pending = engine.gate(patches[pid], version_here)[0] == engine.PENDING
        if pending and changes != "errors":
            assert "would be: disabled (disabled by ATTN_OVERLAY_FIXES=errors: it changes the output" in reason, reason
        else:
            assert "ATTN_OVERLAY_FIXES" not in reason, reason


def test_a_bad_fixes_value_fails_strict_mode(clean_env):
    clean_env.setenv(config.FIXES_VAR, "sometimes")
    done = subprocess.run([sys.executable, "-m", "overlay.apply", "--strict", "--no-verify", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    report = json.loads(done.stdout)
    assert done.returncode == 1 and report["ok"] is False
    entry = report["settings"][config.FIXES_VAR]
    assert entry["value"] == "errors" and "is not a choice of fixes" in entry["problem"]
    assert {row["id"]: row["changes"] for row in report["patches"]} == {p.id: p.changes for p in engine.known_patches()}
