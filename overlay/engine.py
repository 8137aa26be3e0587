"""The engine: gate every patch on the installed transformers, apply, report, revert.

Outcomes are statuses, never exceptions out of ``import transformers`` (unless strict mode asks
for exceptions). Everything that changes state holds one re-entrant lock, so concurrent first
imports from several threads apply each patch exactly once.

What it says is what is in force: a target module is judged only once it has executed (in
whichever thread executed it: a module still executing in another thread is left pending, and
its post-import hook judges it), and :func:`status` checks each applied replacement is still the
object on its owner ("displaced" when someone replaced it since).

This module decides (which patch, when, with what status); the mechanics it calls decide
nothing and are their own modules: :mod:`overlay.swapping` (swapping a target, layering
replacements, taking layers off) and :mod:`overlay.import_watch` (waiting for target modules on
the startup hook's finder).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

from . import call_scope, config
from .import_watch import ModuleWatch

# The verdict's state words are the engine's too (engine.FIXED_UPSTREAM, ...): re-exported.
from .patch import (  # noqa: F401
    APPLIED,
    CHANGES_BOTH,
    CHANGES_ERRORS,
    CHANGES_OUTPUT,
    FAILED,
    FIXED_UPSTREAM,
    NOT_INSTALLED,
    OUT_OF_RANGE,
    PENDING,
    UNRECOGNISED,
    Patch,
    Target,
    assess,
    function_of,
    judge_code,
    source_of,
)
from .swapping import (
    Swap,
    below_overlay,
    carries,
    describe_object,
    follow_bases,
    foreign_code,
    swap_in,
    take_off,
    wraps_replacement,
)

#: The names other modules use; the rest is this module's own.
__all__ = [
    "APPLIED", "BAD_STATES", "DISABLED", "DISPLACED", "FAILED", "FIXED_UPSTREAM", "INACTIVE", "NOT_INSTALLED",
    "OUT_OF_RANGE", "OverlayError", "PENDING", "PatchStatus", "TRANSFORMERS", "UNRECOGNISED", "activation_error", "applied",
    "apply", "gate", "import_target_modules", "installed_transformers_version", "is_active", "isolated", "known_patches",
    "left_out_by_fixes",
    "revert", "reverted",
    "settings", "status",
]

logger = logging.getLogger(config.LOGGER_NAME)

TRANSFORMERS = "transformers"

# Status values, in the words the table prints: the verdict's (overlay.patch) and the engine's own.
DISABLED = "disabled"
INACTIVE = "inactive"  # overlay not activated in this process (or reverted)
# Applied, but another object has taken the replacement's place since: the fix is not in force.
# Derived when a status is read (never stored): putting the replacement back makes it "applied" again.
DISPLACED = "displaced"

BAD_STATES = frozenset({UNRECOGNISED, FAILED, DISPLACED})


class OverlayError(RuntimeError):
    """Raised in strict mode, and for misuse of the API."""

    #: Set on strict mode's error (:func:`_strict_error`): the startup hook lets it through.
    raise_through_import: bool = False


def _strict_error(message: str) -> OverlayError:
    """The error strict mode raises: it goes through the startup hook (which swallows every other
    error) and makes the import that triggered it fail, as ``ATTN_OVERLAY_STRICT=1`` asks."""
    error = OverlayError(message + " (strict mode)")
    error.raise_through_import = True
    return error


@dataclass(frozen=True)
class PatchStatus:
    id: str
    title: str
    state: str
    reason: str
    module: str
    transformers_version: str | None
    affected: str
    fixed_in: str | None
    variants: tuple[str, ...] = ()
    """Release labels of the code each target matched (what the fingerprints recognised)."""
    changes: str = CHANGES_BOTH
    """What the patch changes where it applies (``Patch.changes``: errors, output or both)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "state": self.state,
            "reason": self.reason,
            "module": self.module,
            "transformers_version": self.transformers_version,
            "affected": self.affected,
            "fixed_in": self.fixed_in,
            "variants": list(self.variants),
            "changes": self.changes,
        }


