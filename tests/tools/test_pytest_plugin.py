"""The pytest plugin (``overlay/pytest_plugin.py``, entry point ``pytest11: attn_overlay``).

Each case runs pytest in a subprocess (``pytester.runpytest_subprocess``): the startup hook, the
import of transformers and the fake device are per process, and the test process itself must stay
as it is. The development environments install the project in editable mode, which ships no
startup hook; where a case needs one, a ``sitecustomize.py`` in the subprocess's working folder
(pytester puts it on ``PYTHONPATH``) runs the import line ``attn_overlay.pth`` runs. The last case
installs the wheel into a fresh environment, where the real ``.pth`` file does it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import overlay
from overlay import engine
from overlay.testing import fake_device as fake_device_module

pytest_plugins = ["pytester"]

TRANSFORMERS_VERSION = version("transformers")
PATCH_COUNT = len(engine.known_patches())
#: pytester points HOME at its own folder: the fake device's compiled backend is looked up where
#: this process finds it, not rebuilt (a minute) in every subprocess.
FAKE_DEVICE_CACHE = str(fake_device_module.cache_root())

#: What ``attn_overlay.pth`` does at interpreter start in a regular install.
STARTUP_HOOK_LINE = "import _attn_overlay_startup  # the line attn_overlay.pth runs\n"

#: ``7 applied, 2 out of range``: one count per state, summing to the number of patches.
COUNTS = r"(?P<counts>\d+ [a-z ]+(?:, \d+ [a-z ]+)*)"


def _header(result: pytest.RunResult) -> re.Match:
    for line in result.outlines:
        match = re.fullmatch(
            rf"attn-overlay {re.escape(overlay.__version__)}: (?P<prefix>none in force, would be )?{COUNTS} "
            rf"\(transformers {re.escape(TRANSFORMERS_VERSION)}, (?P<hook>.+)\)",
            line,
        )
        if match:
            assert sum(int(part.split()[0]) for part in match["counts"].split(", ")) == PATCH_COUNT, line
            return match
    raise AssertionError("no attn-overlay header line in:\n" + result.stdout.str())


@pytest.fixture
def hook_off(monkeypatch):
    monkeypatch.setenv("ATTN_OVERLAY", "0")


@pytest.fixture
def hook_on(pytester, monkeypatch):
    """The subprocess starts with the startup hook loaded and switched on, as a wheel install does."""
    monkeypatch.setenv("ATTN_OVERLAY", "1")
    pytester.makepyfile(sitecustomize=STARTUP_HOOK_LINE)


NO_HEAVY_IMPORTS = """
import sys

def test_nothing_heavy_imported():
    assert not {"torch", "transformers"} & set(sys.modules), "imported by the plugin's header"
