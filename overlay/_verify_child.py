"""The install check's child program: ``python [the caller's flags] PATH/TO/_verify_child.py PACKAGE_ROOT``.

:mod:`overlay.install_check` starts it by path, with the caller's interpreter flags, so that it
sees what a user program started there sees: the startup hook either ran at interpreter start or
it did not. It imports the patch target modules the way such a program would and prints one JSON
line (the last of its output): ``hook_active``, ``activation_error``, ``import_errors``,
``patches`` (``PatchStatus.as_dict()`` rows) and ``shadowed`` (the startup module's message where
a module of the user's shadows the overlay, else null). It never calls ``overlay.apply()`` before
reading ``hook_active``: whatever is active there was activated by the startup hook.

Run by path, not with ``-m``: ``-m overlay._verify_child`` would import the overlay package found
first on the path before the check begins (a user's ``overlay.py`` in the working directory, or
nothing at all under ``-S``). ``PACKAGE_ROOT`` is the folder holding the caller's overlay package.
Importing this module runs nothing.
"""

from __future__ import annotations

import sys


def _path_as_dash_c_has_it() -> None:
    """Make ``sys.path[0]`` what ``python -c`` gives (the working directory) instead of this file's
    folder: a user program's imports are resolved from where it runs, and this folder would put
    the package's own modules (``config``, ``report``, ...) on the path as top-level names."""
    # The folder is put first only where -P (PYTHONSAFEPATH) or -I does not keep it out, and there
    # `python -c` adds nothing either.
    if not (sys.flags.isolated or getattr(sys.flags, "safe_path", False)):
        sys.path[0] = ""


def main(argv: list[str]) -> int:
    (package_root,) = argv
    # Imported here, once sys.path[0] is the working directory (see above), not this file's folder.
    import json
    import logging
    import os
    import types

    # Last on the path: used only where this process finds no overlay of its own (-S, -I, -P).
    sys.path.append(package_root)
    # Whether the startup hook ran at interpreter start: its .pth line (or .start file) imports this
    # module. Importing it here would install the hook, so where the start did not, it is read switched
    # off: the check must not activate what it checks (an editable install has no .pth, yet the module
    # is importable).
    hook_ran = "_attn_overlay_startup" in sys.modules
    switch = os.environ.get("ATTN_OVERLAY")
    startup: types.ModuleType | None = None
    shadowed: str | None = None
    try:
        if not hook_ran:
            os.environ["ATTN_OVERLAY"] = "0"
        try:
            import _attn_overlay_startup
        finally:
            if not hook_ran:
                if switch is None:
                    del os.environ["ATTN_OVERLAY"]
                else:
                    os.environ["ATTN_OVERLAY"] = switch
        startup = _attn_overlay_startup
        shadowed = _attn_overlay_startup.shadowing_module()
    except (ImportError, AttributeError):
        startup = shadowed = None
    if shadowed and startup is not None:
        # A program started here imports the user's module, not the overlay (the hook refuses and
        # says so). Still show what the patches would reach, with the caller's overlay, explicitly.
        hooks = startup.finder()
        if hooks is not None:
            hooks.unwatch("transformers", startup.activate_when_transformers_is_imported)
        sys.path.insert(0, package_root)
    import overlay.engine as engine

    errors = engine.import_target_modules()  # every failure is a result: the parent reports it
    hook_active = hook_ran and engine.is_active()
    if not hook_active:
        # Still show what the patches would reach here: the same gate on the same code, applied
        # explicitly (the modules are imported already, so the late-import warning is silenced).
        logging.getLogger("overlay").setLevel(logging.ERROR)
        engine.apply(strict=False)
    print(
        json.dumps(
            {
                "hook_active": hook_active,
                "activation_error": engine.activation_error(),
                "import_errors": errors,
                "patches": [s.as_dict() for s in engine.status()],
                "shadowed": shadowed,
            }
        )
    )
    return 0


if __name__ == "__main__":
    _path_as_dash_c_has_it()
    sys.exit(main(sys.argv[1:]))
