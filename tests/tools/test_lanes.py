"""scripts/lanes.py: the lanes a patch must pass (its oldest and newest affected releases, the first
fixed one, each release where its code changes), read from the release data, never written down."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import lanes  # noqa: E402
import matrix_data  # noqa: E402

PATCHES = matrix_data.load_patches()


def _patch(*keys: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(id="toy", targets=[types.SimpleNamespace(key=k, optional=False) for k in keys])


def _data(facts: dict) -> dict:
    return {"releases": ["1.0", "1.1", "1.2", "1.3", "1.4", "1.5"], "patches": {"toy": facts}}


TOY = {"m:f": {
    "a" * 64: {"code": "before", "releases": ["1.0"]},
    "b" * 64: {"code": "original", "releases": ["1.1", "1.2"]},
    "c" * 64: {"code": "original", "releases": ["1.3"]},
    "d" * 64: {"code": "fixed", "releases": ["1.4", "1.5"]},
}}


def test_the_edges_and_each_change_of_code_each_on_a_lane_that_ships_that_code():
    found = lanes.lanes(_patch("m:f"), _data(TOY), lane_releases=["1.0", "1.2", "1.3", "1.5"])
    assert found == [
        ("1.2", "oldest affected (1.1, same code)"),  # 1.1 has no lane: 1.2 ships its code
        ("1.3", "other code, same variant: m:f original; newest affected"),
        ("1.5", "first fixed upstream (1.4, same code)"),
    ]


def test_a_release_whose_code_no_lane_ships_is_named_as_missing():
    found = dict(lanes.lanes(_patch("m:f"), _data(TOY), lane_releases=["1.0", "1.3", "1.5"]))
    assert found["1.1 (no lane: add it to RELEASES in scripts/matrix_data.py)"] == "oldest affected"


def test_another_variant_is_named():
    facts = {"m:f": {**TOY["m:f"], "c" * 64: {"code": "lazy", "releases": ["1.3"]}}}
    found = dict(lanes.lanes(_patch("m:f"), _data(facts), lane_releases=["1.1", "1.3", "1.4"]))
    assert found["1.3"] == "another variant: m:f lazy; newest affected"


@pytest.mark.parametrize("patch", PATCHES, ids=[p.id for p in PATCHES])
def test_every_patch_gets_its_edges_on_lanes_of_the_matrix(patch):
    from packaging.version import Version

    found = lanes.lanes(patch)
    # Each a lane of the matrix, or a release of the data whose code no lane ships, said so.
    assert all(lane in matrix_data.RELEASES or "(no lane: " in lane for lane, _ in found), found
    applied = [r for r, row in matrix_data.matrix(matrix_data.RELEASES, [patch]).items() if row[patch.id] == "applied"]
    oldest = next(lane for lane, why in found if why.startswith("oldest affected")).split(" ")[0]
    newest = next(lane for lane, why in found if "newest affected" in why).split(" ")[0]
    # The oldest affected lane, or an older release of the data that no lane stands in for.
    assert oldest == applied[0] or (Version(oldest) < Version(applied[0]) and oldest not in matrix_data.RELEASES)
    assert newest == applied[-1] or (Version(newest) > Version(applied[-1]) and newest not in matrix_data.RELEASES)
    assert found[0][0].split(" ")[0] == oldest  # oldest first
    fixed = [lane for lane, why in found if "first fixed upstream" in why]
    if patch.fixed_in is None:
        assert fixed == []
    elif patch.fixed_in in matrix_data.RELEASES:
        assert fixed == [patch.fixed_in]


def test_the_command_takes_a_module_or_an_id_and_prints_the_nox_commands(capsys):
    assert lanes.main(["kept_static_cache"]) == 0
    by_module = capsys.readouterr().out
    assert lanes.main(["kept-static-cache"]) == 0
    assert capsys.readouterr().out == by_module
    patch = next(p for p in PATCHES if p.id == "kept-static-cache")
    for lane in dict(lanes.lanes(patch)):
        assert f".venv-ci/bin/nox -s tf-{lane} -- -k kept_static_cache\n" in by_module
    assert lanes.main(["no-such-patch"]) == 2
    assert "no patch named 'no-such-patch'" in capsys.readouterr().err
