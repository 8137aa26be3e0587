"""Post-import hooks: run a callback right after a watched module has executed.

A meta-path finder that steps aside (returns ``None``) for every module it does not watch, and
for a watched one asks the other finders for the real spec and wraps only its loader. Once the
module has executed, the real loader is put back on ``module.__loader__`` and
``module.__spec__.loader``, so tracebacks, ``inspect`` and ``importlib.resources`` see exactly
what they would without the overlay.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Callable

PostImportCallback = Callable[[ModuleType], None]


class _NotifyingLoader:
    """Delegates to the real loader; calls back once the module body has run."""

    def __init__(self, loader, callback: PostImportCallback):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            # Put the real loader back before anything else can look at the module.
            module.__loader__ = self._loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
        self._callback(module)

    def __getattr__(self, name):  # get_source, get_filename, is_package, get_resource_reader...
        return getattr(self._loader, name)


class PostImportFinder:
    """The engine's finder. ``watch(name, callback)`` arms it for one module."""

    _attn_overlay_finder = True

    def __init__(self) -> None:
        self._callbacks: dict[str, PostImportCallback] = {}
        self._busy = threading.local()

    def watch(self, module_name: str, callback: PostImportCallback) -> None:
        self._callbacks[module_name] = callback

    def unwatch_all(self) -> None:
        self._callbacks.clear()

    @property
    def watched(self) -> frozenset[str]:
        return frozenset(self._callbacks)

    def find_spec(self, fullname, path=None, target=None):
        callback = self._callbacks.get(fullname)
        if callback is None:
            return None
        busy = getattr(self._busy, "names", None)
        if busy is None:
            busy = self._busy.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = _find_spec_elsewhere(fullname, path, target)
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _NotifyingLoader(spec.loader, callback)
        return spec

    def invalidate_caches(self) -> None:
        pass


def _find_spec_elsewhere(fullname, path, target):
    """Ask every other meta-path finder, in order, as the import system would."""
    for finder in list(sys.meta_path):
        if getattr(finder, "_attn_overlay_finder", False):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def startup_finder():
    """The startup hook's finder (it forwards to a ``delegate`` once activated), or ``None``."""
    for finder in sys.meta_path:
        if getattr(finder, "_attn_overlay_finder", False) and hasattr(finder, "delegate"):
            return finder
    return None
