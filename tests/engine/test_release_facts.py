"""overlay.releases: what the release facts (patches/releases.json) make of a patch file's
declarations: labels, ``affected``, ``fixed_in``, ``introduced_in``, "up to" the newest release;
and what it refuses. Synthetic data here; the shipped file is checked by the tool's tests
(tests/tools/test_fingerprint_tool.py) and, release by release, by the matrix."""

from __future__ import annotations

import re

import pytest

from overlay import releases
from overlay.patch import Target

RELEASES = ["5.12.0", "5.13.0", "5.13.1", "5.14.0", "5.15.0", "5.16.0"]
A, B, C, F, Z = "a" * 64, "b" * 64, "c" * 64, "f" * 64, "0" * 64


def _target(**kwargs) -> Target:
    return Target(module="m", qualname="f", replace=lambda original, variant: original, **kwargs)


def _data(entries: dict, releases_list=RELEASES) -> dict:
    return {"releases": list(releases_list), "patches": {"toy": {"m:f": entries}}}


def test_labels_are_the_runs_of_the_releases_that_ship_the_code():
    assert releases.label(["5.13.0", "5.13.1", "5.14.0"], RELEASES) == "5.13.0-5.14.0"
    assert releases.label(["5.13.0", "5.15.0", "5.16.0"], RELEASES) == "5.13.0, 5.15.0-5.16.0"
    assert releases.label(["5.12.0"], RELEASES) == "5.12.0"
    assert releases.label([], RELEASES) == releases.NO_RELEASE


def test_a_label_reads_back_as_its_runs():
    # The fingerprint tool and the test kit read labels with this; free text is no label.
    assert releases.label_runs("5.13.0, 5.15.0-5.16.0") == [("5.13.0", "5.13.0"), ("5.15.0", "5.16.0")]
    assert releases.label_runs("5.0.0rc0-5.0.0rc1") == [("5.0.0rc0", "5.0.0rc1")]
    assert releases.label_runs(releases.NO_RELEASE) == []
    assert releases.label_runs("the 5.x line") is None
    assert releases.label_covers("5.13.0, 5.15.0-5.16.0", "5.15.0") is True
    assert releases.label_covers("5.13.0, 5.15.0-5.16.0", "5.14.0") is False
    assert releases.label_covers(releases.NO_RELEASE, "5.14.0") is False


def test_a_fixed_bug_gets_its_range_fix_and_labels_from_the_data():
    target = _target(variants={"old": {"x": 1}, "new": {"x": 2}})
    derived = releases.derive("toy", [target], _data({
        A: {"code": "old", "releases": ["5.12.0", "5.13.0"]},
        B: {"code": "new", "releases": ["5.13.1", "5.14.0"]},
        F: {"code": "fixed", "releases": ["5.15.0", "5.16.0"]},
    }))
    assert (derived.affected, derived.fixed_in, derived.introduced_in) == (">=5.12.0,<5.15.0", "5.15.0", None)
    assert {d: (v.label, dict(v.params)) for d, v in derived.originals["m:f"].items()} == {
        A: ("5.12.0-5.13.0", {"x": 1}), B: ("5.13.1-5.14.0", {"x": 2}),
    }
    assert derived.fixed["m:f"] == {F: "5.15.0-5.16.0"}
    assert derived.newest == "5.16.0"


def test_an_unfixed_bug_is_open_ended_and_before_code_gives_where_it_arrived():
    derived = releases.derive("toy", [_target()], _data({
        Z: {"code": "before", "releases": ["5.12.0"]},
        A: {"code": "original", "releases": RELEASES[1:]},
    }))
    assert (derived.affected, derived.fixed_in, derived.introduced_in) == (">=5.13.0", None, "5.13.0")


def test_code_kept_after_remove_is_known_without_a_release():
    derived = releases.derive("toy", [_target()], _data({
        A: {"code": "original", "releases": RELEASES}, C: {"code": "original", "releases": []},
    }))
    assert derived.originals["m:f"][C].label == releases.NO_RELEASE


@pytest.mark.parametrize(
    "entries, message",
    [
        ({A: {"code": "original", "releases": ["5.12.0", "5.14.0"]}, F: {"code": "fixed", "releases": ["5.13.0", "5.13.1"]}},
         "not one run"),
        ({A: {"code": "original", "releases": ["5.12.0", "5.13.0"]}, Z: {"code": "before", "releases": ["5.13.1"]}},
         "ship neither it nor a fix"),
        ({A: {"code": "no_such_variant", "releases": RELEASES}}, "does not declare"),
        ({F: {"code": "fixed", "releases": RELEASES}}, "no release in the data ships the code"),
    ],
)
def test_data_that_cannot_be_one_patch_is_refused(entries, message):
    with pytest.raises(ValueError, match=message):
        releases.derive("toy", [_target()], _data(entries))


