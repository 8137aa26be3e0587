"""Swapping a target's function for a patch's replacement, and putting it back: the mechanics
under the engine, apart from its decisions (which patch, when, with what status).

Two patches may replace one function: the second wraps the first's replacement (layered), and
each is judged by transformers' code under the overlay's layers (:func:`below_overlay`).
:func:`take_off` takes any of the layers off in any order, building the ones above again onto
what is left, so that what stays applied stays in force.

A patch on a subclass's inherited copy of a method (``Target.inherited_from``) wraps what the
class inherits when it is built: a patch on the base method applied or taken off later changes
what the class should inherit, so :func:`follow_bases` builds such inherited layers again onto
what their class inherits now (:func:`take_off` does it after every revert, the engine after
every swap): in any order, each patch is in force in the subclass exactly while it is applied.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from . import config
from .call_scope import NEEDED_BY_CALL
from .patch import PATCH_MARKER, Location, Patch, Target, TargetMatch, Variant, function_of

__all__ = [
    "CHAIN_LIMIT", "Layered", "Swap", "below_overlay", "build", "carries", "describe_object",
    "follow_bases", "foreign_code", "swap_in", "take_off", "wraps_replacement",
]

logger = logging.getLogger(config.LOGGER_NAME)

# How far a __wrapped__ chain is followed: a bound on odd __wrapped__ cycles.
CHAIN_LIMIT = 32


@dataclass
class Swap:
    """One target swapped: what to put back, and what built the replacement."""

    owner: Any
    name: str
    # The raw object found in owner.__dict__ (function, staticmethod, ...) or inherited: the stock
    # one, or another overlay patch's replacement this one is layered on (see swap_in).
    original: Any
    replacement: Any
    # What built the replacement, so that it can be built again onto what is below it once a
    # patch under it is reverted (take_off).
    target: Target
    variant: Variant
    # The owner inherited the original (Target.inherited_from): a revert deletes the replacement
    # from the owner's namespace instead of putting the original there.
    inherited: bool = False

    def undo(self) -> None:
        if self.inherited:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


class Layered(Protocol):
    """What :func:`take_off` needs of the engine's record of one patch: the patch, and its swaps
    in force (which it changes)."""

    patch: Patch
    swaps: list[Swap]


Record = TypeVar("Record", bound=Layered)


# -- swapping in ---------------------------------------------------------------------------------


def swap_in(patch_id: str, matches: tuple[TargetMatch, ...], located: dict[str, Location]) -> list[Swap]:
    """Build patch ``patch_id``'s replacement of every matched target (``located``: target key ->
    where :meth:`~overlay.patch.Target.locate` found it) and put them all in place, or none: an
    exception leaves every target as it was, and is raised. What a target holds may be another
    patch's replacement: the new one wraps it (layered)."""
    swaps: list[Swap] = []
    try:
        for match in matches:
            if match.variant is None:  # an optional target this release does not have
                continue
            owner, name, raw = located[match.target.key]
            replacement = build(match.target, match.variant, raw, patch_id)
            inherited = vars(owner).get(name) is not raw
            swaps.append(Swap(owner, name, raw, replacement, match.target, match.variant, inherited))
        for swap in swaps:
            setattr(swap.owner, swap.name, swap.replacement)
    except Exception:
        for swap in swaps:
            if vars(swap.owner).get(swap.name) is swap.replacement:
                swap.undo()
        raise
    return swaps


def build(target: Target, variant: Variant, raw: Any, patch_id: str) -> Any:
    """Patch ``patch_id``'s replacement of ``raw`` (what the owner holds: the stock function, or
    another patch's replacement, which the new one then wraps), marked, wrapped like ``raw``."""
    original = function_of(raw)
    new: Any = target.replace(original, variant)  # a function: its attributes are set below
    if new is original or not callable(new):
        raise TypeError(f"replace() of {target.key} returned no new callable")
    setattr(new, PATCH_MARKER, patch_id)
    if getattr(new, "__wrapped__", None) is None:
        new.__wrapped__ = original
    if target.needed_by_call is not None:
        # With the layer itself: a wrapper built with functools.wraps (a patch's over this one, or
        # anyone's) copies the attribute but is not this layer, and is never passed over.
        setattr(new, NEEDED_BY_CALL, (target.needed_by_call, new))
    return _rewrap_like(raw, new)


def _rewrap_like(raw: Any, func: Any) -> Any:
    if isinstance(raw, staticmethod):
        return staticmethod(func)
    if isinstance(raw, classmethod):
        return classmethod(func)
    return func


# -- reading the layers ----------------------------------------------------------------------------


def _overlay_id(func: Any) -> str | None:
    """The id of the overlay patch whose replacement ``func`` is, or ``None`` for anything else.
    A foreign wrapper made with ``functools.wraps`` around a replacement copies its ``__dict__``,
    marker included, so it carries the id of the function it wraps: no replacement does (a patch
    never wraps its own replacement), so such a wrapper is not counted as one."""
    marker = getattr(func, PATCH_MARKER, None)
    if marker is None or getattr(getattr(func, "__wrapped__", None), PATCH_MARKER, None) == marker:
        return None
    return marker


