"""Environment switches, read at the moment they matter (never cached at import)."""

from __future__ import annotations

import os

#: ``ATTN_OVERLAY=0`` turns the automatic activation (startup hook) off for this process and
#: its children. Explicit calls (``overlay.apply()``, ``python -m overlay.apply PROGRAM``) still work.
ENABLE_VAR = "ATTN_OVERLAY"
#: ``ATTN_OVERLAY_STRICT=1``: unrecognised code or a failed patch raises instead of warning.
STRICT_VAR = "ATTN_OVERLAY_STRICT"
#: ``ATTN_OVERLAY_DISABLE=id1,id2``: leave these patches out (``all`` leaves every patch out).
DISABLE_VAR = "ATTN_OVERLAY_DISABLE"

_FALSE = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}


def auto_enabled() -> bool:
    return os.environ.get(ENABLE_VAR, "1").strip().lower() not in _FALSE


def strict_from_env() -> bool:
    return os.environ.get(STRICT_VAR, "0").strip().lower() in _TRUE


def disabled_patch_ids() -> frozenset[str]:
    raw = os.environ.get(DISABLE_VAR, "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


#: ``ATTN_OVERLAY_REPORT=1``: at exit, print on stderr what each patch fixed in this process.
REPORT_VAR = "ATTN_OVERLAY_REPORT"


def report_at_exit() -> bool:
    return os.environ.get(REPORT_VAR, "0").strip().lower() in _TRUE
