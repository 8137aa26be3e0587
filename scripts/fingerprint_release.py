#!/usr/bin/env python3
"""Fingerprint every patch target in transformers releases, straight from the released wheels.

How a maintainer adds a release::

    python scripts/fingerprint_release.py --check 5.25.0

downloads the wheel (``pip download --no-deps``; nothing is installed or imported), reads the
source of every patch target out of it and prints its sha256 fingerprint and which known
variant of the patch it is: ``original <label>`` (the bug, the patch applies), ``fixed <label>``
(upstream ships the fix) or ``NEW`` (no known variant: the code changed). Read the code of every
NEW target, then either add its fingerprint to the patch's ``originals``/``fixed`` (same bug,
same fix still right) or write a new variant of the replacement. ``--check`` exits 1 while any
target is NEW or missing, disagrees with the patch's declared versions (``affected``,
``fixed_in``), or matches a variant whose label does not name the release.

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

_LABEL = re.compile(r"^\s*(\d+(?:\.\d+)*)\s*(?:-\s*(\d+(?:\.\d+)*))?\s*$")


def label_covers(label: str, version: str) -> bool | None:
    """Whether a variant label such as ``"5.15.0-5.17.0"`` or ``"5.18.0"`` names ``version``;
    ``None`` for a label that is not a release range (free text is allowed)."""
    from packaging.version import Version

    match = _LABEL.match(label)
    if not match:
        return None
    low = Version(match.group(1))
    high = Version(match.group(2) or match.group(1))
    return low <= Version(Version(version).base_version) <= high


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
                f"{where} matches no known variant (sha256 {t.sha256}): read the code, then add the "
                "fingerprint to the target's originals/fixed or write a new variant"
            )
        elif t.match == MISSING:
            report.problems.append(f"{where} does not exist in this release")
        elif t.label_covers_release is False:
            report.problems.append(
                f"{where} is the {t.match} variant labelled {t.label!r}, which does not name {version}: "
                "widen the label"
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

    module = importlib.import_module(f"overlay.patches.{Path(name).stem}")
    patch = getattr(module, "PATCH", None)
    if not isinstance(patch, Patch):
        raise SystemExit(f"fingerprint_release: {module.__name__} defines no PATCH")
    return patch


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
    args = parser.parse_args(argv)
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
