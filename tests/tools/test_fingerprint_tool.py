"""scripts/fingerprint_release.py reads the same code, and computes the same fingerprint, as the
engine does at run time; and it flags code that no known variant matches.

No network: the tool's extraction runs on the installed transformers' own files (what a wheel
holds, unpacked), and on wheels built here from those files.
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import fingerprint_release as tool  # noqa: E402
import matrix_data  # noqa: E402

import overlay  # noqa: E402
from overlay.patch import fingerprint, function_of  # noqa: E402

pytestmark = pytest.mark.lane  # every release lane runs this module (noxfile.py)

PATCHES = matrix_data.load_patches()
TARGETS = [(patch, target) for patch in PATCHES for target in patch.targets]
INSTALLED_VERSION, INSTALLED_ROOT = tool.installed_transformers()


def _runtime_function(target):
    """The target as the engine finds it: the raw object in its owner's namespace."""
    try:
        module = importlib.import_module(target.module)
    except ModuleNotFoundError:  # an older release without the module
        return None
    raw = target.locate(module).raw
    return None if raw is None else function_of(raw)


@pytest.mark.parametrize("patch,target", TARGETS, ids=[f"{p.id}:{t.qualname}" for p, t in TARGETS])
def test_extraction_from_files_equals_runtime_fingerprint(patch, target):
    with overlay.reverted():  # the code as shipped, whatever another test left applied
        func = _runtime_function(target)
        from_files = tool.fingerprint_of_target(tool.directory_reader(INSTALLED_ROOT), target)
        if func is None:
            # Missing is fine where the engine never reads the code (outside the patch's range).
            in_range = matrix_data.expected_status(patch, INSTALLED_VERSION) != matrix_data.OUT_OF_RANGE
            assert target.optional or not in_range, f"{target.key} is missing from transformers {INSTALLED_VERSION}"
            assert from_files is None
            return
        assert from_files == fingerprint(func)


def test_extraction_matches_runtime_on_decorated_nested_and_redefined_code(tmp_path, monkeypatch):
    # The cases where "the first line of the definition" is easy to get wrong: decorators
    # (CPython starts the code object at the first one), a class inside a class, a name
    # defined twice (the last one wins), a definition inside an `if` at module level, a function
    # defined inside a function.
    source = textwrap.dedent(
        '''
        import functools

        def noop(func):
            @functools.wraps(func)
            def inner(*a, **k):
                return func(*a, **k)
            return inner

        class Outer:
            class Inner:
                @staticmethod
                @noop
                def method(x,
                           y=(
                               1, 2)):
                    """doc"""
                    return x  # comment

        def twice():
            return 1

        def twice():
            return 2

        if True:
            def conditional(a):
                return a

        def factory():
            def made(b):
                return [b for _ in range(2)]
            return made
        '''
    )
    (tmp_path / "fp_toy_module.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fp_toy_module", raising=False)
    toy = importlib.import_module("fp_toy_module")
    read = tool.directory_reader(tmp_path)
    cases = {
        "Outer.Inner.method": toy.Outer.Inner.__dict__["method"].__func__,
        "twice": toy.twice,
        "conditional": toy.conditional,
        "factory.<locals>.made": toy.factory(),
    }
    for qualname, func in cases.items():
        assert tool.target_fingerprint(read, "fp_toy_module", qualname) == fingerprint(func), qualname
    assert tool.target_fingerprint(read, "fp_toy_module", "Outer.missing") is None


def _wheel_from_installed(path: Path, version: str, change: tuple[str, str] | None = None) -> Path:
    """A wheel holding the installed files of every patch module (and of the modules a target's
    inherited function is defined in); ``change`` = (module, qualname) gets one character changed
    inside that definition."""
    wheel = path / f"transformers-{version}-py3-none-any.whl"
    read = tool.directory_reader(INSTALLED_ROOT)
    inherited = {t.inherited_from.partition(":")[0] for p in PATCHES for t in p.targets if t.inherited_from}
    with zipfile.ZipFile(wheel, "w") as archive:
        for module in sorted({p.module for p in PATCHES} | inherited):
            for candidate in tool.module_file_candidates(module):
                data = read(candidate)
                if data is None:
                    continue
                if change is not None and change[0] == module:
                    data = _one_character_changed(data, change[1])
                archive.writestr(candidate, data)
                break
    return wheel


def _one_character_changed(data: bytes, qualname: str) -> bytes:
    import ast

    lines = tool.source_lines(data)
    first = tool.definition_first_line(ast.parse("".join(lines)), qualname)
    index = next(i for i in range(first - 1, len(lines)) if lines[i].lstrip().startswith(("def ", "async def ")))
    lines[index] = lines[index].replace("(", "( ", 1)  # still valid Python, no longer the same code
    return "".join(lines).encode("utf-8")


