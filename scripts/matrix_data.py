"""Which transformers release gets which status from each patch: the one table that the matrix
tests, the README table and the nox lanes all read.

Nothing here is written down twice, and nothing here decides: the expected status of every
(release, patch) pair is what the engine's own version gate (:func:`overlay.engine.gate`) says
for that release, from the patch's ``affected`` (a PEP 440 specifier) and ``fixed_in``:

- in ``affected``: the gate says "pending" (read the code next); with the code the patch was
  written for, that ends in ``applied``
- at or after ``fixed_in``: ``fixed upstream``
- anything else: ``out of range``

The fingerprints are the *other* statement of the same facts (which code each release ships).
The two are checked against each other, never merged: ``tests/tools/test_matrix.py`` asserts that the
engine, reading the installed release's real code, reaches exactly these statuses, and
``scripts/fingerprint_release.py --check`` does the same from the released wheels.

Only the list of releases is written here: it is what the matrix proves, one nox lane each.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable, Sequence

REPO = Path(__file__).resolve().parent.parent

#: Every transformers release the matrix proves, oldest first (one nox lane each). Adding a
#: release: ``scripts/fingerprint_release.py --add NEW`` (which code it ships, into
#: ``patches/releases.json``), append the release here, then ``python scripts/readme_table.py``
#: (CONTRIBUTING.md: adding a transformers release).
RELEASES: tuple[str, ...] = (
    # The pinned accelerator stacks' releases: the newest patch release of each minor 4.55 - 5.12.
    "4.55.4",
    "4.56.0",  # the first release with the fix for chunked attention with left padding
    "4.56.2",  # the last release whose caches take an encoder-decoder's depth from the encoder
    "4.57.1",  # the first that sizes them by the decoder (encoder-decoder-cache-depth steps aside)
    "4.57.6",
    "5.0.0rc0",  # the first that keeps the SDPA mask of a query over a cache on XPU machines
    "5.0.0rc1",  # optimum-executorch's pin
    "5.0.0rc2",  # the last release that overwrites an explicit GenerationConfig's booleans
    "5.0.0rc3",  # the first with generation parameters that default to None ("not set")
    "5.0.0",
    "5.1.0",
    "5.2.0",
    "5.3.0",
    "5.4.0",
    "5.5.4",
    "5.6.2",
    "5.7.0",
    "5.8.1",
    "5.9.0",
    "5.10.1",  # the first release with the fix for Gemma 4's empty static cache
    "5.10.4",
    "5.11.0",
    "5.12.0",  # the first release with stop strings matched in bytes
    "5.12.1",
    # Every release since the first the overlay covered.
    "5.13.0",
    "5.13.1",
    "5.14.0",
    "5.14.1",
    "5.15.0",
    "5.15.1",
    "5.16.0",
    "5.16.1",
    "5.17.0",
    "5.18.0",
    "5.19.0",
    "5.20.0",
    "5.20.1",
    "5.20.2",
    "5.21.0",
    "5.21.1",
    "5.22.0",
    "5.22.1",
    "5.22.2",
    "5.23.0",
    "5.24.0",
    "5.25.0",
)

#: Requirements a lane installs its release without, because the package index lacks every
#: release that satisfies them: {release: {requirement name: why}}. The lane installs the release
#: with ``--no-deps``, then its other requirements as it declares them. Empty now: 5.25.0 needed
#: it while the index had no ``kernels`` in 0.19.x (its requirement); it has 0.19.1 since, and the
#: 5.25.0 lane installs as every other (``nox -s newest`` leaves such requirements out by itself).
REQUIREMENTS_LEFT_OUT: dict[str, dict[str, str]] = {}

#: Environment variables a lane's tests run with, on top of the offline settings: {release:
#: {name: value}} (e.g. ``USE_HUB_KERNELS=0`` for a release installed without ``kernels``, whose
#: from_pretrained would otherwise raise "Kernels are not available"). Empty now.
LANE_ENVIRONMENT: dict[str, dict[str, str]] = {}

#: The release the whole test suite runs on (engine, startup hook, every patch): the one the
#: README pins and the development environments use.
FULL_SUITE_RELEASE = "5.18.0"

#: The one torch every lane shares: the CPU build that lies on this kind of machine's disk.
TORCH = "2.13.0"

#: (transformers, torch) of the Neuron stack (optimum-neuron 0.4.x, its `neuronx` extra pins torch
#: 2.8.0): the `neuron-stack` nox session, run by hand (not in CI: a multi-GB torch download).
NEURON_STACK: tuple[str, str] = ("4.57.6", "2.8.0")

#: Releases that accelerator stacks pin (read from the stacks' own package metadata): CI runs
#: their lanes whatever the patches' ranges say, because that is where users cannot upgrade.
PINNED_BY_STACKS: dict[str, str] = {
    "4.57.6": "optimum-neuron 0.4.x (transformers~=4.57.1)",
    "5.0.0rc1": "optimum-executorch 1.1.0 (transformers==5.0.0rc1)",
    "5.0.0": "optimum-executorch 1.1.0's transformers==5.0.0rc1, released as 5.0.0",
}

def ensure_overlay_importable() -> None:
    """Make this checkout's ``overlay`` importable (first on ``sys.path`` when nothing imported
    one yet). The source tree maps ``patches/`` as ``overlay.patches`` by itself."""
    if "overlay" not in sys.modules and str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def load_patches():
    """Every shipped patch (``overlay.patch.Patch``), in the order of ``patches/__init__.py``."""
    ensure_overlay_importable()
    from overlay.registry import load_patches as load

    return load()


# The engine's own words for the outcomes the matrix expects (importing the engine is cheap: no
# torch, no transformers, no packaging at import time).
ensure_overlay_importable()
from overlay import engine as _engine  # noqa: E402

APPLIED = _engine.APPLIED
FIXED_UPSTREAM = _engine.FIXED_UPSTREAM
#: A release outside the patch's declared range (the engine checks no code there).
OUT_OF_RANGE = _engine.OUT_OF_RANGE


def expected_status(patch, version: str) -> str:
    """The status ``patch`` must reach on transformers ``version``: the engine's gate decides."""
    state, reason = _engine.gate(patch, version)
    if state == _engine.PENDING:
        # In range: the engine reads the code next, and the release's code is one the patch was
        # written for (the lanes and the fingerprint tool prove that part).
        return APPLIED
    if state not in (FIXED_UPSTREAM, OUT_OF_RANGE):
        raise ValueError(f"{patch.id} on transformers {version}: {state}: {reason}")
    return state


