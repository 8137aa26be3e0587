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
from types import CodeType
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

#: Attribute set on every replacement the engine installs: the id of the patch it belongs to.
PATCH_MARKER = "__overlay_patch__"


@dataclass(frozen=True)
class Target:
    """One function (or method) a patch replaces.

    ``originals`` and ``fixed`` map a sha256 fingerprint (see :func:`fingerprint`) to a label
    naming the releases that ship that exact code, e.g. ``"5.15.0-5.17.0"``. The label is what
    status reports and ``scripts/fingerprint_release.py`` show; it is never parsed.
    """

    module: str
    """Dotted module name the target lives in, e.g. ``"transformers.generation.utils"``."""
    qualname: str
    """Attribute path inside the module, e.g. ``"GenerationMixin.prepare_inputs_for_generation"``."""
    originals: Mapping[str, str]
    """Fingerprints of every known original this patch was written against -> release label."""
    replace: Callable[[Callable[..., Any]], Callable[..., Any]]
    """Builds the replacement from the original function. Must not mutate the original, and
    must not import anything while building: it runs inside the import of the target module
    under the engine's lock, so an import there could deadlock with another thread's import.
    Import what the replacement needs inside the replacement's body."""
    fixed: Mapping[str, str] = field(default_factory=dict)
    """Fingerprints meaning "upstream already ships the fix" -> release label."""
    optional: bool = False
    """When true, a release where the attribute does not exist is fine (target skipped)."""

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


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

    def __post_init__(self) -> None:
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

    The block runs from the code object's first line (the first decorator) to the last line of
    its last statement, exactly what :func:`inspect.getblock` returns (:func:`block_at`). It is
    found from the code object's own line table (:func:`block_end`) instead of by tokenizing, and
    without :func:`inspect.getsource`, which scans ``sys.modules``: both are far too slow for an
    import hook (tens of milliseconds for a long method). ``scripts/fingerprint_release.py``
    reads release wheels without importing them through :func:`source_in_module_text`, which
    cuts the same block out of the same lines with :func:`block_of_code`.
    """
    func = inspect.unwrap(function_of(func), stop=lambda f: hasattr(f, PATCH_MARKER))
    code = func.__code__
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
