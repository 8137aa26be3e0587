"""Waiting for target modules: the engine's side of the startup hook's post-import finder
(``_attn_overlay_startup.PostImportFinder``).

A patch's module is judged only once it has executed, in whichever thread executed it. The
engine says which modules it waits for and what to call when one executes (a first import or
``importlib.reload``); :class:`ModuleWatch` tells it which of them are executing right now (the
callback judges those) and whether a module found in ``sys.modules`` has run to the end. What
the engine does with an executed module stays the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

__all__ = ["ModuleWatch"]


class ModuleWatch:
    """The modules one engine waits for on the finder, each handed to ``on_executed`` (in the
    thread that executed it) every time it executes. Every engine passes the same callback, so
    the finder holds it once per module whichever engine watches."""

    def __init__(self, on_executed: Callable[[ModuleType], None]) -> None:
        self.on_executed = on_executed
        self.names: set[str] = set()  # the modules watched on the finder
        self._finder: Any = None  # the finder of the last watch() (that has_executed asks)

    def watch(self, names: Iterable[str]) -> set[str]:
        """Watch these modules (the finder is put on ``sys.meta_path`` if it is not there yet);
        returns those executing through the finder right now: ``on_executed`` judges them once
        they have executed."""
        import _attn_overlay_startup as startup

        finder = self._finder = startup.ensure_finder()
        executing: set[str] = set()
        for name in sorted(names):
            # Asked even when watched already: "executing now?" is read with the watch, in one step.
            if finder.watch(name, self.on_executed):
                executing.add(name)
            self.names.add(name)
        return executing

    def has_executed(self, name: str, module: ModuleType) -> bool:
        """Whether ``module`` (in sys.modules, not executing through the finder now: see
        :meth:`watch`) has executed to the end: through the finder (which knows), or else as the
        import system says (a module still executing in another thread, imported before the
        finder watched it, is ``_initializing``)."""
        executed = getattr(self._finder, "executed", None)  # a finder of an older attn-overlay has none
        if executed is not None and executed(name):
            return True
        return not getattr(getattr(module, "__spec__", None), "_initializing", False)

    def unwatch_all(self) -> None:
        """Stop watching every module (the callback leaves the finder: other engines' watches of
        the same modules go with it, see :meth:`rewatch`)."""
        import _attn_overlay_startup as startup

        finder = startup.finder()
        if finder is not None:
            for name in self.names:
                finder.unwatch(name, self.on_executed)
        self.names.clear()

    def rewatch(self) -> None:
        """Watch again what this watch watched, after another one with the same callback unwatched
        it all (:func:`overlay.engine.isolated`)."""
        names, self.names = set(self.names), set()
        if names:
            import _attn_overlay_startup as startup

            finder = startup.ensure_finder()
            for name in names:
                finder.watch(name, self.on_executed)
            self.names = names
