"""What the overlay actually fixed in this process: per patch, how many calls it changed something.

Patches call :func:`record_outside_compile` (or :func:`record`, when they already know they are
not compiling) on their slow path only (tensors moved, dtypes cast, a head count corrected, a
cache rebuilt): the path where the overlay already does real work, so counting costs nothing
measurable, and the hot path (nothing to fix) never reaches this module. :func:`record` must
never run inside a compiled region: the lock would break the graph.

``overlay.fired()`` returns the counts; ``ATTN_OVERLAY_REPORT=1`` prints them at exit on stderr,
one line per patch that fired, with what it did and the upgrade advice from the patch metadata.
A process in which nothing fired prints nothing.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter

#: The names other modules use; the rest is this module's own.
__all__ = [
    "describe_actions", "fired", "fired_actions", "print_report_at_exit", "record", "record_outside_compile",
    "report_lines", "reset",
]

_lock = threading.Lock()
_calls: Counter[str] = Counter()
_actions: dict[str, Counter[str]] = {}


def record(patch_id: str, action: str, *more: str) -> None:
    """Count one call in which patch ``patch_id`` changed something; ``action`` (and ``more``:
    everything else that call changed) says what, in a short phrase that reads after the patch id
    (``"moved nested masks to neuron:0"``). One call is one count, whatever it did."""
    with _lock:
        _calls[patch_id] += 1
        actions = _actions.setdefault(patch_id, Counter())
        for what in (action, *more):
            actions[what] += 1


def record_outside_compile(patch_id: str, action: str, *more: str) -> None:
    """:func:`record`, skipped while torch.compile traces (the eager run counts the same fix)."""
    import torch  # already imported: a patch fired on torch tensors

    if not torch.compiler.is_compiling():
        record(patch_id, action, *more)


def fired() -> dict[str, int]:
    """Calls per patch id in which the patch changed something, in this process."""
    with _lock:
        return dict(_calls)


def fired_actions() -> dict[str, dict[str, int]]:
    """Per patch id, how often each action happened."""
    with _lock:
        return {patch_id: dict(actions) for patch_id, actions in _actions.items()}


def reset() -> None:
    """Forget every count (tests, and the doctor between scenarios)."""
    with _lock:
        _calls.clear()
        _actions.clear()


def describe_actions(actions: dict[str, int]) -> str:
    """``"moved nested tensors to neuron:0 (8x); ..."``, most frequent first."""
    ranked = sorted(actions.items(), key=lambda item: -item[1])
    return "; ".join(f"{action} ({count}x)" for action, count in ranked)


def report_lines(patches, displaced=()) -> list[str]:
    """One line per patch that fired, with its actions and the upgrade advice, then one per
    status in ``displaced`` (the engine's displaced patches: their fix is not in force)."""
    by_id = {patch.id: patch for patch in patches}
    lines = []
    calls = fired()
    for patch_id, actions in sorted(fired_actions().items()):
        total = calls.get(patch_id, 0)
        what = describe_actions(actions)
        patch = by_id.get(patch_id)
        if patch is None:
            advice = ""
        elif patch.fixed_in is not None:
            advice = f"; fixed upstream in transformers {patch.fixed_in}"
        else:
            advice = "; no transformers release fixes this yet"
        lines.append(f"attn-overlay: {patch_id} fired in {total} call(s): {what}{advice}")
    for status in displaced:
        lines.append(f"attn-overlay: {status.id} is displaced: {status.reason}")
    return lines


_registered_at_exit = False


def print_report_at_exit(patches, displaced=None) -> None:
    """Print :func:`report_lines` on stderr when the process exits (registered once);
    ``displaced``: a callable returning the displaced patches' statuses then (the engine's)."""
    global _registered_at_exit
    with _lock:
        if _registered_at_exit:
            return
        _registered_at_exit = True
    import atexit

    atexit.register(print_report, patches, displaced=displaced)


def print_report(patches, stream=None, displaced=None) -> None:
    """Write :func:`report_lines` to stderr (nothing when nothing fired and nothing is displaced;
    ``displaced`` as for :func:`print_report_at_exit`). Never raises."""
    try:
        lines = report_lines(patches, displaced() if displaced is not None else ())
        if lines:
            print("\n".join(lines), file=stream or sys.stderr, flush=True)
    except Exception:
        pass
