"""How the static-cache-tp-heads tests find the patch and apply it (shared by the test module and
the rank processes in ``_tp_worker.py``)."""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Iterator

PATCH_MODULE_NAMES = ("overlay.patches.static_cache_tp_heads", "patches.static_cache_tp_heads")


def load_patch_module() -> ModuleType:
    """The patch module: ``overlay.patches.…`` when the package is installed, else the repo's
    ``patches/`` on ``sys.path`` (a plain checkout with PYTHONPATH set to the repo root)."""
    for name in PATCH_MODULE_NAMES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only "this spelling does not exist" moves on; a missing import inside the patch
            # module is a real failure.
            if exc.name is None or not name.startswith(exc.name):
                raise
    raise ModuleNotFoundError(f"none of {PATCH_MODULE_NAMES} is importable")


@contextlib.contextmanager
def static_cache_tp_heads_applied() -> Iterator[dict]:
    """Apply only this patch through the overlay engine; yield its status (a dict); revert after.

    The engine gates on the installed version and the target's fingerprint exactly as it does for
    users. When the registry cannot load every module listed in ``overlay.patches`` (other patch
    files still being written), the same engine runs in isolation with this one patch.
    """
    from overlay import engine

    patch = load_patch_module().PATCH
    try:
        engine.status()  # loads the registry; fails when a listed patch module is missing
        isolation = contextlib.nullcontext()
        via = "registry"
    except ImportError:
        isolation = engine.isolated([patch])
        via = "isolated engine"
    with isolation:
        with engine.applied(only=[patch.id], strict=True) as statuses:
            (mine,) = [s for s in statuses if s.id == patch.id]
            yield dict(mine.as_dict(), via=via)
