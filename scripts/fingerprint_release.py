#!/usr/bin/env python3
"""Fingerprint every patch target in transformers releases, straight from the released wheels,
and keep the release facts (``patches/releases.json``) that the patch files are built from.

How a maintainer adds a release::

    python scripts/fingerprint_release.py --add 5.25.0

downloads the wheel (``pip download --no-deps``; nothing is installed or imported), reads the
source of every patch target out of it and records, in ``patches/releases.json``, that the
release ships each fingerprint. Labels, ``affected``, ``fixed_in`` and "up to X" all follow from
that file (``overlay/releases.py``); nothing else is edited for a release whose code is unchanged
but its lane line (``RELEASES`` in ``scripts/matrix_data.py``). Where a target's code is new,
``--add`` writes nothing and says which: read the code, then either name what it is with
``--variant SHA=NAME`` (one of the target's variants, ``fixed`` for upstream's fix, ``before``
for code from before the bug) or write a new variant of the replacement first. ``--remove
VERSION`` takes a release out again (its fingerprints stay known, with no release).

Reporting only: ``python scripts/fingerprint_release.py --check 5.25.0`` prints each target's
fingerprint and which known code it is: ``original <label>`` (the bug, the patch applies),
``fixed <label>`` (upstream ships the fix) or ``NEW``; ``--check`` exits 1 while any target is
NEW or missing, disagrees with the declared versions, or the release is not in the data yet.

The fingerprint is the engine's own: the file's text goes through
``overlay.patch.source_in_module_text`` (the code object the module creates, its block cut out
by the function that cuts it at run time) and ``overlay.patch.fingerprint_source``; this script
only finds and decodes the file. ``tests/tools/test_fingerprint_tool.py`` proves the two agree on the
installed release.

Other sources than a version number: ``--all`` for every release of the matrix
(``scripts/matrix_data.py``), a path to a wheel file, or ``--installed`` for the transformers
installed next to this interpreter (read from its files, not imported). ``--patch NAME`` reports
one patch file only, listed in ``patches/__init__.py`` or not yet (CONTRIBUTING.md: adding a patch).
"""

from __future__ import annotations

import argparse
import ast
import copy
import io
import json
import os
import re
import subprocess
import sys
import tokenize
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matrix_data  # noqa: E402  (the scripts folder is not a package)

matrix_data.ensure_overlay_importable()

from overlay import releases  # noqa: E402
from overlay.patch import (  # noqa: E402, F401  (the match words are the tool's too)
    ABSENT_OPTIONAL,
    FIXED,
    MISSING,
    NEW,
    ORIGINAL,
    UNRECOGNISED,
    Patch,
    code_in_module,
    fingerprint_source,
    judge_code,
    source_in_module_text,
)

DEFAULT_WHEEL_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attn-overlay" / "wheels"

# How a target's code compares with what the patch knows: the engine's words (overlay.patch):
# ORIGINAL (the bug is there, the patch applies), FIXED (a known upstream fix), NEW (no known
# variant: the code changed), MISSING (not in this release), ABSENT_OPTIONAL (missing, and the
# target says that is fine).

# Reads one file of a release by its path inside the distribution ("transformers/..."):
# its bytes, or None when the release has no such file.
ReadFile = Callable[[str], "bytes | None"]


# -- extraction: the engine's own functions on a release's files ------------------------------


def module_file_candidates(module: str) -> tuple[str, str]:
    """Where ``module``'s source lives inside a distribution: a module file or a package."""
    path = module.replace(".", "/")
    return f"{path}.py", f"{path}/__init__.py"


