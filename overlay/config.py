"""Every setting of the overlay, in one table: :data:`SETTINGS`.

Each row (a :class:`Setting`) names its environment variable, the values it accepts, its default
and what it does; the README's settings table is generated from these rows
(``scripts/readme_table.py``), ``python -m overlay.apply`` shows the value of each in force and
where it comes from (``--json``: the ``settings`` key), and ``--strict`` exits 1 on any value
outside a row (:func:`problems`).

A value outside its row is never silently replaced: the accessors below log one warning on the
``overlay`` logger, once per process for each variable and value, naming the variable, the value,
the values accepted and what is used instead. An empty value counts as unset. Patch ids in
``ATTN_OVERLAY_DISABLE`` are matched ignoring case, with ``_`` read as ``-`` (``kv_cache_dtype``
is ``kv-cache-dtype``); an id that names no patch is reported with the valid ids and the closest
one. Checking ids needs the patch declarations, which this module cannot import (it is the floor
every other module reads from and imports nothing of the package): the caller that has them
passes ``known_patch_ids``.

Nothing here is read on a hot path: the engine reads its settings once, when the overlay is
activated, and passes them along (``overlay.engine.Settings``); the attention guard reads its
mode when ``overlay.guard`` is first imported. Imports only the standard library (never torch or
transformers).

Logging: the package logs on one logger, ``overlay`` (:data:`LOGGER_NAME`, the import package's
name, so a module's ``logging.getLogger(__name__)`` is its child). By default the overlay adds no
handler and sets no level: its warnings reach stderr through logging's last resort, or through the
handlers the program configured. ``ATTN_OVERLAY_LOG_LEVEL`` (read once, when the overlay activates:
:func:`configure_logging`) sets the logger's level; at ``info`` the engine says in one line per
process what it patches, what is fixed upstream and what is out of range (``debug`` adds a line per
module as it is patched). Below ``warning`` the overlay attaches one handler to its logger that
writes on stderr, and steps aside for each record a handler of the program takes as well
(``logging.basicConfig()``, a framework's set-up, before or after the overlay activated): a line is
printed once, in the program's format where the program configured logging. In a distributed job
(``RANK``, else ``LOCAL_RANK``, as torchrun sets them; torch.distributed is never imported) only
rank 0 goes below ``warning`` unless ``ATTN_OVERLAY_LOG_RANKS=all``; warnings and errors are
printed on every rank, as without the setting.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

#: The names other modules use; the rest is this module's own.
__all__ = [
    "ALL_PATCHES", "BY_NAME", "DEPRECATED_GUARD_MODES", "DISABLE_VAR", "ENABLE_VAR", "FALSE_WORDS", "FIXES", "FIXES_ALL",
    "FIXES_DEFAULT", "FIXES_ERRORS", "FIXES_VAR", "FROM_DEFAULT",
    "FROM_ENVIRONMENT", "GUARD_DEFAULT", "GUARD_MODES", "GUARD_VAR", "LOGGER_NAME", "LOG_LEVEL_VAR", "LOG_RANKS_VAR",
    "RANK_VARS", "REPORT_VAR", "SETTINGS", "STRICT_VAR", "Value", "auto_enabled", "cache_dir", "configure_logging",
    "disabled_patch_ids", "fixes", "guard_mode", "in_force", "log_level", "problems", "process_rank", "report_at_exit",
    "reset_warnings", "strict_from_env", "value",
]

#: The package's one logger: every module of the overlay logs on it (or on a child of it).
LOGGER_NAME = "overlay"
logger = logging.getLogger(LOGGER_NAME)

#: ``ATTN_OVERLAY=0`` turns the automatic activation (startup hook) off for this process and
#: its children. Explicit calls (``overlay.apply()``, ``python -m overlay.apply PROGRAM``) still work.
#: ``_attn_overlay_startup`` reads the same variable with the same words (it cannot import this module).
ENABLE_VAR = "ATTN_OVERLAY"
#: ``ATTN_OVERLAY_STRICT=1``: unrecognised code or a failed patch raises instead of warning.
STRICT_VAR = "ATTN_OVERLAY_STRICT"
#: ``ATTN_OVERLAY_DISABLE=id1,id2``: leave these patches out (``all`` leaves every patch out).
DISABLE_VAR = "ATTN_OVERLAY_DISABLE"
#: ``ATTN_OVERLAY_REPORT=1``: at exit, print on stderr what each patch fixed in this process.
REPORT_VAR = "ATTN_OVERLAY_REPORT"
#: ``ATTN_OVERLAY_ATTENTION_GUARD=align|check|off``: what the attention guard does (``overlay.guard``).
GUARD_VAR = "ATTN_OVERLAY_ATTENTION_GUARD"
#: ``ATTN_OVERLAY_CACHE_DIR=DIR``: where ``overlay.testing`` caches the fake device's compiled backend.
CACHE_DIR_VAR = "ATTN_OVERLAY_CACHE_DIR"
#: ``ATTN_OVERLAY_LOG_LEVEL=debug|info|warning|error``: the level of the ``overlay`` logger.
LOG_LEVEL_VAR = "ATTN_OVERLAY_LOG_LEVEL"
#: ``ATTN_OVERLAY_LOG_RANKS=0|all``: which ranks of a distributed job log below warning.
LOG_RANKS_VAR = "ATTN_OVERLAY_LOG_RANKS"
#: ``ATTN_OVERLAY_FIXES=all|errors``: which fixes apply, by what they change (``Patch.changes``).
FIXES_VAR = "ATTN_OVERLAY_FIXES"

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

#: The attention guard's modes (``overlay.guard`` documents each) and the old names still accepted.
GUARD_MODES = ("align", "check", "off")
GUARD_DEFAULT = "align"
DEPRECATED_GUARD_MODES = {"strict": "check"}

ALL_PATCHES = "all"

#: ``ATTN_OVERLAY_FIXES``'s words: every fix, or only those that change nothing but calls that
#: raise on the stock release (``overlay.patch.CHANGES_ERRORS``: this module imports nothing of
#: the package, so the engine compares ``Patch.changes`` with that word itself).
FIXES_ALL = "all"
FIXES_ERRORS = "errors"
FIXES = (FIXES_ALL, FIXES_ERRORS)
FIXES_DEFAULT = FIXES_ALL

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
LOG_LEVEL_DEFAULT = "warning"
ALL_RANKS = "all"
LOG_RANKS = ("0", ALL_RANKS)
#: Where a process finds its rank, in this order: torchrun sets both (RANK: in the whole job).
RANK_VARS = ("RANK", "LOCAL_RANK")

FROM_ENVIRONMENT = "environment"
FROM_DEFAULT = "default"


@dataclass(frozen=True)
class Reading:
    """What a setting makes of one raw value: the value used, and what is wrong with the raw one."""

    value: Any
    problem: str | None = None
    """The raw value (or part of it) is outside the table: what is wrong and what is used instead."""
    note: str | None = None
    """Accepted, but deprecated: the name to use now."""


@dataclass(frozen=True)
class Setting:
    """One row of the table."""

    name: str
    """The environment variable."""
    values: str
    """The values accepted, as the README and the warnings write them."""
    default: Any
    """The value used when the variable is unset or empty (or outside the table)."""
    default_text: str
    """The default as a user would write it."""
    meaning: str
    """What the setting does, one sentence."""
    parse: Callable[..., Reading]
    """``parse(setting, raw, known_patch_ids)`` -> :class:`Reading` (``raw``: not empty)."""

    def read(self, known_patch_ids: Iterable[str] | None = None) -> Value:
        """This setting's value in the environment now. Logs nothing."""
        raw = os.environ.get(self.name)
        if raw is None or not raw.strip():
            return Value(self, self.default, raw, FROM_DEFAULT)
        known = None if known_patch_ids is None else tuple(known_patch_ids)
        reading = self.parse(self, raw, known)
        return Value(self, reading.value, raw, FROM_ENVIRONMENT, reading.problem, reading.note)