def expected_statuses(version: str, patches: Sequence | None = None) -> dict[str, str]:
    """``{patch id: expected status}`` for one release."""
    return {p.id: expected_status(p, version) for p in (patches if patches is not None else load_patches())}


def matrix(releases: Iterable[str] = RELEASES, patches: Sequence | None = None) -> dict[str, dict[str, str]]:
    """``{release: {patch id: expected status}}``, releases in the given order."""
    patches = patches if patches is not None else load_patches()
    return {release: expected_statuses(release, patches) for release in releases}


def ci_lanes(releases: Sequence[str] = RELEASES, patches: Sequence | None = None) -> tuple[str, ...]:
    """The release lanes CI runs: the representative releases except the whole suite's own
    (:data:`FULL_SUITE_RELEASE`), where the suite already runs every test a lane selects."""
    return tuple(r for r in representative_releases(releases, patches) if r != FULL_SUITE_RELEASE)


def representative_releases(
    releases: Sequence[str] = RELEASES, patches: Sequence | None = None
) -> tuple[str, ...]:
    """The subset CI runs: for every bug that upstream fixed, the oldest and the newest release
    the patch applies to (each original variant family's two ends), the releases accelerator
    stacks pin (:data:`PINNED_BY_STACKS`), plus the newest release (where those patches must
    step aside as "fixed upstream"). Oldest first."""
    patches = patches if patches is not None else load_patches()
    table = matrix(releases, patches)
    picked = {releases[-1], *(r for r in PINNED_BY_STACKS if r in releases)}
    for patch in patches:
        if patch.fixed_in is None:
            continue
        applied = [r for r in releases if table[r][patch.id] == APPLIED]
        if applied:
            picked.update((applied[0], applied[-1]))
    return tuple(r for r in releases if r in picked)

