"""The import drawing of the package: every arrow runs down a floor, never along one or back up.

Floors, top to bottom:
  12 ``overlay/__init__`` (the public API facade), ``overlay/apply.py`` and ``__main__`` (``-m`` entries),
     and the pytest entry point ``_attn_overlay_pytest``
  11 the command line and the pytest plugin: ``overlay.cli``, ``overlay.pytest_plugin``
  10 the install check: ``overlay.install_check`` (the report, and whether the startup hook
     activates the overlay) and the child program it runs by path, ``overlay._verify_child``
  9  the bug-report block: ``overlay.environment``
  8  the doctor: ``overlay.doctor``
  7  the test kit: ``overlay.testing``
  6  the engine: ``overlay.engine`` (gates, applies, reverts: knows no single patch)
  5  the engine's mechanics, which decide nothing: ``overlay.swapping`` (swapping a target for a
     replacement, layering replacements and taking layers off) and ``overlay.import_watch``
     (waiting for target modules on the startup hook's finder)
  4  the registry: ``overlay.registry`` (which patch files ship)
  3  the patch files: ``overlay.patches`` (data and replacements; they import leaves only)
  2  the release facts: ``overlay.releases`` (builds a patch file's ``PATCH`` from ``patches/releases.json``)
  1  leaves: ``overlay.patch`` (the patch format and the verdict),
     ``overlay.report``, ``overlay.guard``, ``overlay.tree_move``, ``overlay.call_forwarding``,
     ``overlay.call_scope`` (the per-call decision on ``generate()``),
     ``overlay._version``, ``overlay._patch_files`` (where the patch files are, in either layout)
     (and the startup modules ``_attn_overlay_startup`` and ``_attn_overlay_finder``)
  0  the settings table: ``overlay.config`` (imports nothing of the package; the guard reads its mode there)
A module imports only modules on lower floors. The one exception is a subpackage's own modules
(``overlay.doctor._runner`` importing ``overlay.doctor._scenarios``): one unit, one floor.
Importing the facade's attributes (``import overlay`` then ``overlay.x``, ``from overlay import
apply``) from inside the package is an arrow up.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FLOORS = {
    "overlay": 12, "overlay.apply": 12, "overlay.__main__": 12, "_attn_overlay_pytest": 12,
    "overlay.cli": 11, "overlay.pytest_plugin": 11,
    "overlay.install_check": 10, "overlay._verify_child": 10,
    "overlay.environment": 9,
    "overlay.doctor": 8,
    "overlay.testing": 7,
    "overlay.engine": 6,
    "overlay.swapping": 5, "overlay.import_watch": 5,
    "overlay.registry": 4,
    "overlay.patches": 3,
    "overlay.releases": 2,
    "overlay.config": 0,
    "overlay.patch": 1, "overlay.report": 1, "overlay.guard": 1, "overlay.tree_move": 1,
    "overlay.call_forwarding": 1, "overlay.call_scope": 1,
    "overlay._version": 1, "overlay._patch_files": 1, "_attn_overlay_startup": 1, "_attn_overlay_finder": 1,
}
#: Subpackages whose modules may import each other (one unit on one floor).
UNITS = ("overlay.doctor", "overlay.testing", "overlay.patches")


def _floor(module: str) -> int:
    while module not in FLOORS:
        module = module.rpartition(".")[0]
    return FLOORS[module]


def _modules():
    for path in sorted((REPO / "overlay").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, path.name == "__init__.py"
    for path in sorted((REPO / "patches").glob("*.py")):
        stem = path.stem
        yield ("overlay.patches" if stem == "__init__" else f"overlay.patches.{stem}"), path, stem == "__init__"


def _imports(name: str, path: Path, is_package: bool):
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for alias in node.names:
                # `from overlay import engine` imports the submodule overlay.engine
                yield (f"{module}.{alias.name}" if _is_submodule(f"{module}.{alias.name}") else module), node.lineno


def _is_submodule(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "overlay":
        return False
    if parts[:2] == ["overlay", "patches"]:
        base = REPO / "patches" / Path(*parts[2:]) if len(parts) > 2 else REPO / "patches"
    else:
        base = REPO / Path(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def test_no_import_runs_back_up_a_floor():
    upward = []
    for name, path, is_package in _modules():
        for imported, line in _imports(name, path, is_package):
            if not (imported == "overlay" or imported.startswith("overlay.") or imported in ("_attn_overlay_startup", "_attn_overlay_finder")):
                continue
            if imported == name or name.startswith(imported + ".") and imported != "overlay":
                continue  # a package's own parent package, as the import system loads it anyway
            same_unit = any(_in(name, unit) and _in(imported, unit) for unit in UNITS)
            if (_floor(imported) >= _floor(name) and not same_unit) or (imported == "overlay" and name != "overlay"):
                upward.append(f"{path.relative_to(REPO)}:{line}: {name} (floor {_floor(name)}) imports {imported}")
    assert upward == []


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_drawing_catches_an_arrow_along_a_floor():
    # The check itself: the engine importing the registry runs down; the reverse, or the engine
    # importing a sibling floor's module, is refused.
    assert _floor("overlay.engine") > _floor("overlay.registry") > _floor("overlay.patches.device_move")
    assert not any(_in("overlay.engine", unit) and _in("overlay.registry", unit) for unit in UNITS)


def test_the_registry_finds_the_patch_files_itself():
    # The source tree's patches/ is mapped as overlay.patches by a floor-1 module that the
    # registry calls, not by the facade: with the facade's mapping undone, the registry still
    # loads every patch file. (-S: no site, so no editable-install finder and no startup hook.)
    import subprocess
    import sys

    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import overlay\n"
        "for name in [n for n in sys.modules if n.startswith('overlay.patches')]: del sys.modules[name]\n"
        "vars(overlay).pop('patches', None)\n"
        "from overlay.registry import load_patches\n"
        "print(','.join(p.id for p in load_patches()))\n"
    )
    out = subprocess.run([sys.executable, "-S", "-c", script, str(REPO)], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    from overlay.registry import load_patches

    assert out.stdout.strip() == ",".join(p.id for p in load_patches())


def _module_level_imports(name: str, path: Path, is_package: bool):
    """:func:`_imports` run when the module is loaded: those outside any function body."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    in_functions = {
        id(inner)
        for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for inner in ast.walk(node) if inner is not node
    }
    lines = {node.lineno for node in ast.walk(tree)
             if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in in_functions}
    yield from ((imported, line) for imported, line in _imports(name, path, is_package) if line in lines)


