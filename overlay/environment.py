"""The bug-report block: ``attn-overlay env`` (also ``python -m overlay.apply --env``).

:func:`collect` returns what a maintainer asks first, as ``key -> text`` in a fixed order:
attn-overlay, transformers, torch and its build (CUDA, ROCm, XPU, and the accelerator plug-ins'
own SDKs where installed: Neuron, CANN, Gaudi, XLA), the libraries that change generation
(accelerate, optimum and its stacks, liger-kernel, flash-attn, kernels), the accelerator torch
sees, Python, the OS, whether the startup hook is active here and installed, one line per patch
(:func:`overlay.status`) and the settings that differ from their default (``overlay/config.py``).
:func:`format_block` writes it as ``- key: value`` lines; ``--json`` prints the same keys as one
object.

It owns the facts about the startup hook here (installed? active? why not?), which ``python -m
overlay.apply`` reports too.

Versions come from package metadata, torch's build from ``torch/version.py``; transformers is
never imported and no model runs. Which accelerator torch sees is the doctor's detection
(:func:`overlay.doctor._env.detect_accelerators`): it imports torch (about a second) and, where an
accelerator plug-in is installed, imports it in a subprocess, as the doctor does (such a device
belongs to one process at a time). Where torch cannot see one (a CPU build, no plug-in, not
macOS), the block says so without importing torch. A probe that fails never raises: its error is
the value.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
from collections.abc import Callable

from . import config, engine
from ._version import __version__

#: The names other modules use; the rest is this module's own.
__all__ = [
    "LIBRARIES", "NOT_INSTALLED", "SHADOW_PREFIX", "cannot_see_an_accelerator", "collect", "distribution_version",
    "CHANGES_KEY", "changes_lines", "format_block", "settings_in_force", "shadow_reason", "startup_hook_lines",
    "startup_hook_watching", "torch_build",
    "why_the_hook_is_inactive",
]

NOT_INSTALLED = "not installed"
CPU_BUILD = "CPU (no CUDA, ROCm or XPU in this build)"

#: Libraries that change what generation does, shown whether installed or not (distribution names).
LIBRARIES = (
    "accelerate",
    "optimum",
    "optimum-neuron",
    "optimum-habana",
    "optimum-intel",
    "optimum-executorch",
    "liger-kernel",
    "flash-attn",
    "kernels",
)

#: The accelerator plug-ins' own distributions, shown only where the plug-in is installed:
#: (module that tells it is there, the distributions to show).
PLUGIN_DISTRIBUTIONS = (
    ("torch_xla", ("torch-xla",)),
    ("torch_neuronx", ("torch-neuronx", "neuronx-cc")),
    ("torch_npu", ("torch-npu",)),
    ("habana_frameworks", ("habana-torch-plugin",)),
)

#: Where a CANN toolkit keeps ``<arch>-linux/ascend_toolkit_install.info`` (its ``version=`` line):
#: what its set_env.sh exports first, then the default install folders (older, then 8.5+ layout).
CANN_HOMES = (
    "$ASCEND_HOME_PATH",
    "$ASCEND_TOOLKIT_HOME",
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/cann",
)

#: How the startup hook's message about a shadowing module begins (``_attn_overlay_startup``).
SHADOW_PREFIX = "attn-overlay: NOT active in this process: "

#: Seconds the accelerator plug-ins' probe may take here (the doctor allows more: it has minutes).
PLUGIN_PROBE_TIMEOUT_S = 60.0

Lines = dict[str, str]


def collect() -> Lines:
    """Every line of the block, in order; never raises (a failing probe's error is its value)."""
    lines: Lines = {}
    for key, probe in (
        ("attn-overlay", overlay_lines),
        ("packages", package_lines),
        ("accelerator", accelerator_lines),
        ("python", python_lines),
        ("startup hook", startup_hook_lines),
        ("patches", patch_lines),
        ("settings", setting_lines),
    ):
        lines.update(_guarded(key, probe))
    return lines


def _guarded(key: str, probe: Callable[[], Lines]) -> Lines:
    try:
        return probe()
    except Exception as exc:  # the block is for a bug report: the error is the answer
        return {key: _error(exc)}


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"error: {type(exc).__name__}" + (f": {text[0]}" if text else "")


def format_block(lines: Lines) -> str:
    """The block as text to paste into an issue: one ``- key: value`` line each."""
    return "\n".join(f"- {key}: {value}" for key, value in lines.items())


# -- the probes ----------------------------------------------------------------------------------


def distribution_version(name: str) -> str:
    """The installed version of distribution ``name``, ``"not installed"``, or the error."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return NOT_INSTALLED
    except Exception as exc:  # broken metadata is worth reporting, not dying for
        return _error(exc)


def overlay_lines() -> Lines:
    # The code that runs, which may not be the distribution installed (a clone's root comes first).
    return {"attn-overlay": f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})"}


def package_lines() -> Lines:
    lines = {name: distribution_version(name) for name in ("transformers", "torch")}
    # The code on the path may not be the distribution installed (a source tree or vendored copy
    # first on the path, a fork with its own version): the patches judge the code, the block shows both.
    code_version = _guarded("transformers.__version__", transformers_code_version)["transformers.__version__"]
    if code_version != lines["transformers"] and code_version != NOT_INSTALLED:
        code_version += " (not the package metadata's: each patch judges the code it finds)"
    lines = {"transformers": lines["transformers"], "transformers.__version__": code_version, "torch": lines["torch"]}
    if lines["torch"] != NOT_INSTALLED:
        lines["torch build"] = _guarded("torch build", torch_build)["torch build"]
    lines.update(_guarded("accelerator plug-ins", plugin_lines))
    lines.update((name, distribution_version(name)) for name in LIBRARIES)
    return lines


def transformers_code_version() -> Lines:
    """``transformers.__version__`` of the transformers the path finds: the imported module's, or
    else read from its ``__init__.py`` without importing it (which takes seconds)."""
    import ast

    module = sys.modules.get("transformers")
    if module is not None and isinstance(getattr(module, "__version__", None), str):
        return {"transformers.__version__": module.__version__}
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return {"transformers.__version__": NOT_INSTALLED}
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), spec.origin)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "__version__" and isinstance(node.value, ast.Constant)):
            return {"transformers.__version__": str(node.value.value)}
    return {"transformers.__version__": f"not found in {spec.origin}"}


def torch_build() -> Lines:
    """What torch was built for, from ``torch/version.py``."""
    build = torch_version_file()
    parts = []
    if build.get("cuda"):
        parts.append(f"CUDA {build['cuda']}")
    if build.get("hip"):
        rocm = build.get("rocm")
        parts.append(f"ROCm {rocm} (HIP {build['hip']})" if rocm else f"ROCm (HIP {build['hip']})")
    if build.get("xpu"):
        parts.append(f"XPU {build['xpu']}")
    return {"torch build": ", ".join(parts) or CPU_BUILD}


def torch_version_file() -> dict[str, object]:
    """The constants of ``torch/version.py`` (``cuda``, ``hip``, ``xpu``...), read without
    importing torch (which costs about a second); where the file is not there, from ``torch.version``."""
    import ast

    spec = importlib.util.find_spec("torch")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, "version.py")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        constants: dict[str, object] = {}
        for node in tree.body:  # `cuda: Optional[str] = None` (annotated) or `__version__ = '2.13.0'`
            target: ast.expr
            value: ast.expr
            if isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            else:
                continue
            if isinstance(target, ast.Name):
                try:
                    constants[target.id] = ast.literal_eval(value)
                except (ValueError, TypeError, SyntaxError):  # a computed value: none of those we read
                    continue
        return constants
    from torch import version

    return {name: getattr(version, name, None) for name in ("__version__", "cuda", "hip", "rocm", "xpu")}


def plugin_lines() -> Lines:
    """The plug-ins' distributions, where the plug-in is installed (found without importing it)."""
    lines: Lines = {}
    for module, distributions in PLUGIN_DISTRIBUTIONS:
        if not _module_installed(module) and all(distribution_version(d) == NOT_INSTALLED for d in distributions):
            continue
        for name in distributions:
            lines[name] = distribution_version(name)
        if lines[distributions[0]] == NOT_INSTALLED and _module_installed(module):  # built from source?
            lines[distributions[0]] = f"no package metadata ({module} is importable)"
        if module == "torch_npu":
            lines["CANN"] = _guarded("CANN", cann_lines)["CANN"]
    return lines


def _module_installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cann_lines() -> Lines:
    """The CANN toolkit's version, read from its install record (importing torch_npu takes seconds)."""
    for home in CANN_HOMES:
        folder = os.path.expandvars(home)
        if folder.startswith("$"):  # the variable is not set
            continue
        record = os.path.join(folder, f"{platform.machine()}-linux", "ascend_toolkit_install.info")
        if not os.path.isfile(record):
            continue
        with open(record, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.strip().partition("=")
                if key == "version" and value:
                    return {"CANN": f"{value} ({record})"}
    return {"CANN": "no toolkit install record found (ASCEND_HOME_PATH unset? source the toolkit's set_env.sh)"}


def accelerator_lines() -> Lines:
    """The accelerators torch sees, as the doctor finds them (no model runs); where torch cannot
    see one (a CPU build, no plug-in, not macOS), said without importing torch."""
    if not _module_installed("torch"):
        return {"accelerator": "unknown: torch is not installed"}
    from .doctor import _env

    # An imported torch is asked in any case (it costs nothing more).
    if "torch" not in sys.modules and cannot_see_an_accelerator(_env.installed_plugins()):
        return {"accelerator": "none: a CPU build of torch, and no accelerator plug-in installed"}
    found, problems = _env.detect_accelerators(probe_timeout=PLUGIN_PROBE_TIMEOUT_S)
    groups: dict[tuple[str, str], list[str]] = {}
    for accelerator in found:
        groups.setdefault((accelerator.type, accelerator.name), []).append(accelerator.device)
    described = [
        f"{name} ({devices[0]})" if len(devices) == 1 else f"{len(devices)} x {name} ({devices[0]} ... {devices[-1]})"
        for (_, name), devices in groups.items()
    ]
    lines = {"accelerator": "; ".join(described) or "none found (the doctor would use its host-memory fake device)"}
    if problems:
        lines["accelerator problems"] = "; ".join(problems)
    return lines


def cannot_see_an_accelerator(plugins: list[str]) -> bool:
    """Whether this torch cannot see any accelerator, so that the block need not import it: built
    for the CPU only, not on macOS (MPS), no plug-in installed (:data:`overlay.doctor._env.PLUGINS`)
    and none that torch loads by itself (its ``torch.backends`` entry points)."""
    from importlib.metadata import entry_points

    if plugins or sys.platform == "darwin":
        return False
    if torch_build()["torch build"] != CPU_BUILD:
        return False
    return not list(entry_points(group="torch.backends"))


def python_lines() -> Lines:
    return {
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "os": f"{platform.platform()}, {os.cpu_count()} CPUs",
    }


def startup_hook_lines() -> Lines:
    return {
        "startup hook active": _guarded("startup hook active", _hook_active)["startup hook active"],
        "startup hook installed": _guarded("startup hook installed", _hook_installed)["startup hook installed"],
    }


def startup_hook_watching() -> bool:
    """Whether the startup hook's one watch, on ``transformers``, is on its finder in this process
    (it stays there after it activated the overlay). Reads, never imports, ``_attn_overlay_startup``:
    importing it is what installs the hook."""
    startup = sys.modules.get("_attn_overlay_startup")
    finder = startup.finder() if startup is not None else None
    watches = finder.watched().get(engine.TRANSFORMERS, ()) if finder is not None else ()
    return startup is not None and any(hook is startup.activate_when_transformers_is_imported for hook in watches)


def _hook_active() -> Lines:
    """Whether the startup hook ran in this process: the interpreter read attn_overlay.pth at start,
    and the hook's one watch, on ``transformers``, is on its finder (it stays there after it
    activated the overlay). Importing the startup module sets that watch too (``overlay.apply()``
    does, in a source tree or an editable install): without the .pth, that is not the hook."""
    startup = sys.modules.get("_attn_overlay_startup")
    watching = startup_hook_watching()
    read_at_start = not sys.flags.no_site and installed_pth() is not None
    if watching and read_at_start and config.auto_enabled():
        if engine.is_active():
            return {"startup hook active": "yes: it activated the overlay (transformers is imported)"}
        if engine.TRANSFORMERS in sys.modules:
            why = engine.activation_error() or "reverted since, or left out (overlay.revert(), ATTN_OVERLAY_DISABLE)"
            return {"startup hook active": f"yes, but the overlay is not active: {why}"}
        return {"startup hook active": "yes: waiting for `import transformers`"}
    # The check imports the startup module to look for a shadowing overlay.py; where no .pth
    # imported it, that import would install the very hook this line reports missing.
    why = why_the_hook_is_inactive(look_for_shadowing=startup is not None)
    if engine.is_active():
        return {"startup hook active": f"no, the overlay was applied explicitly (overlay.apply()); the hook: {why}"}
    return {"startup hook active": f"no: {why}"}


def _hook_installed() -> Lines:
    pth = installed_pth()
    if pth is not None:
        return {"startup hook installed": f"yes: {pth}"}
    if editable_install():
        return {"startup hook installed": "no: an editable install (pip install -e) ships no attn_overlay.pth"}
    return {"startup hook installed": "no: no attn_overlay.pth in this environment's site-packages"}


# -- the startup hook in this environment (python -m overlay.apply says why too) ------------------------


def why_the_hook_is_inactive(look_for_shadowing: bool = True) -> str:
    """The likeliest real cause, checked in this order; the first that holds is the answer.

    ``look_for_shadowing=False`` skips importing the startup module (which installs the hook)."""
    if not config.auto_enabled():
        return f"{config.ENABLE_VAR}={os.environ.get(config.ENABLE_VAR)} is set: the startup hook is turned off"
    if sys.flags.no_site:
        # Only -S: -I (isolated mode) skips the user site and PYTHON* variables, but still reads
        # site-packages' .pth files, so the hook runs there.
        return (
            "python was started with -S: it reads no site-packages .pth file, so the startup hook never "
            "runs (-I, isolated mode, does read them)"
        )
    try:
        if look_for_shadowing:
            import _attn_overlay_startup as startup

            shadow = startup.shadowing_module()
            if shadow:
                return shadow_reason(shadow)
    except ImportError:
        pass
    pth = installed_pth()
    if pth is None:
        on_path = [p for p in sys.path if p and os.path.isfile(os.path.join(p, "attn_overlay.pth"))]
        if on_path:
            return (
                f"attn_overlay.pth is in {on_path[0]}, which is on sys.path but not a site directory "
                "(`pip install --target` + PYTHONPATH?): Python reads .pth files only in site directories. "
                "Install attn-overlay into the environment itself, or run programs with `python -m overlay.apply PROGRAM.py`"
            )
        if editable_install():
            return (
                "attn-overlay is installed in editable mode (`pip install -e`), which does not ship the "
                "startup file attn_overlay.pth; install it as a regular package (`pip install .`)"
            )
        return (
            "attn-overlay is not installed in this environment (no attn_overlay.pth in its site-packages); "
            "`pip install attn-overlay` (or `pip install .` in a clone)"
        )
    return f"the startup hook ({pth}) did not activate; see the activation error above, if any"


def shadow_reason(message: str) -> str:
    """The startup hook's line about a shadowing module, as the report's reason."""
    return message.removeprefix(SHADOW_PREFIX).removeprefix("attn-overlay: ")


def installed_pth() -> str | None:
    """The startup file ``attn_overlay.pth`` in a site directory of this interpreter, or ``None``."""
    import site

    folders = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    for folder in folders:
        candidate = os.path.join(folder, "attn_overlay.pth")
        if os.path.isfile(candidate):
            return candidate
    return None


def editable_install() -> bool:
    """Whether attn-overlay is installed with ``pip install -e`` (which ships no startup file)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        direct_url = distribution("attn-overlay").read_text("direct_url.json") or ""
    except PackageNotFoundError:
        return False
    try:
        return bool(json.loads(direct_url).get("dir_info", {}).get("editable"))
    except ValueError:
        return False


def patch_lines() -> Lines:
    """``<patch id>: <state>`` from :func:`overlay.status`; where the overlay is not active in
    this process, what the version gate says it would be (its code is checked on import)."""
    statuses = engine.status()
    if engine.is_active():
        lines: Lines = {"patches": "the overlay is active in this process: each line is the state in force"}
        lines.update((s.id, f"{s.state}: {s.reason}" if s.state in engine.BAD_STATES else s.state) for s in statuses)
        lines.update(changes_lines())
        return lines
    version = engine.installed_transformers_version()
    patches = {patch.id: patch for patch in engine.known_patches()}
    disabled = config.disabled_patch_ids(list(patches))
    fixes = config.fixes()
    lines = {
        "patches": "the overlay is not active in this process (transformers is not imported here): each line "
        "says what the version gate makes of the installed release (pending: in range, its code is checked "
        "when transformers is imported; `python -m overlay.apply` checks it)"
    }
    for status in statuses:
        if status.id in disabled or config.ALL_PATCHES in disabled:
            would_be = engine.DISABLED
        else:
            would_be = engine.gate(patches[status.id], version)[0]
            if would_be == engine.PENDING and engine.left_out_by_fixes(patches[status.id], fixes) is not None:
                would_be = engine.DISABLED
        lines[status.id] = f"{status.state} (would be: {would_be})"
    lines.update(changes_lines())
    return lines


#: The block's key for what each patch changes (never a patch id: ids have no spaces).
CHANGES_KEY = "what the patches change"


def changes_lines() -> Lines:
    """One line: the patches by what they change (``Patch.changes``), and what
    ``ATTN_OVERLAY_FIXES`` keeps of them."""
    from .patch import CHANGES, CHANGES_BOTH, CHANGES_ERRORS, CHANGES_OUTPUT

    by_kind: dict[str, list[str]] = {kind: [] for kind in CHANGES}
    for patch in engine.known_patches():
        by_kind.setdefault(patch.changes, []).append(patch.id)
    words = {CHANGES_ERRORS: "errors only (calls that raise on stock)",
             CHANGES_OUTPUT: "output (calls that complete on stock)", CHANGES_BOTH: "both"}
    parts = [f"{words.get(kind, kind)}: {', '.join(ids) or 'none'}" for kind, ids in by_kind.items()]
    fixes = config.fixes()
    kept = "all apply" if fixes == config.FIXES_ALL else "only the errors-only ones apply"
    return {CHANGES_KEY: "; ".join(parts) + f" ({config.FIXES_VAR}={fixes}: {kept})"}


def settings_in_force() -> list[config.Value]:
    """Every setting's value, ``ATTN_OVERLAY_DISABLE``'s ids checked against the patch files."""
    try:
        known = [patch.id for patch in engine.known_patches()]
    except Exception:  # a broken patch file: its status says so; ids go unchecked
        known = None
    return config.in_force(known)


def setting_lines() -> Lines:
    """The settings whose value in force differs from the default, as the environment spells them."""
    changed: Lines = {}
    for value in settings_in_force():
        if value.source != config.FROM_ENVIRONMENT:
            continue
        if value.value == value.setting.default and not (value.problem or value.note):
            continue
        text = (value.raw or "").strip()
        for message in (value.problem, value.note):
            if message:
                text += f" ({message.removeprefix('attn-overlay: ')})"
        changed[value.setting.name] = text
    summary = ", ".join(changed) + " differ from the default" if changed else "every one at its default"
    return {"settings": summary, **changed}