@dataclass(frozen=True)
class Value:
    """A setting's value in force, and where it comes from."""

    setting: Setting
    value: Any
    raw: str | None
    """The environment's text, or ``None`` when the variable is unset."""
    source: str
    """``"environment"`` or ``"default"`` (unset or empty)."""
    problem: str | None = None
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The ``settings`` entry of ``python -m overlay.apply --json`` (see ``overlay/cli.py``)."""
        value = self.value
        if isinstance(value, frozenset):
            value = sorted(value)
        return {
            "value": value,
            "source": self.source,
            "raw": self.raw,
            "default": self.setting.default_text,
            "problem": self.problem,
            "deprecated": self.note,
        }


# -- parsers ---------------------------------------------------------------------------------


def _outside(setting: Setting, raw: str, what: str = "an accepted value") -> str:
    return (
        f"attn-overlay: {setting.name}={raw!r} is not {what} (accepted: {setting.values}); "
        f"using the default, {setting.default_text}"
    )


def _boolean(setting: Setting, raw: str, known_patch_ids: tuple[str, ...] | None) -> Reading:
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return Reading(True)
    if word in FALSE_WORDS:
        return Reading(False)
    return Reading(setting.default, _outside(setting, raw))


def _guard_mode(setting: Setting, raw: str, known_patch_ids: tuple[str, ...] | None) -> Reading:
    word = raw.strip().lower()
    if word in GUARD_MODES:
        return Reading(word)
    if word in DEPRECATED_GUARD_MODES:
        new = DEPRECATED_GUARD_MODES[word]
        return Reading(
            new,
            note=(
                f"attn-overlay: {setting.name}={raw!r} is deprecated: that mode is now called {new!r} "
                f"(same behaviour); using {new}. Set {setting.name}={new}"
            ),
        )
    return Reading(setting.default, _outside(setting, raw, "a mode"))


def _one_of(words: Iterable[str], what: str) -> Callable[..., Reading]:
    """A parser accepting ``words`` (case and spaces ignored); ``what`` names them in the warning."""
    accepted = tuple(words)

    def parse(setting: Setting, raw: str, known_patch_ids: tuple[str, ...] | None) -> Reading:
        word = raw.strip().lower()
        if word in accepted:
            return Reading(word)
        return Reading(setting.default, _outside(setting, raw, what))

    return parse


def normalise_patch_id(text: str) -> str:
    """How ``ATTN_OVERLAY_DISABLE`` compares ids: case ignored, ``_`` read as ``-``, spaces stripped."""
    return text.strip().lower().replace("_", "-")


def _patch_ids(setting: Setting, raw: str, known_patch_ids: tuple[str, ...] | None) -> Reading:
    wanted = [normalise_patch_id(part) for part in raw.split(",") if part.strip()]
    if known_patch_ids is None:  # no patch declarations to check against: taken as written
        return Reading(frozenset(wanted))
    canonical = {normalise_patch_id(pid): pid for pid in known_patch_ids}
    ids, unknown = set(), []
    for pid in wanted:
        if pid == ALL_PATCHES:
            ids.add(ALL_PATCHES)
        elif pid in canonical:
            ids.add(canonical[pid])
        elif pid not in unknown:
            unknown.append(pid)
    if not unknown:
        return Reading(frozenset(ids))
    import difflib  # only on this path: a typo to explain

    valid = sorted(known_patch_ids)
    named = []
    for pid in unknown:
        close = difflib.get_close_matches(pid, list(canonical), n=1)
        named.append(f"{pid!r}" + (f" (did you mean {canonical[close[0]]!r}?)" if close else ""))
    left_out = ", ".join(sorted(ids)) if ids else "none"
    return Reading(
        frozenset(ids),
        f"attn-overlay: {setting.name}={raw!r} names no patch {', '.join(named)}; valid ids: "
        f"{', '.join(valid)} (or {ALL_PATCHES}); ignored: the patches left out are {left_out}",
    )


def _fixes(setting: Setting, raw: str, known_patch_ids: tuple[str, ...] | None) -> Reading:
    word = raw.strip().lower()
    if word in FIXES:
        return Reading(word)
    import difflib  # only on this path: a typo to explain

    close = difflib.get_close_matches(word, FIXES, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    # Not the default: someone who set this variable at all asked to choose what changes, and a
    # typo must not give them the output changes they meant to keep out. `errors` changes no call
    # that completes on stock, so it is the one value that cannot surprise them.
    return Reading(FIXES_ERRORS, (
        f"attn-overlay: {setting.name}={raw!r} is not a choice of fixes{hint} (accepted: {setting.values}); "
        f"using {FIXES_ERRORS}, which changes no call that completes on the stock release; set "
        f"{setting.name}={FIXES_ALL} for every fix"
    ))


def _path(setting: Setting, raw: str, known_patch_ids: tuple[str, ...] | None) -> Reading:
    return Reading(os.path.expanduser(raw.strip()))


# -- the table -------------------------------------------------------------------------------

_BOOLEAN_WORDS = f"{', '.join(TRUE_WORDS)} / {', '.join(FALSE_WORDS)}"

SETTINGS: tuple[Setting, ...] = (
    Setting(
        ENABLE_VAR,
        _BOOLEAN_WORDS,
        True,
        "1",
        "0 turns the startup hook off for a process and its children; `overlay.apply()` and "
        "`python -m overlay.apply PROGRAM` still apply the patches (the latter sets it to 1 for the "
        "program's child processes, multiprocessing's spawn and forkserver children among them)",
        _boolean,
    ),
    Setting(
        DISABLE_VAR,
        f"patch ids, comma-separated (case ignored, _ read as -), or {ALL_PATCHES}",
        frozenset(),
        "none (every patch applies)",
        "leaves these patches out; an id that names no patch is reported, with the valid ids and the "
        "closest one",
        _patch_ids,
    ),
    Setting(
        FIXES_VAR,
        ", ".join(FIXES),
        FIXES_DEFAULT,
        FIXES_DEFAULT,
        "which fixes apply: `all` every one; `errors` only those that change nothing but calls that raise "
        "on the stock release (an error becomes a working run), so every call stock completes gives the "
        "stock output; the fixes that change completed calls (other tokens or scores: the fixed release's) "
        "are disabled with a reason saying so (the status table's `changes` column); a value outside these "
        "is reported, with the closest one, and `errors` is used",
        _fixes,
    ),
    Setting(
        STRICT_VAR,
        _BOOLEAN_WORDS,
        False,
        "0",
        "1 fails loudly instead of warning: a patch meeting unrecognised code, or failing, raises "
        "`OverlayError` (same as `python -m overlay.apply --strict`)",
        _boolean,
    ),
    Setting(
        REPORT_VAR,
        _BOOLEAN_WORDS,
        False,
        "0",
        "1 prints at exit, on stderr, what each patch fixed in the process",
        _boolean,
    ),
    Setting(
        GUARD_VAR,
        ", ".join(GUARD_MODES) + " (strict: the old name of check, deprecated)",
        GUARD_DEFAULT,
        GUARD_DEFAULT,
        "what the attention guard does with q, k, v that do not go together: `align` casts a "
        "dtype-only mismatch (and names the tensors of anything else, after the kernel fails), "
        "`check` checks before every call and raises on any mismatch (for CI), `off` steps aside",
        _guard_mode,
    ),
    Setting(
        CACHE_DIR_VAR,
        "a directory",
        None,
        "$XDG_CACHE_HOME/attn-overlay, else ~/.cache/attn-overlay",
        "where `overlay.testing`'s fake device caches its compiled backend",
        _path,
    ),
    Setting(
        LOG_LEVEL_VAR,
        ", ".join(LOG_LEVELS),
        LOG_LEVEL_DEFAULT,
        LOG_LEVEL_DEFAULT,
        "the level of the `overlay` logger: `info` prints one line per process on stderr when the "
        "overlay activates (what it patches, what is fixed upstream or out of range), `debug` also a "
        "line per module patched, `error` hides the warnings; a line the program's own logging "
        "handlers print is not printed twice",
        _one_of(LOG_LEVELS, "a level"),
    ),
    Setting(
        LOG_RANKS_VAR,
        ", ".join(LOG_RANKS),
        LOG_RANKS[0],
        LOG_RANKS[0],
        "in a distributed job (`RANK`, else `LOCAL_RANK`, as torchrun sets them), which ranks log "
        "below warning: `0` rank 0 only, `all` every rank; warnings are printed on every rank either way",
        _one_of(LOG_RANKS, "a choice of ranks"),
    ),
)

BY_NAME: dict[str, Setting] = {setting.name: setting for setting in SETTINGS}


# -- reading, with one warning per variable and value ------------------------------------------

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(value: Value) -> None:
    for message in (value.problem, value.note):
        if message is None:
            continue
        with _warned_lock:
            if (value.setting.name, message) in _warned:
                continue
            _warned.add((value.setting.name, message))
        logger.warning(message)


def value(name: str, known_patch_ids: Iterable[str] | None = None) -> Value:
    """The value in force of setting ``name`` (its environment variable); a value outside the
    table is logged once per process (see the module docstring)."""
    current = BY_NAME[name].read(known_patch_ids=known_patch_ids)
    _warn_once(current)
    return current


def in_force(known_patch_ids: Iterable[str] | None = None) -> list[Value]:
    """Every setting's value in force, in table order (logs nothing: for reports)."""
    known = None if known_patch_ids is None else tuple(known_patch_ids)
    return [setting.read(known_patch_ids=known) for setting in SETTINGS]


