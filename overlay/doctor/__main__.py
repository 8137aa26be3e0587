"""``python -m overlay.doctor``: see :mod:`overlay.doctor`."""

import sys

from overlay.doctor import main

sys.exit(main())
