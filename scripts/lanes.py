#!/usr/bin/env python3
"""The release lanes a patch must pass, read from the release data, and the commands that run them.

    python scripts/lanes.py kept_static_cache      # a patch module's name, or its id (kept-static-cache)

A patch's differences show at its own edges, not at fixed releases: the oldest and the newest
release it applies to, the first release with upstream's fix (where it must step aside), and each
release where the code it patches changes (another variant, or other code of the same variant: a
replacement that was right for the old code must be proved on the new). Which release ships which
code is ``patches/releases.json`` (``overlay.releases``); which releases have a lane is ``RELEASES``
in ``scripts/matrix_data.py``. A release of the data without a lane is stood in for by the nearest
lane that ships the same code, or named as missing.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matrix_data  # noqa: E402  (the scripts folder is not a package)


def find_patch(name: str):
    """The patch a module name (``kept_static_cache``) or an id (``kept-static-cache``) names, and its
    module's name; listed in ``patches/__init__.py`` or not yet."""
    matrix_data.ensure_overlay_importable()
    from overlay import patches as package

    for module in (*package.PATCH_MODULES, name.replace("-", "_")):
        try:
            patch = getattr(importlib.import_module(f"{package.__name__}.{module}"), "PATCH", None)
        except ModuleNotFoundError:
            continue
        if patch is not None and name in (module, patch.id):
            return patch, module
    raise LookupError(f"no patch named {name!r} (a module of patches/ or a patch id)")


def lanes(patch, data=None, lane_releases: Sequence[str] = matrix_data.RELEASES) -> list[tuple[str, str]]:
    """``[(lane release, why)]``, oldest first, for ``patch``: one entry per lane, its reasons joined."""
    from overlay import releases as facts

    data = facts.load() if data is None else data
    if patch.id not in data["patches"]:
        raise LookupError(
            f"{patch.id}: no entry in patches/releases.json yet; run "
            "python scripts/fingerprint_release.py --patch <module> --add-known first"
        )
    releases = list(data["releases"])
    patch_facts = data["patches"][patch.id]
    by_release = facts.code_by_release(patch_facts, releases)
    verdicts = facts.verdicts(patch.targets, patch_facts, releases)
    sha_of = {
        (key, release): digest
        for key, entries in patch_facts.items()
        for digest, entry in entries.items()
        for release in entry["releases"]
    }

    def code(release: str) -> tuple:
        # What the patch meets there: each target's code (variant name and fingerprint).
        return tuple(sorted((key, kind, sha_of[(key, release)][:12]) for key, kind in by_release[release].items()))

    def lane_for(release: str) -> str | None:
        # The release's own lane, else the nearest lane that ships the same code.
        if release in lane_releases:
            return release
        same = [r for r in lane_releases if r in by_release and code(r) == code(release)]
        return min(same, key=lambda r: abs(releases.index(r) - releases.index(release)), default=None)

    affected = [r for r in releases if verdicts[r] == "original"]
    wanted: list[tuple[str, str]] = []
    if affected:
        wanted.append((affected[0], "oldest affected"))
        previous = None
        for release in affected:
            if previous is not None and code(release) != code(previous):
                shapes = ", ".join(f"{key.rsplit('.', 1)[-1]} {kind}" for key, kind, _ in code(release))
                same_variants = [c[:2] for c in code(release)] == [c[:2] for c in code(previous)]
                wanted.append((release, f"{'other code, same variant' if same_variants else 'another variant'}: {shapes}"))
            previous = release
        wanted.append((affected[-1], "newest affected"))
    first_fixed = next((r for r in releases[releases.index(affected[-1]) + 1 :]), None) if affected else None
    if first_fixed is not None:
        wanted.append((first_fixed, "first fixed upstream"))

    result: dict[str, list[str]] = {}
    for release, why in wanted:
        lane = lane_for(release)
        if lane is None:
            result.setdefault(f"{release} (no lane: add it to RELEASES in scripts/matrix_data.py)", []).append(why)
        else:
            result.setdefault(lane, []).append(why if lane == release else f"{why} ({release}, same code)")
    order = {r: i for i, r in enumerate(releases)}
    return sorted(((lane, "; ".join(dict.fromkeys(whys))) for lane, whys in result.items()),
                  key=lambda item: order.get(item[0].split(" ")[0], len(order)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/lanes.py", description=__doc__.splitlines()[0])
    parser.add_argument("patch", help="a patch module's name (kept_static_cache) or its id (kept-static-cache)")
    args = parser.parse_args(argv)
    try:
        patch, module = find_patch(args.patch)
        found = lanes(patch)
    except LookupError as exc:
        print(f"lanes: {exc.args[0]}", file=sys.stderr)
        return 2
    print(f"{patch.id} (patches/{module}.py): the lanes it must pass")
    width = max(len(lane) for lane, _ in found)
    for lane, why in found:
        print(f"  {lane:<{width}}  {why}")
    print()
    for lane, _ in found:
        if " " not in lane:
            print(f".venv-ci/bin/nox -s tf-{lane} -- -k {module}")
    print(f".venv-ci/bin/nox -s tests -- tests/patches/{module}/ tests/tools/test_matrix.py tests/tools/test_readme_tables.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