def problems(known_patch_ids: Iterable[str] | None = None) -> list[str]:
    """The message for each setting whose value is outside the table (empty: all good).

    Pass ``known_patch_ids`` to check ``ATTN_OVERLAY_DISABLE``'s ids too. Deprecated names are
    accepted and not counted here (their note is in :func:`in_force`)."""
    return [v.problem for v in in_force(known_patch_ids) if v.problem is not None]


def reset_warnings() -> None:
    """Forget which values were already reported (for tests)."""
    with _warned_lock:
        _warned.clear()


# -- the accessors the engine, the guard and the startup path call (each reads one variable) ---


def auto_enabled() -> bool:
    return value(ENABLE_VAR).value


def strict_from_env() -> bool:
    return value(STRICT_VAR).value


def disabled_patch_ids(known_patch_ids: Iterable[str] | None = None) -> frozenset[str]:
    """The ids ``ATTN_OVERLAY_DISABLE`` leaves out, normalised (``all``: every patch). With
    ``known_patch_ids``, spelled as the patches spell them, and an id naming no patch is reported."""
    return value(DISABLE_VAR, known_patch_ids).value


def fixes() -> str:
    """``ATTN_OVERLAY_FIXES``: :data:`FIXES_ALL` or :data:`FIXES_ERRORS`."""
    return value(FIXES_VAR).value