"""


# -- the header -----------------------------------------------------------------------------------


def test_header_says_the_hook_is_off_and_the_run_is_untouched(pytester, hook_off):
    pytester.makepyfile(NO_HEAVY_IMPORTS)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    header = _header(result)
    assert header["prefix"], "nothing is in force with the hook off"
    assert header["hook"] == "hook inactive: ATTN_OVERLAY=0"


def test_header_before_transformers_is_imported_says_pending_import(pytester, hook_on):
    pytester.makepyfile(NO_HEAVY_IMPORTS)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    header = _header(result)
    assert header["hook"] == "hook armed"
    assert not header["prefix"]
    gate = {engine.gate(patch, TRANSFORMERS_VERSION)[0] for patch in engine.known_patches()}
    assert ("pending import" in header["counts"]) == (engine.PENDING in gate)


def test_plugin_module_imports_neither_torch_transformers_nor_packaging():
    code = (
        "import json, sys, overlay.pytest_plugin\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.partition('.')[0] in ('torch', 'transformers', 'packaging'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_plugin_is_registered_through_its_entry_point():
    from importlib.metadata import entry_points

    (entry,) = [ep for ep in entry_points(group="pytest11") if ep.name == "attn_overlay"]
    # A top-level module of its own, which loads overlay.pytest_plugin (see the test below).
    assert entry.value == "_attn_overlay_pytest"


# -- strict mode ----------------------------------------------------------------------------------


def test_strict_passes_with_the_hook_active(pytester, hook_on):
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess("--attn-overlay-strict")
    assert result.ret == 0, result.stderr.str()
    header = _header(result)
    assert header["hook"] == "hook active"
    assert not header["prefix"]


@pytest.mark.parametrize("how", ["option", "ini"])
def test_strict_fails_at_session_start_with_the_hook_off(pytester, hook_off, how):
    pytester.makepyfile("def test_never_runs():\n    raise AssertionError('collected and run')\n")
    if how == "ini":
        pytester.makeini("[pytest]\nattn_overlay_strict = true\n")
    result = pytester.runpytest_subprocess(*(["--attn-overlay-strict"] if how == "option" else []))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = result.stderr.str()
    assert "attn-overlay strict check failed" in errors
    assert "ATTN_OVERLAY=0" in errors and "Unset ATTN_OVERLAY" in errors
    assert "collected and run" not in result.stdout.str()


@pytest.mark.skipif("_attn_overlay_startup" in sys.modules, reason="attn-overlay is installed with its startup hook here")
def test_strict_fails_without_a_startup_hook_and_says_how_to_get_one(pytester, monkeypatch):
    monkeypatch.setenv("ATTN_OVERLAY", "1")  # switched on, but an editable install has no hook to switch on
    pytester.makepyfile("def test_never_runs():\n    raise AssertionError('collected and run')\n")
    result = pytester.runpytest_subprocess("--attn-overlay-strict")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = result.stderr.str()
    assert "Install attn-overlay as a regular package" in errors and "editable" in errors


def test_strict_ini_false_leaves_the_run_alone(pytester, hook_off):
    pytester.makepyfile("def test_ok():\n    pass\n")
    pytester.makeini("[pytest]\nattn_overlay_strict = false\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)


#: Settings outside the table, and the words of the warning each earns.
BAD_SETTINGS = [
    ("ATTN_OVERLAY_DISABLE", "kv-cache-dtyp", "names no patch 'kv-cache-dtyp' (did you mean 'kv-cache-dtype'?)"),
    ("ATTN_OVERLAY_ATTENTION_GUARD", "alighn", "'alighn' is not a mode"),
]


@pytest.mark.parametrize(("name", "value", "said"), BAD_SETTINGS, ids=[name for name, _, _ in BAD_SETTINGS])
def test_strict_fails_on_a_setting_outside_the_table_and_says_why(pytester, hook_on, monkeypatch, name, value, said):
    # What `python -m overlay.apply --strict` exits 1 on: the hook is active and every patch is
    # well, so the setting alone fails the session.
    from overlay import install_check

    monkeypatch.setenv(name, value)
    pytester.makepyfile("def test_never_runs():\n    raise AssertionError('collected and run')\n")
    result = pytester.runpytest_subprocess("--attn-overlay-strict")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    errors = result.stderr.str()
    assert "attn-overlay strict check failed" in errors
    cli_fails_on = install_check.setting_problems()  # the same environment, judged as the CLI judges it
    assert len(cli_fails_on) == 1 and said in cli_fails_on[0]
    assert f"  - {cli_fails_on[0].removeprefix('attn-overlay: ')}. Correct the value or unset the variable" in errors
    assert "collected and run" not in result.stdout.str()


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [BAD_SETTINGS[0], ("ATTN_OVERLAY_ATTENTION_GUARD", "strict", "'strict' is deprecated")],
    ids=["misspelled patch id", "deprecated name"],
)
@pytest.mark.parametrize("verbosity", [[], ["-q"]], ids=["header", "quiet"])
def test_a_settings_warning_is_in_the_output_without_strict(pytester, hook_off, monkeypatch, name, value, said,
                                                           verbosity):
    # The engine logs it on activation, which pytest's log capture hides (and a run that never
    # imports transformers never activates): the plugin says it, in the header or, under -q, which
    # hides the header, at the end of the run.
    monkeypatch.setenv(name, value)
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess(*verbosity)
    result.assert_outcomes(passed=1)
    (line,) = [line for line in result.outlines if said in line]
    assert line.startswith(f"attn-overlay: {name}={value!r} ")
    if verbosity:
        result.stdout.fnmatch_lines(["*= attn-overlay settings =*", f"attn-overlay: {name}=*"])
    else:
        _header(result)  # the header line is still there, above the warning
        assert result.outlines.index(line) < result.outlines.index("collected 1 item")


def test_no_settings_warning_where_every_setting_is_accepted(pytester, hook_off, monkeypatch):
    monkeypatch.setenv("ATTN_OVERLAY_DISABLE", "KV_CACHE_DTYPE")  # case ignored, _ read as -: accepted
    pytester.makepyfile("def test_ok():\n    pass\n")
    for verbosity in ([], ["-q"]):
        result = pytester.runpytest_subprocess(*verbosity)
        result.assert_outcomes(passed=1)
        assert not [line for line in result.outlines if line.startswith("attn-overlay: ")], result.outlines


DISPLACING_CONFTEST = """
import importlib, pathlib

