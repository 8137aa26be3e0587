"""The patch format: what one fix declares about itself.

A patch file in ``patches/`` builds one :class:`Patch` and binds it to the module-level name
``PATCH``. The engine reads these declarations, gates them on the installed transformers
version and on the exact source of each target, and only then swaps the target for its
replacement. Nothing here imports torch or transformers: a patch file must stay cheap to import,
because the registry loads every patch file when transformers is first imported.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import linecache
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, NamedTuple, cast

#: The names other modules use; the rest is this module's own.
__all__ = [
    "ABSENT_OPTIONAL", "APPLIED", "BEFORE", "CHANGES", "CHANGES_BOTH", "CHANGES_ERRORS", "CHANGES_OUTPUT", "FAILED",
    "FIXED", "FIXED_UPSTREAM", "MISSING", "NEW", "NOT_INSTALLED", "ORIGINAL",
    "OUT_OF_RANGE", "PATCH_MARKER", "PENDING", "Patch", "Target", "UNRECOGNISED", "Variant", "argument_reader", "assess",
    "block_at", "code_in_module", "fingerprint", "fingerprint_source", "function_of", "judge_code", "lowest_release",
    "source_in_module_text", "source_of", "wraps",
]

#: Attribute set on every replacement the engine installs: the id of the patch it belongs to.
PATCH_MARKER = "__overlay_patch__"

# What a fix changes (``Patch.changes``), in the words status, ``--json``, ``attn-overlay env``,
# the pytest header and the README's table print. The stock release is the reference: a call
# "raises" or "completes" there.
CHANGES_ERRORS = "errors"
"""Only calls that raise on the stock release: an error becomes a working run. Every call the
release completes gives the same output with the patch (what ``ATTN_OVERLAY_FIXES=errors`` keeps)."""
CHANGES_OUTPUT = "output"
"""Calls that complete on the stock release: other tokens or scores (the first fixed release's)."""
CHANGES_BOTH = "both"
"""Both: some calls that raise on stock now work, and some that complete give other output."""
#: Every value ``Patch.changes`` accepts, in the order tables list them.
CHANGES = (CHANGES_ERRORS, CHANGES_OUTPUT, CHANGES_BOTH)


@dataclass(frozen=True)
class Variant:
    """One shape of a target's code: the releases that ship it, and what the replacement needs
    to know about that shape (``params``), so that a release with new code is a new variant, not
    a branch inside the replacement. The engine hands the matched variant to ``Target.replace``."""

    label: str
    """The releases that ship this exact code, e.g. ``"5.15.0-5.17.0"``: what status reports and
    ``scripts/fingerprint_release.py`` show (that tool checks the label names the release)."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Whatever differs in the replacement for this shape: flags, values, small functions."""

    def __getitem__(self, name: str) -> Any:
        try:
            return self.params[name]
        except KeyError:
            raise KeyError(f"variant {self.label!r} declares no parameter {name!r}") from None


class Location(NamedTuple):
    """Where a target is in an imported module (:meth:`Target.locate`)."""

    owner: Any  #: the class or module that holds it (``None``: the module has no such owner)
    name: str  #: the attribute name on ``owner``
    raw: Any  #: what ``owner.__dict__`` holds (a ``staticmethod`` stays one), or ``None``


@dataclass(frozen=True)
class Target:
    """One function (or method) a patch replaces.

    ``originals`` maps the sha256 fingerprint (see :func:`fingerprint`) of every code shape the
    patch was written for to its :class:`Variant` (a plain label string is shorthand for a
    variant without parameters); ``fixed`` maps the fingerprints of upstream's fixed code to a
    label naming the releases that ship it. Labels are shown, never parsed by the engine.
    """

    module: str
    """Dotted module name the target lives in, e.g. ``"transformers.generation.utils"``."""
    qualname: str
    """Attribute path inside the module, e.g. ``"GenerationMixin.prepare_inputs_for_generation"``."""
    replace: Callable[[Callable[..., Any], Variant], Callable[..., Any]]
    """``replace(original, variant)`` builds the replacement from the original function and the
    variant its code matched. Must not mutate the original, and must not import anything while
    building: it runs inside the import of the target module under the engine's lock, so an
    import there could deadlock with another thread's import. Import what the replacement needs
    inside the replacement's body."""
    originals: Mapping[str, Variant | str] = field(default_factory=dict)
    """Fingerprints of every known original this patch was written against -> its variant. A
    shipped patch file leaves it (and ``fixed``) empty: :func:`overlay.releases.patch_with_release_facts`
    fills both from ``patches/releases.json``. Tests and tools build targets with them directly."""
    fixed: Mapping[str, str] = field(default_factory=dict)
    """Fingerprints meaning "upstream already ships the fix" -> release label."""
    before: Mapping[str, str] = field(default_factory=dict)
    """Fingerprints of code from before the bug arrived -> release label (filled from the data
    like ``fixed``): such code is out of the patch's range whatever the release number says."""
    optional: bool = False
    """When true, a release where the attribute does not exist is fine (target skipped)."""
    inherited_from: str | None = None
    """``"module:Class.name"``: where the function is defined when the class named in ``qualname``
    inherits it instead of defining it (``AttentionInterface.__getitem__`` is
    ``transformers.utils.generic:GeneralInterface.__getitem__``). The engine then reads the function
    the class really resolves to (its method resolution order), the fingerprint tool reads it from
    this module's file; the replacement is set on the class itself, so its subclasses see it and its
    bases (and their other subclasses) do not, and a revert deletes it again: the class's own
    namespace is left exactly as it was. Where the class defines the function itself, that is the
    code judged, as for any target."""
    unless: str | None = None
    """The qualified name of another function in the same module whose presence makes this target
    unnecessary (it is that release's entry point, patched by another target): where it exists this
    target counts as absent, so declare ``optional`` too."""
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The replacement's variants by name -> the parameters each sets (beside ``defaults``):
    ``patches/releases.json`` names, per fingerprint, which variant that code is, and
    :func:`overlay.releases.patch_with_release_facts` builds ``originals`` from the two. Empty:
    one variant, ``"original"``, without parameters."""
    needed_by_call: Callable[[Any, tuple, dict], bool] | None = None
    """For a method the decoding loop calls on the model at every step: ``needed_by_call(model,
    args, kwargs)`` of a ``generate()`` call answers False only when no step of that call can reach
    what the fix changes; that call then runs the code below this replacement at every step
    (:mod:`overlay.call_scope`). It must be cheap (it runs once per call) and err towards True."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """The variant parameters this target's replacement reads, each with the value most variants
    have: a variant states only where its code differs, so a new parameter is one entry here plus
    one in the variant that needs another value, not an edit of every variant. Once declared, a
    variant naming a parameter that is not here is refused (a typo cannot pass for a default)."""

    def __post_init__(self) -> None:
        variants = {}
        for digest, variant in self.originals.items():
            variant = variant if isinstance(variant, Variant) else Variant(variant)
            if self.defaults:
                unknown = sorted(set(variant.params) - set(self.defaults))
                if unknown:
                    raise ValueError(
                        f"{self.module}:{self.qualname}: variant {variant.label!r} sets {', '.join(map(repr, unknown))}, "
                        f"which the target's defaults do not declare ({', '.join(map(repr, self.defaults)) or 'none'})"
                    )
                variant = Variant(variant.label, {**self.defaults, **variant.params})
            variants[digest] = variant
        object.__setattr__(self, "originals", variants)

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def known_variants(self) -> Mapping[str, Variant]:
        """``originals`` as it is after construction: every label string is a :class:`Variant`
        by then (``__post_init__``), whatever the field's type admits when a target is built."""
        return cast(Mapping[str, Variant], self.originals)

    def locate(self, module: Any) -> Location:
        """(owner, attribute name, raw object, or ``None``) for this target in the imported
        ``module``. The raw object is what the owner's ``__dict__`` holds (a ``staticmethod`` stays
        one): what a swap replaces and a revert puts back. For a target with ``inherited_from``
        whose class does not define the attribute itself, it is what the class inherits (found
        along its method resolution order; not in the owner's ``__dict__``: a revert deletes the
        replacement instead of putting it back). ``None`` where the module has no such attribute,
        or where the target's ``unless`` function exists."""
        owner, name = _resolve(module, self.qualname)
        if owner is None:
            return Location(None, name, None)
        if self.unless is not None:
            other_owner, other_name = _resolve(module, self.unless)
            if other_owner is not None and getattr(other_owner, other_name, None) is not None:
                return Location(owner, name, None)
        raw = vars(owner).get(name)
        if raw is None and self.inherited_from is not None and isinstance(owner, type):
            for base in owner.__mro__[1:]:
                if name in vars(base):
                    raw = vars(base)[name]
                    break
        return Location(owner, name, raw)

    def stock(self, module: Any) -> Any:
        """The release's own function for this target in ``module``, behind any overlay
        replacement (``None`` when the module has no such attribute)."""
        raw = self.locate(module).raw
        func: Any = function_of(raw) if raw is not None else None
        while getattr(func, PATCH_MARKER, None) is not None:
            func = func.__wrapped__
        return func

    def variant_of(self, func: Callable[..., Any]) -> Variant | None:
        """The variant whose code ``func`` is, or ``None``."""
        return self.known_variants.get(fingerprint(func))

    def build(self, original: Callable[..., Any], otherwise: Variant | None = None) -> Callable[..., Any]:
        """``replace(original, its variant)`` outside the engine (tests, benchmarks). For code no
        variant names (a test wrapping upstream's fixed code by hand, to show the wrapper changes
        nothing there) pass the variant to use as ``otherwise``; without it such code raises
        ``ValueError``."""
        variant = self.variant_of(original) or otherwise
        if variant is None:
            raise ValueError(f"{self.key}: the given function is not a known original (sha256 {fingerprint(original)[:12]})")
        return self.replace(original, variant)


def _resolve(module: Any, qualname: str) -> tuple[Any, str]:
    """(the object holding the last part of ``qualname``, that last part), or ``(None, name)``."""
    *path, name = qualname.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None, name
    return owner, name


@dataclass(frozen=True)
class Patch:
    """Everything about one fix. See ``patches/`` for real ones and CONTRIBUTING.md for adding one."""

    id: str
    """Short stable identifier, e.g. ``"device-move-nested"``; used by status, logs and opt-outs."""
    title: str
    errors: tuple[str, ...]
    """The exact error texts users hit (what they paste into a search box)."""
    why: str
    """One sentence: the cause. The patch module's docstring tells the rest (what breaks, what
    the replacement does and costs), and the README's table of fixes is generated from the other
    fields (``scripts/readme_table.py``): nothing is explained twice."""
    upstream: str
    """Upstream issue / pull request reference."""
    affected: str
    """PEP 440 specifier of the transformers releases that carry the bug, e.g. ``">=5.13.0,<5.20.0"``."""
    fixed_in: str | None
    """First upstream release that fixes it, or ``None`` when no release does."""
    targets: tuple[Target, ...]
    introduced_in: str | None = None
    """The first release that ships the code causing the bug, when that is inside what the patch
    knows: releases before it do not have the bug, and their "out of range" says so. ``None``:
    the bug's code is older than ``affected``'s lowest release (or not known), so a release
    before that range is "out of range" as not checked."""
    doctor: tuple[str, ...] = ()
    """Ids of the ``python -m overlay.doctor`` scenarios that prove this fix on a user's machine
    (``overlay/doctor/_scenarios.py``): the doctor reports each scenario with the patches that
    name it, and ``tests/tools/test_doctor.py`` checks every id names a scenario."""
    changes: str = CHANGES_BOTH
    """What the fix changes on a release it applies to: :data:`CHANGES_ERRORS` (only calls that
    raise on stock), :data:`CHANGES_OUTPUT` (calls that complete on stock give other tokens or
    scores) or :data:`CHANGES_BOTH`. ``ATTN_OVERLAY_FIXES=errors`` leaves off every patch that
    does not say ``"errors"``. Every shipped patch declares it (``tests/patches/test_patch_declarations.py``
    holds each declaration true); the default, for patches built by tests and tools, is the
    cautious one: a fix that says nothing may change output."""

    def __post_init__(self) -> None:
        if self.changes not in CHANGES:
            raise ValueError(
                f"patch {self.id!r} declares changes={self.changes!r}; use one of {', '.join(map(repr, CHANGES))} "
                "(overlay.patch.CHANGES_ERRORS, CHANGES_OUTPUT, CHANGES_BOTH)"
            )
        if not self.targets:
            raise ValueError(f"patch {self.id!r} declares no targets")
        modules = {t.module for t in self.targets}
        if len(modules) != 1:
            # One module per patch keeps application atomic: every target of a patch is swapped
            # in the same post-import callback, or none is.
            raise ValueError(
                f"patch {self.id!r} spans modules {sorted(modules)}; split it into one patch per module"
            )

    @property
    def module(self) -> str:
        return self.targets[0].module


def source_of(func: Callable[..., Any]) -> str:
    """The dedented source block of ``func``, decorators included: the canonical text a
    fingerprint hashes.

    The block runs from the code object's first line (the first decorator) to the last line any
    of its instructions covers: what :func:`inspect.getblock` returns (:func:`block_at`), except
    a closing bracket on a line of its own after the last instruction, which no instruction covers
    (the same block is cut everywhere, in the engine and from the wheels, so fingerprints agree). It is
    found from the code object's own line table (:func:`block_end`) instead of by tokenizing, and
    without :func:`inspect.getsource`, which scans ``sys.modules``: both are far too slow for an
    import hook (tens of milliseconds for a long method). ``scripts/fingerprint_release.py``
    reads release wheels without importing them through :func:`source_in_module_text`, which
    cuts the same block out of the same lines with :func:`block_of_code`.
    """
    func = inspect.unwrap(function_of(func), stop=lambda f: hasattr(f, PATCH_MARKER))
    code = func.__code__
    # The file as it is now: linecache keeps what it read first, and a module reloaded from
    # changed source must not be judged by its old text (one stat call).
    linecache.checkcache(code.co_filename)
    lines = linecache.getlines(code.co_filename)
    if not lines:
        raise OSError(f"no source available for {func!r} ({code.co_filename})")
    return block_of_code(lines, code)


def block_of_code(lines: list[str], code: CodeType) -> str:
    """The dedented block of ``code`` in its module's ``lines`` (see :func:`source_of`)."""
    end = block_end(code)
    if end is None:  # no line table with end positions (Python < 3.11): tokenize instead
        return block_at(lines, code.co_firstlineno)
    return textwrap.dedent("".join(lines[code.co_firstlineno - 1 : end]))


def block_end(code: CodeType) -> int | None:
    """Last source line of ``code``'s body: the largest end line of any of its instructions,
    nested code (inner functions, comprehensions) included. ``None`` before Python 3.11."""
    if not hasattr(code, "co_positions"):
        return None
    last = code.co_firstlineno
    pending = [code]
    while pending:
        current = pending.pop()
        for _, end_line, _, _ in current.co_positions():
            if end_line is not None and end_line > last:
                last = end_line
        pending.extend(const for const in current.co_consts if isinstance(const, CodeType))
    return last


def block_at(lines: list[str], first_lineno: int) -> str:
    """The dedented block starting at 1-based ``first_lineno`` of ``lines`` (decorators first),
    found by tokenizing: the reference definition :func:`source_of` must agree with."""
    block = inspect.getblock(lines[first_lineno - 1 :])
    return textwrap.dedent("".join(block))


def source_in_module_text(text: str, filename: str, qualname: str) -> str | None:
    """:func:`source_of` for the function ``qualname`` defined in a module's source ``text``,
    without importing it (``scripts/fingerprint_release.py`` reads it from a release wheel).
    ``None`` when the module defines no such function.

    The lines are split as :mod:`linecache` splits them for :func:`source_of` at run time
    (universal newlines, the last line ending in ``\\n``), the code object is the one the
    module creates when it runs (:func:`code_in_module`), and the same :func:`block_of_code`
    cuts the block: both sides hash identical text.
    """
    lines = io.StringIO(text, newline=None).readlines()
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    code = code_in_module(compile("".join(lines), filename, "exec", dont_inherit=True), qualname)
    return None if code is None else block_of_code(lines, code)


def code_in_module(module_code: CodeType, qualname: str) -> CodeType | None:
    """The code object of the function ``qualname`` (``"Class.method"``,
    ``"factory.<locals>.inner"``) inside a compiled module. When the name is defined more than
    once, the last definition in the file wins, as a redefinition does when the module runs (of
    definitions in ``if``/``else`` branches, too: the file does not say which branch runs)."""
    found: CodeType | None = None
    pending: list[tuple[str, CodeType]] = [("", module_code)]
    while pending:
        prefix, current = pending.pop()
        for const in current.co_consts:
            if not isinstance(const, CodeType):
                continue
            # Qualified names as the compiler gives them (co_qualname, Python 3.11+), rebuilt
            # here so that Python 3.10 reads wheels too: a function's children sit in its
            # "<locals>", a class body's and the module's do not.
            name = prefix + const.co_name
            if name == qualname and (found is None or const.co_firstlineno > found.co_firstlineno):
                found = const
            inner = ".<locals>." if const.co_flags & inspect.CO_NEWLOCALS else "."
            pending.append((name + inner, const))
    return found


def fingerprint_source(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def fingerprint(func: Callable[..., Any]) -> str:
    """sha256 of :func:`source_of` ``func``: how patches recognise the exact code they target."""
    return fingerprint_source(source_of(func))


def function_of(raw: Any) -> Any:
    """The function behind a class attribute as found in the class's ``__dict__``: the
    ``__func__`` of a ``staticmethod`` or ``classmethod``, anything else as it is."""
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def wraps(original: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """:func:`functools.wraps` for replacements: keeps name, docstring, signature (``__wrapped__``)."""
    return functools.wraps(original)


def argument_reader(original: Callable[..., Any]) -> Callable[[tuple, Mapping[str, Any], str], Any]:
    """For a wrapper of the method ``original`` that receives ``(self, *args, **kwargs)``: a
    function ``read(args, kwargs, name)`` giving the argument ``name`` wherever the caller put it,
    by keyword or by position (``None`` when the call did not pass it). Built once per target."""
    positional = [
        p.name
        for p in inspect.signature(original).parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ][1:]  # args start after self
    index = {name: i for i, name in enumerate(positional)}

    def read(args: tuple, kwargs: Mapping[str, Any], name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        at = index.get(name)
        return args[at] if at is not None and at < len(args) else None

    return read


# -- the verdict ----------------------------------------------------------------------------
# One pure function says what a patch meets on a release; the engine, the fingerprint tool, the
# test kit and the benchmarks all ask it. States are the words the status table prints.

APPLIED = "applied"  # from assess(): every target is a known original, so the engine swaps them
FIXED_UPSTREAM = "fixed upstream"
OUT_OF_RANGE = "out of range"  # the release is outside the patch's declared range: nothing checked
NOT_INSTALLED = "not installed"  # transformers is not installed: nothing to patch
UNRECOGNISED = "unrecognised code"
FAILED = "failed"
PENDING = "pending"  # version in range; the code has not been read (module not imported yet)

# How one target's code compares with what the patch knows.
ORIGINAL = "original"
FIXED = "fixed"
NEW = "new"  # present, but no known fingerprint
BEFORE = "before"  # code from before the bug arrived (a release older than the patch's range ships it)
MISSING = "missing"
ABSENT_OPTIONAL = "absent (optional)"
UNREADABLE = "unreadable"  # present, but its source cannot be read


@dataclass(frozen=True)
class TargetMatch:
    target: Target
    match: str
    digest: str | None = None
    variant: Variant | None = None
    """The matched variant (``match == ORIGINAL``)."""
    label: str | None = None
    """The variant's or the fixed code's release label."""
    detail: str = ""


@dataclass(frozen=True)
class Verdict:
    state: str
    reason: str
    matches: tuple[TargetMatch, ...] = ()

    @property
    def labels(self) -> tuple[str, ...]:
        """Release labels of the code the decisive targets matched."""
        wanted = {APPLIED: ORIGINAL, OUT_OF_RANGE: BEFORE}.get(self.state, FIXED)
        return tuple(m.label for m in self.matches if m.match == wanted and m.label is not None)


def judge_version(patch: Patch, installed: str | None, distribution: str = "transformers") -> tuple[str, str]:
    """The version half of :func:`assess`: (state, reason); ``PENDING`` means "read the code next"."""
    if installed is None:
        return NOT_INSTALLED, f"{distribution} is not installed"
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        version = Version(installed)
    except InvalidVersion:
        return UNRECOGNISED, (
            f"{distribution} reports version {installed!r}, which is not a PEP 440 version; "
            "reinstall it from a release or set ATTN_OVERLAY_DISABLE to skip this patch"
        )
    try:
        affected = SpecifierSet(patch.affected)
    except InvalidSpecifier as exc:  # a broken patch file, not the user's fault
        return FAILED, f"patch declares an invalid version specifier {patch.affected!r}: {exc}"
    # Dev builds (5.19.0.dev0) and local builds (5.18.0+neuron) are judged by their release
    # number: they carry the same code as far as the fingerprints can tell, and the code check
    # refuses anything that is not the exact original.
    if affected.contains(version, prereleases=True):
        return PENDING, f"{distribution} {installed} is in {patch.affected}"
    if patch.fixed_in is not None and Version(version.base_version) >= Version(patch.fixed_in):
        return FIXED_UPSTREAM, f"{distribution} {installed} includes the upstream fix (since {patch.fixed_in})"
    if patch.introduced_in is not None and version < Version(patch.introduced_in):
        return OUT_OF_RANGE, (
            f"{distribution} {installed} does not have this bug: the code that causes it arrived in {patch.introduced_in}"
        )
    lowest = lowest_release(affected)
    if lowest is not None and version < lowest:
        return OUT_OF_RANGE, (
            f"{distribution} {installed} is older than {lowest}, the oldest release this patch was written for: "
            "not checked (the bug may be there)"
        )
    return OUT_OF_RANGE, f"{distribution} {installed} is outside {patch.affected}, the releases this patch was written for"


def lowest_release(affected: Any) -> Any:
    """The lowest release a ``SpecifierSet`` admits by its ``>=``/``>``/``==``/``~=`` bounds, or
    ``None`` when it has no lower bound."""
    from packaging.version import Version

    bounds = [Version(spec.version) for spec in affected if spec.operator in (">=", ">", "==", "~=", "===")
              and "*" not in spec.version]
    return min(bounds) if bounds else None


def match_target(target: Target, source: str | None) -> TargetMatch:
    """How one target's source (``None``: not defined in this release) compares with the patch."""
    if source is None:
        return TargetMatch(target, ABSENT_OPTIONAL if target.optional else MISSING)
    digest = fingerprint_source(source)
    variant = target.known_variants.get(digest)
    if variant is not None:
        return TargetMatch(target, ORIGINAL, digest, variant, variant.label)
    if digest in target.fixed:
        return TargetMatch(target, FIXED, digest, label=target.fixed[digest])
    if digest in target.before:
        return TargetMatch(target, BEFORE, digest, label=target.before[digest])
    return TargetMatch(target, NEW, digest)


def assess(
    patch: Patch,
    installed: str | None,
    read_source: Callable[[Target], str | None] | None = None,
    *,
    distribution: str = "transformers",
) -> Verdict:
    """What ``patch`` meets on release ``installed``: the one decision, without side effects.

    The version first (:func:`judge_version`); in range, and given ``read_source`` (``target -> source
    text``, ``None`` when the release defines no such function; it may raise ``OSError`` or
    ``TypeError`` for code without readable source), the code of every target
    (:func:`judge_code`). Without ``read_source`` an in-range release stays ``PENDING``.
    """
    state, reason = judge_version(patch, installed, distribution)
    if state != PENDING or read_source is None:
        return Verdict(state, reason)
    return judge_code(patch, read_source)


def judge_code(patch: Patch, read_source: Callable[[Target], str | None]) -> Verdict:
    """The code half of :func:`assess`, whatever the release number says:

    - every present target a known original -> ``APPLIED`` (each match names its variant);
    - else any target new, missing or unreadable -> ``UNRECOGNISED``, naming the first;
    - else any target from before the bug arrived -> ``OUT_OF_RANGE``;
    - else (known fixed code, possibly next to originals) -> ``FIXED_UPSTREAM``.

    The same order as the release facts' verdict per release (:func:`overlay.releases.verdicts`).
    """
    found: list[TargetMatch] = []
    for target in patch.targets:
        try:
            found.append(match_target(target, read_source(target)))
        except (OSError, TypeError) as exc:
            found.append(TargetMatch(target, UNREADABLE, detail=f"cannot read the source of {target.key}: {exc}"))
    matches = tuple(found)
    present = [m for m in matches if m.match != ABSENT_OPTIONAL]
    if present and all(m.match == ORIGINAL for m in present):
        return Verdict(APPLIED, f"patched {', '.join(m.target.key for m in present)}", matches)
    for m in matches:
        if m.match == NEW:  # match_target gives every NEW match its digest (the `or` is for the type)
            return Verdict(UNRECOGNISED, (
                f"{m.target.key} is not the code this patch was written for (sha256 {(m.digest or '')[:12]}); "
                "not patched. If this is a transformers release, report it with the output of `attn-overlay env` "
                f"(docs/releases.md lists the releases each patch knows); ATTN_OVERLAY_DISABLE={patch.id} silences this"
            ), matches)
        if m.match == MISSING:
            return Verdict(UNRECOGNISED, f"{m.target.key} does not exist in this transformers release", matches)
        if m.match == UNREADABLE:
            return Verdict(UNRECOGNISED, m.detail, matches)
    before = [m for m in matches if m.match == BEFORE]
    if before:
        return Verdict(OUT_OF_RANGE, "; ".join(
            f"{m.target.key} is code from before the bug arrived (as in {m.label})" for m in before
        ), matches)
    fixed = [m for m in matches if m.match == FIXED]
    if not fixed:
        return Verdict(UNRECOGNISED, "none of the patch's targets exists in this release", matches)
    return Verdict(
        FIXED_UPSTREAM,
        "; ".join(f"{m.target.key} is already the fixed code (as in {m.label})" for m in fixed),
        matches,
    )
