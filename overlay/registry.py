"""Finds the patch files. They ship as the ``overlay.patches`` package (``patches/`` in the repo)."""

from __future__ import annotations

from . import _patch_files
from .patch import Patch

#: The names other modules use; the rest is this module's own.
__all__ = [
    "load_patches",
]


def load_patches() -> tuple[Patch, ...]:
    package = _patch_files.package()
    found: list[Patch] = []
    seen: set[str] = set()
    for name in package.PATCH_MODULES:
        module = _patch_files.module(name)
        patch = getattr(module, "PATCH", None)
        if not isinstance(patch, Patch):
            raise TypeError(f"{module.__name__} must define PATCH = overlay.patch.Patch(...)")
        if patch.id in seen:
            raise ValueError(f"two patch files declare the id {patch.id!r}")
        seen.add(patch.id)
        found.append(patch)
    return tuple(found)