@dataclass
class _Record:
    patch: Patch
    status: PatchStatus
    swaps: list[Swap] = field(default_factory=list)
    # The version label put the release outside the patch's range ("fixed upstream", "out of
    # range"): a verdict the code outranks where the release facts know it, read once the
    # target module has executed (_apply_patch), as for a pending record.
    label_only: bool = False

    @property
    def awaits_code(self) -> bool:
        """Whether the target module's code is still to be judged (the module is watched)."""
        return self.status.state == PENDING or self.label_only


@dataclass(frozen=True)
class Settings:
    """What the caller chose, read once when the overlay is activated and then passed along:
    re-applying (``reverted()``, ``applied()``) never reads the environment again."""

    strict: bool = False
    disabled: frozenset[str] = frozenset()
    fixes: str = config.FIXES_ALL
    """``ATTN_OVERLAY_FIXES``: ``errors`` leaves out every patch whose ``changes`` is not errors."""

    @classmethod
    def from_env(cls, strict: bool | None = None) -> Settings:
        return cls(
            strict=config.strict_from_env() if strict is None else strict,
            disabled=config.disabled_patch_ids([patch.id for patch in known_patches()]),
            fixes=config.fixes(),
        )


class _Engine:
    """Everything the engine keeps: the patches, what each one did (records, with the swaps to
    put back), the settings in force (``None``: not active) and which modules it waits for."""

    def __init__(self, patches: tuple[Patch, ...] | None = None, distribution: str = TRANSFORMERS) -> None:
        self.lock = threading.RLock()
        # The distribution whose version gates the patches. Always transformers, except in the
        # engine's own tests, which gate toy patches on a throwaway package (see isolated()).
        self.distribution = distribution
        self.patches = patches
        self.version: str | None = None
        self.settings: Settings | None = None
        self.records: dict[str, _Record] = {}
        self.imports = ModuleWatch(_on_module_executed)  # the target modules it waits for
        # Inside reverted(): the watched modules that executed meanwhile (patched when it ends).
        self.suspended: set[str] | None = None
        self.ever_patched: set[str] = set()  # modules this process has patched at least once
        self.startup_error: str | None = None
        self.last_apply_seconds: dict[str, float] = {}
        self.summary_logged = False  # the one info line of the first activation (_log_summary_once)

    @property
    def active(self) -> bool:
        return self.settings is not None


# -- the gate -------------------------------------------------------------------------------