def source_lines(data: bytes) -> list[str]:
    """The file's lines exactly as ``linecache`` gives them to the engine at run time: decoded
    with the encoding the file declares (PEP 263), universal newlines, last line ending in
    ``\\n``."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    lines = io.TextIOWrapper(io.BytesIO(data), encoding=encoding).readlines()
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


def extract_target_source(read: ReadFile, module: str, qualname: str) -> str | None:
    """The dedented source block of ``module:qualname`` from a release's files, exactly as the
    engine reads it at run time (the engine's own :func:`overlay.patch.source_in_module_text`);
    ``None`` when the release has no such module or definition."""
    for candidate in module_file_candidates(module):
        data = read(candidate)
        if data is not None:
            return source_in_module_text("".join(source_lines(data)), candidate, qualname)
    return None


def target_fingerprint(read: ReadFile, module: str, qualname: str) -> str | None:
    source = extract_target_source(read, module, qualname)
    return None if source is None else fingerprint_source(source)


def target_source(read: ReadFile, target) -> str | None:
    """The code of ``target`` (an ``overlay.patch.Target``) in a release's files, as the engine
    judges it (``Target.locate``): ``None`` where the target's ``unless`` function exists; where
    its class does not define the function but the target names ``inherited_from``, that
    definition (the engine follows the class's method resolution order, which files cannot show:
    a release that changes the hierarchy shows there as code the patch does not know)."""
    if target.unless is not None and extract_target_source(read, target.module, target.unless) is not None:
        return None
    source = extract_target_source(read, target.module, target.qualname)
    if source is None and target.inherited_from is not None:
        owner = target.qualname.rpartition(".")[0]
        if owner and extract_target_source(read, target.module, owner) is not None:
            module, _, qualname = target.inherited_from.partition(":")
            source = extract_target_source(read, module, qualname)
    return source


def fingerprint_of_target(read: ReadFile, target) -> str | None:
    """sha256 of :func:`target_source`."""
    source = target_source(read, target)
    return None if source is None else fingerprint_source(source)


def definition_first_line(tree: ast.Module, qualname: str) -> int | None:
    """1-based first line (first decorator) of the definition of ``qualname`` that the module
    binds, found as the engine's fingerprint finds it; ``None`` when there is none. The tests
    use it to change one target's code."""
    code = code_in_module(compile(tree, "<module>", "exec", dont_inherit=True), qualname)
    return None if code is None else code.co_firstlineno


def wheel_reader(wheel: Path) -> ReadFile:
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())

    def read(path: str) -> bytes | None:
        return archive.read(path) if path in names else None

    return read


def directory_reader(root: Path) -> ReadFile:
    """Files under ``root``, the folder that holds the ``transformers`` package (site-packages
    or an unpacked wheel)."""

    def read(path: str) -> bytes | None:
        file = root / path
        return file.read_bytes() if file.is_file() else None

    return read


def installed_transformers() -> tuple[str, Path]:
    """(version, folder holding the package) of the transformers next to this interpreter,
    found without importing it."""
    from importlib.metadata import distribution

    dist = distribution("transformers")
    init = Path(dist.locate_file("transformers/__init__.py"))
    return dist.version, init.parent.parent


# -- classification -------------------------------------------------------------------------

def label_covers(label: str, version: str) -> bool | None:
    """Whether a variant label such as ``"5.15.0-5.17.0"`` or ``"5.18.0"`` names ``version``;
    ``None`` for a label that is not a release range (free text is allowed)."""
    from overlay import releases

    return releases.label_covers(label, version)


@dataclass
class TargetReport:
    module: str
    qualname: str
    sha256: str | None
    match: str  # ORIGINAL, FIXED, NEW, MISSING, ABSENT_OPTIONAL
    label: str | None = None
    label_covers_release: bool | None = None


