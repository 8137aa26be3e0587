"""What the doctor runs on: package versions, the accelerators torch sees, the device to use.

The parent process looks at CUDA, XPU and MPS itself: asking does not lock those devices.
Accelerators that come as torch plug-ins (``torch_xla`` for TPUs, ``torch_neuronx`` for AWS
Trainium/Inferentia, ``torch_npu`` for Ascend, ``habana_frameworks.torch`` for Intel Gaudi) are
probed in a short subprocess instead: a TPU, a NeuronCore or a Gaudi card belongs to one process
at a time, and the parent must not hold it while the scenario subprocesses need it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Distributions whose versions the report shows (``None`` when not installed).
PACKAGES = (
    "torch", "transformers", "accelerate", "torch-neuronx", "torch-xla", "torch-npu", "habana-torch-plugin",
    "attn-overlay",
)

#: Torch plug-ins that add an accelerator when imported: module name -> what it is for.
PLUGINS = {
    "torch_npu": "Ascend NPU",
    "torch_neuronx": "AWS Neuron",
    "torch_xla": "XLA (TPU, Neuron)",
    "habana_frameworks.torch": "Intel Gaudi (HPU)",
}

#: Order of preference when several accelerators are present (by device type).
PREFERENCE = ("cuda", "xpu", "npu", "hpu", "neuron", "privateuse1", "xla", "mps")

PROBE_TIMEOUT_S = 180.0


class DeviceChoiceError(ValueError):
    """``--device`` names something this machine does not have."""


class MissingDependencyError(ImportError):
    """torch or transformers cannot be imported here: the doctor cannot run (exit code 3)."""


#: What the doctor needs in the environment it runs in (import name -> distribution name).
REQUIRED = {"torch": "torch", "transformers": "transformers"}


def check_dependencies() -> None:
    """Raises :class:`MissingDependencyError`, with one line saying what is missing and what to
    install, unless torch imports and transformers is installed. Imports torch (the doctor
    needs it next anyway), not transformers: the parent process never imports it, the scenario
    subprocesses do."""
    missing: list[str] = []
    broken: list[str] = []
    for module in REQUIRED:
        try:
            if module == "torch":
                importlib.import_module(module)
            elif importlib.util.find_spec(module) is None:
                missing.append(module)
        except ModuleNotFoundError as exc:
            if exc.name in (None, module):
                missing.append(module)
            else:  # installed, but something it imports is not
                broken.append(f"{module} ({type(exc).__name__}: {exc})")
        except Exception as exc:  # an installed package that does not import
            lines = str(exc).strip().splitlines()
            what = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
            broken.append(f"{module} ({what})")
    if not missing and not broken:
        return
    python = f"the Python at {sys.executable}"
    if not missing:
        raise MissingDependencyError(
            f"cannot run here: {' and '.join(broken)} does not import with {python}; repair or reinstall it"
        )
    versions = {name: _installed_version(REQUIRED[name]) for name in REQUIRED if name not in missing}
    installed = [f"{name} {v}" for name, v in versions.items() if v]
    pins = " ".join(f'"{REQUIRED[name]}==<the release you use>"' for name in missing)
    text = (
        f"cannot run here: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
        f"for {python} (the doctor runs tiny models with torch and transformers); install "
        f"{'it' if len(missing) == 1 else 'them'}, pinned"
        + (f" to go with {', '.join(installed)}" if installed else "")
        + f": pip install {pins}"
    )
    if broken:
        text += f"; also, {' and '.join(broken)} does not import"
    raise MissingDependencyError(text)


def _installed_version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


@dataclass
class Accelerator:
    device: str  # e.g. "cuda:0", "xla:0", "neuron:0"
    type: str
    name: str
    plugins: list[str] = field(default_factory=list)  # modules a process must import to use it

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "type": self.type, "name": self.name, "plugins": list(self.plugins)}


@dataclass
class DeviceChoice:
    device: str
    kind: str  # "accelerator" | "fake" | "cpu"
    description: str
    plugins: list[str] = field(default_factory=list)
    fake_name: str | None = None
    fake_backend: str | None = None
    # The fake device's implementation, as installed here: see fake_device_summary().
    fake_details: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "kind": self.kind,
            "description": self.description,
            "plugins": list(self.plugins),
            "fake_device": None
            if self.fake_name is None
            else {"name": self.fake_name, "backend": self.fake_backend, **self.fake_details},
            "notes": list(self.notes),
        }


def package_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    if found["attn-overlay"] is None:  # a plain checkout on sys.path
        from overlay._version import __version__

        checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        found["attn-overlay"] = f"{__version__} (not installed: {checkout})"
    return found


def python_description() -> str:
    return f"{platform.python_version()} ({sys.executable})"


def platform_description() -> str:
    return f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} CPUs"


# -- detection -------------------------------------------------------------------------------


def detect_accelerators(
    probe_plugins: bool = True, probe_timeout: float = PROBE_TIMEOUT_S
) -> tuple[list[Accelerator], list[str]]:
    """(accelerators found, problems met while looking). Imports torch in this process; the
    plug-ins installed (:data:`PLUGINS`) are imported in a subprocess that gets ``probe_timeout`` s."""
    import torch

    found: list[Accelerator] = []
    problems: list[str] = []

    try:
        if torch.cuda.is_available():
            flavour = "ROCm" if getattr(torch.version, "hip", None) else "CUDA"
            for index in range(torch.cuda.device_count()):
                found.append(Accelerator(f"cuda:{index}", "cuda", f"{torch.cuda.get_device_name(index)} ({flavour})"))
    except Exception as exc:  # a broken driver is worth saying, not dying for
        problems.append(f"cuda: {type(exc).__name__}: {exc}")

    try:
        xpu = getattr(torch, "xpu", None)
        if xpu is not None and xpu.is_available():
            for index in range(xpu.device_count()):
                found.append(Accelerator(f"xpu:{index}", "xpu", xpu.get_device_name(index)))
    except Exception as exc:
        problems.append(f"xpu: {type(exc).__name__}: {exc}")

    try:
        if torch.backends.mps.is_available():
            found.append(Accelerator("mps:0", "mps", "Apple Metal (MPS)"))
    except Exception as exc:
        problems.append(f"mps: {type(exc).__name__}: {exc}")

    # A PrivateUse1 backend registered without any plug-in import (built into this torch).
    name = torch._C._get_privateuse1_backend_name()
    if name != "privateuseone":
        module = getattr(torch, name, None)
        count = _device_count(module)
        for index in range(count):
            found.append(Accelerator(f"{name}:{index}", name, f"{name} (PrivateUse1 backend)"))

    if probe_plugins:
        plugins = installed_plugins()
        if plugins:
            more, trouble = _probe_plugins(plugins, probe_timeout)
            found += more
            problems += trouble
    return found, problems


def installed_plugins() -> list[str]:
    """The modules of :data:`PLUGINS` this environment has, without importing them (a dotted name
    imports its parent package, ``habana_frameworks``, only)."""
    found = []
    for module in PLUGINS:
        top = module.partition(".")[0]
        try:
            if importlib.util.find_spec(top) is not None and importlib.util.find_spec(module) is not None:
                found.append(module)
        except (ImportError, ValueError):  # a parent package that does not import: not usable here
            continue
    return found


def _device_count(module: Any) -> int:
    if module is None:
        return 0
    try:
        if hasattr(module, "device_count"):
            return int(module.device_count())
        if hasattr(module, "is_available"):
            return 1 if module.is_available() else 0
    except Exception:
        return 0
    return 0


# Runs in a subprocess: imports each plug-in, reports the devices it adds, exits (releasing them).
_PROBE_CODE = r"""
import importlib, json, sys
import torch
found, problems, imported = [], [], []
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
        imported.append(module)
    except Exception as exc:
        problems.append(f"{module}: cannot import: {type(exc).__name__}: {exc}")

