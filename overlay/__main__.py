"""``python -m overlay``: the same command as ``python -m overlay.apply``."""

import sys

from .cli import main

sys.exit(main())