from overlay import engine

for name in sorted({patch.module for patch in engine.known_patches()}):
    importlib.import_module(name)  # the startup hook activates the overlay on the first
states = {status.id: status.state for status in engine.status()}
displaced = ""
for patch in engine.known_patches():
    if states[patch.id] != "applied":
        continue
    for target in patch.targets:
        owner, name, raw = target.locate(importlib.import_module(patch.module))
        if raw is not None:
            def impostor(*args, **kwargs):
                raise AssertionError("a test library's own replacement")

            setattr(owner, name, impostor)
            displaced = patch.id
            break
    if displaced:
        break
pathlib.Path("displaced.txt").write_text(displaced)
"""


def test_strict_fails_when_a_conftest_displaces_a_patch(pytester, hook_on):
    pytester.makeconftest(DISPLACING_CONFTEST)
    pytester.makepyfile("def test_never_runs():\n    raise AssertionError('collected and run')\n")
    result = pytester.runpytest_subprocess("--attn-overlay-strict")
    displaced = (pytester.path / "displaced.txt").read_text()
    if not displaced:
        pytest.skip(f"no patch applies on transformers {TRANSFORMERS_VERSION}: nothing to displace")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    errors = result.stderr.str()
    assert f"- {displaced}: displaced: " in errors
    assert "impostor" in errors, "names what took the patch's place"


# -- fixtures -------------------------------------------------------------------------------------

FIXTURE_TESTS = """
import importlib

import pytest

import overlay
from overlay import engine



def applied_ids():
    return {status.id for status in overlay.status() if status.state == "applied"}


def test_applied_yields_the_statuses_in_force(attn_overlay_applied):
    # First in the module: the fixture imports the patches' modules itself.
    assert overlay.is_active()
    assert any(s.state == "applied" for s in attn_overlay_applied) == any(
        engine.gate(patch, engine.installed_transformers_version())[0] == engine.PENDING
        for patch in engine.known_patches()
    )
    assert {s.id for s in attn_overlay_applied if s.state == "applied"} == applied_ids()
    assert len(attn_overlay_applied) == len(engine.known_patches())


def test_applied_is_reverted_after_the_test():
    assert not applied_ids()


@pytest.fixture(scope="module")
def overlay_on():
    for module in sorted({patch.module for patch in engine.known_patches()}):
        importlib.import_module(module)  # judged at once: applied now, reverted after
    with overlay.applied() as statuses:
        yield {status.id for status in statuses if status.state == "applied"}


def test_reverted_gives_stock_transformers(overlay_on, attn_overlay_reverted):
    assert not applied_ids()


def test_patches_come_back_after_reverted(overlay_on):
    assert applied_ids() == overlay_on


def test_fake_device(fake_device):
    import torch

    assert fake_device.type == "fakeaccel"
    on_device = torch.arange(3, device=fake_device)
    assert on_device.device == fake_device and (on_device.cpu() == torch.arange(3)).all()