def test_a_patch_the_data_does_not_know_and_targets_it_does_not_declare_are_refused():
    with pytest.raises(ValueError, match="has no entry"):
        releases.derive("other", [_target()], _data({A: {"code": "original", "releases": RELEASES}}))
    data = _data({A: {"code": "original", "releases": RELEASES}})
    data["patches"]["toy"]["m:g"] = {}
    with pytest.raises(ValueError, match="does not declare: m:g"):
        releases.derive("toy", [_target()], data)


def test_a_patch_file_declares_no_release_facts_itself(monkeypatch):
    monkeypatch.setattr(releases, "_loaded", _data({A: {"code": "original", "releases": RELEASES}}))
    common = dict(id="toy", title="t", errors=(), why="w", upstream="none up to {newest_release}")
    patch = releases.patch_with_release_facts(targets=[_target()], **common)
    assert (patch.affected, patch.fixed_in, patch.upstream) == (">=5.12.0", None, "none up to 5.16.0")
    assert patch.targets[0].originals[A].label == "5.12.0-5.16.0"
    with pytest.raises(TypeError, match="affected is derived"):
        releases.patch_with_release_facts(targets=[_target()], affected=">=1", **common)
    with pytest.raises(TypeError, match="declares fingerprints"):
        releases.patch_with_release_facts(targets=[_target(originals={A: "1.0"})], **common)


def test_the_upstream_text_takes_the_derived_fix_release(monkeypatch):
    common = dict(id="toy", title="t", errors=(), why="w", upstream="#1, in {fixed_in}")
    monkeypatch.setattr(releases, "_loaded", _data({
        A: {"code": "original", "releases": RELEASES[:3]}, F: {"code": "fixed", "releases": RELEASES[3:]},
    }))
    patch = releases.patch_with_release_facts(targets=[_target()], **common)
    assert (patch.fixed_in, patch.upstream) == ("5.14.0", "#1, in 5.14.0")
    monkeypatch.setattr(releases, "_loaded", _data({A: {"code": "original", "releases": RELEASES}}))
    with pytest.raises(ValueError, match="no release in releases.json ships a fix"):
        releases.patch_with_release_facts(targets=[_target()], **common)


def test_every_shipped_patch_is_built_from_the_data():
    from overlay.registry import load_patches

    data = releases.load()
    for patch in load_patches():
        derived = releases.derive(patch.id, patch.targets, data)
        assert (patch.affected, patch.fixed_in, patch.introduced_in) == (derived.affected, derived.fixed_in, derived.introduced_in)
        for target in patch.targets:
            assert set(target.originals) | set(target.fixed) <= set(data["patches"][patch.id][target.key])
            assert target.originals or not any(
                e["code"] not in (releases.FIXED, releases.BEFORE) for e in data["patches"][patch.id][target.key].values()
            )


@pytest.mark.parametrize("content", [None, '{"releases": ['])
def test_a_missing_or_broken_data_file_names_itself_and_the_fix(tmp_path, monkeypatch, content):
    path = tmp_path / "releases.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    monkeypatch.setattr(releases, "_loaded", None)
    monkeypatch.setattr(releases, "data_path", lambda: str(path))
    with pytest.raises(RuntimeError, match=r"cannot read its release facts .*releases\.json.*reinstall"):
        releases.load()


def test_every_release_an_upstream_text_names_is_one_the_data_knows_and_the_fix_is_the_derived_one():
    # The full fix's release comes from the data ("{fixed_in}"); a text may still name an earlier
    # partial fix by hand, which must then be a real release before the derived fix.
    from packaging.version import Version

    from overlay.registry import load_patches

    data = releases.load()
    known = set(data["releases"])
    for patch in load_patches():
        named = re.findall(r"(?<![\w.#])\d+\.\d+\.\d+(?:rc\d+)?(?![\w.])", patch.upstream)
        assert set(named) <= known, (patch.id, sorted(set(named) - known))
        if patch.fixed_in is not None:
            assert patch.fixed_in in named, (patch.id, patch.upstream)
            assert all(Version(n) <= Version(patch.fixed_in) for n in named), (patch.id, named)
