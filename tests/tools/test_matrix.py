"""The installed transformers release gets exactly the statuses the matrix declares, and code
that matches no known fingerprint is refused ("unrecognised code"), by the engine and by
``python -m overlay.apply``.

This module runs in every nox lane (one transformers release each): the expectation comes from
``scripts/matrix_data.py`` (each patch's ``affected`` / ``fixed_in``), the outcome from the
engine reading the release's real code, so the lanes together prove the patch declarations and
the fingerprints agree on every release.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import inspect
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import fingerprint_release as tool  # noqa: E402
import matrix_data  # noqa: E402
import readme_table  # noqa: E402

import overlay  # noqa: E402
from overlay import engine  # noqa: E402
from overlay.patch import PATCH_MARKER, fingerprint  # noqa: E402
from overlay.testing.harness import fake_version_label  # noqa: E402

pytestmark = pytest.mark.lane  # every release lane runs this module (noxfile.py)

INSTALLED = version("transformers")
PATCHES = matrix_data.load_patches()
EXPECTED = matrix_data.expected_statuses(INSTALLED, PATCHES)


def _raw(module, qualname):
    return next(t for p in PATCHES for t in p.targets if t.qualname == qualname).locate(module)


def _function(raw):
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


@pytest.mark.parametrize("patch", PATCHES, ids=[p.id for p in PATCHES])
def test_installed_release_gets_the_declared_status(patch):
    module = importlib.import_module(patch.module)
    with overlay.reverted():
        before = {t.qualname: _raw(module, t.qualname)[2] for t in patch.targets}
        with overlay.applied(only=[patch.id], strict=False) as statuses:
            status = next(s for s in statuses if s.id == patch.id)
            assert (status.state, status.transformers_version) == (EXPECTED[patch.id], INSTALLED), status.reason
            during = {t.qualname: _raw(module, t.qualname)[2] for t in patch.targets}
        after = {t.qualname: _raw(module, t.qualname)[2] for t in patch.targets}

    assert after == before, "leaving overlay.applied() puts the very same objects back"
    present = [t for t in patch.targets if before[t.qualname] is not None]
    if EXPECTED[patch.id] == matrix_data.APPLIED:
        for target in present:
            replacement = _function(during[target.qualname])
            assert getattr(replacement, PATCH_MARKER, None) == patch.id, target.key
            assert replacement.__wrapped__ is _function(before[target.qualname])
        # Each target matched a known original, and the status names which one.
        assert len(status.variants) == len(present)
        assert set(status.variants) <= {v.label for t in present for v in t.originals.values()}
    else:
        assert during == before, f"a {EXPECTED[patch.id]} patch changes nothing"


def test_every_declared_release_range_is_in_the_matrix():
    # A patch whose bug starts or ends outside the proven releases would make the table lie.
    table = matrix_data.matrix()
    for patch in PATCHES:
        statuses = [row[patch.id] for row in table.values()]
        assert matrix_data.APPLIED in statuses, f"{patch.id} applies to no release of the matrix"
        if patch.fixed_in is not None:
            assert patch.fixed_in in matrix_data.RELEASES, f"{patch.id}: fixed_in {patch.fixed_in} is not a lane"
            assert statuses[matrix_data.RELEASES.index(patch.fixed_in)] == matrix_data.FIXED_UPSTREAM


def test_expected_statuses_are_the_engine_gate_in_the_engine_words():
    out_of_range = engine.gate(dataclasses.replace(PATCHES[0], affected="<1", fixed_in=None), "5.13.0")[0]
    assert (matrix_data.APPLIED, matrix_data.FIXED_UPSTREAM, matrix_data.OUT_OF_RANGE) == (
        engine.APPLIED, engine.FIXED_UPSTREAM, out_of_range
    )
    probe = dataclasses.replace(PATCHES[0], affected=">=5.13.0,<5.15.0", fixed_in="5.15.0")
    for release, gate_state, expected in (
        ("5.12.1", out_of_range, matrix_data.OUT_OF_RANGE),
        ("5.13.0", engine.PENDING, matrix_data.APPLIED),
        ("5.14.1", engine.PENDING, matrix_data.APPLIED),
        ("5.14.1.dev0", engine.PENDING, matrix_data.APPLIED),
        ("5.15.0.dev0", engine.FIXED_UPSTREAM, matrix_data.FIXED_UPSTREAM),  # by its release number
        ("5.15.0", engine.FIXED_UPSTREAM, matrix_data.FIXED_UPSTREAM),
    ):
        assert engine.gate(probe, release)[0] == gate_state, release
        assert matrix_data.expected_status(probe, release) == expected, release
    with pytest.raises(ValueError, match="not a PEP 440 version"):
        matrix_data.expected_status(probe, "five")


def test_release_table_is_generated_from_the_matrix():
    text = readme_table.RELEASES_DOC.read_text(encoding="utf-8")
    assert readme_table.replace_block(text, readme_table.render_block()) == text, (
        "docs/releases.md's release table is stale: run python scripts/readme_table.py"
    )


# -- a synthetic changed target --------------------------------------------------------------


def _synthetic_module_text(patch, *, change: str | None) -> str:
    """A module holding a copy of every target of ``patch``, as the installed release ships it
    (same source text, so the same fingerprint), with the names the real module defines;
    ``change`` names the one target whose ``def`` line gets one character more."""
    real = importlib.import_module(patch.module)
    out = [
        "import importlib as _importlib",
        # Decorators run at definition time and need the real module's names.
        "globals().update({k: v for k, v in vars(_importlib.import_module(%r)).items() if not k.startswith('__')})"
        % patch.module,
    ]
    classes: dict[tuple[str, ...], list[str]] = {}
    for target in patch.targets:
        raw = _raw(real, target.qualname)[2]
        if raw is None:
            continue
        # The whole block, as inspect reads it: source_of stops at the last line an instruction
        # covers, so a closing bracket on its own line after it (4.56's _prepare_cache_for_generation)
        # is not in it, and the copy would not compile. Its fingerprint is the same either way.
        block = textwrap.dedent(inspect.getsource(_function(raw)))
        if target.qualname == change:
            lines = block.splitlines(keepends=True)
            at = next(i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "async def ")))
            lines[at] = lines[at].replace("(", "( ", 1)  # still valid Python, no longer the same code
            block = "".join(lines)
        classes.setdefault(tuple(target.qualname.split(".")[:-1]), []).append(block)
    for path, blocks in classes.items():
        for depth, name in enumerate(path):
            out.append("    " * depth + f"class {name}:")
        for block in blocks:
            out.append(textwrap.indent(block, "    " * len(path)))
    return "\n".join(out) + "\n"


def _synthetic_patch(patch, module_name: str, patch_id: str):
    # The patch's own fingerprints and replacements, gated on the installed release so the
    # fingerprint check is what decides (a fixed-upstream release would otherwise be settled by
    # its version number before any code is read).
    return dataclasses.replace(
        patch,
        id=patch_id,
        affected=f"=={INSTALLED}",
        targets=tuple(dataclasses.replace(t, module=module_name) for t in patch.targets),
    )


@pytest.mark.parametrize("patch", PATCHES, ids=[p.id for p in PATCHES])
def test_changed_target_is_unrecognised_and_left_alone(patch, tmp_path, monkeypatch):
    if EXPECTED[patch.id] == matrix_data.OUT_OF_RANGE:
        pytest.skip(f"{patch.id} covers transformers {patch.affected}: its code here is none it knows")
    real = importlib.import_module(patch.module)
    present = [t for t in patch.targets if _raw(real, t.qualname)[2] is not None]
    changed = present[-1]
    stem = f"matrix_synthetic_{patch.id.replace('-', '_')}"
    same_name, changed_name = f"{stem}_same", f"{stem}_changed"
    (tmp_path / f"{same_name}.py").write_text(_synthetic_module_text(patch, change=None))
    (tmp_path / f"{changed_name}.py").write_text(_synthetic_module_text(patch, change=changed.qualname))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (same_name, changed_name):
        monkeypatch.delitem(sys.modules, name, raising=False)

    control = _synthetic_patch(patch, same_name, "synthetic-same")
    altered = _synthetic_patch(patch, changed_name, "synthetic-changed")
    with engine.isolated([control, altered]):
        overlay.apply(strict=False)  # watches both modules: the post-import hook decides
        same_module = importlib.import_module(same_name)
        changed_module = importlib.import_module(changed_name)
        states = {s.id: s for s in overlay.status()}

        # The copy is byte-identical where it counts: same fingerprint, recognised as the real one.
        real_function = _function(_raw(real, changed.qualname)[2])
        copied = _function(_raw(same_module, changed.qualname)[2])
        copied = getattr(copied, "__wrapped__", copied)
        assert fingerprint(copied) == fingerprint(real_function)
        digest = fingerprint(real_function)
        recognised = matrix_data.APPLIED if digest in changed.originals else matrix_data.FIXED_UPSTREAM
        assert states["synthetic-same"].state == recognised, states["synthetic-same"].reason

        # One character more: refused, and no target of the patch touched (all or nothing).
        assert states["synthetic-changed"].state == engine.UNRECOGNISED
        assert "not the code this patch was written for" in states["synthetic-changed"].reason
        assert changed.qualname in states["synthetic-changed"].reason
        for target in present:
            function = _function(_raw(changed_module, target.qualname)[2])
            assert not hasattr(function, PATCH_MARKER), f"{target.key} was patched despite the change"


def _shadow_transformers(root: Path, module: str, qualname: str) -> Path:
    """A ``transformers`` package under ``root`` made of links to the installed one, except the
    file of ``module``, copied with one character changed in ``qualname``'s ``def`` line. Put
    ``root`` first on ``PYTHONPATH``: the installed release's metadata (its version) stays."""
    _, installed_root = tool.installed_transformers()
    relative = Path(module.replace(".", "/") + ".py")
    parts = relative.parts
    source_dir, target_dir = installed_root, root
    for depth, part in enumerate(parts[:-1]):
        source_dir, target_dir = source_dir / part, target_dir / part
        target_dir.mkdir(parents=True)
        for entry in source_dir.iterdir():
            # The next folder on the way to the changed file is rebuilt, not linked; compiled
            # files stay out (no bytecode of the changed copy may land in the real package).
            if entry.name in (parts[depth + 1], "__pycache__"):
                continue
            (target_dir / entry.name).symlink_to(entry)
    data = (installed_root / relative).read_bytes()
    lines = tool.source_lines(data)
    import ast

    first = tool.definition_first_line(ast.parse("".join(lines)), qualname)
    at = next(i for i in range(first - 1, len(lines)) if lines[i].lstrip().startswith(("def ", "async def ")))
    lines[at] = lines[at].replace("(", "( ", 1)
    (root / relative).write_text("".join(lines), encoding="utf-8")
    return root