@dataclass
class PatchReport:
    id: str
    declared: str  # from the patch's affected / fixed_in (matrix_data.expected_status)
    code: str  # what the fingerprints alone say: applied / fixed upstream / unrecognised code
    targets: list[TargetReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class ReleaseReport:
    version: str
    source: str
    patches: list[PatchReport] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return [f"transformers {self.version}: {p.id}: {msg}" for p in self.patches for msg in p.problems]

    @property
    def notes(self) -> list[str]:
        return [f"transformers {self.version}: {p.id}: {msg}" for p in self.patches for msg in p.notes]


def report_patch(patch, version: str, read: ReadFile) -> PatchReport:
    report = PatchReport(id=patch.id, declared=matrix_data.expected_status(patch, version), code="")
    # The engine's own code verdict, on the release's files instead of its live functions.
    verdict = judge_code(patch, lambda target: target_source(read, target))
    report.code = verdict.state
    for m in verdict.matches:
        covers = label_covers(m.label, version) if m.label is not None else None
        report.targets.append(TargetReport(m.target.module, m.target.qualname, m.digest, m.match, m.label, covers))

    if report.declared == matrix_data.OUT_OF_RANGE:
        # Outside the patch's releases: the engine never looks at this code, nothing to fix here.
        if report.code == matrix_data.APPLIED:
            report.notes.append(
                f"every target is a known original although {version} is outside {patch.affected!r}: "
                "if the bug is there too, widen affected"
            )
        return report
    for t in report.targets:
        where = f"{t.module}:{t.qualname}"
        if t.match == NEW:
            report.problems.append(
                f"{where} matches no known variant (sha256 {t.sha256}): read the code, then name it with "
                f"--add {version} --variant {t.sha256[:12]}=NAME (a variant of the target, 'fixed' or "
                "'before'), or write a new variant of the replacement first"
            )
        elif t.match == MISSING:
            report.problems.append(f"{where} does not exist in this release")
        elif t.label_covers_release is False:
            report.problems.append(
                f"{where} is the {t.match} variant labelled {t.label!r}, which does not name {version}: "
                f"add the release to the data (scripts/fingerprint_release.py --add {version})"
            )
    if report.code != UNRECOGNISED and report.code != report.declared:
        report.problems.append(
            f"the patch declares {report.declared!r} for {version} (affected {patch.affected!r}, "
            f"fixed_in {patch.fixed_in!r}) but the code says {report.code!r}"
        )
    return report


def report_release(version: str, read: ReadFile, source: str, patches: Sequence | None = None) -> ReleaseReport:
    patches = patches if patches is not None else matrix_data.load_patches()
    return ReleaseReport(version, source, [report_patch(p, version, read) for p in patches])


def load_patch_module(name: str):
    """The ``PATCH`` of ``patches/<name>.py`` (``name`` may carry the ``.py`` or a folder)."""
    import importlib

    releases.allow_drafts = True  # a patch file being written has no data yet: --add gives it some
    module = importlib.import_module(f"overlay.patches.{Path(name).stem}")
    patch = getattr(module, "PATCH", None)
    if not isinstance(patch, Patch):
        raise SystemExit(f"fingerprint_release: {module.__name__} defines no PATCH")
    return patch


# -- the release facts (patches/releases.json) ------------------------------------------------

DATA_FILE = Path(releases.data_path())
ABOUT = (
    "Which transformers release ships which code of each patch target: sha256 -> the variant it is "
    "('fixed': upstream's fix; 'before': from before the bug) and the releases that ship it. Written by "
    "scripts/fingerprint_release.py --add / --remove; overlay/releases.py derives labels, affected and "
    "fixed_in from it."
)


def read_data(path: Path = DATA_FILE) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def format_data(data: dict) -> str:
    """The file's text: one line per fingerprint, so that a new release changes the lines of the
    code it ships and nothing else."""
    releases = data["releases"]
    rows = [", ".join(json.dumps(r) for r in releases[i : i + 10]) for i in range(0, len(releases), 10)]
    out = ["{", f'  "about": {json.dumps(ABOUT)},', '  "releases": [']
    out += [f"    {row}," for row in rows[:-1]] + ([f"    {rows[-1]}"] if rows else [])
    out += ["  ],", '  "patches": {']
    patches = list(data["patches"].items())
    for i, (patch_id, targets) in enumerate(patches):
        out.append(f"    {json.dumps(patch_id)}: {{")
        for j, (key, entries) in enumerate(targets.items()):
            out.append(f"      {json.dumps(key)}: {{")
            out += [f"        {json.dumps(digest)}: {json.dumps(entry)}" + ("," if k < len(entries) - 1 else "")
                    for k, (digest, entry) in enumerate(entries.items())]
            out.append("      }" + ("," if j < len(targets) - 1 else ""))
        out.append("    }" + ("," if i < len(patches) - 1 else ""))
    out += ["  }", "}", ""]
    return "\n".join(out)


def _ordered(releases: Sequence[str]) -> list[str]:
    from packaging.version import Version

    return sorted(set(releases), key=Version)


def remove_release(data: dict, version: str) -> dict:
    """``data`` without ``version``; the fingerprints it shipped stay known (with no release),
    so that adding it back restores exactly what was there."""
    if version not in data["releases"]:
        raise ValueError(f"transformers {version} is not in the data")
    data = copy.deepcopy(data)
    data["releases"].remove(version)
    for targets in data["patches"].values():
        for entries in targets.values():
            for entry in entries.values():
                if version in entry["releases"]:
                    entry["releases"].remove(version)
    return data


def add_release(data: dict, version: str, read: ReadFile, patches: Sequence, named: dict[str, str],
                used: set[str] | None = None) -> tuple[dict, list[str]]:
    """(``data`` with ``version``, problems): every target's code in the release, recorded under
    the fingerprint the data knows it by, or under the name ``named`` gives its sha256 prefix
    (the prefixes that named something are added to ``used``). Code nobody named is a problem;
    so is a name the target does not declare."""
    data = copy.deepcopy(data)
    data["releases"] = _ordered([*data["releases"], version])
    problems: list[str] = []
    for patch in patches:
        targets = data["patches"].setdefault(patch.id, {})
        for target in patch.targets:
            entries = targets.setdefault(target.key, {})
            digest = fingerprint_of_target(read, target)
            if digest is None:
                continue  # absent in this release: the derived verdict says what that means
            entry = entries.get(digest)
            if entry is None:
                prefixes = [prefix for prefix in named if digest.startswith(prefix)]
                allowed = releases.codes_of(target)
                if not prefixes:
                    problems.append(
                        f"{patch.id}: {target.key} is code the data does not know (sha256 {digest}): read it, "
                        f"then --variant {digest[:12]}=NAME ({', '.join(allowed)}), or write a new variant of "
                        f"the replacement first; shipped by transformers {version}"
                    )
                    continue
                name = named[prefixes[0]]
                if name not in allowed:
                    problems.append(f"{patch.id}: {target.key} declares no variant {name!r} ({', '.join(allowed)})")
                    continue
                if used is not None:
                    used.update(prefixes)
                entry = entries[digest] = {"code": name, "releases": []}
            entry["releases"] = _ordered([*entry["releases"], version])
    return data, problems


def _merged(problems: list[str]) -> list[str]:
    """One line per problem, the releases that show it joined: ``...; shipped by transformers
    5.13.0, 5.13.1``."""
    marker = "; shipped by transformers "
    merged: dict[str, list[str]] = {}
    for problem in problems:
        text, _, release = problem.partition(marker)
        merged.setdefault(text, []).extend([release] if release else [])
    return [text + (marker + ", ".join(found) if found else "") for text, found in merged.items()]


def derive_all(data: dict, patches: Sequence) -> list[str]:
    """What :mod:`overlay.releases` refuses in ``data`` (a gap in a patch's releases, code after
    its last affected release that is not a fix ...), one line each."""
    problems = []
    for patch in patches:
        try:
            releases.derive(patch.id, patch.targets, data)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


# -- wheels ---------------------------------------------------------------------------------


def find_wheel(version: str, wheel_dir: Path) -> Path | None:
    found = sorted(wheel_dir.glob(f"transformers-{version}-*.whl"))
    return found[0] if found else None


def fetch_wheel(version: str, wheel_dir: Path, timeout: float = 600) -> Path:
    """The release's wheel from ``wheel_dir``, downloaded there first if needed (never installed)."""
    wheel = find_wheel(version, wheel_dir)
    if wheel is not None:
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        # Never installed, only read: the release's Requires-Python is not this interpreter's concern.
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--ignore-requires-python",
         "--no-input", "--disable-pip-version-check", "--dest", str(wheel_dir), f"transformers=={version}"],
        capture_output=True, text=True, timeout=timeout,
    )
    wheel = find_wheel(version, wheel_dir)
    if done.returncode != 0 or wheel is None:
        last = ((done.stderr or done.stdout).strip().splitlines() or ["pip printed nothing"])[-1]
        raise RuntimeError(f"could not download transformers {version}: {last}")
    return wheel


