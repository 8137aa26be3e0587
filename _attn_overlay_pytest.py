"""attn-overlay's pytest11 entry point: the plugin itself is overlay/pytest_plugin.py.

PYTEST_DONT_REWRITE (nothing to rewrite here).

A top-level module of its own, so that pytest still starts where ``import overlay`` finds
something else (a project's own ``overlay.py`` in the folder ``python -m pytest`` runs in): an
entry point naming ``overlay.pytest_plugin`` would stop every pytest run there with "Error while
loading plugin". There, the header says so and the strict option fails with that reason.
"""

try:
    from overlay.pytest_plugin import *  # noqa: F401,F403 -- the hooks and fixtures pytest looks up by name
except ImportError as exc:  # `overlay` is not attn-overlay in this process
    _UNUSABLE = f"attn-overlay: plugin not loaded: `import overlay.pytest_plugin` failed ({exc})"

    def pytest_addoption(parser):
        parser.getgroup("attn-overlay").addoption("--attn-overlay-strict", action="store_true", default=False,
                                                  dest="attn_overlay_strict", help="see attn-overlay's README")
        parser.addini("attn_overlay_strict", "see attn-overlay's README", type="bool", default=False)

    def pytest_report_header(config):
        return _UNUSABLE

    def pytest_sessionstart(session):
        config = session.config
        if config.getoption("attn_overlay_strict") or config.getini("attn_overlay_strict"):
            import pytest

            raise pytest.UsageError(f"attn-overlay strict check failed: {_UNUSABLE}")
