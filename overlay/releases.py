"""Release facts: which transformers release ships which code of each patch target.

A patch file declares what it knows about code: its targets, and for each target the variants of
the replacement by name (``Target.variants``: name -> parameters). It names no release. Which
release ships which code is data, in ``patches/releases.json``, written by
``scripts/fingerprint_release.py --add VERSION`` (and ``--remove``) from the released wheels:

    {"releases": [every release the data covers, oldest first],
     "patches": {patch id: {"module:qualname": {sha256: {"code": NAME, "releases": [...]}}}}}

where ``NAME`` is one of the target's variants (the code with the bug; the patch applies),
``"fixed"`` (upstream's fix) or ``"before"`` (code from before the bug arrived). A patch file
builds its ``PATCH`` with :func:`patch_with_release_facts`, which derives from the data
everything a release number used to be typed for:

- each variant's and each fixed code's label (``"5.13.0-5.14.1"``: the runs of data releases
  that ship it);
- ``affected`` (``>=`` the first release where every target present is a known original, ``<``
  the first later release with the fix), ``fixed_in`` (that release, or ``None``), and
  ``introduced_in`` (the first affected release, where older releases ship ``"before"`` code);
- ``"{newest_release}"`` in the ``upstream`` text: the newest release in the data; ``"{fixed_in}"``:
  the derived ``fixed_in`` (a patch with no fix in the data may not use it).

It lives between the leaves and the patch files (it imports :mod:`overlay.patch` and
:mod:`overlay._patch_files`, and the patch files import it), reads the file once, and imports
neither torch nor transformers: patch files are loaded inside the import of transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from . import _patch_files
from .patch import BEFORE, FIXED, Patch, Target, Variant

#: The names other modules use; the rest is this module's own.
__all__ = [
    "BEFORE", "FIXED", "NO_RELEASE", "allow_drafts", "codes_of", "data_path", "derive", "label", "label_covers",
    "label_runs", "load", "newest_release", "patch_with_release_facts",
]

#: Where the data lives: beside the patch files, in the package they ship in.
FILENAME = "releases.json"
#: The code kinds the data names besides a variant's name: ``FIXED`` (upstream's fix) and ``BEFORE``
#: (code from before the bug arrived): the same words :func:`overlay.patch.match_target` gives such code.
#: Placeholder in a patch's ``upstream`` text for the newest release the data covers.
NEWEST = "{newest_release}"
#: Placeholder in a patch's ``upstream`` text for the derived first release with the fix.
FIXED_IN = "{fixed_in}"
#: The label of code no release in the data ships (kept after ``--remove``, so that adding
#: the release back restores it).
NO_RELEASE = "no release in the data"

_loaded: dict[str, Any] | None = None

#: Set by ``scripts/fingerprint_release.py`` while it loads a patch file being written: a patch the
#: data has no entry for yet is built without fingerprints (``affected`` matching no release), so
#: that the tool can read its targets and ``--add`` the first releases. Anywhere else such a
#: patch file fails to import, naming the command.
allow_drafts = False


def data_path() -> str:
    return os.path.join(os.path.dirname(_patch_files.package().__file__ or ""), FILENAME)


def load() -> dict[str, Any]:
    """The data file, read once per process."""
    global _loaded
    if _loaded is None:
        path = data_path()
        try:
            with open(path, encoding="utf-8") as file:
                _loaded = json.load(file)
        except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, a bad encoding
            raise RuntimeError(
                f"attn-overlay cannot read its release facts ({path}: {getattr(exc, 'strerror', None) or exc}); "
                "reinstall it: pip install --force-reinstall --no-deps attn-overlay"
            ) from exc
    return _loaded


def newest_release() -> str:
    """The newest release the data covers."""
    return str(load()["releases"][-1])


def label(shipped: Sequence[str], releases: Sequence[str]) -> str:
    """The runs of ``releases`` (the data's ordered list) that are in ``shipped``:
    ``"5.13.0-5.14.1"``, ``"5.23.0"``, ``"5.1.0-5.3.0, 5.5.0"``."""
    wanted = set(shipped)
    runs: list[list[str]] = []
    previous_in = False
    for release in releases:
        if release in wanted:
            if previous_in:
                runs[-1][1] = release
            else:
                runs.append([release, release])
        previous_in = release in wanted
    if not runs:
        return NO_RELEASE
    return ", ".join(low if low == high else f"{low}-{high}" for low, high in runs)


_VERSION = r"\d+(?:\.\d+)*(?:rc\d+)?"
_RUN = re.compile(rf"^\s*({_VERSION})\s*(?:-\s*({_VERSION}))?\s*$")


def label_runs(text: str) -> list[tuple[str, str]] | None:
    """:func:`label` read back: ``(first, last)`` of each run (``[]`` for :data:`NO_RELEASE`), or
    ``None`` for text that is not a release label."""
    if text == NO_RELEASE:
        return []
    runs = []
    for run in text.split(","):
        match = _RUN.match(run)
        if not match:
            return None
        runs.append((match.group(1), match.group(2) or match.group(1)))
    return runs


def label_covers(text: str, version: str) -> bool | None:
    """Whether a release label names ``version`` (``None``: the text is not a release label)."""
    from packaging.version import Version

    runs = label_runs(text)
    if runs is None:
        return None
    return any(Version(low) <= Version(version) <= Version(high) for low, high in runs)


def variant_names(target: Target) -> Mapping[str, Mapping[str, Any]]:
    """The target's variants by name (one, ``"original"``, where it declares none)."""
    return target.variants or {"original": {}}


def codes_of(target: Target) -> list[str]:
    """What the data may say a fingerprint of ``target`` is: one of its variants, or the fix, or
    code from before the bug."""
    return [*variant_names(target), FIXED, BEFORE]


@dataclasses.dataclass(frozen=True)
class Derived:
    """What the data says of one patch: the fields a patch file no longer types."""

    originals: dict[str, dict[str, Variant]]  # target key -> sha256 -> variant (label derived)
    fixed: dict[str, dict[str, str]]  # target key -> sha256 -> label
    before: dict[str, dict[str, str]]  # target key -> sha256 -> label of code from before the bug
    affected: str
    fixed_in: str | None
    introduced_in: str | None
    newest: str


def code_by_release(facts: Mapping[str, Any], releases: Sequence[str]) -> dict[str, dict[str, str]]:
    """``{release: {target key: code kind}}`` for one patch's facts (a target no entry names for a
    release is absent there)."""
    table: dict[str, dict[str, str]] = {release: {} for release in releases}
    for key, entries in facts.items():
        for entry in entries.values():
            for release in entry["releases"]:
                table[release][key] = entry["code"]
    return table


def verdicts(targets: Sequence[Target], facts: Mapping[str, Any], releases: Sequence[str]) -> dict[str, str]:
    """``{release: "original" | "fixed" | "before" | "absent"}``: the patch's code on each data
    release, by :func:`overlay.patch.judge_code`'s rule (every present target a known original:
    ``"original"``; else any before-code or a missing required target: ``"before"``; else, with
    known fixed code, ``"fixed"``)."""
    out = {}
    for release, codes in code_by_release(facts, releases).items():
        present = [codes[t.key] for t in targets if t.key in codes]
        required_missing = any(t.key not in codes and not t.optional for t in targets)
        if present and not required_missing and all(code not in (FIXED, BEFORE) for code in present):
            out[release] = "original"
        elif BEFORE in present or required_missing:
            out[release] = BEFORE
        elif FIXED in present:
            out[release] = FIXED
        else:
            out[release] = "absent"
    return out


def derive(patch_id: str, targets: Sequence[Target], data: Mapping[str, Any] | None = None) -> Derived:
    """Everything :func:`patch_with_release_facts` fills in, from the data (default: the file)."""
    data = load() if data is None else data
    releases: list[str] = list(data["releases"])
    facts = data["patches"].get(patch_id)
    where = f"{FILENAME}: patch {patch_id!r}"
    if facts is None:
        raise ValueError(f"{where} has no entry: run scripts/fingerprint_release.py --add RELEASE --patch MODULE")
    declared = {t.key for t in targets}
    unknown = sorted(set(facts) - declared)
    if unknown:
        raise ValueError(f"{where} names targets the patch does not declare: {', '.join(unknown)}")
    originals: dict[str, dict[str, Variant]] = {}
    fixed: dict[str, dict[str, str]] = {}
    before_bug: dict[str, dict[str, str]] = {}
    for target in targets:
        names = variant_names(target)
        originals[target.key], fixed[target.key], before_bug[target.key] = {}, {}, {}
        for digest, entry in facts.get(target.key, {}).items():
            code, shipped = entry["code"], entry["releases"]
            if code == FIXED:
                fixed[target.key][digest] = label(shipped, releases)
            elif code == BEFORE:
                before_bug[target.key][digest] = label(shipped, releases)
            else:
                if code not in names:
                    raise ValueError(
                        f"{where}: {target.key} code {digest[:12]} is variant {code!r}, which the target does not "
                        f"declare ({', '.join(codes_of(target))})"
                    )
                originals[target.key][digest] = Variant(label(shipped, releases), dict(names[code]))

    by_release = verdicts(targets, facts, releases)
    affected_releases = [r for r in releases if by_release[r] == "original"]
    if not affected_releases:
        raise ValueError(f"{where}: no release in the data ships the code this patch was written for")
    first, last = releases.index(affected_releases[0]), releases.index(affected_releases[-1])
    gaps = [r for r in releases[first : last + 1] if by_release[r] != "original"]
    if gaps:
        raise ValueError(
            f"{where}: the releases with the patch's original code are not one run "
            f"({affected_releases[0]} - {affected_releases[-1]}, but {', '.join(gaps)} between)"
        )
    after = releases[last + 1 :]
    not_fixed = [r for r in after if by_release[r] != FIXED]
    if after and not_fixed:
        raise ValueError(
            f"{where}: after {affected_releases[-1]}, the last release with the original code, "
            f"{', '.join(not_fixed)} ship neither it nor a fix"
        )
    fixed_in = after[0] if after else None
    before = [r for r in releases[:first] if by_release[r] == BEFORE]
    introduced_in = affected_releases[0] if before else None
    affected = f">={affected_releases[0]}" + (f",<{fixed_in}" if fixed_in else "")
    return Derived(originals, fixed, before_bug, affected, fixed_in, introduced_in, releases[-1])


def patch_with_release_facts(*, targets: Sequence[Target], **declared: Any) -> Patch:
    """The :class:`~overlay.patch.Patch` a patch file declares (everything but what the data
    says, which this fills in; see the module docstring)."""
    for name in ("affected", "fixed_in", "introduced_in"):
        if name in declared:
            raise TypeError(f"patch {declared.get('id')!r}: {name} is derived from {FILENAME}; do not declare it")
    targets = tuple(targets)
    for target in targets:
        if target.originals or target.fixed or target.before:
            raise TypeError(
                f"patch {declared.get('id')!r}: {target.key} declares fingerprints; they belong in {FILENAME} "
                "(scripts/fingerprint_release.py --add)"
            )
    if allow_drafts and declared["id"] not in load()["patches"]:
        return Patch(**declared, targets=targets, affected="<0", fixed_in=None)
    derived = derive(declared["id"], targets)
    targets = tuple(
        dataclasses.replace(t, originals=derived.originals[t.key], fixed=derived.fixed[t.key], before=derived.before[t.key])
        for t in targets
    )
    upstream = declared.pop("upstream")
    if FIXED_IN in upstream and derived.fixed_in is None:
        raise ValueError(
            f"patch {declared['id']!r}: its upstream text names {FIXED_IN}, but no release in {FILENAME} ships a fix"
        )
    upstream = upstream.replace(NEWEST, derived.newest).replace(FIXED_IN, derived.fixed_in or FIXED_IN)
    return Patch(
        **declared, upstream=upstream, targets=targets,
        affected=derived.affected, fixed_in=derived.fixed_in, introduced_in=derived.introduced_in,
    )
