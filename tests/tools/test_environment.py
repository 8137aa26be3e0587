"""``attn-overlay env`` / ``python -m overlay.apply --env``: the block to paste into a bug report.

- every key is there, torch's version is named, one line per patch, the changed settings;
- ``--json`` carries the same keys and values as the text; ``attn-overlay env`` is the same command,
  and ``python -m overlay.apply env`` still runs a program named env;
- an absent package reads "not installed"; a probe that raises is reported, not raised; torch is
  not imported where it cannot see an accelerator, transformers never;
- where the wheel is installed, the startup hook reads installed and active;
- an Intel Gaudi card (a stand-in ``habana_frameworks.torch``) is the accelerator found, with its
  plug-in's version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
from importlib.metadata import version
from pathlib import Path

import pytest

from overlay import __version__, config, engine, environment

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
#: Set in the runs below: two settings that differ from the default (ATTN_OVERLAY=0 comes from conftest).
CHANGED_SETTINGS = {"ATTN_OVERLAY_DISABLE": "kv_cache_dtype", "ATTN_OVERLAY_REPORT": "1"}
HPU_PLUGIN_VERSION = "1.21.0.555"


def _run(
    *args: str, cwd: Path = REPO, env: dict | None = None, program: list[str] | None = None, path_first: Path | None = None
):
    """``python -m overlay.apply ARGS`` (or ``program ARGS``) on this tree's overlay, with ``env``
    and no other ATTN_OVERLAY_* setting than conftest's ``ATTN_OVERLAY=0``; ``path_first`` goes
    before the tree on the path. Returns (completed process, wall seconds)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OVERLAY_")}
    full = dict(clean, **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join(str(p) for p in (path_first, REPO) if p)
    started = time.perf_counter()
    done = subprocess.run(
        (program or [sys.executable, "-m", "overlay.apply"]) + list(args),
        cwd=cwd, env=full, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    return done, time.perf_counter() - started


def _parse_block(text: str) -> dict[str, str]:
    lines = {}
    for line in text.splitlines():
        assert line.startswith("- "), line
        key, sep, value = line[2:].partition(": ")
        assert sep and key not in lines, line
        lines[key] = value
    return lines


@pytest.fixture(scope="module")
def block():
    """The text block and the JSON object, from two runs with :data:`CHANGED_SETTINGS` set."""
    text, text_seconds = _run("--env", env=CHANGED_SETTINGS)
    as_json, _ = _run("--env", "--json", env=CHANGED_SETTINGS)
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    print(f"\n`python -m overlay.apply --env` took {text_seconds:.2f} s (wall, this machine)")
    return _parse_block(text.stdout), json.loads(as_json.stdout)


def test_the_block_has_every_key_and_names_torchs_version(block):
    lines, _ = block
    for key in (
        "attn-overlay", "transformers", "torch", *environment.LIBRARIES, "accelerator", "python", "os",
        "startup hook active", "startup hook installed", "patches", "settings",
    ):
        assert key in lines, key
    assert lines["attn-overlay"] == f"{__version__} ({REPO / 'overlay'})"
    assert lines["transformers"] == version("transformers")
    assert lines["transformers.__version__"] == version("transformers")  # read from its __init__.py, not imported
    assert lines["torch"] == version("torch")
    import torch

    build = lines["torch build"]
    assert build == environment.torch_build()["torch build"]
    if torch.version.cuda:
        assert f"CUDA {torch.version.cuda}" in build
    elif not (torch.version.hip or getattr(torch.version, "xpu", None)):
        assert build == "CPU (no CUDA, ROCm or XPU in this build)"
    assert lines["python"].startswith(sys.version.split()[0])
    # the conftest switches the hook off for every test process: that is the reason given
    assert lines["startup hook active"] == f"no: {config.ENABLE_VAR}=0 is set: the startup hook is turned off"


def test_every_patch_has_its_state_line(block):
    lines, _ = block
    states = {engine.FIXED_UPSTREAM, engine.OUT_OF_RANGE, engine.NOT_INSTALLED, engine.DISABLED, engine.PENDING}
    patches = engine.known_patches()
    assert patches
    for patch in patches:
        state = lines[patch.id]
        assert state.startswith(f"{engine.INACTIVE} (would be: "), state  # transformers is never imported there
        assert state.removeprefix(f"{engine.INACTIVE} (would be: ").rstrip(")") in states, state
    assert lines["kv-cache-dtype"] == f"{engine.INACTIVE} (would be: {engine.DISABLED})"  # ATTN_OVERLAY_DISABLE


def test_json_carries_the_same_keys_and_values_as_the_text(block):
    lines, as_json = block
    assert list(as_json) == list(lines)
    assert as_json == lines


def test_the_settings_that_differ_are_listed_and_only_those(block):
    lines, _ = block
    changed = {config.ENABLE_VAR: "0", **CHANGED_SETTINGS}
    assert lines["settings"] == ", ".join(s.name for s in config.SETTINGS if s.name in changed) + " differ from the default"
    for setting in config.SETTINGS:
        if setting.name in changed:
            assert lines[setting.name] == changed[setting.name]
        else:
            assert setting.name not in lines


def test_a_value_outside_the_table_says_so(tmp_path):
    done, _ = _run("--env", env={config.REPORT_VAR: "maybe"})
    lines = _parse_block(done.stdout)
    assert lines[config.REPORT_VAR].startswith("maybe (ATTN_OVERLAY_REPORT='maybe' is not an accepted value")


def test_an_absent_package_reads_not_installed(block):
    lines, _ = block
    assert environment.distribution_version("no-such-distribution-for-attn-overlay") == environment.NOT_INSTALLED
    for name in environment.LIBRARIES:
        assert lines[name] == environment.distribution_version(name)
    assert environment.NOT_INSTALLED in {lines[name] for name in environment.LIBRARIES}, "every library installed?"


def test_a_probe_that_raises_is_reported_not_raised(monkeypatch):
    def broken():
        raise RuntimeError("driver exploded\nsecond line")

    monkeypatch.setattr(environment, "accelerator_lines", broken)
    monkeypatch.setattr(environment, "torch_build", broken)
    monkeypatch.setattr(environment, "_hook_installed", broken)
    lines = environment.collect()
    for key in ("accelerator", "torch build", "startup hook installed"):
        assert lines[key] == "error: RuntimeError: driver exploded", key
    assert lines["transformers"] == version("transformers")  # the other probes still ran
    assert environment.format_block(lines).splitlines()[0].startswith("- attn-overlay: ")


def test_where_torch_cannot_see_an_accelerator_the_block_does_not_import_it(monkeypatch):
    from overlay.doctor import _env

    code = "import sys; from overlay import environment; environment.collect(); print('torch' in sys.modules)"
    done, _ = _run("-c", code, program=[sys.executable])
    assert done.returncode == 0, done.stderr
    if environment.cannot_see_an_accelerator(_env.installed_plugins()):
        assert done.stdout.split() == ["False"]
    # ... and whatever may see one is asked:
    assert not environment.cannot_see_an_accelerator(["torch_neuronx"])
    monkeypatch.setattr(environment, "torch_version_file", lambda: {"cuda": "12.8"})
    assert not environment.cannot_see_an_accelerator([])
    assert environment.torch_build() == {"torch build": "CUDA 12.8"}
    monkeypatch.setattr(environment, "torch_version_file", lambda: {"hip": "6.3.42131", "rocm": "6.3.1"})
    assert environment.torch_build() == {"torch build": "ROCm 6.3.1 (HIP 6.3.42131)"}


def test_the_block_imports_neither_transformers_nor_torchs_submodules():
    code = textwrap.dedent(
        """
        import sys, torch
        before = set(sys.modules)
        from overlay import environment
        environment.collect()
        print(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("torch", "transformers")))
        """
    )
    done, _ = _run("-c", code, program=[sys.executable])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


def test_the_hook_line_says_whether_the_hook_ran_here(monkeypatch):
    def hook(module=None):
        pass

    # What the startup hook leaves in a process it ran in: its one watch, on transformers.
    finder = types.SimpleNamespace(watched=lambda: {"transformers": (hook,)})
    startup = types.SimpleNamespace(finder=lambda: finder, activate_when_transformers_is_imported=hook,
                                    shadowing_module=lambda: None)
    monkeypatch.setitem(sys.modules, "_attn_overlay_startup", startup)
    monkeypatch.setattr(environment, "installed_pth", lambda: "/site-packages/attn_overlay.pth")
    monkeypatch.setenv(config.ENABLE_VAR, "1")
    monkeypatch.setattr(engine, "is_active", lambda: False)
    monkeypatch.delitem(sys.modules, "transformers", raising=False)  # looked up, never imported here
    assert environment.startup_hook_lines()["startup hook active"] == "yes: waiting for `import transformers`"
    monkeypatch.setattr(engine, "is_active", lambda: True)
    assert environment.startup_hook_lines()["startup hook active"].startswith("yes: it activated the overlay")
    # overlay.apply() where no .pth is installed (it imports the startup module, which sets the watch)
    monkeypatch.setattr(environment, "installed_pth", lambda: None)
    line = environment.startup_hook_lines()["startup hook active"]
    assert line.startswith("no, the overlay was applied explicitly (overlay.apply()); the hook: "), line


def test_asking_about_the_hook_does_not_install_it():
    # Where no .pth ran the startup module (an editable install, a source tree), importing it to
    # look for a shadowing overlay.py would install the very hook the line reports missing.
    code = textwrap.dedent(
        """
        import json, sys
        before = "_attn_overlay_startup" in sys.modules
        from overlay import environment
        line = environment.collect()["startup hook active"]
        print(json.dumps([before, "_attn_overlay_startup" in sys.modules, line]))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != config.ENABLE_VAR}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    before, after, line = json.loads(done.stdout.splitlines()[-1])
    assert after == before, line
    assert line.startswith("yes: " if before else "no: "), line


def test_where_the_wheel_is_installed_the_hook_is_installed_and_active(tmp_path):
    from tests.freshenv import build_wheel, install_wheel, make_fresh_env

    fresh = make_fresh_env(tmp_path / "venv")
    install_wheel(fresh, build_wheel(tmp_path / "wheel"))
    without_settings = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OVERLAY")}
    done = subprocess.run([str(fresh.python.parent / "attn-overlay"), "env", "--json"], cwd=tmp_path,
                          env=without_settings, capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = json.loads(done.stdout)
    assert lines["startup hook installed"] == f"yes: {fresh.site_packages / 'attn_overlay.pth'}"
    assert lines["startup hook active"] == "yes: waiting for `import transformers`"
    assert lines["attn-overlay"] == f"{__version__} ({fresh.site_packages / 'overlay'})"
    assert lines["settings"] == "every one at its default"


# -- the command line -----------------------------------------------------------------------------------


def test_attn_overlay_env_is_the_same_command(block):
    lines, _ = block
    script = Path(sys.executable).with_name("attn-overlay")
    if not script.is_file():
        pytest.skip(f"no attn-overlay console script next to {sys.executable}")
    done, _ = _run("env", env=CHANGED_SETTINGS, program=[str(script)])
    assert done.returncode == 0, done.stderr
    assert list(_parse_block(done.stdout)) == list(lines)
    as_json, _ = _run("env", "--json", env=CHANGED_SETTINGS, program=[str(script)])
    assert list(json.loads(as_json.stdout)) == list(lines)


def test_python_dash_m_overlay_apply_env_still_runs_a_program_named_env(tmp_path):
    (tmp_path / "env").write_text("print('the program named env ran')\n")
    done, _ = _run("env", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "the program named env ran"


def test_env_with_a_program_is_refused(tmp_path):
    done, _ = _run("--env", "prog.py", cwd=tmp_path)
    assert done.returncode == 2
    assert "--env runs nothing" in done.stderr


# -- Intel Gaudi (HPU), through a stand-in plug-in ------------------------------------------------------------


def write_hpu_stand_in(folder: Path, *, cards: int = 2, broken: str | None = None) -> Path:
    """A stand-in for Intel Gaudi's ``habana_frameworks.torch`` in ``folder``: importing it
    registers ``torch.hpu`` with ``cards`` GAUDI2 cards, as the real plug-in does (or raises
    ``broken``); its distribution, ``habana-torch-plugin``, has package metadata. Returns ``folder``."""
    package = folder / "habana_frameworks" / "torch"
    package.mkdir(parents=True)
    (folder / "habana_frameworks" / "__init__.py").write_text("")
    if broken:
        body = f"raise RuntimeError({broken!r})\n"
    else:
        body = textwrap.dedent(
            f"""
            import types

            import torch

            hpu = types.ModuleType("torch.hpu")
            hpu.is_available = lambda: True
            hpu.device_count = lambda: {cards}
            hpu.get_device_name = lambda index=0: "GAUDI2"
            torch._register_device_module("hpu", hpu)
            """
        )
    (package / "__init__.py").write_text('"""Stand-in for Intel Gaudi\'s plug-in (tests only)."""\n' + body)
    info = folder / f"habana_torch_plugin-{HPU_PLUGIN_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: habana-torch-plugin\nVersion: {HPU_PLUGIN_VERSION}\n")
    return folder


def test_a_gaudi_card_is_the_accelerator_with_its_plugins_version(tmp_path):
    stand_in = write_hpu_stand_in(tmp_path / "gaudi")
    done, _ = _run("--env", "--json", path_first=stand_in)
    assert done.returncode == 0, done.stderr
    lines = json.loads(done.stdout)
    assert "2 x GAUDI2 (Intel Gaudi) (hpu:0 ... hpu:1)" in lines["accelerator"].split("; ")
    assert lines["habana-torch-plugin"] == HPU_PLUGIN_VERSION
    assert "accelerator problems" not in lines
    assert list(lines).index("habana-torch-plugin") < list(lines).index("accelerate")  # next to torch


def test_the_block_shows_transformers_version_beside_a_metadata_that_says_otherwise(tmp_path):
    # Issue 38: 5.18.0's code under metadata saying 5.26.0 (a source tree, a vendored copy, a fork):
    # the block shows both, and says that the patches judge the code.
    from overlay.testing.harness import fake_version_label

    label = fake_version_label(tmp_path, "5.26.0")
    done = subprocess.run([sys.executable, "-m", "overlay.apply", "--env"], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=label), timeout=300)
    lines = _parse_block(done.stdout)
    assert lines["transformers"] == "5.26.0", done.stderr
    assert lines["transformers.__version__"] == (
        f"{version('transformers')} (not the package metadata's: each patch judges the code it finds)"
    )
