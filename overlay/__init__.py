"""attn-overlay: fixes for transformers' generation internals, applied to the installed release.

Public API (imports nothing heavy until called)::

    import overlay
    overlay.apply()          # activate in this process (idempotent, thread-safe)
    overlay.status()         # one PatchStatus per patch: applied / fixed upstream / ...
    overlay.revert()         # put the original functions back
    with overlay.applied():  # apply for a block, then revert what the block applied
        ...
    with overlay.reverted(): # run a block on stock transformers
        ...
    overlay.fired()          # per patch, how many calls it changed something in this process
    overlay.run_doctor()     # prove the fixes on this machine's accelerator (or the fake device)

Most users never call these: the startup hook installed with the package activates the
overlay in every process when transformers is first imported (``ATTN_OVERLAY=0`` turns it off).

The package logs on the logger ``overlay`` (``ATTN_OVERLAY_LOG_LEVEL``: see :mod:`overlay.config`).
Type checkers read the API's real signatures from the imports under ``TYPE_CHECKING`` below; at
run time each name is imported on first use (:func:`__getattr__`), so ``import overlay`` stays cheap.
"""

import sys

from . import _patch_files
from ._version import __version__

# Not `from typing import TYPE_CHECKING`: `import overlay` would import typing. mypy and pyright
# read any variable of this name as true (mypy's "common issues" page says so;
# tests/engine/test_typing.py checks mypy).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from .doctor import run_doctor
    from .engine import (
        OverlayError,
        PatchStatus,
        activation_error,
        applied,
        apply,
        is_active,
        known_patches,
        revert,
        reverted,
        status,
    )
    from .report import fired

# The patch files are the subpackage `overlay.patches` in both layouts (installed: overlay/patches/;
# a source tree: patches/ beside this package, mapped by _patch_files): mapped here so that a plain
# `import overlay.patches.<name>` works. Costs two stat calls.
_patch_files.mount()

__all__ = [
    "apply",
    "revert",
    "status",
    "applied",
    "reverted",
    "is_active",
    "OverlayError",
    "PatchStatus",
    "fired",
    "known_patches",
    "activation_error",
    "run_doctor",
    "__version__",
]


def __getattr__(name):
    if name == "run_doctor":
        from .doctor import run_doctor

        return run_doctor
    if name == "fired":
        from .report import fired

        return fired
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'overlay' has no attribute {name!r}")


class _Package(type(sys)):  # type: ignore[misc]  # types.ModuleType, named so as to import nothing
    """This package's module type: ``overlay.apply`` stays the function.

    ``import overlay.apply`` (the module behind ``python -m overlay.apply``) makes the import system
    bind the package attribute ``apply`` to that module once it has executed (too late for the
    module to undo it), and ``overlay.apply()`` would raise "'module' object is not callable".
    That one binding is dropped here, so :func:`__getattr__` keeps answering with the function; the
    module stays in ``sys.modules``. Nothing else is changed: every other attribute is set as usual.
    """

    def __setattr__(self, name, value):
        if name == "apply" and isinstance(value, type(sys)) and value.__name__ == f"{__name__}.apply":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