def installed_transformers_version() -> str | None:
    """The installed transformers version, read from package metadata (never by importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(_engine.distribution)
    except PackageNotFoundError:
        return None


def gate(patch: Patch, installed: str | None) -> tuple[str, str]:
    """Decide from the version alone: (state, reason). ``PENDING`` means "check the code next"."""
    verdict = assess(patch, installed, distribution=_engine.distribution)
    return verdict.state, verdict.reason


# -- applying a patch ---------------------------------------------------------------------------


def _apply_patch(record: _Record, module: ModuleType) -> bool:
    """Ask :func:`overlay.patch.judge_code` (the code half of ``assess``) about the module's code,
    then swap every target or none (:func:`overlay.swapping.swap_in`).
    Updates ``record.status``; true when this call swapped the targets.

    A target that another overlay patch has replaced already is judged by the code under the
    overlay's replacements (transformers' own), and the new replacement wraps the one in place:
    both fixes are in force, each patch's replacement calling the function it was given
    (layered). :func:`overlay.swapping.take_off` takes such layers off in any order."""
    patch = record.patch
    located = {target.key: target.locate(module) for target in patch.targets}
    for location in located.values():
        if location.raw is not None and carries(function_of(location.raw), patch.id):
            # Already ours (re-entrant import, or a second engine copy), possibly under another
            # patch's layer: nothing to do.
            if record.status.state != APPLIED:
                _set(record, APPLIED, "already applied in this process")
            return False
    # The code each target is judged by: the release's own, under any overlay replacements.
    judged = {key: None if loc.raw is None else below_overlay(function_of(loc.raw)) for key, loc in located.items()}

    def read_source(target: Target) -> str | None:
        func = judged[target.key]
        return None if func is None else source_of(func)

    # The version half of the verdict was decided when the record was made (PENDING: in range;
    # label_only: outside it): what is left to judge is the code, which decides where it is code
    # the release facts know (_code_decides).
    verdict = judge_code(patch, read_source)
    state, reason = _code_decides(record, verdict)
    left_out = left_out_by_fixes(patch, _engine.settings.fixes) if state == APPLIED and _engine.settings else None
    if left_out is not None:  # the code says it would apply (a label outside the range): the setting decides
        _set(record, DISABLED, left_out)
        return False
    if state != APPLIED:
        if state == UNRECOGNISED:
            reason = foreign_code(patch, judged) or reason
        _set(record, state, reason, verdict.labels if state == verdict.state else ())
        return False
    try:
        record.swaps = swap_in(patch.id, verdict.matches, located)
    except Exception as exc:  # a patch that raises leaves every target as it was
        _set(record, FAILED, f"{type(exc).__name__}: {exc}")
        return False
    # A subclass's inherited copy another patch wrapped before this one reached the base method
    # is built again onto it, so both are in force there (overlay.swapping.follow_bases).
    for failed, reason in follow_bases(list(_engine.records.values())):
        _set(failed, FAILED, reason)
        if failed is record:
            return False
    _engine.ever_patched.add(module.__name__)
    _set(record, APPLIED, reason, verdict.labels)
    return True


def _code_decides(record: _Record, verdict: Any) -> tuple[str, str]:
    """(state, reason) of a record whose code ``verdict`` (:func:`overlay.patch.judge_code`) is in:
    known code decides whatever the version label said (a source tree or vendored copy first on
    the path, a fork with its own version), and the reason names both where they disagree;
    unknown code leaves a label outside the range its verdict, and is "unrecognised" inside it."""
    in_range = not record.label_only
    record.label_only = False  # judged now: a reload starts over from the label (_forget_reexecuted)
    label = record.status.transformers_version
    if verdict.state == UNRECOGNISED:
        return (verdict.state, verdict.reason) if in_range else (record.status.state, record.status.reason)
    if in_range:
        disagrees = verdict.state != APPLIED or not _labels_name(verdict.labels, label)
    else:
        disagrees = verdict.state != record.status.state
    if not disagrees:
        return verdict.state, verdict.reason if in_range else record.status.reason
    as_in = f" (the code is as in {', '.join(verdict.labels)})" if verdict.state == APPLIED and verdict.labels else ""
    if record.status.state == UNRECOGNISED and not in_range:  # judge_version's word for a label that is not PEP 440
        where = "which is not a PEP 440 version"
    else:
        where = f"inside {record.patch.affected}" if in_range else f"outside {record.patch.affected}"
    return verdict.state, (
        f"{verdict.reason}{as_in}: the code decides, though {_label_said(label)}, {where} "
        "(another transformers' code first on the path, or a fork with its own version)"
    )


def _labels_name(labels: tuple[str, ...], version: str | None) -> bool:
    """Whether every release label of the matched code names ``version`` (a label that is not
    one of the release facts' labels, a version that is not PEP 440, and a release newer than the
    facts know, whose code they cannot tell, count as naming it)."""
    from packaging.version import InvalidVersion, Version

    from .releases import label_covers, newest_release

    try:
        # A dev or local build (5.19.0.dev0, 5.18.0+neuron) is named by its release number.
        release = None if version is None else Version(version).base_version
        if release is None or Version(release) > Version(newest_release()):
            return True
        return all(label_covers(label, release) is not False for label in labels)
    except InvalidVersion:
        return True


def _label_said(version: str | None) -> str:
    """What the version label says: the package metadata's, and ``transformers.__version__``
    where the imported package says otherwise."""
    said = f"the package metadata of {_engine.distribution} says {version}"
    imported = getattr(sys.modules.get(_engine.distribution), "__version__", None)
    if isinstance(imported, str) and imported != version:
        said += f" (and {_engine.distribution}.__version__ {imported})"
    return said


def _set(record: _Record, state: str, reason: str, variants: tuple[str, ...] = ()) -> None:
    record.status = replace(record.status, state=state, reason=reason, variants=variants)


def _revert_records(records: list[_Record]) -> None:
    """Take these records' replacements off (:func:`overlay.swapping.take_off`: any order, the
    layers of patches not reverted stay in force). A patch one of whose layers could not be
    built again is taken off entirely and fails: all or none, for a patch too."""
    for record, reason in take_off(list(_engine.records.values()), records):
        _set(record, FAILED, reason)


def _sync_call_scope() -> None:
    """Keep :mod:`overlay.call_scope` in step with the replacements in force: the per-call decision
    on ``generate()`` exists exactly while some applied target declares ``needed_by_call``."""
    names = {
        swap.name
        for record in _engine.records.values()
        if record.status.state == APPLIED
        for swap in record.swaps
        if swap.target.needed_by_call is not None
    }
    try:
        call_scope.update(names)
    except Exception as exc:  # noqa: BLE001 - without it every step runs every layer: still correct
        logger.warning("attn-overlay: the per-call decision on generate() is not in place: %s", exc)


# -- registry ------------------------------------------------------------------------------


def known_patches() -> tuple[Patch, ...]:
    """Every patch this overlay ships (the patch files), in status-table order."""
    if _engine.patches is None:
        from .registry import load_patches

        _engine.patches = load_patches()
    return _engine.patches


def import_target_modules() -> dict[str, str]:
    """Import every patch's target module, as a program would, so that each patch is judged on the
    installed code (the startup hook, where armed, activates the overlay on the first). Returns the
    error of each module that could not be imported (a module of a release outside a patch's range
    may not exist: only a patch it leaves pending is a problem)."""
    import importlib

    errors = {}
    for name in sorted({patch.module for patch in known_patches()}):
        try:
            importlib.import_module(name)
        except Exception as exc:  # every failure is a result: the caller reports it
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def left_out_by_fixes(patch: Patch, fixes: str) -> str | None:
    """The reason ``ATTN_OVERLAY_FIXES=fixes`` leaves ``patch`` out (it changes the output of
    calls that complete on stock), or ``None`` where the setting keeps it."""
    if fixes != config.FIXES_ERRORS or patch.changes == CHANGES_ERRORS:
        return None
    # The patch's own words for the output it changes: its "(no error) ..." texts.
    silent = [text.removeprefix("(no error) ") for text in patch.errors if text.startswith("(no error)")]
    what = f" ({silent[0]})" if silent else ""
    also = "" if patch.changes == CHANGES_OUTPUT else "; it also fixes calls that raise on stock, which raise again"
    return (
        f"disabled by {config.FIXES_VAR}={config.FIXES_ERRORS}: it changes the output of calls that complete "
        f"on stock{what}{also}; {config.FIXES_VAR}={config.FIXES_ALL} applies it"
    )


def _initial_record(
    patch: Patch, version: str | None, disabled: frozenset[str], fixes: str = config.FIXES_ALL
) -> _Record:
    label_only = False
    if patch.id in disabled or "all" in disabled:
        state, reason = DISABLED, f"disabled by {config.DISABLE_VAR}"
    else:
        state, reason = gate(patch, version)
        # ATTN_OVERLAY_FIXES leaves out a patch the release would get; one fixed upstream or out of
        # range keeps that state (stock already gives the fixed output, or the patch never applied),
        # and where the code outranks the label, _apply_patch asks again.
        left_out = left_out_by_fixes(patch, fixes) if state == PENDING else None
        if left_out is not None:
            state, reason = DISABLED, left_out
        # Outside the range by the version label alone (or a label that is not PEP 440): the code
        # is judged too once its module has executed, and decides where the release facts know it.
        label_only = state in (FIXED_UPSTREAM, OUT_OF_RANGE) or (state == UNRECOGNISED and version is not None)
    status = PatchStatus(
        id=patch.id,
        title=patch.title,
        state=state,
        reason=reason,
        module=patch.module,
        transformers_version=version,
        affected=patch.affected,
        fixed_in=patch.fixed_in,
        changes=patch.changes,
    )
    return _Record(patch=patch, status=status, label_only=label_only)


# -- activation ----------------------------------------------------------------------------


def _on_module_executed(module: ModuleType) -> None:
    """Post-import hook (see ``_attn_overlay_startup.PostImportFinder``): a watched module has
    just executed, by a first import or by ``importlib.reload``, in this thread. In strict mode a
    patch that could not be applied makes this import raise."""
    with _engine.lock:
        if not _engine.active:
            return
        if _engine.suspended is not None:  # inside reverted(): patched when the block ends
            _engine.suspended.add(module.__name__)
            return
        _forget_reexecuted(module)
        problems = _apply_for_module(module)
        if problems and _strict():
            raise _strict_error("; ".join(problems))


# This process's engine, made here: its import watch needs the callback above.
_engine = _Engine()


def _strict() -> bool:
    """Whether the settings in force ask for strict mode (``False`` when not active)."""
    return _engine.settings is not None and _engine.settings.strict


def _forget_reexecuted(module: ModuleType) -> None:
    """After a reload the module holds new, stock functions: its applied records start over."""
    for record in _engine.records.values():
        if record.patch.module != module.__name__ or record.status.state != APPLIED or not record.swaps:
            continue
        current = [target.locate(module).raw for target in record.patch.targets]
        if all(raw is None or carries(function_of(raw), record.patch.id) for raw in current):
            continue
        record.swaps = []  # the owners are the old module's objects: nothing to put back there
        # Judged again from the version label on, as when the record was made (_initial_record).
        state, reason = gate(record.patch, record.status.transformers_version)
        record.label_only = state != PENDING
        if state == PENDING:
            reason = f"{module.__name__} was executed again (reload); patching the new code"
        _set(record, state, reason)


def _apply_for_module(module: ModuleType, *, imported_before: bool = False) -> list[str]:
    """Judge and apply every pending patch of ``module`` (which has executed). One patch's failure
    never stops the others. Returns one message per patch that could not be applied (the caller
    raises them in strict mode; each is logged as a warning here otherwise)."""
    started = time.perf_counter()
    swapped: list[str] = []
    problems: list[str] = []
    for record in _engine.records.values():
        if record.patch.module != module.__name__ or not record.awaits_code:
            continue
        try:
            applied_now = _apply_patch(record, module)
        except Exception as exc:  # a broken patch is that patch's status, no one else's
            _set(record, FAILED, f"{type(exc).__name__} while applying: {exc}")
            applied_now = False
        if applied_now:
            swapped.append(record.patch.id)
        elif record.status.state in BAD_STATES:
            message = f"attn-overlay: patch {record.patch.id} not applied: {record.status.reason}"
            problems.append(message)
            if not _strict():
                logger.warning(message)
    if swapped:
        _sync_call_scope()
    _engine.last_apply_seconds[module.__name__] = time.perf_counter() - started
    if swapped:
        if imported_before:  # once per module: it is in ever_patched from now on
            logger.warning(
                "attn-overlay: %s was imported before the overlay was activated; objects that "
                "captured its functions before now still hold the unpatched ones",
                module.__name__,
            )
        # At debug: the one info line is the activation's summary (_log_summary_once).
        logger.debug(
            "attn-overlay: patched %s in %s (transformers %s)",
            ", ".join(swapped),
            module.__name__,
            _engine.version,
        )
    return problems


def _activate(settings: Settings, only: Iterable[str] | None, *, from_startup: bool = False) -> None:
    """Activate with ``settings`` (the caller decided them: nothing is read here)."""
    with _engine.lock:
        patches = known_patches()
        known = {p.id for p in patches}
        wanted = set(only) if only is not None else known
        unknown = wanted - known
        if unknown:
            raise OverlayError(
                f"unknown patch id(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        if not _engine.active:
            _engine.version = installed_transformers_version()
        _engine.settings = settings
        for patch in patches:
            record = _engine.records.get(patch.id)
            if patch.id not in wanted:
                if record is None:
                    _engine.records[patch.id] = _initial_record(patch, _engine.version, frozenset({"all"}))
                    _set(_engine.records[patch.id], INACTIVE, "not selected")
                continue
            if record is None or record.status.state in (INACTIVE, DISABLED):
                _engine.records[patch.id] = _initial_record(patch, _engine.version, settings.disabled, settings.fixes)
        executing = _engine.imports.watch({r.patch.module for r in _engine.records.values() if r.awaits_code})
        if config.report_at_exit():
            from . import report

            report.print_report_at_exit(patches, displaced=_displaced)
        problems: list[str] = []
        for name in sorted({r.patch.module for r in _engine.records.values() if r.awaits_code}):
            module = sys.modules.get(name)
            if module is None or name in executing:
                continue  # not imported yet, or executing now: judged by its post-import hook
            if not _engine.imports.has_executed(name, module):
                _leave_pending(name, (
                    f"{name} was still executing in another thread when the overlay was activated, "
                    "without the overlay's import hook; call overlay.apply() again once it is imported"
                ))
                continue
            # Imported during `import transformers` itself (startup) is not late: nothing
            # outside transformers can have captured a function yet.
            problems += _apply_for_module(module, imported_before=not from_startup and name not in _engine.ever_patched)
        _log_summary_once()
        if problems and settings.strict:
            raise _strict_error("; ".join(problems))


def _log_summary_once() -> None:
    """At info, one line for the first activation (so one per process): the patches applied and
    where, those waiting for their module's import, and the others by state (fixed upstream, out
    of range, disabled...). Modules patched later say so at debug."""
    if _engine.summary_logged:
        return
    _engine.summary_logged = True
    if not logger.isEnabledFor(logging.INFO):
        return
    patched: dict[str, list[str]] = {}  # module -> the patch ids applied there
    others: dict[str, list[str]] = {}  # state -> patch ids
    for record in _engine.records.values():
        if record.status.state == APPLIED:
            patched.setdefault(record.patch.module, []).append(record.patch.id)
        else:
            others.setdefault(record.status.state, []).append(record.patch.id)
    parts = [f"patched {', '.join(ids)} in {module}" for module, ids in patched.items()]
    pending = others.pop(PENDING, None)
    if pending:
        parts.append(f"pending until their module is imported: {', '.join(pending)}")
    parts += [f"{state}: {', '.join(ids)}" for state, ids in others.items()]
    release = f"{_engine.distribution} {_engine.version}" if _engine.version else f"{_engine.distribution} not installed"
    logger.info("attn-overlay: %s: %s", release, "; ".join(parts))


def _leave_pending(module_name: str, reason: str) -> None:
    for record in _engine.records.values():
        if record.patch.module == module_name and record.status.state == PENDING:
            _set(record, PENDING, reason)


def activate_from_startup(module: ModuleType | None = None) -> None:
    """The startup hook's post-import hook on ``transformers``. Never raises (except in strict
    mode, which asked for it)."""
    settings = None
    try:
        if not config.auto_enabled():
            return
        config.configure_logging()
        settings = Settings.from_env()
        _activate(settings, only=None, from_startup=True)
    except OverlayError as exc:
        if getattr(exc, "raise_through_import", False):
            raise
        record_startup_failure(exc)
    except Exception as exc:
        record_startup_failure(exc)


def record_startup_failure(exc: BaseException | None) -> None:
    _engine.startup_error = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
    logger.warning("attn-overlay: could not activate: %s (transformers runs unpatched)", _engine.startup_error)


def activation_error() -> str | None:
    """Why the startup hook could not activate the overlay in this process, or ``None``."""
    return _engine.startup_error


# -- public API ----------------------------------------------------------------------------


def _settings_for(strict: bool | None) -> Settings:
    """The settings an ``apply()`` call asks for: those in force (the environment's, read once,
    on first activation), with ``strict`` changed only where the caller passed it."""
    current = _engine.settings or Settings.from_env()
    return current if strict is None or strict == current.strict else replace(current, strict=strict)


def apply(*, strict: bool | None = None, only: Iterable[str] | None = None) -> list[PatchStatus]:
    """Activate the overlay in this process: patch what is imported, watch what is not yet.

    Idempotent and thread-safe. ``only`` restricts it to some patch ids. ``strict`` raises
    :class:`OverlayError` for unrecognised code or a failed patch; ``None`` keeps the mode in
    force (on first activation: ``ATTN_OVERLAY_STRICT``).
    """
    with _engine.lock:
        config.configure_logging()
        settings = _settings_for(strict)
        _activate(settings, only=only)
        return _checked_status(settings)


def _checked_status(settings: Settings) -> list[PatchStatus]:
    result = status()
    if settings.strict:
        bad = [s for s in result if s.state in BAD_STATES]
        if bad:
            raise OverlayError(
                "; ".join(f"{s.id}: {s.state}: {s.reason}" for s in bad) + " (strict mode)"
            )
    return result


def revert(only: Iterable[str] | None = None) -> list[PatchStatus]:
    """Put back the very same function objects the overlay replaced, and stop watching imports."""
    with _engine.lock:
        ids = set(only) if only is not None else set(_engine.records)
        chosen = [record for patch_id, record in _engine.records.items() if patch_id in ids]
        _revert_records(chosen)
        for record in chosen:
            _set(record, INACTIVE, "reverted")
            record.label_only = False
        _sync_call_scope()
        if all(r.status.state == INACTIVE for r in _engine.records.values()):
            _engine.settings = None
            _engine.imports.unwatch_all()
        return status()


def status() -> list[PatchStatus]:
    """One :class:`PatchStatus` per patch. Does not activate anything."""
    with _engine.lock:
        if not _engine.records:
            version = installed_transformers_version()
            patches = known_patches()
            disabled = config.disabled_patch_ids([p.id for p in patches])  # read once, not per patch
            fixes = config.fixes()
            out = []
            for patch in patches:
                record = _initial_record(patch, version, disabled, fixes)
                reason = _engine.startup_error or "overlay not activated in this process"
                would_be = f"{reason}; would be: {record.status.state} ({record.status.reason})"
                out.append(replace(record.status, state=INACTIVE, reason=would_be))
            return out
        return [_in_force(r) for r in _engine.records.values()]


def _displaced() -> list[PatchStatus]:
    """The statuses of the patches displaced now (the exit report names them)."""
    return [s for s in status() if s.state == DISPLACED]


def _in_force(record: _Record) -> PatchStatus:
    """The record's status, checked against what is in force now: an applied patch whose
    replacement is no longer the object on its owner is "displaced", naming what took its place
    (read each time: nothing is stored, so putting the replacement back makes it "applied" again)."""
    status = record.status
    if status.state != APPLIED:
        return status
    for swap in record.swaps:
        current = vars(swap.owner).get(swap.name)
        if current is swap.replacement or wraps_replacement(current, swap.replacement):
            continue
        where = f"{getattr(swap.owner, '__module__', '?')}:{getattr(swap.owner, '__qualname__', swap.owner)}.{swap.name}"
        who = describe_object(current)
        return replace(status, state=DISPLACED, reason=(
            f"{where} is now {who}, set after the overlay patched it: the overlay's replacement is not in force. "
            f"If {who} only wraps the function it found, keep the fix by installing it after the overlay "
            "with functools.wraps (the overlay follows __wrapped__); if it replaces the function, "
            f"the fix is not there: leave one of the two out (ATTN_OVERLAY_DISABLE={record.patch.id}, "
            "or do not install the other)"
        ))
    return status


def is_active() -> bool:
    return _engine.active


def settings() -> Settings | None:
    """The settings in force, or ``None`` when the overlay is not active in this process."""
    return _engine.settings


def apply_timings() -> dict[str, float]:
    """Seconds spent applying patches, per module, in this process (for the benchmarks)."""
    return dict(_engine.last_apply_seconds)


@contextlib.contextmanager
def applied(*, only: Iterable[str] | None = None, strict: bool | None = None) -> Iterator[list[PatchStatus]]:
    """Apply for the duration of a ``with`` block; afterwards revert what this block applied and
    put back the settings that were in force before it. A patch the block left waiting for its
    module's import stops waiting too: a module first imported after the block stays stock."""
    def in_play() -> set[str]:  # applied, or waiting for its module's code
        return {pid for pid, r in _engine.records.items() if r.status.state == APPLIED or r.awaits_code}

    with _engine.lock:
        before = in_play()
        previous = _engine.settings
        try:
            result = apply(strict=strict, only=only)
        except BaseException:
            _restore_settings(previous)
            raise
        mine = sorted(in_play() - before)
    try:
        yield result
    finally:
        with _engine.lock:
            revert(only=mine)
            _restore_settings(previous)