def test_unchanged_release_passes_check_and_reports_known_variants(tmp_path, capsys):
    wheel = _wheel_from_installed(tmp_path, INSTALLED_VERSION)
    assert tool.main([str(wheel), "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == []
    (release,) = report["releases"]
    for patch_report in release["patches"]:
        expected = matrix_data.expected_status(next(p for p in PATCHES if p.id == patch_report["id"]), INSTALLED_VERSION)
        assert patch_report["declared"] == expected
        if expected != matrix_data.OUT_OF_RANGE:
            assert patch_report["code"] == expected
            assert all(t["match"] in (tool.ORIGINAL, tool.FIXED, tool.ABSENT_OPTIONAL) for t in patch_report["targets"])


def _changeable_target(covering):
    """The first (patch, target) of ``covering`` present on this release whose function no other
    target reads as well: a target declared ``inherited_from`` it (cpmant-cached-generate's
    CpmAntForCausalLM.prepare_inputs_for_generation is GenerationMixin's) changes with it."""
    read_elsewhere = {t.inherited_from for p in PATCHES for t in p.targets if t.inherited_from}
    return next((patch, target) for patch in covering for target in patch.targets
                if _runtime_function(target) is not None and target.key not in read_elsewhere)


def test_changed_target_is_flagged_new_and_fails_check(tmp_path, capsys):
    # A patch whose code this release ships as a known variant (the change must be the only new one).
    covering = [p for p in PATCHES if matrix_data.expected_status(p, INSTALLED_VERSION) != matrix_data.OUT_OF_RANGE]
    if not covering:
        pytest.skip(f"no patch covers transformers {INSTALLED_VERSION}")
    patch, target = _changeable_target(covering)
    wheel = _wheel_from_installed(tmp_path, INSTALLED_VERSION, change=(target.module, target.qualname))

    assert tool.main([str(wheel), "--check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (release,) = report["releases"]
    by_target = {
        (p["id"], t["qualname"]): t for p in release["patches"] for t in p["targets"]
    }
    changed = by_target.pop((patch.id, target.qualname))
    assert changed["match"] == tool.NEW and changed["label"] is None
    assert len(changed["sha256"]) == 64
    # Only the changed target is new, of the code the patches know on this release (outside a
    # patch's range its code may be anything: 5.12.1's prepare_inputs_for_generation, say).
    known_here = {p.id for p in covering}
    assert all(t["match"] != tool.NEW for (pid, _), t in by_target.items() if pid in known_here), (
        "only the changed target is new"
    )
    patch_report = next(p for p in release["patches"] if p["id"] == patch.id)
    assert patch_report["code"] == "unrecognised code"
    if patch_report["declared"] != matrix_data.OUT_OF_RANGE:
        assert any("matches no known variant" in msg and target.qualname in msg for msg in report["problems"])

    # Without --check the report is the same, and the exit status 0.
    assert tool.main([str(wheel)]) == 0
    text = capsys.readouterr().out
    assert f"{changed['sha256']}  {tool.NEW}" in text


# Three versions of the toy target's source: the known original, the known fix, new code.
TOY_SOURCE = {"a": "def method(self):\n    return 'original'\n", "b": "def method(self):\n    return 'fixed'\n",
              "c": "def method(self):\n    return 'changed'\n"}


def _toy_patch(**declared):
    from overlay.patch import Patch, Target, fingerprint_source

    target = Target(
        module="toy_module",
        qualname="Toy.method",
        originals={fingerprint_source(TOY_SOURCE["a"]): "5.13.0-5.14.1"},
        fixed={fingerprint_source(TOY_SOURCE["b"]): "5.20.0"},
        replace=lambda original, variant: original,
    )
    fields = {"affected": ">=5.13.0,<5.20.0", "fixed_in": "5.20.0", **declared}
    return Patch(id="toy", title="toy", errors=(), why="", upstream="", targets=(target,), **fields)


def _report(monkeypatch, patch, version, code):
    """The tool's report when the release's toy target is ``TOY_SOURCE[code]`` (``None``: absent)."""
    source = None if code is None else TOY_SOURCE[code]
    monkeypatch.setattr(tool, "extract_target_source", lambda read, module, qualname: source)
    return tool.report_patch(patch, version, read=lambda path: None)


def test_known_variant_named_by_its_label_is_no_problem(monkeypatch):
    report = _report(monkeypatch, _toy_patch(), "5.14.0", "a")
    assert (report.declared, report.code, report.problems) == ("applied", "applied", [])
    report = _report(monkeypatch, _toy_patch(), "5.20.0", "b")
    assert (report.declared, report.code, report.problems) == ("fixed upstream", "fixed upstream", [])


def test_code_that_contradicts_the_declared_versions_is_flagged(monkeypatch):
    # Declared fixed upstream, but the release still ships the original: fixed_in is wrong.
    report = _report(monkeypatch, _toy_patch(), "5.20.0", "a")
    assert report.code == "applied"
    assert any("declares 'fixed upstream'" in msg and "code says 'applied'" in msg for msg in report.problems)
    # Declared affected, but the release already ships the fix: affected is too wide.
    report = _report(monkeypatch, _toy_patch(), "5.14.0", "b")
    assert any("declares 'applied'" in msg and "code says 'fixed upstream'" in msg for msg in report.problems)


def test_stale_label_is_flagged(monkeypatch):
    report = _report(monkeypatch, _toy_patch(), "5.15.0", "a")
    assert report.code == "applied"
    assert any("labelled '5.13.0-5.14.1', which does not name 5.15.0" in msg for msg in report.problems)
    assert tool.label_covers("5.13.0-5.14.1", "5.14.0") is True
    assert tool.label_covers("5.18.0", "5.18.0") is True
    assert tool.label_covers("the 5.x line", "5.18.0") is None  # free text: not checked


def test_new_and_missing_code_is_flagged_only_where_the_patch_applies(monkeypatch):
    report = _report(monkeypatch, _toy_patch(), "5.14.0", "c")
    assert report.code == "unrecognised code"
    assert any("matches no known variant" in msg for msg in report.problems)
    report = _report(monkeypatch, _toy_patch(), "5.14.0", None)
    assert any("does not exist in this release" in msg for msg in report.problems)
    # Before the bug: the engine never reads this code, so a different one is no problem.
    report = _report(monkeypatch, _toy_patch(), "5.12.0", "c")
    assert (report.declared, report.problems) == (matrix_data.OUT_OF_RANGE, [])


# -- the release facts: patches/releases.json, written by --add / --remove ---------------------


def test_the_data_file_is_as_the_tool_writes_it():
    # Hand edits that the tool would reformat show up here, not as noise in the next --add.
    assert tool.format_data(tool.read_data()) == tool.DATA_FILE.read_text(encoding="utf-8")


def test_every_lane_is_a_release_the_data_knows():
    # A lane proves a release's behaviour; the data is what says which code it ships. A lane
    # without the data's word would have its labels and ranges guessed.
    known = set(tool.read_data()["releases"])
    assert [r for r in matrix_data.RELEASES if r not in known] == []
    assert matrix_data.FULL_SUITE_RELEASE in known


@pytest.fixture
def data_file(tmp_path) -> Path:
    """A copy of the shipped data file, for the tool to rewrite."""
    copy = tmp_path / "releases.json"
    copy.write_text(tool.DATA_FILE.read_text(encoding="utf-8"), encoding="utf-8")
    return copy


def test_removing_the_installed_release_and_adding_it_back_changes_nothing(tmp_path, data_file, capsys):
    # The maintainer's loop on the lane's own release, read from its installed files (what its
    # wheel holds): remove, then --add with the wheel, gives the file back byte for byte.
    assert tool.main(["--data", str(data_file), "--remove", INSTALLED_VERSION]) == 0
    removed = tool.read_data(data_file)
    assert INSTALLED_VERSION not in removed["releases"]
    assert not any(
        INSTALLED_VERSION in entry["releases"]
        for targets in removed["patches"].values() for entries in targets.values() for entry in entries.values()
    )
    wheel = _wheel_from_installed(tmp_path, INSTALLED_VERSION)
    assert tool.main(["--data", str(data_file), "--add", str(wheel)]) == 0
    assert data_file.read_text(encoding="utf-8") == tool.DATA_FILE.read_text(encoding="utf-8")
    assert "added" in capsys.readouterr().out


def test_adding_a_release_with_new_code_writes_nothing_until_the_code_is_named(tmp_path, data_file, capsys):
    covering = [p for p in PATCHES if matrix_data.expected_status(p, INSTALLED_VERSION) == matrix_data.APPLIED]
    if not covering:
        pytest.skip(f"no patch applies on transformers {INSTALLED_VERSION}")
    patch, target = _changeable_target(covering)
    assert tool.main(["--data", str(data_file), "--remove", INSTALLED_VERSION]) == 0
    before = data_file.read_text(encoding="utf-8")
    wheel = _wheel_from_installed(tmp_path, INSTALLED_VERSION, change=(target.module, target.qualname))
    capsys.readouterr()

    assert tool.main(["--data", str(data_file), "--add", str(wheel)]) == 1
    out = capsys.readouterr().out
    assert data_file.read_text(encoding="utf-8") == before
    (problem,) = [line for line in out.splitlines() if "does not know" in line]
    assert target.key in problem and "--variant" in problem
    digest = problem.split("sha256 ")[1].split(")")[0]

    # A name the target does not declare is refused; one it declares is recorded.
    assert tool.main(["--data", str(data_file), "--add", str(wheel), "--variant", f"{digest[:12]}=no_such_variant"]) == 1
    assert data_file.read_text(encoding="utf-8") == before
    name = next(iter(target.variants or {"original": {}}))
    assert tool.main(["--data", str(data_file), "--add", str(wheel), "--variant", f"{digest[:12]}={name}"]) == 0
    entry = tool.read_data(data_file)["patches"][patch.id][target.key][digest]
    assert entry == {"code": name, "releases": [INSTALLED_VERSION]}


def test_variant_without_add_and_a_short_prefix_are_refused(capsys):
    with pytest.raises(SystemExit):
        tool.main(["--variant", "abcdef012345=fixed"])
    with pytest.raises(SystemExit):
        tool.main(["--add", INSTALLED_VERSION, "--variant", "abc=fixed"])
    capsys.readouterr()
