"""attn-overlay's startup hook: what every Python process of the environment runs at start. PYTEST_DONT_REWRITE

``attn_overlay.pth`` imports this module when the interpreter starts (``attn_overlay.start`` calls
:func:`install` on Python 3.15+, where ``.pth`` import lines are skipped). It costs next to nothing
and never raises: it puts itself first on ``sys.meta_path`` as a waiting finder and returns. The first
search for ``transformers`` (in any thread), or the first caller that asks for the finder, loads
``_attn_overlay_finder``, whose ``PostImportFinder`` takes the waiting finder's place watching
``transformers`` and hands over to the engine when it has executed. A process that never imports
transformers (pip, most tools) pays one dictionary-free comparison per import and loads nothing more.

``ATTN_OVERLAY=0`` turns it off (nothing is put on ``sys.meta_path``; the engine checks it again).
Three names of ``_attn_overlay_finder`` (``PostImportFinder``, ``shadowing_module``,
``activate_when_transformers_is_imported``) are read through this module too, which loads it; any
other missing name is an ``AttributeError`` (finder probes on ``sys.meta_path`` must find nothing).

At interpreter start it imports nothing that a bare ``python -c pass`` has not imported already
(``sys`` and ``_thread`` are there before ``site`` reads any ``.pth`` file, and so is ``os``, read
inside :func:`install`: a global ``os`` here would keep it alive until the very end of the process).
``tests/engine/test_startup_hook.py`` checks the set, and ``scripts/bench`` (figure 1) the cost.
"""

import _thread
import sys

_OFF = ("0", "false", "no", "off")
_lock = _thread.allocate_lock()
_this = sys.modules[__name__]


# This module is itself the waiting finder on sys.meta_path (a module with ``find_spec`` is a finder):
# no class to build at every interpreter start.
attn_overlay_waiting = True


def find_spec(fullname, path=None, target=None):
    """Until ``transformers`` is searched for: nothing. Then the full finder takes over."""
    if fullname != "transformers":
        return None
    current = _take_over()
    return None if current is None else current.find_spec(fullname, path, target)


def invalidate_caches():
    pass


def _waiting():
    return [entry for entry in sys.meta_path if entry is _this]


def _take_over():
    """Load the full finder in the waiting one's place (watching ``transformers``): the finder, or
    ``None`` when it cannot be loaded (a broken install stays silent, as ``import transformers``
    must never fail because of the overlay)."""
    with _lock:
        try:
            import _attn_overlay_finder

            _attn_overlay_finder.install()  # the finder takes this module's place on sys.meta_path
            current = _attn_overlay_finder.finder()
        except Exception:
            current = None
        for entry in _waiting():  # still there: the finder was elsewhere already, or failed to load
            sys.meta_path.remove(entry)
        return current


def finder():
    """The finder on ``sys.meta_path`` (one per process), or ``None``. Where the waiting finder
    still stands, the full one takes its place first: callers see the finder watching
    ``transformers`` exactly as if it had been there from the start."""
    if _waiting():
        return _take_over()
    loaded = sys.modules.get("_attn_overlay_finder")
    return None if loaded is None else loaded.finder()


def ensure_finder():
    """The finder, put first on ``sys.meta_path`` if it is not there yet."""
    if _waiting():
        _take_over()
    import _attn_overlay_finder

    return _attn_overlay_finder.ensure_finder()


#: The full module's names read through this one (PEP 562 ``__getattr__`` below), loaded on first use.
_FORWARDED = ("PostImportFinder", "activate_when_transformers_is_imported", "shadowing_module")


def __getattr__(name):
    # Only the names above load the full module. This module stands on sys.meta_path, where other
    # code probes finders for optional methods (importlib.metadata asks every finder for
    # ``find_distributions`` with getattr(..., None)): any other name is simply missing, and so is
    # a forwarded one whose module cannot be imported (pip's isolated build environments drop the
    # site-packages folder this module was imported from), never another exception.
    if name in _FORWARDED:
        try:
            import _attn_overlay_finder

            return getattr(_attn_overlay_finder, name)
        except (ImportError, AttributeError):
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install():
    """Entry point of the ``.start`` file and the ``.pth`` line; idempotent, never raises."""
    try:
        import os

        if os.environ.get("ATTN_OVERLAY", "1").strip().lower() in _OFF:
            return
        if not _waiting() and "_attn_overlay_finder" not in sys.modules:
            sys.meta_path.insert(0, _this)
        elif "_attn_overlay_finder" in sys.modules:
            sys.modules["_attn_overlay_finder"].install()
    except Exception:
        pass


# The .pth line imports this module: on Python < 3.15 importing it is the activation.
# On 3.15+ the matching .start file calls install() and .pth import lines are skipped.
if sys.version_info < (3, 15):
    install()
