"""``python -m overlay.apply``: report, verify, or run a program with the patches applied.

Only a ``-m`` entry point (the command line lives in :mod:`overlay.cli`); nothing imports this
module. In Python, ``overlay.apply`` is the function that activates the overlay
(:func:`overlay.engine.apply`).
"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
