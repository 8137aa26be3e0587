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
    overlay.doctor()         # prove the fixes on this machine's accelerator (or the fake device)

Most users never call these: the startup hook installed with the package activates the
overlay in every process when transformers is first imported (``ATTN_OVERLAY=0`` turns it off).
"""

__version__ = "0.1.0"

__all__ = [
    "apply",
    "revert",
    "status",
    "applied",
    "reverted",
    "is_active",
    "OverlayError",
    "PatchStatus",
    "doctor",
    "run_doctor",
    "__version__",
]


def __getattr__(name):
    if name == "doctor":
        import importlib

        # The module is callable: overlay.doctor(...) is overlay.doctor.run_doctor(...).
        return importlib.import_module(".doctor", __name__)
    if name == "run_doctor":
        from .doctor import run_doctor

        return run_doctor
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'overlay' has no attribute {name!r}")
