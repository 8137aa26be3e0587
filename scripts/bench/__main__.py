"""``python -m scripts.bench``: see :mod:`scripts.bench.run`."""

import sys

from .run import main

sys.exit(main())
