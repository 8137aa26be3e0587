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

import os as _os

from ._version import __version__

# In a source tree (a clone, `PYTHONPATH=.`, an editable install) the patch files sit in
# `patches/` beside this package; the built wheel installs them as `overlay/patches/`. Either way
# they are the subpackage `overlay.patches`: put the source tree's folder on this package's
# search path, once, only when the installed layout is absent. Costs two stat calls.
_here = __path__[0]
if not _os.path.isdir(_os.path.join(_here, "patches")):
    _beside = _os.path.join(_os.path.dirname(_here), "patches")
    if _os.path.isfile(_os.path.join(_beside, "__init__.py")):
        import importlib.util as _util
        import sys as _sys

        _spec = _util.spec_from_file_location(
            __name__ + ".patches", _os.path.join(_beside, "__init__.py"), submodule_search_locations=[_beside]
        )
        patches = _util.module_from_spec(_spec)
        _sys.modules[_spec.name] = patches
        _spec.loader.exec_module(patches)
        del _util, _sys, _spec
    del _beside
del _here

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