def carries(func: Any, patch_id: str) -> bool:
    """Whether ``func`` is patch ``patch_id``'s replacement or wraps it at any depth (under other
    patches' layers, or under a wrapper that keeps ``__wrapped__``): the patch is there already."""
    for _ in range(CHAIN_LIMIT):
        if func is None:
            return False
        if getattr(func, PATCH_MARKER, None) == patch_id:
            return True
        func = getattr(func, "__wrapped__", None)
    return False


def below_overlay(func: Any) -> Any:
    """The function under the overlay replacements stacked on ``func`` (``func`` itself where
    there are none): the code a patch layered on them is judged by. Only the overlay's own
    replacements are looked through, never a foreign wrapper (that one is judged as it is)."""
    for _ in range(CHAIN_LIMIT):
        inner = getattr(func, "__wrapped__", None)
        if _overlay_id(func) is None or inner is None:
            return func
        func = inner
    return func


def wraps_replacement(current: Any, replacement: Any) -> bool:
    """Whether ``current`` wraps ``replacement`` (``functools.wraps``' ``__wrapped__`` chain)."""
    target = function_of(replacement)
    func = function_of(current)
    for _ in range(CHAIN_LIMIT):
        func = getattr(func, "__wrapped__", None)
        if func is None:
            return False
        if func is target:
            return True
    return False


def foreign_code(patch: Patch, judged: dict[str, Any]) -> str | None:
    """Why a target is unrecognised when another library replaced it before the overlay came (its
    function is defined outside transformers' module for it): the overlay patches only code it
    recognises, never over someone else's. ``None`` when every target is transformers' own code.
    ``judged`` maps each target's key to the function its code was judged by."""
    for target in patch.targets:
        func = judged[target.key]
        if func is None:
            continue
        module = getattr(func, "__module__", None)
        own = {target.module, *([target.inherited_from.partition(":")[0]] if target.inherited_from else [])}
        if module is not None and module not in own:
            return (
                f"{target.key} is {describe_object(func)}, which another library put there before the overlay "
                "patched: not transformers' code, so not patched (the overlay patches only code it recognises). "
                f"Its fix, if any, is that library's; ATTN_OVERLAY_DISABLE={patch.id} silences this"
            )
    return None


def describe_object(obj: Any) -> str:
    """``module.qualname`` of a function found on a class or module (``"nothing"`` when gone)."""
    if obj is None:
        return "nothing (the attribute was deleted)"
    func = function_of(obj)
    module = getattr(func, "__module__", None) or "?"
    name = getattr(func, "__qualname__", None) or type(func).__qualname__
    return f"{module}.{name}"


# -- taking layers off -------------------------------------------------------------------------------


def take_off(records: Collection[Record], chosen: list[Record]) -> list[tuple[Record, str]]:
    """Take the ``chosen`` records' replacements off, in any order (``records``: every record
    with swaps in force): each target gets back the very object the lowest of them replaced.
    Another patch's replacement layered on one of them (not chosen itself) is taken off with it,
    then built again onto what is there now: that patch stays applied, over the code below. A
    replacement someone else covered since (with anything but the overlay's own layers) is left
    as it is, with a warning.

    Returns the records whose layer could not be built again, with why, in the order they are to
    be marked failed: all or none, for a patch too, so each of them is taken off entirely."""
    reverting = {id(record) for record in chosen}
    failed: dict[str, tuple[Record, str]] = {}  # patch id -> (record, why) of a layer not rebuilt
    for entries in _slots(records).values():
        if any(id(record) in reverting for record, _ in entries):
            _take_off_slot(entries, reverting, failed)
    for record in chosen:
        record.swaps = []
    _follow_bases(records, failed)
    return _taken_off_whole(records, failed)


def follow_bases(records: Collection[Record]) -> list[tuple[Record, str]]:
    """Build every inherited layer (a replacement set on a class that inherited the function it
    wraps) again onto what its class inherits now, where that changed since it was built: a patch
    on the base method was applied or taken off. Layers above it on that class are built again
    over it, subclasses after their bases. ``records``: every record with swaps in force.

    Returns the records whose layer could not be built again, with why (as :func:`take_off`):
    each of them is taken off entirely."""
    failed: dict[str, tuple[Record, str]] = {}
    _follow_bases(records, failed)
    return _taken_off_whole(records, failed)


def _taken_off_whole(records: Collection[Record], failed: dict[str, tuple[Record, str]]) -> list[tuple[Record, str]]:
    """Take the ``failed`` records off entirely (all or none, for a patch too): the failures, in
    the order they are to be marked failed."""
    failures: list[tuple[Record, str]] = []
    for record, reason in failed.values():
        failures += take_off(records, [record])
        failures.append((record, reason))
    return failures


def _slots(records: Collection[Record]) -> dict[tuple[int, str], list[tuple[Record, Swap]]]:
    """Every applied swap, by the attribute it was made on: (id of the owner, name) -> entries."""
    slots: dict[tuple[int, str], list[tuple[Record, Swap]]] = {}
    for record in records:
        for swap in record.swaps:
            slots.setdefault((id(swap.owner), swap.name), []).append((record, swap))
    return slots


