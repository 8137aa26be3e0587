"""How the worker processes reach the overlay and the functions they compare (worker side only).

The overlay is imported from this checkout (installed, or a bare checkout on ``PYTHONPATH``, e.g.
the lent GPU machine): either way ``overlay.patches`` is importable, because the package maps a
source tree's ``patches/`` itself (``overlay/__init__.py``) and the wheel installs it in place.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import Any

from .common import REPO

DEVICE_MOVE_MODULE = "device_move"
DEVICE_MOVE_ID = "device-move-nested"


def ensure_overlay_importable(root: str | None = None) -> str:
    """Import the overlay and its patches; returns where they came from (for the report).

    ``root``: import the overlay from that checkout instead (``--overlay-root``). It goes first on
    ``sys.path`` (before the working directory, which ``python -m`` puts there); the checkout's
    own ``overlay/__init__.py`` maps its ``patches/``.
    """
    if root:
        root_path = Path(root).resolve()
        if "overlay" in sys.modules:
            raise RuntimeError(f"overlay already imported from {sys.modules['overlay'].__file__}, cannot switch to {root_path}")
        sys.path.insert(0, str(root_path))
    import overlay

    patches = importlib.import_module("overlay.patches")
    found = Path(overlay.__file__).resolve()
    if root and Path(root).resolve() not in found.parents:
        raise RuntimeError(f"--overlay-root {root}: import overlay resolved to {found}")
    return f"{'--overlay-root checkout' if root else 'overlay'} ({found.parent}; patches from {Path(patches.__file__).parent})"


def overlay_files() -> dict[str, str]:
    """Where the overlay and its patches were imported from (a premise check of every figure)."""
    import overlay

    files = {"overlay": str(Path(overlay.__file__).resolve())}
    for name in ("kv_cache_dtype", "attention_guard"):
        try:
            files[f"overlay.patches.{name}"] = str(Path(importlib.import_module(f"overlay.patches.{name}").__file__).resolve())
        except ImportError as exc:
            files[f"overlay.patches.{name}"] = f"not importable: {exc}"
    return files


def quiet_overlay_logs() -> None:
    """The engine warns when it patches modules that were imported before it was activated, which
    every toggle in a benchmark does on purpose."""
    logging.getLogger("overlay").setLevel(logging.ERROR)


def registered_patch_ids() -> list[str]:
    from overlay import engine

    return [p.id for p in engine.known_patches()]


def patch_files_on_disk() -> list[str]:
    return sorted(p.stem for p in (REPO / "patches").glob("*.py") if not p.stem.startswith("_"))


def unregistered_patch_modules() -> list[str]:
    """Patch files in ``patches/`` that ``patches/__init__.py`` does not list (not shipped)."""
    from overlay import patches

    return [name for name in patch_files_on_disk() if name not in patches.PATCH_MODULES]


def apply_all() -> dict[str, str]:
    """``overlay.apply()`` (every registered patch); returns ``{patch id: state}``."""
    import overlay

    return {s.id: s.state for s in overlay.apply()}


def revert_all() -> None:
    import overlay

    overlay.revert()


def device_move_patch() -> Any:
    return importlib.import_module(f"overlay.patches.{DEVICE_MOVE_MODULE}").PATCH


def gate_device_move(stock: Any) -> tuple[bool, str]:
    """Would the engine apply ``device-move-nested`` to ``stock`` on this transformers? The same
    two checks: installed version in the patch's range, source fingerprint a known original."""
    from importlib.metadata import version

    from overlay.patch import APPLIED, assess, source_of

    verdict = assess(device_move_patch(), version("transformers"), lambda target: source_of(stock))
    if verdict.state != APPLIED:
        return False, f"{verdict.state}: {verdict.reason}"
    return True, f"{APPLIED} would be: matches {', '.join(verdict.labels)}"
