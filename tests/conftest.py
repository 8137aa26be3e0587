"""Shared test set-up.

Tests decide for themselves when the overlay is on (``overlay.applied()``) and off
(``overlay.reverted()``), so the automatic activation is switched off for the test process and
every subprocess it starts, before anything imports transformers.
"""

import os

os.environ["ATTN_OVERLAY"] = "0"
