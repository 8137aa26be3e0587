"""attn-overlay's startup hook, imported by ``attn_overlay.pth`` (or run from ``attn_overlay.start``
on Python 3.15+) when the interpreter starts.

It must cost next to nothing and never raise: it imports neither torch, transformers nor
packaging. All it does is put one tiny finder on ``sys.meta_path`` that wakes up the first time
``transformers`` is imported and hands over to the engine (``overlay.engine``), which then
checks the installed version and watches the modules its patches target. Every other import
passes straight through with a single string comparison.

``ATTN_OVERLAY=0`` turns it off (checked here and again when transformers is imported).
"""

import os
import sys

_OFF = ("0", "false", "no", "off")


class AttnOverlayStartupFinder:
    """Meta-path finder that stays inert until ``transformers`` is imported, then delegates."""

    _attn_overlay_finder = True

    def __init__(self):
        self.delegate = None  # the engine's finder, once activated
        self._activating = False

    def find_spec(self, fullname, path=None, target=None):
        delegate = self.delegate
        if delegate is not None:
            return delegate.find_spec(fullname, path, target)
        if fullname != "transformers" or self._activating:
            return None
        self._activating = True
        try:
            if os.environ.get("ATTN_OVERLAY", "1").strip().lower() in _OFF:
                return None
            from overlay import engine

            engine.activate_from_startup(self)
            if self.delegate is not None:
                return self.delegate.find_spec(fullname, path, target)
        except Exception:  # never break `import transformers`; status says what happened
            try:
                from overlay import engine

                engine.record_startup_failure(sys.exc_info()[1])
            except Exception:
                pass
        finally:
            self._activating = False
        return None

    def invalidate_caches(self):
        pass


def install():
    """Entry point of the ``.start`` file and the ``.pth`` line; idempotent, never raises."""
    try:
        if os.environ.get("ATTN_OVERLAY", "1").strip().lower() in _OFF:
            return
        for finder in sys.meta_path:
            if getattr(finder, "_attn_overlay_finder", False):
                return
        sys.meta_path.insert(0, AttnOverlayStartupFinder())
    except Exception:
        pass


# The .pth line is a plain `import`: on Python < 3.15 importing this module is the activation.
# On 3.15+ the matching .start file calls install() and .pth import lines are skipped.
if sys.version_info < (3, 15):
    install()
