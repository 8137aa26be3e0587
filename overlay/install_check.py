"""Whether this install works: the report ``python -m overlay.apply`` shows (``--json``: the document).

:func:`build_report` builds the document :mod:`overlay.cli`'s docstring describes (schema 1):
every patch's status for the installed transformers and the settings in force, and, unless told
not to, whether the startup hook really activates the overlay in a fresh process of this
interpreter. That check runs :mod:`overlay._verify_child` by path, with this interpreter's flags
(:func:`interpreter_flags`), and reads the one JSON line it prints last. Told not to
(``--no-verify``), it judges the patches in this process instead (:func:`judge_here`) and says the
hook was not checked.

:func:`setting_problems` and :func:`overlay.engine.import_target_modules` are shared with the pytest plugin
(``--attn-overlay-strict`` fails on what ``--strict`` fails on) and the child program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from . import config, engine, environment
from ._version import __version__
from .environment import why_the_hook_is_inactive

#: The names other modules use; the rest is this module's own.
__all__ = [
    "HOOK_NOT_CHECKED", "SCHEMA", "VERIFY_CHILD", "build_report", "interpreter_flags",
    "judge_here", "setting_messages", "setting_problems",
]

SCHEMA = 1

#: The child program (run by path, never imported here: see its docstring).
VERIFY_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_verify_child.py")

#: The hook's ``reason`` where the fresh-subprocess check was skipped (``--no-verify``).
HOOK_NOT_CHECKED = (
    "not checked (--no-verify): the statuses are what the patches reach in this process, with the "
    "overlay activated here; run without --no-verify to check that the startup hook activates it in "
    "a fresh process"
)


def interpreter_flags() -> list[str]:
    """The flags this interpreter was started with (-S, -I, -E, -X ...), for a child that must
    see what the caller's processes see."""
    # What multiprocessing uses to start its children; private, so not every Python need have it.
    from_flags: Callable[[], list[str]] | None = getattr(subprocess, "_args_from_interpreter_flags", None)
    try:
        if from_flags is not None:
            return list(from_flags())
    except Exception:  # a private helper that failed: rebuild the common flags, as below
        pass
    flags = sys.flags
    out = ["-S"] * bool(flags.no_site)  # -I does not imply -S: site-packages .pth files still run
    if flags.isolated:
        out.append("-I")
    else:
        out += ["-E"] * bool(flags.ignore_environment) + ["-s"] * bool(flags.no_user_site)
        out += ["-P"] * bool(getattr(flags, "safe_path", False))
    return out


def _package_root() -> str:
    """The folder holding this overlay package (site-packages, or a source tree's root)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def verify_in_subprocess(timeout: float = 300.0) -> dict[str, Any]:
    """The child's document (:mod:`overlay._verify_child`), or ``{"error": why}`` when it has none."""
    command = [sys.executable, *interpreter_flags(), VERIFY_CHILD, _package_root()]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the verification subprocess did not finish in {timeout:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"error": "the verification subprocess failed: " + " | ".join(tail)}
    try:
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unexpected output from the verification subprocess: {done.stdout[-300:]!r}"}
    if not result.get("shadowed"):
        said = [line for line in done.stderr.splitlines() if line.startswith(environment.SHADOW_PREFIX)]
        result["shadowed"] = said[-1] if said else None
    return result


