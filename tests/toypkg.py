"""A throwaway installed distribution for the engine's tests: a package with a version in its
metadata and a module with functions to patch, written to a temporary directory on sys.path."""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass

from overlay.patch import Patch, Target, block_at, fingerprint_source

_counter = itertools.count()

CORE_SOURCE = '''\
class Mixin:
    def compute(self, x):
        """Adds one (the bug: should add two)."""
        return x + 1

    @staticmethod
    def scale(x):
        return x * 10


def helper(x):
    return x - 1
'''

FIXED_COMPUTE = CORE_SOURCE.replace(
    '''"""Adds one (the bug: should add two)."""
        return x + 1''',
    '''"""Adds two: fixed upstream."""
        return x + 2''',
)


@dataclass
class ToyPackage:
    name: str
    root: str
    module: str  # "<name>.core"

    def fingerprint(self, qualname_line: str, source: str = CORE_SOURCE) -> str:
        lines = source.splitlines(keepends=True)
        lineno = next(i for i, line in enumerate(lines, 1) if line.strip().startswith(qualname_line))
        # Decorators belong to the block, as in overlay.patch.source_of.
        while lineno > 1 and lines[lineno - 2].strip().startswith("@"):
            lineno -= 1
        return fingerprint_source(block_at(lines, lineno))

    def import_core(self):
        import importlib

        return importlib.import_module(self.module)

    def forget(self) -> None:
        for mod in [m for m in sys.modules if m == self.name or m.startswith(self.name + ".")]:
            del sys.modules[mod]


def make_toy_package(tmp_path, version: str = "1.5.0", source: str = CORE_SOURCE) -> ToyPackage:
    name = f"toylib_{os.getpid()}_{next(_counter)}"
    root = tmp_path / f"site_{name}"
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text(source)
    dist = root / f"{name}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    sys.path.insert(0, str(root))
    return ToyPackage(name=name, root=str(root), module=f"{name}.core")


def add_two(original, variant):
    from overlay.patch import wraps

    @wraps(original)
    def compute(self, x):
        return original(self, x) + 1

    return compute


def toy_patch(toy: ToyPackage, *, affected=">=1.0,<2.0", fixed_in="2.0", replace=add_two,
              originals=None, fixed=None, extra_targets=(), patch_id="toy-add-two") -> Patch:
    if originals is None:
        originals = {toy.fingerprint("def compute"): "1.x"}
    if fixed is None:
        fixed = {toy.fingerprint("def compute", FIXED_COMPUTE): "2.x"}
    return Patch(
        id=patch_id,
        title="compute adds two",
        errors=("AssertionError: 2 != 3",),
        why="compute adds one",
        upstream="toylib#1",
        affected=affected,
        fixed_in=fixed_in,
        targets=(Target(module=toy.module, qualname="Mixin.compute", originals=originals,
                        fixed=fixed, replace=replace), *extra_targets),
    )


def scale_target(toy: ToyPackage, replace) -> Target:
    """A second target in the same module: the static method ``Mixin.scale``."""
    return Target(module=toy.module, qualname="Mixin.scale", originals={toy.fingerprint("@staticmethod"): "1.x"},
                  replace=replace)


def remove_from_path(toy: ToyPackage) -> None:
    toy.forget()
    if toy.root in sys.path:
        sys.path.remove(toy.root)
    import importlib

    importlib.invalidate_caches()


__all__ = ["make_toy_package", "toy_patch", "scale_target", "add_two", "remove_from_path", "CORE_SOURCE", "FIXED_COMPUTE"]


def run_in_threads(worker, count: int, timeout: float = 30.0) -> None:
    """Start ``count`` threads running ``worker`` at once and wait for each (``timeout`` seconds)."""
    import threading

    threads = [threading.Thread(target=worker) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
