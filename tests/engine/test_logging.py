"""What the overlay prints on its logger, ``overlay``: by default nothing new; at
``ATTN_OVERLAY_LOG_LEVEL=info`` one line per process, on rank 0 only unless
``ATTN_OVERLAY_LOG_RANKS=all``, and once even where the program configured logging too.

Each case is a fresh interpreter that does what a user's process does: the startup hook's ``.pth``
line (``import _attn_overlay_startup``), then ``import transformers``. The values each setting
accepts are in ``test_settings.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from overlay import config, engine

REPO = Path(__file__).resolve().parents[2]
STARTUP_THEN_TRANSFORMERS = "import _attn_overlay_startup, transformers\n"
SUMMARY_START = f"attn-overlay: transformers {engine.installed_transformers_version()}: "
PATCH_IDS = [patch.id for patch in engine.known_patches()]


def _run(program: str = STARTUP_THEN_TRANSFORMERS, **environment: str) -> subprocess.CompletedProcess:
    """``program`` in a fresh interpreter, with no ATTN_OVERLAY_* variable (the hook on) and no
    rank but those given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OVERLAY") and k not in config.RANK_VARS}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    env.update(environment)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=240, cwd=REPO,
                          env=env)
    assert done.returncode == 0, done.stderr
    return done


def _overlay_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "attn-overlay" in line]


def test_by_default_nothing_new_is_printed():
    default = _run()
    switched_off = _run(ATTN_OVERLAY="0")
    assert default.stdout == switched_off.stdout == ""
    assert _overlay_lines(default.stderr) == []
    assert default.stderr == switched_off.stderr


def test_info_prints_one_line_naming_every_patch_once():
    # Target modules imported after activation, and a second apply(): still the one line.
    program = STARTUP_THEN_TRANSFORMERS + "import transformers.generation.utils, overlay\noverlay.apply()\n"
    done = _run(program, ATTN_OVERLAY_LOG_LEVEL="info")
    (line,) = _overlay_lines(done.stderr)
    assert line.startswith(SUMMARY_START), line
    for patch_id in PATCH_IDS:  # each patch in one group: patched, pending, fixed upstream, ...
        assert len(re.findall(rf"(?<![\w-]){re.escape(patch_id)}(?![\w-])", line)) == 1, (patch_id, line)
    assert done.stdout == ""


def test_debug_adds_a_line_per_module_as_it_is_patched():
    program = STARTUP_THEN_TRANSFORMERS + (
        "import json, transformers.generation.utils, overlay\n"
        "print(json.dumps(sorted({s.module for s in overlay.status() if s.state == 'applied'})))\n"
    )
    done = _run(program, ATTN_OVERLAY_LOG_LEVEL="debug")
    lines = _overlay_lines(done.stderr)
    patched = [line for line in lines if not line.startswith(SUMMARY_START)]
    assert len(lines) == len(patched) + 1, done.stderr
    modules = json.loads(done.stdout)
    assert sorted(line.rsplit(" in ", 1)[1].split(" (")[0] for line in patched) == modules, done.stderr
    assert all(line.startswith("attn-overlay: patched ") for line in patched)


@pytest.mark.parametrize(
    ("ranks", "printed"),
    [
        ({"RANK": "0", "LOCAL_RANK": "0"}, True),
        ({"RANK": "1", "LOCAL_RANK": "1"}, False),
        ({"LOCAL_RANK": "1"}, False),
        ({"RANK": "1", config.LOG_RANKS_VAR: "all"}, True),
    ],
    ids=["rank0", "rank1", "local-rank1", "rank1-all"],
)
def test_under_torchrun_only_rank_0_prints_unless_every_rank_is_asked(ranks, printed):
    done = _run(ATTN_OVERLAY_LOG_LEVEL="info", **ranks)
    lines = _overlay_lines(done.stderr)
    assert len(lines) == (1 if printed else 0), done.stderr
    assert all(line.startswith(SUMMARY_START) for line in lines)


def test_the_programs_own_logging_prints_the_line_and_the_overlay_steps_aside():
    # Configured before the overlay activates, and (at debug, for the later lines) after it.
    before = _run("import logging\nlogging.basicConfig()\n" + STARTUP_THEN_TRANSFORMERS, ATTN_OVERLAY_LOG_LEVEL="info")
    (line,) = _overlay_lines(before.stderr)
    assert line.startswith(f"INFO:overlay:{SUMMARY_START}"), line  # the program's format
    after = _run(STARTUP_THEN_TRANSFORMERS + "import logging\nlogging.basicConfig()\nimport transformers.generation.utils\n",
                 ATTN_OVERLAY_LOG_LEVEL="debug")
    lines = _overlay_lines(after.stderr)
    assert len(lines) == len(set(lines)), after.stderr  # no line twice
    assert sum(line.startswith(SUMMARY_START) for line in lines) == 1
    assert all(line.startswith("DEBUG:overlay:") for line in lines if "patched" in line and "pending" not in line)


def test_a_bad_level_is_named_and_the_default_used():
    done = _run(ATTN_OVERLAY_LOG_LEVEL="verbose")
    (line,) = _overlay_lines(done.stderr)
    assert f"{config.LOG_LEVEL_VAR}='verbose' is not a level" in line and "using the default, warning" in line


def test_error_hides_the_warnings():
    warned = _run(ATTN_OVERLAY_DISABLE="no-such-patch")
    assert any("no-such-patch" in line for line in _overlay_lines(warned.stderr))
    quiet = _run(ATTN_OVERLAY_DISABLE="no-such-patch", ATTN_OVERLAY_LOG_LEVEL="error")
    assert _overlay_lines(quiet.stderr) == []