def count(mod):
    try:
        if hasattr(mod, "device_count"):
            return int(mod.device_count())
        return 1 if mod.is_available() else 0
    except Exception:
        return 0

if "torch_npu" in imported and hasattr(torch, "npu"):
    try:
        for i in range(count(torch.npu)):
            found.append({"device": f"npu:{i}", "type": "npu", "name": torch.npu.get_device_name(i), "plugins": ["torch_npu"]})
    except Exception as exc:
        problems.append(f"npu: {type(exc).__name__}: {exc}")
# Gaudi's plug-in registers torch.hpu (HPU is a device type of torch itself, not PrivateUse1).
if "habana_frameworks.torch" in imported and hasattr(torch, "hpu"):
    try:
        for i in range(count(torch.hpu)):
            card = f"{torch.hpu.get_device_name(i)} (Intel Gaudi)"
            found.append({"device": f"hpu:{i}", "type": "hpu", "name": card, "plugins": ["habana_frameworks.torch"]})
    except Exception as exc:
        problems.append(f"hpu: {type(exc).__name__}: {exc}")
name = torch._C._get_privateuse1_backend_name()
if name not in ("privateuseone", "npu"):
    plugins = [m for m in imported if m not in ("torch_xla", "habana_frameworks.torch")]
    for i in range(count(getattr(torch, name, None))):
        label = f"{name} (PrivateUse1, via {', '.join(plugins) or 'torch'})"
        found.append({"device": f"{name}:{i}", "type": name, "name": label, "plugins": plugins})
