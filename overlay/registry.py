"""Finds the patch files. They ship as the ``overlay.patches`` package (``patches/`` in the repo)."""

from __future__ import annotations

import importlib

from .patch import Patch


def load_patches() -> tuple[Patch, ...]:
    from . import patches as package

    found: list[Patch] = []
    seen: set[str] = set()
    for name in package.PATCH_MODULES:
        module = importlib.import_module(f"{package.__name__}.{name}")
        patch = getattr(module, "PATCH", None)
        if not isinstance(patch, Patch):
            raise TypeError(f"{module.__name__} must define PATCH = overlay.patch.Patch(...)")
        if patch.id in seen:
            raise ValueError(f"two patch files declare the id {patch.id!r}")
        seen.add(patch.id)
        found.append(patch)
    return tuple(found)