# -- output ---------------------------------------------------------------------------------


def format_text(reports: Sequence[ReleaseReport]) -> str:
    out: list[str] = []
    for release in reports:
        out.append(f"transformers {release.version}  ({release.source})")
        for patch in release.patches:
            out.append(f"  {patch.id}: declared {patch.declared}; code says {patch.code}")
            for t in patch.targets:
                what = t.match if t.label is None else f"{t.match} {t.label}"
                if t.label_covers_release is False:
                    what += f"  (label does not name {release.version})"
                out.append(f"    {t.qualname:<58} {t.sha256 or '-':<64}  {what}")
        out.append("")
    patch_ids = [p.id for p in reports[0].patches] if reports else []
    width = max([len(i) for i in patch_ids] + [len("(unrecognised code)")])
    out.append("code says (release x patch):")
    out.append(("  " + " " * 8 + "  ".join(f"{i:<{width}}" for i in patch_ids)).rstrip())
    for release in reports:
        cells = []
        for p in release.patches:
            cell = p.code if p.declared != matrix_data.OUT_OF_RANGE else f"({p.code})"
            cells.append(f"{cell + (' !' if p.problems else ''):<{width}}")
        out.append(f"  {release.version:<8}" + "  ".join(cells).rstrip())
    problems = [msg for release in reports for msg in release.problems]
    notes = [msg for release in reports for msg in release.notes]
    out.append("")
    if notes:
        out.append("notes:")
        out.extend(f"  - {msg}" for msg in notes)
    if problems:
        out.append(f"{len(problems)} problem(s):")
        out.extend(f"  - {msg}" for msg in problems)
    else:
        out.append("every target matches a known variant that agrees with the declared versions")
    return "\n".join(out)


