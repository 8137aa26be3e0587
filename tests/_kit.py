"""Checks several patch test modules make the same way, written once (``overlay/testing`` is the test
kit users get; these are the suite's own).

- :func:`covered_module`: a patch test module's preamble;
- :func:`assert_replacements_keep_the_originals_face`: name, docstring and signature kept;
- :func:`assert_in_force_only_while_applied` and :func:`assert_set_on_its_class_only_while_applied`:
  the engine's status and what is on the class during and after ``PATCH.applied()``;
- ``STATIC_*``, :func:`static_greedy`, :func:`static_cases`: the static cache patches' scenarios;
- :func:`count_calls`: the Python calls made while something runs (what runs per decoding step);
- :func:`toy_generation_patch`: a patch of a ``GenerationMixin`` method, for the engine tests.

Imported as ``from tests._kit import ...`` (pytest runs from the repository root). A test file that
also runs as a worker script imports it inside the test that needs it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from overlay.patch import PATCH_MARKER, Variant
from overlay.testing.harness import PatchUnderTest


def covered_module(patch: PatchUnderTest) -> Any:
    """``pytestmark = covered_module(PATCH)`` at a test module's top, under its module-level
    ``PATCH = PatchUnderTest("<patch module>")`` (the declaration that marks the module as proving
    that patch: tests/conftest.py): the whole module skipped on releases before the patch's range,
    and every test on one torch thread (``one_thread``: tiny models' ids must not depend on the
    machine's cores)."""
    patch.skip_module_unless_covered()
    return pytest.mark.usefixtures("one_thread")


def assert_replacements_keep_the_originals_face(patch: PatchUnderTest, otherwise: Variant) -> int:
    """Each present target's replacement wraps the release's own function and keeps its name,
    docstring and signature. The signature is load-bearing: ``generate()`` reads the signatures of
    the functions it calls (``_validate_model_kwargs`` reads ``prepare_inputs_for_generation``'s) to
    decide which arguments a model takes. ``otherwise``: the variant a replacement is built with
    where the code is not an original the patch knows (fixed releases: only the wrapper's metadata
    is read there). Returns how many targets this release defines (the ones checked)."""
    present = patch.present_targets()
    for target, stock in present:
        replacement = target.build(stock, otherwise=otherwise)
        assert replacement.__wrapped__ is stock
        assert (replacement.__name__, replacement.__doc__) == (stock.__name__, stock.__doc__)
        assert inspect.signature(replacement) == inspect.signature(stock)
    return len(present)


def assert_in_force_only_while_applied(patch: PatchUnderTest, read: Callable[[], Any],
                                       stepped_aside: str = "fixed upstream") -> Any:
    """``read()`` (the function where the patch sets its replacement) is the patch's wrapper of the
    release's function while ``patch.applied()`` holds on an affected release, the release's very
    own function where the engine says ``stepped_aside``, and that same function again after the
    block. Returns the engine's status."""
    before = read()
    with patch.applied() as statuses:
        status = statuses[patch.id]
        during = read()
    assert read() is before, "the revert puts the very same function back"
    if patch.affected:
        assert status.state == "applied", status.reason
        assert getattr(during, PATCH_MARKER, None) == patch.id
        assert during.__wrapped__ is before
    else:
        assert status.state == stepped_aside, status.reason
        assert during is before, "the patch steps aside"
    return status


def assert_set_on_its_class_only_while_applied(patch: PatchUnderTest, owner: type, name: str,
                                               others: Callable[[], Any]) -> None:
    """For a function ``owner`` inherits on the affected releases: while ``patch.applied()`` holds,
    the replacement is set on ``owner`` itself and ``others()`` (the base's function, which the
    other classes inherit) stays the release's; the revert deletes it from ``owner`` again. Where
    upstream fixed it, ``owner``'s own function is no replacement."""
    with patch.applied() as statuses:
        status = statuses[patch.id]
        during = vars(owner).get(name)
        theirs = others()
    if patch.affected:
        assert status.state == "applied", status.reason
        assert getattr(during, PATCH_MARKER, None) == patch.id
        assert not hasattr(theirs, PATCH_MARKER), "the other classes keep theirs"
        assert name not in vars(owner), "the revert deletes the replacement again"
    else:
        assert status.state == "fixed upstream", status.reason
        assert not hasattr(during, PATCH_MARKER)


# -- a static cache's scenarios -----------------------------------------------------------------------
# The patches on the static cache (static-cache-kv-head-sizes, static-cache-zero-kv-shared-layers) run
# the same scenarios: each prompt both ways to get a static cache, greedy, and with every patch the
# release gets on the padded batch (the composed run).

STATIC_PROMPTS = {"one prompt": (9,), "padded batch of two": (9, 6)}
STATIC_WAYS = ("cache_implementation='static'", "user-built StaticCache")
STATIC_COMPOSED_PROMPT = "padded batch of two"
STATIC_MAX_NEW_TOKENS = 5
STATIC_MAX_CACHE_LEN = 32


def static_greedy(model, batch, **kwargs) -> dict:
    """The ids of one greedy run, or its error (type, text, and the function that raised it)."""
    from overlay.testing.models import greedy_outcome

    return greedy_outcome(model, batch, STATIC_MAX_NEW_TOKENS, **kwargs)


def static_cases(names):
    """A test per case of ``names``, way and prompt."""
    return pytest.mark.parametrize("name,way,prompt", [(n, w, p) for n in names for w in STATIC_WAYS for p in STATIC_PROMPTS])


def fired_after_each(patch: PatchUnderTest, *calls: Callable[[], Any]) -> list[int]:
    """Run ``calls`` one after the other while ``patch.applied()`` holds: how often the patch had
    fired (``overlay.report``) after each, counted from zero."""
    from overlay import report

    report.reset()
    counts = []
    with patch.applied():
        for call in calls:
            call()
            counts.append(report.fired().get(patch.id, 0))
    return counts


# -- a share per release lane ----------------------------------------------------------------------

#: Set by noxfile.py's release lanes ("1"): the run is one of many (CI runs about twenty), so a
#: test whose costly part repeats a release-independent check on every release runs its share of
#: it there (:func:`lane_share`, :func:`at_a_patch_edge`). Unset (the whole suite, a developer's
#: own pytest, ``nox -s tests``): everything runs. ``0`` in a lane runs everything too.
LANE_SHARE_VAR = "ATTN_OVERLAY_TESTS_LANE_SHARE"


def _lane_place() -> tuple[int, int] | None:
    """(the installed release's place in the matrix, the matrix's size), or ``None`` where every
    case runs: not a sharing lane, or a release the matrix does not list."""
    import importlib.metadata
    import os
    import sys
    from pathlib import Path

    if os.environ.get(LANE_SHARE_VAR) != "1":
        return None
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import matrix_data

    installed = importlib.metadata.version("transformers")
    if installed not in matrix_data.RELEASES:
        return None
    return matrix_data.RELEASES.index(installed), len(matrix_data.RELEASES)


def lane_share(cases: list, always: int = 1) -> list:
    """``cases`` whole, or on a sharing lane its first ``always`` cases plus one of the others,
    chosen by the release's place in the matrix: over consecutive releases every case runs (each
    of CI's lanes runs a different one, in turn), and the same lane always runs the same ones."""
    place = _lane_place()
    rest = cases[always:]
    if place is None or not rest:
        return list(cases)
    return [*cases[:always], rest[place[0] % len(rest)]]


def at_a_patch_edge(patch_id: str) -> bool:
    """Whether a check that turns on ``patch_id``'s status runs on this lane: everywhere but on a
    sharing lane, and there on the releases where that status changes (the oldest and newest
    release the patch applies to, and the first release that fixed it)."""
    import importlib.metadata

    place = _lane_place()
    if place is None:
        return True
    import matrix_data

    patch = next(p for p in matrix_data.load_patches() if p.id == patch_id)
    applied = [r for r in matrix_data.RELEASES if matrix_data.expected_status(patch, r) == matrix_data.APPLIED]
    edges = {*applied[:1], *applied[-1:], *([patch.fixed_in] if patch.fixed_in else [])}
    return importlib.metadata.version("transformers") in edges


def run_module_as_worker(test_file: str, tmp_path_factory: Any, *, marker: str, timeout: float) -> Any:
    """A patch test module that is also its worker script (``if __name__ == "__main__"``), run in a
    fresh interpreter in a temporary folder named after its test folder: the JSON it prints after
    ``marker`` (:func:`overlay.testing.harness.run_json_worker`)."""
    from pathlib import Path

    from overlay.testing.harness import run_json_worker

    script = Path(test_file).resolve()
    return run_json_worker(script, marker=marker, timeout=timeout, cwd=str(tmp_path_factory.mktemp(script.parent.name)))


def count_calls(key_of: Callable[[Any], Any], run: Callable[[], Any]) -> dict:
    """``{key: calls}`` of the Python functions called during ``run()`` (``sys.setprofile``), keyed by
    ``key_of(code)``; a code whose key is None is not counted (asked once per code object)."""
    import sys

    counts: dict = {}
    keys: dict = {}

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        try:
            key = keys[code]
        except KeyError:
            key = keys[code] = key_of(code)
        if key is not None:
            counts[key] = counts.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return counts


def toy_generation_patch(patch_id: str, name: str, replace: Callable[..., Any], needed_by_call: Any = None) -> Any:
    """A patch of ``GenerationMixin.<name>`` written for the code installed now (its fingerprint
    below any overlay layer), replaced by ``replace``: what the engine tests apply and revert."""
    import importlib

    from overlay.patch import Patch, Target, fingerprint
    from overlay.swapping import below_overlay

    module = "transformers.generation.utils"
    stock = below_overlay(vars(importlib.import_module(module).GenerationMixin)[name])
    target = Target(module=module, qualname=f"GenerationMixin.{name}", replace=replace,
                    originals={fingerprint(stock): "installed"}, needed_by_call=needed_by_call)
    return Patch(id=patch_id, title="toy", errors=(), why="test", upstream="none", affected=">=0", fixed_in=None,
                 targets=(target,))