def report_at_exit() -> bool:
    return value(REPORT_VAR).value


def guard_mode() -> str:
    return value(GUARD_VAR).value


def cache_dir() -> str | None:
    """``ATTN_OVERLAY_CACHE_DIR`` (``~`` expanded), or ``None`` for the default location."""
    return value(CACHE_DIR_VAR).value


# -- logging ---------------------------------------------------------------------------------------


def process_rank() -> int | None:
    """This process's rank in a distributed job, from ``RANK`` (else ``LOCAL_RANK``), which torchrun
    sets; ``None`` outside one, or where the value is not a number. Imports nothing."""
    for name in RANK_VARS:
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                return int(raw)
            except ValueError:
                return None
    return None


def log_level() -> int:
    """The level ``ATTN_OVERLAY_LOG_LEVEL`` asks for in this process: on a rank other than 0, not
    below warning (the default) unless ``ATTN_OVERLAY_LOG_RANKS=all``."""
    level = LOG_LEVELS[value(LOG_LEVEL_VAR).value]
    every_rank = value(LOG_RANKS_VAR).value == ALL_RANKS
    if level < logging.WARNING and not every_rank and process_rank() not in (None, 0):
        return logging.WARNING
    return level


class StderrUnlessHandled(logging.Handler):
    """Writes each record's message on stderr, unless a handler of the program takes the record too.

    Asked at each record, not when attached: logging configured after the overlay activated
    (``logging.basicConfig()`` in ``main()``) still gets each line once, in its own format. The
    stream is looked up at each record too (``sys.stderr`` redirected later is followed)."""

    def emit(self, record: logging.LogRecord) -> None:
        if self._taken_by_another(record):
            return
        try:
            stream = sys.stderr
            if stream is not None:  # pythonw: no stderr at all
                stream.write(self.format(record) + "\n")
                stream.flush()
        except Exception:
            self.handleError(record)

    def _taken_by_another(self, record: logging.LogRecord) -> bool:
        """Whether another handler on the record's way up the logger tree (as logging propagates
        it) accepts its level."""
        current: logging.Logger | None = logging.getLogger(record.name)
        while current is not None:
            if any(handler is not self and record.levelno >= handler.level for handler in current.handlers):
                return True
            if not current.propagate:
                return False
            current = current.parent
        return False


_logging_lock = threading.Lock()
_logging_configured = False


def configure_logging() -> None:
    """Apply ``ATTN_OVERLAY_LOG_LEVEL`` to the ``overlay`` logger, once per process (the engine
    calls this when it activates). At warning, the default, nothing changes: no level, no handler.
    Below it, the logger gets the level and one :class:`StderrUnlessHandled`; at error, the level."""
    global _logging_configured
    with _logging_lock:
        if _logging_configured:
            return
        _logging_configured = True
        level = log_level()
        if level == logging.WARNING:
            return
        logger.setLevel(level)
        if level < logging.WARNING and not any(isinstance(h, StderrUnlessHandled) for h in logger.handlers):
            logger.addHandler(StderrUnlessHandled())
