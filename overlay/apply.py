"""``python -m overlay.apply``: report, verify, or run a program with the patches applied.

This module is also what ``overlay.apply`` names once it has been imported, so it is callable:
``overlay.apply()`` activates the overlay whether ``overlay.apply`` resolves to the function or,
after ``import overlay.apply``, to this module.
"""

import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from .engine import apply

        return apply(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    from .cli import main

    sys.exit(main())
