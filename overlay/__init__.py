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
"""

from . import _patch_files
from ._version import __version__

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