def test_what_the_import_hook_loads_imports_no_torch_or_transformers_module():
    # The engine, the registry and the patch files are loaded inside the import of a
    # transformers module, while that thread holds the module's import lock. Were one of them to
    # import a torch or transformers module when loaded, it could close a cycle of import locks
    # with another thread's import (CPython's _DeadlockError), which stock's imports alone never
    # would: tests/engine/test_engine_threads.py counts such a deadlock as stock's own because of
    # this. Their functions import what they need when they run.
    # (overlay.tree_move imports torch, and is imported only inside the replacement that moves.)
    modules = {name: (path, is_package) for name, path, is_package in _modules()}
    pending = ["overlay.engine", "overlay.registry", *(name for name in modules if name.startswith("overlay.patches."))]
    loaded_by_the_hook: set[str] = set()
    while pending:
        name = pending.pop()
        if name in loaded_by_the_hook or name not in modules:
            continue
        loaded_by_the_hook.add(name)
        pending.extend(imported for imported, _ in _module_level_imports(name, *modules[name]) if imported.startswith("overlay"))
    assert {"overlay.patches.kv_cache_dtype", "overlay.patch", "overlay.guard", "overlay._patch_files", "overlay.releases"} <= loaded_by_the_hook
    # Split out of overlay.engine, which imports them when it is loaded: the hook loads them too.
    assert {"overlay.swapping", "overlay.import_watch"} <= loaded_by_the_hook
    assert "overlay.tree_move" not in loaded_by_the_hook
    found = [
        f"{modules[name][0].relative_to(REPO)}:{line}: {imported}"
        for name in sorted(loaded_by_the_hook)
        for imported, line in _module_level_imports(name, *modules[name])
        if imported.split(".")[0] in ("torch", "transformers")
    ]
    assert found == []
