"""attn-overlay's pytest plugin (entry point ``pytest11: attn_overlay``; ``-p no:attn_overlay`` turns it off).

Inert unless asked: it adds one header line saying what the overlay does in the test process, and
changes nothing else. A setting outside ``overlay/config.py``'s table (a misspelled patch id in
``ATTN_OVERLAY_DISABLE``, a word a switch does not accept) or a deprecated name gets its warning,
the one ``python -m overlay.apply`` prints, on a header line of its own (and at the end of the run
where the header is not shown: ``-q``, ``--no-header``). Asked, it offers:

- ``--attn-overlay-strict`` (or ``attn_overlay_strict = true`` in the ini file): the session
  fails at its start, before collection, on what ``python -m overlay.apply --strict`` fails on:
  a setting outside the table, the overlay not in force in the test process, a patch that met
  unrecognised code, failed or was displaced (``ATTN_OVERLAY_STRICT`` is the engine's and the
  report's switch, not this plugin's: the option or the ini value asks for the check). The startup hook acts on
  ``import transformers``, which may not have happened yet when the session starts: the check
  then imports the patches' target modules itself (as ``python -m overlay.apply`` does to verify),
  after the initial conftest files ran, so what they import or replace is judged too.
- fixtures: ``attn_overlay_reverted`` (a test on stock transformers), ``attn_overlay_applied``
  (a test with the patches applied; yields the statuses) and ``fake_device`` (the host-memory
  device of :mod:`overlay.testing`; the test is skipped, with the reason, where it cannot be
  installed).

Importing this module imports nothing but pytest and the standard library: it is loaded in every
pytest run of an environment where attn-overlay is installed. The status is read when the header
is written, without importing transformers (a status read before ``import transformers`` says
what the version gate decided and that the code is judged on import).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

#: What pytest looks up by name: the hooks and the fixtures.
__all__ = [
    "pytest_addoption",
    "pytest_report_header",
    "pytest_sessionstart",
    "pytest_terminal_summary",
    "attn_overlay_reverted",
    "attn_overlay_applied",
    "fake_device",
]

STRICT_OPTION = "--attn-overlay-strict"
STRICT_INI = "attn_overlay_strict"
PENDING_IMPORT = "pending import"

_STRICT_HELP = (
    "fail the session at its start unless attn-overlay is in force in this process, no patch "
    "met unrecognised code, failed or was displaced, and every ATTN_OVERLAY_* setting is one the "
    "table accepts, as `python -m overlay.apply --strict` (a usage error naming each and what to do; exit status 4). "
    "When transformers is not imported yet (by a conftest file), the check imports the patches' "
    "target modules itself, as `python -m overlay.apply` does, so that the startup hook judges the "
    "code: that costs the import of transformers and torch at session start."
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attn-overlay")
    group.addoption(STRICT_OPTION, action="store_true", default=False, dest="attn_overlay_strict", help=_STRICT_HELP)
    parser.addini(STRICT_INI, _STRICT_HELP + " Same as " + STRICT_OPTION + ".", type="bool", default=False)


def _strict_requested(config: pytest.Config) -> bool:
    return bool(config.getoption("attn_overlay_strict") or config.getini(STRICT_INI))


# -- what the overlay does in this process ------------------------------------------------------


def _startup_hook() -> tuple[bool, str | None]:
    """(armed, why not): whether the startup hook will activate the overlay on (or did on)
    ``import transformers`` in this process. Never imports ``_attn_overlay_startup``: importing it
    is what installs the hook (its ``.pth`` line does just that)."""
    from . import config

    if not config.BY_NAME[config.ENABLE_VAR].read().value:  # read silently: a bad value is the engine's to report
        return False, f"{config.ENABLE_VAR}={os.environ.get(config.ENABLE_VAR)}"
    if "_attn_overlay_startup" not in sys.modules:
        return False, "startup hook not loaded in this process (editable install? `python -m overlay.apply` says why)"
    from .environment import startup_hook_watching

    if not startup_hook_watching():
        return False, "the startup hook is not watching transformers in this process"
    return True, None


def _hook_phrase() -> str:
    """How the overlay came to be in force (or why it is not), in a few words."""
    from . import engine

    armed, why_not = _startup_hook()
    if engine.is_active():
        return "hook active" if armed else f"applied by overlay.apply(); hook inactive: {why_not}"
    error = engine.activation_error()
    if error:
        return f"hook inactive: could not activate: {error}"
    if not armed:
        return f"hook inactive: {why_not}"
    if "transformers" not in sys.modules:
        return "hook armed"
    shadow = sys.modules["_attn_overlay_startup"].shadowing_module()
    return f"hook inactive: {shadow}" if shadow else "hook inactive"


def _states() -> list[str]:
    """One state per patch: what is in force when the overlay is active; otherwise what the version
    gate decides, without importing transformers ("pending import": in range, the code is judged
    when its module is imported)."""
    from . import config, engine

    if engine.is_active():
        return [status.state for status in engine.status()]
    version = engine.installed_transformers_version()
    patches = engine.known_patches()
    disabled = config.BY_NAME[config.DISABLE_VAR].read([p.id for p in patches]).value
    fixes = config.BY_NAME[config.FIXES_VAR].read().value
    return [
        engine.DISABLED if (patch.id in disabled or config.ALL_PATCHES in disabled) else _gate_state(patch, version, fixes)
        for patch in patches
    ]


def _changes_of_applied() -> str:
    """What the patches in force (or, before transformers is imported, those the gate would apply)
    change: ``"12 errors only, 6 output, 5 both"`` (``Patch.changes``); empty when none applies."""
    from . import engine
    from .patch import CHANGES, CHANGES_ERRORS

    states = _states()
    kinds = [patch.changes for patch, state in zip(engine.known_patches(), states, strict=True)
             if state in (engine.APPLIED, engine.PENDING, PENDING_IMPORT)]
    words = {CHANGES_ERRORS: "errors only"}
    return ", ".join(f"{kinds.count(kind)} {words.get(kind, kind)}" for kind in CHANGES if kinds.count(kind))


def _gate_state(patch: Any, version: str | None, fixes: str) -> str:
    from . import engine

    state = engine.gate(patch, version)[0]
    if state == engine.PENDING and engine.left_out_by_fixes(patch, fixes) is not None:
        return engine.DISABLED  # ATTN_OVERLAY_FIXES=errors: as the engine will decide
    return PENDING_IMPORT if state == engine.PENDING else state


def _counts(states: list[str]) -> str:
    order: list[str] = []
    for state in states:
        if state not in order:
            order.append(state)
    return ", ".join(f"{states.count(state)} {state}" for state in order)


def header_line() -> str:
    """E.g. ``attn-overlay 0.2.0: 7 applied, 2 out of range (transformers 4.57.6, hook active)``."""
    from . import engine
    from ._version import __version__

    version = engine.installed_transformers_version()
    if version is None:
        return f"attn-overlay {__version__}: transformers is not installed, nothing to patch"
    counts = _counts(_states())
    armed_before_import = _startup_hook()[0] and "transformers" not in sys.modules
    if not engine.is_active() and not armed_before_import:
        counts = f"none in force, would be {counts}"
    return f"attn-overlay {__version__}: {counts} (transformers {version}, {_hook_phrase()})"


def changes_line() -> str | None:
    """The header's second line: what the fixes counted on the first change, e.g. ``attn-overlay
    fixes counted above change: 7 errors only, 3 output, 3 both (ATTN_OVERLAY_FIXES=all: every
    fix)``, so that a run shows whether it can differ from stock's output (the applied and pending
    ones: those the run gets); ``None`` where transformers is not installed."""
    from . import config, engine

    if engine.installed_transformers_version() is None:
        return None
    in_force = engine.settings()  # active: the settings read when it activated
    fixes = in_force.fixes if in_force is not None else config.BY_NAME[config.FIXES_VAR].read().value
    kept = "every fix" if fixes == config.FIXES_ALL else "only fixes of calls that raise on stock"
    changes = _changes_of_applied() or "nothing"
    # Not "attn-overlay: ...": lines so prefixed are the settings' warnings.
    return f"attn-overlay fixes counted above change: {changes} ({config.FIXES_VAR}={fixes}: {kept})"


def setting_warnings() -> list[str]:
    """The warnings the settings in force earn (``install_check.setting_messages``), each as one
    line beginning ``attn-overlay: ``; empty when every setting is one the table accepts."""
    from .install_check import setting_messages

    return [message if message.startswith("attn-overlay: ") else f"attn-overlay: {message}"
            for message in setting_messages()]


def _setting_warnings_or_why_not() -> list[str]:
    try:
        return setting_warnings()
    except Exception as exc:  # a broken patch file must not stop the test run; strict mode says more
        return [f"attn-overlay: settings unchecked ({type(exc).__name__}: {exc})"]


def pytest_report_header(config: pytest.Config) -> list[str]:
    try:
        lines = [header_line()]
        changes = changes_line()
        if changes is not None:
            lines.append(changes)
    except Exception as exc:  # a broken patch file must not stop the test run; strict mode says more
        lines = [f"attn-overlay: status unavailable ({type(exc).__name__}: {exc})"]
    # The engine logs these when it activates, where pytest's log capture keeps them out of sight
    # (and not at all before transformers is imported): said here, once per run, instead.
    return [*lines, *_setting_warnings_or_why_not()]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    # Where the header was not written (-q, --no-header), the settings warnings go at the end of
    # the run, where pytest puts its own warnings: a misspelled patch id must not pass unseen.
    if terminalreporter.verbosity >= 0 and not config.getoption("no_header", False):
        return
    warnings = _setting_warnings_or_why_not()
    if warnings:
        terminalreporter.write_sep("=", "attn-overlay settings", yellow=True)
        for warning in warnings:
            terminalreporter.write_line(warning)


# -- strict mode ----------------------------------------------------------------------------------


def _what_to_do(state: str, patch_id: str) -> str:
    """Advice for a patch in a bad state ("" for a displaced one: its reason says what to do)."""
    from . import engine

    if state == engine.UNRECOGNISED:
        return (
            "the installed transformers' code is not what the patch was written for: pin a release the "
            f"overlay knows (`python -m overlay.apply` lists each patch's range), or ATTN_OVERLAY_DISABLE={patch_id}"
        )
    if state == engine.FAILED:
        return f"report it with the reason above; ATTN_OVERLAY_DISABLE={patch_id} leaves the patch out meanwhile"
    return ""


def _how_to_activate() -> str:
    from . import config

    if not config.BY_NAME[config.ENABLE_VAR].read().value:
        return f"Unset {config.ENABLE_VAR} (or set it to 1) for the test run"
    if "_attn_overlay_startup" not in sys.modules:
        return (
            "Install attn-overlay as a regular package (`pip install attn-overlay`, or `pip install .` "
            "in a clone: an editable install has no startup hook), or call overlay.apply() in a conftest.py"
        )
    return "`python -m overlay.apply` shows each patch and the hook's state"


#: What to do about a setting outside the table (the problem itself says what is used instead).
_SETTING_ADVICE = (
    "Correct the value or unset the variable for the test run (the values accepted: the settings table "
    "in attn-overlay's README, from overlay/config.py; `python -m overlay.apply` shows each in force)"
)


def _setting_problems() -> list[str]:
    """The settings ``python -m overlay.apply --strict`` fails on, each with what to do."""
    from .install_check import setting_problems

    return [f"{problem.removeprefix('attn-overlay: ')}. {_SETTING_ADVICE}" for problem in setting_problems()]


def strict_problems() -> list[str]:
    """What fails the strict check, one line each with what to do; empty when all is well. The
    same as ``python -m overlay.apply --strict`` fails on: settings outside the table, the overlay
    not in force, a patch in one of ``engine.BAD_STATES`` (and, here, a patch left pending)."""
    return _setting_problems() + _overlay_problems()


def _overlay_problems() -> list[str]:
    from . import engine

    if engine.installed_transformers_version() is None:
        return ["transformers is not installed in this environment: nothing is patched"]
    # Without the hook armed, importing transformers activates nothing: no need to pay for it.
    import_errors = engine.import_target_modules() if engine.is_active() or _startup_hook()[0] else {}
    if not engine.is_active():
        from .environment import why_the_hook_is_inactive

        advice = _how_to_activate()  # before why_the_hook_is_inactive(), which imports the startup module
        why = engine.activation_error() or why_the_hook_is_inactive()
        return [
            f"the overlay is not in force in this process: {why}. {advice}",
            *(f"importing {name} failed: {error}" for name, error in import_errors.items()),
        ]
    problems = []
    for status in engine.status():
        if status.state in engine.BAD_STATES:
            advice = _what_to_do(status.state, status.id)
            problems.append(f"{status.id}: {status.state}: {status.reason}" + (f". {advice}" if advice else ""))
        elif status.state == engine.PENDING:
            cause = import_errors.get(status.module, f"{status.module} is not imported")
            problems.append(f"{status.id}: pending, its code was not judged: {cause}")
    return problems


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    # tryfirst: checked before the terminal writes the header, which then shows the state checked.
    if not _strict_requested(session.config):
        return
    try:
        problems = strict_problems()
    except Exception as exc:  # e.g. a broken patch file: that is the finding
        problems = [f"{type(exc).__name__}: {exc}"]
    if problems:
        # A UsageError, not pytest.exit(): pytest prints it once, as "ERROR: ...", and exits with 4.
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise pytest.UsageError(f"attn-overlay strict check failed ({STRICT_OPTION} / {STRICT_INI}):\n{listed}")


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def attn_overlay_reverted() -> Iterator[None]:
    """The test runs on stock transformers (``overlay.reverted()``); the patches come back after."""
    from . import engine

    with engine.reverted():
        yield


@pytest.fixture
def attn_overlay_applied() -> Iterator[list[Any]]:
    """The test runs with the patches applied (``overlay.applied()``); yields their statuses.
    Afterwards, what the fixture applied is reverted. Imports the patches' target modules first
    (transformers, torch): a patch is applied when its module is imported, and one applied only
    during the test would be left in place after it."""
    from . import engine

    engine.import_target_modules()  # a module that fails to import leaves its patches pending: the statuses say so
    with engine.applied() as statuses:
        yield statuses


@pytest.fixture(scope="session")
def fake_device() -> Any:
    """``overlay.testing.install_fake_device()``: a second torch device backed by host memory
    (``fakeaccel:0``), once per process. Skips the test, saying why, where it cannot be installed."""
    from .testing import FakeDeviceUnavailable, install_fake_device

    try:
        return install_fake_device()
    except (ImportError, FakeDeviceUnavailable, RuntimeError) as exc:  # no torch; no backend; device renamed
        pytest.skip(f"fake device unavailable: {type(exc).__name__}: {exc}")
