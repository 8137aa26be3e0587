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
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

logger = logging.getLogger("overlay")

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

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

#: The attention guard's modes (``overlay.guard`` documents each) and the old names still accepted.
GUARD_MODES = ("align", "check", "off")
GUARD_DEFAULT = "align"
DEPRECATED_GUARD_MODES = {"strict": "check"}

ALL_PATCHES = "all"

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

    def read(self, known_patch_ids: Iterable[str] | None = None) -> "Value":
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


def report_at_exit() -> bool:
    return value(REPORT_VAR).value


def guard_mode() -> str:
    return value(GUARD_VAR).value


def cache_dir() -> str | None:
    """``ATTN_OVERLAY_CACHE_DIR`` (``~`` expanded), or ``None`` for the default location."""
    return value(CACHE_DIR_VAR).value
