"""A release lane's share of the release-independent costly checks (``tests/_kit.py``): every
case runs over CI's lanes, each lane runs the same ones every time, and everything runs where the
switch is unset (the whole suite, a developer's pytest)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

from tests import _kit

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import matrix_data  # noqa: E402

CASES = ["the reported race", "b", "c", "d", "e", "f", "g"]


def _on_lane(monkeypatch, release: str) -> None:
    monkeypatch.setenv(_kit.LANE_SHARE_VAR, "1")
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: release if name == "transformers" else real(name))


def test_noxfile_sets_the_switch_the_kit_reads():
    sys.path.insert(0, str(REPO))
    try:
        import noxfile
    except ImportError:
        pytest.skip("nox is not installed in this environment (CI's .venv-ci has it)")
    assert noxfile.LANE_SHARE_VAR == _kit.LANE_SHARE_VAR


def test_everything_runs_where_the_switch_is_unset(monkeypatch):
    monkeypatch.delenv(_kit.LANE_SHARE_VAR, raising=False)
    assert _kit.lane_share(CASES) == CASES
    assert _kit.at_a_patch_edge("generation-config-precedence")
    monkeypatch.setenv(_kit.LANE_SHARE_VAR, "0")
    assert _kit.lane_share(CASES) == CASES


def test_ci_lanes_share_every_case_and_keep_the_first(monkeypatch):
    ran: set[str] = set()
    for release in matrix_data.ci_lanes():
        _on_lane(monkeypatch, release)
        share = _kit.lane_share(CASES, always=1)
        assert share[0] == "the reported race" and len(share) == 2
        assert share == _kit.lane_share(CASES, always=1)  # the same lane, the same cases
        ran.update(share)
    assert ran == set(CASES)


def test_ci_lanes_run_every_per_step_budget_mode(monkeypatch):
    """tests/engine/test_per_step_budget.py: three modes on every lane, the other three in turn."""
    modes = [f"mode {i}" for i in range(6)]
    ran: set[str] = set()
    for release in matrix_data.ci_lanes():
        _on_lane(monkeypatch, release)
        share = _kit.lane_share(modes, always=3)
        assert share[:3] == modes[:3] and len(share) == 4
        ran.update(share)
    assert ran == set(modes)


def test_a_release_the_matrix_does_not_list_runs_everything(monkeypatch):
    _on_lane(monkeypatch, "5.999.0")
    assert _kit.lane_share(CASES) == CASES
    assert _kit.at_a_patch_edge("generation-config-precedence")


def test_a_status_check_runs_on_both_sides_of_its_patch_in_ci(monkeypatch):
    table = matrix_data.matrix()
    sides = set()
    for release in matrix_data.ci_lanes():
        _on_lane(monkeypatch, release)
        if _kit.at_a_patch_edge("generation-config-precedence"):
            sides.add(table[release]["generation-config-precedence"])
    # Applied on CI's lanes; fixed upstream in the whole suite (5.18.0) where the fixed side's
    # first release is not one of CI's lanes.
    assert matrix_data.APPLIED in sides
    assert table[matrix_data.FULL_SUITE_RELEASE]["generation-config-precedence"] == matrix_data.FIXED_UPSTREAM