def test_apply_cli_reports_unrecognised_code_for_a_changed_release(tmp_path):
    # A patch the installed release needs, one of its targets changed by one character in the
    # transformers files the interpreter imports, the version number untouched: what a user
    # sees on a release (or a local build) the overlay does not know.
    # A target no other target reads as well (one declared inherited_from it changes with it:
    # cpmant-cached-generate reads GenerationMixin.prepare_inputs_for_generation as CPM-Ant's).
    read_elsewhere = {t.inherited_from for p in PATCHES for t in p.targets if t.inherited_from}
    found = next(((p, t) for p in PATCHES if EXPECTED[p.id] == matrix_data.APPLIED for t in p.targets
                  if t.key not in read_elsewhere and _raw(importlib.import_module(p.module), t.qualname)[2] is not None),
                 None)
    assert found is not None, f"no patch applies to transformers {INSTALLED}"
    patch, target = found
    shadow = _shadow_transformers(tmp_path / "shadow", patch.module, target.qualname)
    # The startup hook, as attn_overlay.pth runs it in an installed (non-editable) overlay.
    (shadow / "sitecustomize.py").write_text("import _attn_overlay_startup\n")

    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OVERLAY")}
    env.update(PYTHONPATH=str(shadow), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "overlay.apply", "--json", "--strict"],
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
    )
    assert done.stdout.strip(), done.stderr
    report = json.loads(done.stdout)
    assert report["hook"]["active"] is True, report
    states = {s["id"]: s for s in report["patches"]}
    assert states[patch.id]["state"] == engine.UNRECOGNISED, states[patch.id]
    assert target.qualname in states[patch.id]["reason"]
    for other in PATCHES:
        if other.id != patch.id:
            assert states[other.id]["state"] == EXPECTED[other.id], states[other.id]
    assert done.returncode == 1, "--strict fails on unrecognised code"


