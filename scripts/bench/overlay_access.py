"""How the worker processes reach the overlay and the functions they compare (worker side only).

The overlay is imported from this checkout. Installed (``pip install -e .`` or the wheel), the
repo's ``patches/`` folder is importable as ``overlay.patches``; from a bare checkout on
``PYTHONPATH`` (e.g. the lent GPU machine, where nothing is installed) it is not, so
:func:`ensure_overlay_importable` maps it there the way ``setup.py``'s ``package_dir`` does.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

from .common import REPO

DEVICE_MOVE_MODULE = "device_move"
DEVICE_MOVE_ID = "device-move-nested"


def ensure_overlay_importable(root: str | None = None) -> str:
    """Make ``overlay.patches`` importable; returns how the overlay was found (for the report).

    ``root``: import the overlay from that checkout instead (``--overlay-root``). It goes first on
    ``sys.path`` (before the working directory, which ``python -m`` puts there), and its
    ``patches/`` is mapped to ``overlay.patches`` explicitly: an editable install's import finder
    would otherwise resolve ``overlay.patches`` to the installed checkout's folder.
    """
    if root:
        return _overlay_from(Path(root).resolve())
    import overlay

    try:
        importlib.import_module("overlay.patches")
        return f"installed ({overlay.__file__})"
    except ModuleNotFoundError:
        pass
    _map_patches(overlay, REPO)
    return f"source checkout ({REPO}; patches/ mapped to overlay.patches)"


def _map_patches(overlay, root: Path) -> None:
    """Load ``root/patches`` as ``overlay.patches``: checkouts older than the source tree's own
    mapping (``overlay/__init__.py``) need it, e.g. the "before" checkout of a comparison."""
    spec = importlib.util.spec_from_file_location(
        "overlay.patches", root / "patches" / "__init__.py", submodule_search_locations=[str(root / "patches")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["overlay.patches"] = module
    spec.loader.exec_module(module)
    overlay.patches = module


def _overlay_from(root: Path) -> str:
    if "overlay" in sys.modules:
        raise RuntimeError(f"overlay already imported from {sys.modules['overlay'].__file__}, cannot switch to {root}")
    sys.path.insert(0, str(root))
    import overlay

    found = Path(overlay.__file__).resolve()
    if root not in found.parents:
        raise RuntimeError(f"--overlay-root {root}: import overlay resolved to {found}")
    _map_patches(overlay, root)
    return f"--overlay-root checkout ({found.parent}; patches/ mapped to overlay.patches)"


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

    # known_patches() is the public accessor; older checkouts (--overlay-root) only had _load_patches().
    known = getattr(engine, "known_patches", None) or engine._load_patches
    return [p.id for p in known()]


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

    from overlay.engine import APPLIED, PENDING, gate
    from overlay.patch import fingerprint

    patch = device_move_patch()
    installed = version("transformers")
    state, reason = gate(patch, installed)
    if state != PENDING:
        return False, f"{state}: {reason}"
    target = patch.targets[0]
    digest = fingerprint(stock)
    if digest in target.fixed:
        return False, f"fixed upstream: the installed function is the fixed code ({target.fixed[digest]})"
    if digest not in target.originals:
        return False, f"unrecognised code: sha256 {digest[:12]} is not a known original"
    return True, f"{APPLIED} would be: matches {target.originals[digest]}"