def _restore_settings(previous: Settings | None) -> None:
    if _engine.active and previous is not None:
        _engine.settings = previous


@contextlib.contextmanager
def reverted() -> Iterator[None]:
    """Run a block on stock transformers (e.g. a control run while the startup hook is active).

    Inside the block every patched function is the original, and a target module first imported
    there stays stock too; when the block ends, both are patched again, with the settings that
    were in force (no late-import warning: the block asked for stock)."""
    with _engine.lock:
        settings = _engine.settings
        was = [pid for pid, r in _engine.records.items() if r.status.state == APPLIED]
        revert(only=was)
        outer = _engine.suspended
        _engine.suspended = set()
    try:
        yield
    finally:
        with _engine.lock:
            imported = sorted(_engine.suspended)
            _engine.suspended = outer
            if outer is not None:  # nested: the outer block patches them when it ends
                outer.update(imported)
            if was and settings is not None:  # something was applied, so settings were in force
                _activate(settings, only=was)
            if _engine.active and _engine.suspended is None:
                problems = []
                for name in imported:
                    module = sys.modules.get(name)
                    if module is not None:
                        problems += _apply_for_module(module)
                if problems and _strict():
                    raise _strict_error("; ".join(problems))


@contextlib.contextmanager
def isolated(patches: Iterable[Patch], *, distribution: str = TRANSFORMERS) -> Iterator[None]:
    """For tests of the engine itself: a fresh engine state with these patches, gated on the
    version of ``distribution``. Reverts everything and restores the previous state on exit."""
    global _engine
    previous = _engine
    fresh = _Engine(tuple(patches), distribution)
    with previous.lock:
        _engine = fresh
    try:
        yield
    finally:
        with fresh.lock:
            revert()
            fresh.imports.unwatch_all()
        _engine = previous
        with previous.lock:
            # Both engines watch through the same callback: put back what the fresh one removed.
            previous.imports.rewatch()
            _sync_call_scope()  # the per-call decision follows the restored engine's replacements
