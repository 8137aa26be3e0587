"""Where the patch files are: the subpackage ``overlay.patches``, in either layout.

The built wheel installs them as ``overlay/patches/``. In a source tree (a clone, ``PYTHONPATH=.``,
an editable install) they sit in ``patches/`` beside the ``overlay`` folder, and this module maps
that folder as ``overlay.patches``, once, only when the installed layout is absent. It lives on
the lowest floor so that the registry and the test kit find the patch files themselves, without
counting on the package facade (``overlay/__init__``) to have done it; the facade calls
:func:`mount` too, so that a plain ``import overlay.patches.<name>`` works in a source tree.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

PACKAGE = "overlay.patches"
_OVERLAY_DIR = os.path.dirname(os.path.abspath(__file__))


def mount() -> None:
    """Map the source tree's ``patches/`` as ``overlay.patches`` when the installed layout is
    absent and nothing mapped it yet. Costs a dictionary lookup once done, two stat calls before."""
    if PACKAGE in sys.modules or os.path.isdir(os.path.join(_OVERLAY_DIR, "patches")):
        return
    beside = os.path.join(os.path.dirname(_OVERLAY_DIR), "patches")
    init = os.path.join(beside, "__init__.py")
    if not os.path.isfile(init):
        return  # neither layout: the import below names what is missing
    import importlib.util

    spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[beside])
    if spec is None or spec.loader is None:  # not for an existing .py file: there for the type checker
        raise ImportError(f"cannot load {init} as {PACKAGE}")
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules[PACKAGE]
        raise


def package() -> ModuleType:
    """The ``overlay.patches`` package (its ``PATCH_MODULES`` lists the patch files)."""
    mount()
    return importlib.import_module(PACKAGE)


def module(name: str) -> ModuleType:
    """The patch file ``overlay.patches.<name>`` (e.g. ``"device_move"``)."""
    mount()
    return importlib.import_module(f"{PACKAGE}.{name}")