def _stack_in_place(entries: list[tuple[Record, Swap]]) -> tuple[list[tuple[Record, Swap]], list[tuple[Record, Swap]]]:
    """The overlay's layers on one attribute, from the object in place down (each the original of
    the one above), and the entries not reached that way (someone else covered them since)."""
    owner, name = entries[0][1].owner, entries[0][1].name
    by_replacement = {id(swap.replacement): (record, swap) for record, swap in entries}
    stack: list[tuple[Record, Swap]] = []
    current = vars(owner).get(name)
    while id(current) in by_replacement:
        record, swap = by_replacement.pop(id(current))
        stack.append((record, swap))
        current = swap.original
    return stack, list(by_replacement.values())


def _follow_bases(records: Collection[Record], failed: dict[str, tuple[Record, str]]) -> None:
    """:func:`follow_bases`, collecting the layers not rebuilt in ``failed``."""
    inherited = []
    for entries in _slots(records).values():
        stack, unreached = _stack_in_place(entries)
        # A stack someone else covered is left as it is: its status says "displaced".
        if stack and not unreached and stack[-1][1].inherited:
            inherited.append(stack)
    # A class before its subclasses: rebuilding it changes what they inherit.
    for stack in sorted(inherited, key=lambda s: len(getattr(s[-1][1].owner, "__mro__", ()))):
        record, bottom = stack[-1]
        if function_of(_inherited_original(bottom.owner, bottom.name, record.patch.id)) is function_of(bottom.original):
            continue
        for _, swap in stack:  # from the top: the bottom one deletes the class's own entry
            swap.undo()
        for record, swap in reversed(stack):  # from the bottom up, onto what is inherited now
            _relayer(record, swap, failed)


def _take_off_slot(
    entries: list[tuple[Record, Swap]], reverting: set[int], failed: dict[str, tuple[Record, str]]
) -> None:
    """:func:`take_off` on one attribute: ``entries`` are every applied swap made there."""
    owner, name = entries[0][1].owner, entries[0][1].name
    stack, unreached = _stack_in_place(entries)
    for record, _ in unreached:
        if id(record) in reverting:
            logger.warning(
                "attn-overlay: %s.%s was replaced by someone else after the overlay patched it; left as it is",
                getattr(owner, "__qualname__", owner),
                name,
            )
    lowest = max((i for i, (record, _) in enumerate(stack) if id(record) in reverting), default=None)
    if lowest is None:
        return
    for _, swap in stack[: lowest + 1]:  # from the top: each puts back the layer below it
        swap.undo()
    for record, swap in reversed(stack[:lowest]):  # the layers kept, from the bottom up
        if id(record) not in reverting:
            _relayer(record, swap, failed)


def _relayer(record: Record, swap: Swap, failed: dict[str, tuple[Record, str]]) -> None:
    """Build ``swap``'s replacement again onto what its attribute holds now (the same variant: the
    code under the overlay, which it was judged by, is unchanged), in ``record.swaps``. Where the
    class inherits the attribute, onto :func:`_inherited_original`."""
    raw = vars(swap.owner).get(swap.name)
    if raw is None:
        raw = _inherited_original(swap.owner, swap.name, record.patch.id)
    try:
        if raw is None:
            raise AttributeError(f"{swap.target.key} is gone")
        replacement = build(swap.target, swap.variant, raw, record.patch.id)
    except Exception as exc:
        record.swaps = [s for s in record.swaps if s is not swap]
        failed[record.patch.id] = (record, f"{type(exc).__name__} while layering it again after a revert under it: {exc}")
        return
    layered = Swap(swap.owner, swap.name, raw, replacement, swap.target, swap.variant, swap.name not in vars(swap.owner))
    setattr(swap.owner, swap.name, replacement)
    record.swaps = [layered if s is swap else s for s in record.swaps]


def _inherited_original(owner: Any, name: str, patch_id: str) -> Any:
    """What an inherited layer of patch ``patch_id`` on class ``owner`` wraps: what the class
    inherits now, under that patch's own replacements on top of it. A patch whose targets are a
    base method and a subclass's inherited copy of it gives each its own replacement of the code
    as it was before the patch (as :func:`swap_in` builds them), never the one over the other.
    ``None`` when no base defines the attribute.

    Limit: only that patch's layers on top are looked through. Where another patch was layered on
    the base over it since, the subclass's layer wraps both (that patch's base replacement then
    runs twice there). No shipped patch targets a base method and an inherited copy of it at once."""
    raw = _inherited_raw(owner, name)
    func = below = function_of(raw)
    for _ in range(CHAIN_LIMIT):
        inner = getattr(below, "__wrapped__", None)
        if inner is None or _overlay_id(below) != patch_id:
            break
        below = inner
    return raw if below is func else _rewrap_like(raw, below)


def _inherited_raw(owner: Any, name: str) -> Any:
    """What a class inherits for ``name`` from its bases (its method resolution order after
    itself), whatever its own namespace holds; ``None`` when no base defines it."""
    for base in getattr(owner, "__mro__", ())[1:]:
        if name in vars(base):
            return vars(base)[name]
    return None