def build_report(verify: bool = True) -> dict[str, Any]:
    """The ``--json`` document (see :mod:`overlay.cli`'s docstring)."""
    version = engine.installed_transformers_version()
    hook: dict[str, Any] = {"active": None, "verified": False, "reason": None}
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "overlay_version": __version__,
        "python": sys.version.split()[0],
        "transformers_version": version,
        "hook": hook,
        "patches": [],
        "import_errors": {},
        "settings": _settings_document(),
        "ok": True,
    }
    if version is None:
        report["patches"] = [dict(s.as_dict(), would_be=None) for s in engine.status()]
        hook["reason"] = "transformers is not installed: nothing to patch"
        return _finish(report)
    if not verify:
        # Without the fresh process, this one is judged: the statuses of a process that never
        # activated the overlay would all read "inactive", whatever the hook does elsewhere.
        report["import_errors"] = judge_here()
        report["patches"] = [dict(s.as_dict(), would_be=None) for s in engine.status()]
        hook["reason"] = HOOK_NOT_CHECKED
        return _finish(report)
    verified = verify_in_subprocess()
    if "error" in verified:
        report["hook"] = {"active": False, "verified": False, "reason": verified["error"]}
        report["patches"] = [dict(s.as_dict(), would_be=None) for s in engine.status()]
        return _finish(report)
    active = bool(verified["hook_active"])
    reason = None
    if not active:
        shadowed = verified.get("shadowed")
        reason = environment.shadow_reason(shadowed) if shadowed else verified.get("activation_error")
        reason = reason or why_the_hook_is_inactive()
    report["hook"] = {"active": active, "verified": True, "reason": reason}
    report["import_errors"] = verified.get("import_errors", {})
    for row in verified["patches"]:
        if active:
            row["would_be"] = None
        else:  # no process gets these patches: never say "applied"
            row["would_be"], row["state"] = row["state"], engine.INACTIVE
        report["patches"].append(row)
    return _finish(report)


def judge_here() -> dict[str, str]:
    """Judge every patch in this process, as :mod:`overlay._verify_child` does in its own: import
    the target modules, then activate the overlay explicitly where the startup hook did not (not
    strict: a bad state is a status to report). Returns the import errors."""
    import logging

    errors = engine.import_target_modules()
    if not engine.is_active():
        # The modules are imported already: the engine's late-import warning would only say that
        # this check imported them first. Silenced for this one call, as in the child.
        overlay_logger = logging.getLogger(config.LOGGER_NAME)
        level = overlay_logger.level
        overlay_logger.setLevel(logging.ERROR)
        try:
            engine.apply(strict=False)
        finally:
            overlay_logger.setLevel(level)
    return errors


def _settings_document() -> dict[str, dict[str, Any]]:
    """The report's ``settings``: each setting of the table in force, keyed by its variable."""
    return {value.setting.name: value.as_dict() for value in environment.settings_in_force()}


def setting_problems(report: dict[str, Any] | None = None) -> list[str]:
    """The bad settings: values outside the table (``--strict`` exits 1 on any, and so does
    ``pytest --attn-overlay-strict``): the report's, or, without one, those in force now."""
    settings = _settings_document() if report is None else report["settings"]
    return [entry["problem"] for entry in settings.values() if entry["problem"]]


def setting_messages() -> list[str]:
    """What the settings in force would make the engine warn about: each value outside the table
    and each deprecated name, as the engine logs them (the pytest plugin shows them; strict mode
    fails only on the first kind, :func:`setting_problems`)."""
    return [
        message
        for entry in _settings_document().values()
        for message in (entry["problem"], entry["deprecated"])
        if message
    ]


def _finish(report: dict[str, Any]) -> dict[str, Any]:
    states = {row["would_be"] or row["state"] for row in report["patches"]}
    report["ok"] = not (states & engine.BAD_STATES)
    report["summary"] = _older_than_every_patch(report["transformers_version"], states)
    return report


def _older_than_every_patch(version: str | None, states: set[str]) -> str | None:
    """One line for a release older than the lowest release any patch was written for."""
    if version is None or states != {engine.OUT_OF_RANGE}:
        return None
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    from .patch import lowest_release

    lowest = [low for p in engine.known_patches() if (low := lowest_release(SpecifierSet(p.affected))) is not None]
    try:
        older = bool(lowest) and Version(version) < min(lowest)
    except InvalidVersion:
        return None
    if not older:
        return None
    return (
        f"transformers {version} is older than {min(lowest)}, the oldest release any patch was written for: "
        "nothing is patched or checked here (the accelerator stacks' pins start at 4.55)"
    )