if "torch_xla" in imported:
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        device = torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()
        hardware = xm.xla_device_hw(device)
        plugins = ["torch_xla"] + [m for m in imported if m == "torch_neuronx"]
        found.append({"device": str(device), "type": "xla", "name": f"XLA ({hardware})", "plugins": plugins})
    except Exception as exc:
        problems.append(f"xla: {type(exc).__name__}: {exc}")
print(json.dumps({"found": found, "problems": problems}))
"""


def _probe_plugins(plugins: list[str], timeout: float = PROBE_TIMEOUT_S) -> tuple[list[Accelerator], list[str]]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE_CODE, *plugins],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, ATTN_OVERLAY="0"),
        )
    except subprocess.TimeoutExpired:
        return [], [f"probing {', '.join(plugins)} did not finish in {timeout:.0f} s"]
    try:
        data = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return [], [f"probing {', '.join(plugins)} failed (exit {done.returncode}): {tail[0]}"]
    return [Accelerator(**a) for a in data["found"]], list(data["problems"])


# -- choosing the device -----------------------------------------------------------------------

FAKE_NOTE = (
    "no accelerator found: running on the host-memory fake device `{name}`, which reproduces "
    "device-placement bugs, not performance"
)
CPU_NOTE = (
    "--device cpu: the model and the host-side inputs share one device, so the host-input "
    "scenario cannot reproduce the device-placement bug here (it passes with and without the "
    "overlay); leave out --device to use an accelerator, or pass --device fake to use the "
    "host-memory fake device"
)


def choose_device(
    requested: str | None,
    accelerators: list[Accelerator],
    *,
    local_rank: int = 0,
    prepare_fake: bool = True,
    announce: Callable[[str], None] | None = None,
) -> DeviceChoice:
    """The device the scenarios run on. ``requested`` is ``--device``: ``None`` (best found,
    else the fake device), ``cpu``, ``fake`` / ``fake:NAME`` / ``fakeaccel``, or a device
    type with an optional index (``cuda``, ``cuda:1``, ``xla``, ``neuron``...)."""
    from overlay.testing import DEFAULT_DEVICE_NAME

    if requested is None:
        if accelerators:
            best = min(
                accelerators,
                key=lambda a: (PREFERENCE.index(a.type) if a.type in PREFERENCE else len(PREFERENCE), a.device),
            )
            # Under torchrun, rank N's device is index LOCAL_RANK of the same type.
            same_type = [a for a in accelerators if a.type == best.type]
            pick = next((a for a in same_type if a.device.endswith(f":{local_rank}")), best)
            return DeviceChoice(pick.device, "accelerator", pick.name, plugins=list(pick.plugins))
        return _fake_choice(DEFAULT_DEVICE_NAME, prepare_fake, no_accelerator=True, announce=announce)

    text = requested.strip().lower()
    if text == "cpu":
        return DeviceChoice("cpu", "cpu", "the CPU (host memory)", notes=[CPU_NOTE])
    if text in ("fake", DEFAULT_DEVICE_NAME) or text.startswith("fake:"):
        name = text.split(":", 1)[1] if text.startswith("fake:") else DEFAULT_DEVICE_NAME
        return _fake_choice(name, prepare_fake, no_accelerator=not accelerators, announce=announce)

    device_type, _, index_text = text.partition(":")
    if index_text and not index_text.isdigit():
        raise DeviceChoiceError(f"--device {requested!r}: the index must be a number, e.g. {device_type}:0")
    index = int(index_text) if index_text else local_rank
    same_type = [a for a in accelerators if a.type == device_type]
    wanted = f"{device_type}:{index}"
    for accelerator in same_type:
        if accelerator.device == wanted:
            return DeviceChoice(accelerator.device, "accelerator", accelerator.name, plugins=list(accelerator.plugins))
    if same_type and not index_text:
        first = same_type[0]
        return DeviceChoice(first.device, "accelerator", first.name, plugins=list(first.plugins))
    present = ", ".join(a.device for a in accelerators) or "no accelerator"
    import torch

    # The fake device can take the name of a device torch does not know itself (neuron, xla, ...),
    # which exercises code that looks at device.type; torch's own names (cuda, mps) are taken.
    fake = f"fake:{device_type}" if device_type.isidentifier() and not hasattr(torch, device_type) else "fake"
    raise DeviceChoiceError(
        f"--device {requested!r}: not found on this machine (found: {present}). Use --device cpu, "
        f"or --device {fake} to run on the host-memory fake device"
    )


def _fake_choice(
    name: str, prepare: bool, *, no_accelerator: bool, announce: Callable[[str], None] | None = None
) -> DeviceChoice:
    """The fake device, built (or loaded from its cache) here once, so that the scenario
    subprocesses only load it."""
    backend = None
    notes = [FAKE_NOTE.format(name=name)] if no_accelerator else [
        f"--device fake: running on the host-memory fake device `{name}`, which reproduces "
        "device-placement bugs, not performance"
    ]
    if prepare:
        from overlay.testing import fake_device_backend, install_fake_device

        if announce is not None:
            announce(
                f"preparing the host-memory fake device `{name}` (compiled once per machine and torch "
                "version, about a minute the first time)"
            )
        try:
            install_fake_device(name)
        except Exception as exc:
            raise DeviceChoiceError(f"the host-memory fake device `{name}` is not available here: {exc}") from exc
        backend = fake_device_backend()
    details = fake_device_summary() if prepare else {}
    in_words = {"cpp": ", C++ backend", "python": ", pure-Python backend"}.get(backend or "", "")
    description = "host-memory fake device" + in_words
    return DeviceChoice(
        f"{name}:0", "fake", description, fake_name=name, fake_backend=backend, fake_details=details, notes=notes
    )


def fake_device_summary() -> dict[str, Any]:
    """The installed fake device's implementation, for the report: ``library`` (the cached C++
    library, or None), ``fallback_reason`` (why the pure-Python backend: no C++ compiler, ninja
    missing, the cache folder not writable, the compiler's first error...), ``backend_text``
    (both in words), ``cache_dir`` (attn-overlay's cache folder) and ``cache_bytes`` (what it
    holds now; None when it does not exist)."""
    from overlay.testing.fake_device import cache_root, fake_device_details

    details = fake_device_details() or {}
    if details.get("backend") == "cpp":
        library = details.get("library")
        text = f"C++ backend (cached in {os.path.dirname(library)})" if library else "C++ backend"
    else:
        text = f"pure-Python backend, because {details.get('fallback_reason') or 'the C++ backend was not used'}"
    root = cache_root()
    return {
        "library": details.get("library"),
        "fallback_reason": details.get("fallback_reason"),
        "backend_text": text,
        "cache_dir": str(root),
        "cache_bytes": _folder_bytes(root),
    }


def _folder_bytes(folder: Any) -> int | None:
    """What the files under ``folder`` hold, in bytes; None when there is no such folder."""
    if not os.path.isdir(folder):
        return None
    total = 0
    for path, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(path, name)).st_size
            except OSError:
                pass
    return total