"""


def test_fixtures(pytester, hook_off, monkeypatch):
    monkeypatch.setenv("ATTN_OVERLAY_CACHE_DIR", FAKE_DEVICE_CACHE)
    pytester.makepyfile(FIXTURE_TESTS)
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=5)


def test_fake_device_skips_with_the_reason_when_it_cannot_be_installed(pytester, hook_off):
    pytester.makeconftest("import torch\ntorch.utils.rename_privateuse1_backend('othername')\n")
    pytester.makepyfile("def test_needs_it(fake_device):\n    raise AssertionError('ran without a device')\n")
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*fake device unavailable: RuntimeError: *already named 'othername'*"])


# -- end to end: the wheel in a fresh environment -----------------------------------------------


def _folder_holding(module: str) -> str | None:
    """The sys.path entry this process imports ``module`` from (found, not imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(next(iter(spec.submodule_search_locations))).parent)


@pytest.mark.slow
def test_wheel_in_a_fresh_environment(tmp_path):
    """The wheel's startup hook (its real ``.pth`` file) and its entry point, as a user gets them.
    torch and transformers come from this process's folders through path lines, as the test
    harness's fresh environments do (no download: runs offline)."""
    from tests.freshenv import REPO, build_wheel, install_wheel, make_fresh_env

    wheel = build_wheel(tmp_path / "wheel")
    env = make_fresh_env(tmp_path / "env")
    install_wheel(env, wheel)
    extra = {_folder_holding(name) for name in ("torch", "transformers")} - {None}
    # A release lane reaches its shared torch through a path line of its own: name it too.
    (env.site_packages / "zz_runner_torch.pth").write_text("".join(f"{folder}\n" for folder in sorted(extra)))
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_tiny.py").write_text("def test_ok():\n    pass\n")
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def run(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
        return env.run("-m", "pytest", "-p", "no:cacheprovider", *args, env={**offline, **env_vars},
                       cwd=str(project), check=False)

    plain, strict, hook_off = run(), run("--attn-overlay-strict"), run("--attn-overlay-strict", ATTN_OVERLAY="0")
    installed = env.run("-c", "import overlay; print(overlay.__file__)").stdout
    assert str(env.site_packages) in installed, "the fresh environment imports the wheel's overlay"
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert re.search(rf"^attn-overlay \S+: .*\(transformers {re.escape(TRANSFORMERS_VERSION)}, hook armed\)$",
                     plain.stdout, re.M), plain.stdout
    assert strict.returncode == 0, strict.stdout + strict.stderr
    assert re.search(r"^attn-overlay \S+: .*, hook active\)$", strict.stdout, re.M), strict.stdout
    assert hook_off.returncode == pytest.ExitCode.USAGE_ERROR, hook_off.stdout + hook_off.stderr
    assert "ATTN_OVERLAY=0" in hook_off.stderr
    # pytest marks the distribution's top-level modules for rewriting; the startup module, imported
    # before pytest runs, says PYTEST_DONT_REWRITE, so no warning.
    for done in (plain, strict):
        assert "PytestAssertRewriteWarning" not in done.stdout, done.stdout


def test_a_projects_own_overlay_module_does_not_stop_pytest(pytester, hook_off):
    # The entry point is the top-level _attn_overlay_pytest: an entry point naming
    # overlay.pytest_plugin would stop pytest there ("Error while loading plugin", exit 3).
    pytester.makepyfile(overlay="NOT_ATTN_OVERLAY = True\n")
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess()  # `python -m pytest` in that folder: it comes first on sys.path
    assert result.ret == 0, result.stderr.str()
    result.stdout.fnmatch_lines(["attn-overlay: plugin not loaded*"])
    strict = pytester.runpytest_subprocess("--attn-overlay-strict")
    assert strict.ret == pytest.ExitCode.USAGE_ERROR, strict.stdout.str()
    assert "plugin not loaded" in strict.stderr.str()