def as_json(reports: Sequence[ReleaseReport]) -> str:
    data = {
        "releases": [
            {"version": r.version, "source": r.source, "patches": [asdict(p) for p in r.patches]} for r in reports
        ],
        "problems": [msg for r in reports for msg in r.problems],
        "notes": [msg for r in reports for msg in r.notes],
    }
    return json.dumps(data, indent=2)


def update_data(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--add`` / ``--remove``: the data file, rewritten only when every release went in cleanly."""
    named = {}
    for item in args.variant:
        prefix, _, name = item.partition("=")
        if len(prefix) < 8 or not name or not re.fullmatch(r"[0-9a-f]+", prefix):
            parser.error(f"--variant {item!r}: give SHA=NAME, SHA being at least 8 hex digits of the sha256")
        named[prefix] = name
    patches = (
        [load_patch_module(name) for name in args.patch_modules] if args.patch_modules else matrix_data.load_patches()
    )
    original = args.data.read_text(encoding="utf-8")
    data = json.loads(original)
    if args.add_known:
        if not args.patch_modules:
            parser.error("--add-known goes with --patch (the data's releases are already read for the shipped patches)")
        args.add = [*data["releases"], *args.add]
    if args.patch_modules:
        new = [item for item in args.add if not item.endswith(".whl") and item not in data["releases"]]
        if new or args.remove:
            parser.error("with --patch, --add only releases the data covers and --remove none: a release "
                         "enters or leaves the data for every patch at once (drop --patch)")
    problems: list[str] = []
    used: set[str] = set()
    try:
        for version in args.remove:
            data = remove_release(data, version)
        for item in args.add:
            if item.endswith(".whl"):
                wheel, version = Path(item), Path(item).name.split("-")[1]
            else:
                wheel, version = fetch_wheel(item, args.wheel_dir), item
            data, found = add_release(data, version, wheel_reader(wheel), patches, named, used)
            problems += found
    except (ValueError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"fingerprint_release: {exc}", file=sys.stderr)
        return 2
    problems = _merged(problems)
    problems += [f"--variant {prefix}: no target of the releases added has that code" for prefix in sorted(set(named) - used)]
    problems += derive_all(data, patches) if not problems else []
    if problems:
        print(f"{args.data} left as it was; {len(problems)} problem(s):")
        print("\n".join(f"  - {msg}" for msg in problems))
        return 1
    text = format_data(data)
    changed = text != original
    args.data.write_text(text, encoding="utf-8")
    def listed(verb: str, versions: list[str]) -> list[str]:
        if len(versions) > 3:
            return [f"{verb} {len(versions)} releases ({versions[0]} ... {versions[-1]})"]
        return [f"{verb} {v}" for v in versions]

    done = [*listed("removed", args.remove), *listed("added", args.add)]
    print(f"{args.data}: {', '.join(done)}" + ("" if changed else " (no change)"))
    print("next: the release's lane line in scripts/matrix_data.py (RELEASES), then python scripts/readme_table.py")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/fingerprint_release.py",
        description="Fingerprint every patch target in transformers releases, read from their wheels.",
    )
    parser.add_argument("releases", nargs="*", metavar="VERSION",
                        help="transformers release numbers (e.g. 5.24.0) or paths to wheel files")
    parser.add_argument("--all", action="store_true", dest="all_releases",
                        help="every release the matrix proves (RELEASES in scripts/matrix_data.py)")
    parser.add_argument("--installed", action="store_true",
                        help="also report the transformers installed next to this interpreter (read, not imported)")
    parser.add_argument("--wheel-dir", type=Path, default=DEFAULT_WHEEL_DIR,
                        help=f"where wheels are looked for and downloaded (default {DEFAULT_WHEEL_DIR})")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--patch", action="append", metavar="MODULE", dest="patch_modules",
                        help="report only this patch file of patches/ (repeatable; it need not be "
                        "listed in patches/__init__.py yet, e.g. while writing it)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when any target is NEW, missing, or disagrees with the declared versions")
    parser.add_argument("--add", action="append", default=[], metavar="VERSION",
                        help="record what this release ships in the data file (repeatable)")
    parser.add_argument("--remove", action="append", default=[], metavar="VERSION",
                        help="take this release out of the data file (repeatable)")
    parser.add_argument("--add-known", action="store_true",
                        help="with --patch: read every release the data covers again (a new patch file's first facts)")
    parser.add_argument("--variant", action="append", default=[], metavar="SHA=NAME",
                        help="with --add: the code whose sha256 starts with SHA is variant NAME of its target "
                        "('fixed': upstream's fix; 'before': code from before the bug)")
    parser.add_argument("--data", type=Path, default=DATA_FILE, help=f"the data file (default {DATA_FILE})")
    args = parser.parse_args(argv)
    if args.add or args.remove or args.add_known:
        return update_data(args, parser)
    if args.variant:
        parser.error("--variant goes with --add")
    if args.all_releases:
        args.releases = [*matrix_data.RELEASES, *(r for r in args.releases if r not in matrix_data.RELEASES)]
    if not args.releases and not args.installed:
        parser.error("name at least one release (or --all, or --installed)")

    patches = (
        [load_patch_module(name) for name in args.patch_modules] if args.patch_modules else matrix_data.load_patches()
    )
    reports: list[ReleaseReport] = []
    for item in args.releases:
        try:
            if item.endswith(".whl"):
                wheel = Path(item)
                version = wheel.name.split("-")[1]
            else:
                version, wheel = item, fetch_wheel(item, args.wheel_dir)
        except (RuntimeError, subprocess.TimeoutExpired, IndexError) as exc:
            print(f"fingerprint_release: {exc}", file=sys.stderr)
            return 2
        reports.append(report_release(version, wheel_reader(wheel), str(wheel), patches))
    if args.installed:
        version, root = installed_transformers()
        reports.append(report_release(version, directory_reader(root), f"installed at {root}", patches))

    print(as_json(reports) if args.json else format_text(reports))
    problems = [msg for r in reports for msg in r.problems]
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
