"""Shared test set-up.

Tests decide for themselves when the overlay is on (``overlay.applied()``) and off
(``overlay.reverted()``), so the automatic activation is switched off for the test process and
every subprocess it starts, before anything imports transformers.

Shared by every module: the markers (``slow``, ``gpu``: a ``gpu`` test is skipped where CUDA is
not available; ``patch``: set here on every test of a module in ``tests/patches/<patch module>/``
and of a module that holds a ``PatchUnderTest``, naming its patches, so that each release lane
runs every test of every patch, by patch and not by file name; ``lane``: the matrix checks every lane runs too) and the ``one_thread`` fixture. Tiny models, tensor-parallel plans, the patch under
test and the error texts a test expects come from ``overlay.testing`` (``models``,
``tensor_parallel``, ``harness``), which the doctor and the benchmarks use too.
"""

import os

os.environ["ATTN_OVERLAY"] = "0"

import pytest  # noqa: E402

MARKERS = {
    "slow": "long lanes (multi-process, many releases); run with `-m slow` or the matrix",
    "gpu": "needs a CUDA device; skipped elsewhere",
    "patch(*ids)": "proves these patches (set from the module's folder, tests/patches/<patch module>/, and its PatchUnderTest objects); every release lane runs it",
    "lane": "checks the installed release against the matrix; every release lane runs it",
}


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def patches_under_test(module) -> tuple[str, ...]:
    """Ids of the patches a test module proves: its module-level ``PatchUnderTest`` objects
    (none for a module that says ``LANE = False``: a tool's tests that borrow a patch's texts)."""
    from overlay.testing.harness import PatchUnderTest

    if not getattr(module, "LANE", True):
        return ()
    return tuple(sorted({v.id for v in vars(module).values() if isinstance(v, PatchUnderTest)}))


def patch_of_folder(path) -> tuple[str, ...]:
    """The patch a test file's folder proves: ``tests/patches/<patch module>/`` (see tests/patches)."""
    from pathlib import Path

    from overlay import _patch_files

    relative = Path(path).resolve().relative_to(Path(__file__).resolve().parent)
    if len(relative.parts) < 3 or relative.parts[0] != "patches":
        return ()
    if relative.parts[1] not in _patch_files.package().PATCH_MODULES:
        return ()
    return (_patch_files.module(relative.parts[1]).PATCH.id,)


def pytest_collection_modifyitems(config, items):
    by_module = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if module not in by_module:
            by_module[module] = tuple(sorted(set(patches_under_test(module)) | set(patch_of_folder(module.__file__))))
        if by_module[module]:
            item.add_marker(pytest.mark.patch(*by_module[module]))


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