def test_every_patch_has_tests_that_the_release_lanes_run():
    # The lanes select by the `patch` marker, which tests/conftest.py derives from each module's
    # folder (tests/patches/<patch module>/) and PatchUnderTest objects: a patch no lane-run
    # module declares would be proven nowhere but here.
    import re

    declared: set[str] = set()
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        if re.search(r"^LANE = False", text, re.M):
            continue
        declared.update(re.findall(r'^\w+ = PatchUnderTest\("(\w+)"\)', text, re.M))
    from overlay import patches as package

    assert set(package.PATCH_MODULES) <= declared, sorted(set(package.PATCH_MODULES) - declared)
    # One place per patch: a folder of tests/patches/ for each patch module, and no other folder there.
    folders = {path.name for path in (REPO / "tests" / "patches").iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert folders == set(package.PATCH_MODULES), (sorted(folders - set(package.PATCH_MODULES)), sorted(set(package.PATCH_MODULES) - folders))


# -- the code decides, not the version label ------------------------------------------------------

#: A label the installed code is not: a release after the data's newest on the releases before
#: the last fixes, one from before most patches' ranges after them.
OTHER_LABEL = "5.26.0" if Version(INSTALLED) < Version("5.20.0") else "4.55.0"

_STATUSES_UNDER_LABEL = """
import importlib, json, overlay
overlay.apply()
for patch in overlay.engine.known_patches():
    try:
        importlib.import_module(patch.module)
    except Exception:
        pass
print("STATUSES=" + json.dumps({s.id: [s.state, s.reason] for s in overlay.status()}))
"""


def test_the_installed_code_decides_under_another_version_label(tmp_path):
    # Issue 38: 5.18.0's code under metadata saying 5.26.0 had 24 patches "fixed upstream".
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([fake_version_label(tmp_path, OTHER_LABEL), str(REPO)]),
               ATTN_OVERLAY="0")
    done = subprocess.run([sys.executable, "-c", _STATUSES_UNDER_LABEL], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("STATUSES=")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    statuses = json.loads(lines[-1][len("STATUSES="):])
    for patch in PATCHES:
        state, reason = statuses[patch.id]
        expected = EXPECTED[patch.id]
        if expected in (matrix_data.APPLIED, matrix_data.FIXED_UPSTREAM):
            # Code the release facts know decides: the state the installed release gets.
            assert state == expected, (patch.id, reason)
        else:  # code from before the bug: never patched, whatever the label says
            assert state != matrix_data.APPLIED, (patch.id, reason)
        by_label = matrix_data.expected_status(patch, OTHER_LABEL)
        if state != by_label:
            assert f"the code decides, though the package metadata of transformers says {OTHER_LABEL}" in reason, reason
            assert f"transformers.__version__ {INSTALLED}" in reason, reason
