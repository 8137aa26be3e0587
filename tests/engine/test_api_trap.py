"""``overlay.apply`` is the function, even after ``import overlay.apply`` (the module behind
``python -m overlay.apply``), which binds the package attribute ``apply`` to that module.

The import system binds it only on the module's first import, so each case runs in a fresh
interpreter (this one may have imported ``overlay.apply`` already).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import overlay

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OVERLAY")}
    env.update(ATTN_OVERLAY="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr
    return done


def test_overlay_apply_is_callable_after_importing_the_module_of_the_same_name():
    program = textwrap.dedent(
        """
        import sys
        import overlay.apply
        import overlay, overlay.engine

        assert overlay.apply is overlay.engine.apply, overlay.apply
        assert isinstance(sys.modules["overlay.apply"], type(sys))  # the module is still there
        from overlay import apply
        assert apply is overlay.engine.apply
        statuses = overlay.apply()  # was: TypeError: 'module' object is not callable
        assert statuses and all(isinstance(s, overlay.PatchStatus) for s in statuses)
        assert overlay.is_active()
        print("ok")
        """
    )
    assert _run("-c", program).stdout.strip() == "ok"


def test_the_module_still_runs_as_python_m_overlay_apply():
    assert _run("-m", "overlay.apply", "--version").stdout.startswith("attn-overlay ")


def test_other_attributes_and_a_function_for_apply_are_set_as_usual(monkeypatch):
    stand_in = lambda **kwargs: []  # noqa: E731 -- a one-line stand-in for the test
    monkeypatch.setattr(overlay, "apply", stand_in)
    assert overlay.apply is stand_in  # only the submodule's binding is dropped
    monkeypatch.setattr(overlay, "not_a_name_of_the_api", 1, raising=False)
    assert overlay.not_a_name_of_the_api == 1
    other = types.ModuleType("somewhere.apply")
    monkeypatch.setattr(overlay, "apply", other)
    assert overlay.apply is other
