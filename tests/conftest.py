"""Shared test set-up.

Tests decide for themselves when the overlay is on (``overlay.applied()``) and off
(``overlay.reverted()``), so the automatic activation is switched off for the test process and
every subprocess it starts, before anything imports transformers.

Shared by every module: the markers (``slow``, ``gpu``: a ``gpu`` test is skipped where CUDA is
not available) and the ``one_thread`` fixture. Tiny models, tensor-parallel plans, the patch under
test and the error texts a test expects come from ``overlay.testing`` (``models``,
``tensor_parallel``, ``harness``), which the doctor and the benchmarks use too.
"""

import os

os.environ["ATTN_OVERLAY"] = "0"

import pytest  # noqa: E402

MARKERS = {
    "slow": "long lanes (multi-process, many releases); run with `-m slow` or the matrix",
    "gpu": "needs a CUDA device; skipped elsewhere",
}


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device on this machine (a `gpu` test)")


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    the cores are shared, and tiny models gain nothing from more threads."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
