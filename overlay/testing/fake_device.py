"""A second torch device backed by host memory, for catching device-placement bugs on CPU-only CI.

Generation code that works on CPU can still break on an accelerator: a mask, an index or a cache
tensor built on the CPU meets activations on the GPU and the op fails with ``Expected all tensors
to be on the same device``. On a CPU-only machine such bugs are invisible, because every tensor is
on the one device there is. :func:`install_fake_device` gives torch a second device whose tensors
live in ordinary host memory but report their own device (``fakeaccel:0`` by default,
``is_cpu == False``), so the same bugs fail on CPU with PyTorch's own error message, while correct
code computes exactly what it computes on CPU (bit for bit: the CPU kernels do the work).

Usage, e.g. in a pytest fixture or at the top of a test script::

    from overlay.testing import install_fake_device

    device = install_fake_device()            # torch.device("fakeaccel:0")
    # install_fake_device(device_count=2): fakeaccel:0 and fakeaccel:1
    model = model.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    out = model.generate(**inputs, do_sample=False, disable_compile=True)

    # A tensor left on the CPU now fails as it would on a GPU:
    #   RuntimeError: Expected all tensors to be on the same device, but found at least two
    #   devices, fakeaccel:0 and cpu!

Things to know:

* The device is torch's *PrivateUse1* backend under a new name. torch allows renaming it once per
  process: calling :func:`install_fake_device` again with the same name returns the same device;
  another name raises :class:`RuntimeError` (run such a test in a fresh process, e.g. a
  ``subprocess``). Any name torch accepts works, e.g. ``install_fake_device("neuron")`` to
  exercise code paths that look at ``device.type``.
* Two implementations (``backend=``):

  ``"cpp"``
      A small C++ extension (``_fake_device.cpp``) compiled on first use with
      ``torch.utils.cpp_extension`` (needs a C++ compiler and ninja; about a minute). The library
      (a few hundred KiB) is cached per user under ``$ATTN_OVERLAY_CACHE_DIR`` or
      ``$XDG_CACHE_HOME/attn-overlay`` (default ``~/.cache/attn-overlay``, see
      :func:`cache_root`), in ``fake_device/<key>/``, keyed by the torch version and the source,
      so later processes load it in milliseconds. Its sha256 is recorded next to it and checked
      before loading: a broken cache (a truncated or altered library, one that does not load, a
      file where a folder of the cache should be) is deleted and rebuilt, with one warning on
      the ``overlay`` logger naming the path and what was wrong. ``pip uninstall`` leaves that
      folder; delete it by hand (``rm -rf ~/.cache/attn-overlay``). Operators without a kernel
      of their own check devices and then run their CPU kernel on the same memory (torch's
      ``cpu_fallback``), so any dense CPU operator works, autograd included.
  ``"python"``
      No compiler needed: a tensor subclass whose ``__torch_dispatch__`` checks devices and runs
      the CPU kernels on the host tensor it wraps (one Python call per op: several times slower).
      Device tensors are instances of a ``torch.Tensor`` subclass, have no ``data_ptr()`` or
      storage, and ops that check devices themselves (e.g. ``index_copy_``) report the generic
      message instead of their own. ``scaled_dot_product_attention`` under autograd runs torch's
      math decomposition: right gradients, forward values that may differ from CPU in the last
      bits (without autograd, e.g. in ``generate``, results equal the CPU ones bit for bit).
      It has no device allocator (torch accepts one only from C++): ``torch.accelerator``'s
      memory statistics (``memory_allocated``, ``memory_stats``, ``get_memory_info``, ...) are
      replaced by functions that raise :class:`RuntimeError` saying so, ``empty_cache`` is a
      no-op (nothing is cached), ``memory_per_device`` is refused, and torch keeps the current
      device at index 0 (``torch.<name>.set_device(1)`` raises; name indices explicitly).
      accelerate's ``get_max_memory`` then sees no device memory (only ``"cpu"``), so
      ``device_map="auto"`` places nothing on the device: pass explicit device maps.
  ``"auto"`` (default)
      ``"cpp"`` when it builds or is cached, else ``"python"``.

  :func:`fake_device_backend` says which one is installed, :func:`fake_device_details` also
  why (the reason the C++ one was not used) and where the C++ library is cached.
* Device rules follow real accelerators: all tensor arguments of an op must be on one device,
  except zero-dimensional CPU tensors (treated as scalars) and CPU index tensors of advanced
  indexing (``x[idx]``, ``x[idx] = v``). Copies between devices (``.to()``, ``copy_``) work.
* Once installed, the device is torch's current accelerator (``torch.accelerator``), as a GPU
  would be: code that picks "the accelerator" by itself picks it.
* ``install_fake_device(device_count=2)`` gives two devices, ``fakeaccel:0`` and ``fakeaccel:1``
  (up to :data:`MAX_DEVICES`; the default is one), e.g. to test a ``device_map`` spanning two
  accelerators (``accelerate.dispatch_model(model, {"model.layers.0": 0, "model.layers.1": 1,
  ...})``). Tensors on different indices do not mix, as on real accelerators: ``x0 + x1``
  raises ``Expected all tensors to be on the same device, but found at least two devices,
  fakeaccel:0 and fakeaccel:1!``; copies between them work. An index past the last device
  raises ``Invalid device index``. With the C++ backend each thread has a current device
  (``torch.accelerator.set_device_index``, ``torch.fakeaccel.device(1)``), where ``fakeaccel``
  without an index allocates. Random numbers come from the CPU generator, so
  ``torch.manual_seed`` gives the same numbers on every device.
* Memory (C++ backend; torch 2.9 or later, whose ``c10::DeviceAllocator`` torch.accelerator's
  memory functions require): a device allocator counts the bytes each device holds, so
  ``torch.accelerator.memory_allocated`` / ``max_memory_allocated`` / ``memory_stats`` /
  ``reset_peak_memory_stats`` / ``get_memory_info`` (and the same functions on
  ``torch.fakeaccel``, with ``mem_get_info``) report real numbers: a tensor's bytes are counted
  from its allocation to its release. Nothing is cached, so ``empty_cache()`` frees nothing
  and "reserved" equals "allocated". ``get_memory_info`` reports the host's available and total
  memory, or with ``memory_per_device=N`` (bytes) a capacity of N per device (free: N less what
  the device holds), so accelerate's ``infer_auto_device_map`` / ``device_map="auto"`` splits a
  model across the devices. Allocations beyond N are not refused (there is no out-of-memory
  error): without a cache, transformers' allocator warm-up and the weights would hold twice
  what a caching GPU allocator needs. ``memory_per_device`` needs the C++ backend
  (``backend="auto"`` then does not fall back to ``"python"``). accelerate's ``cpu_offload``,
  ``dispatch_model`` and device maps mixing the device with ``"cpu"`` or ``"disk"`` work.
* safetensors accepts only its own device types: ``safe_open(path, device="fakeaccel:0")``
  raises ``device fakeaccel:0 is invalid``. transformers 5 (5.0.0, 5.18.0) opens checkpoints on
  the CPU and moves the tensors, so ``from_pretrained(path, device_map={"": "fakeaccel:0"})``
  works as it is; 4.x (4.55.4, 4.57.6) opens them on the target device and fails. There, load inside
  :func:`safetensors_via_host` (which opens such files on the CPU; transformers then moves each
  tensor to the device), or load to the CPU and call ``model.to(device)``::

      from overlay.testing.fake_device import safetensors_via_host

      with safetensors_via_host():
          model = AutoModelForCausalLM.from_pretrained(path, device_map={"": "fakeaccel:0"})

  Code that calls ``safetensors.torch.load_file(path, device="fakeaccel:0")`` itself fails the
  same way: load with ``device="cpu"`` and move the tensors.
* Pass ``disable_compile=True`` to ``generate``: torch.compile has no backend for this device.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: importing this module must stay cheap
    import torch

__all__ = [
    "DEFAULT_DEVICE_NAME",
    "FakeDeviceUnavailable",
    "install_fake_device",
    "fake_device_available",
    "fake_device_backend",
    "fake_device_details",
    "fake_device_cache_dir",
    "cache_root",
    "safetensors_via_host",
]

DEFAULT_DEVICE_NAME = "fakeaccel"
_BACKENDS = ("auto", "cpp", "python")
_CPP_SOURCE = Path(__file__).with_name("_fake_device.cpp")
_LIBRARY_NAME = "attn_overlay_fake_device"
# Part of the cache key: a change here must not reuse a library built with other flags.
_EXTRA_CFLAGS = ("-O2",)

_log = logging.getLogger(__name__)
_lock = threading.Lock()
# The most devices install_fake_device(device_count=...) accepts (kMaxDevices in the C++ source).
MAX_DEVICES = 16
# What this process installed: {"name": str, "backend": "cpp" | "python", "library": path of
# the C++ library or None, "fallback_reason": why not the C++ backend, or None, "device_count":
# int, "memory_per_device": int or None}; None before.
_installed: dict[str, Any] | None = None


class FakeDeviceUnavailable(RuntimeError):
    """No implementation of the fake device could be installed in this process."""


def install_fake_device(
    name: str = DEFAULT_DEVICE_NAME,
    backend: str = "auto",
    *,
    device_count: int = 1,
    memory_per_device: int | None = None,
) -> torch.device:
    """Install the host-memory device under ``name`` and return ``torch.device(f"{name}:0")``.

    ``backend`` is ``"auto"``, ``"cpp"`` or ``"python"`` (see the module documentation).
    ``device_count`` (1 to :data:`MAX_DEVICES`) devices ``{name}:0`` ... exist;
    ``memory_per_device`` (bytes, C++ backend only) is each device's capacity as memory queries
    report it (total; free is the capacity less what the device holds); None: the host's
    memory. Allocations beyond it are not refused. Idempotent for the same arguments. Raises :class:`RuntimeError` if
    torch's PrivateUse1 backend is already named differently, or the device was installed with
    other arguments, in this process (a fresh process is needed then), and
    :class:`FakeDeviceUnavailable` if the requested backend cannot be installed.
    """
    global _installed
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"device name must be lowercase letters, digits and '_', got {name!r}")
    if isinstance(device_count, bool) or not isinstance(device_count, int) or not 1 <= device_count <= MAX_DEVICES:
        raise ValueError(f"device_count must be an int from 1 to {MAX_DEVICES}, got {device_count!r}")
    if memory_per_device is not None and (
        isinstance(memory_per_device, bool) or not isinstance(memory_per_device, int) or memory_per_device <= 0
    ):
        raise ValueError(f"memory_per_device must be a positive number of bytes or None, got {memory_per_device!r}")
    if memory_per_device is not None and backend == "python":
        raise ValueError(
            "memory_per_device needs the C++ backend: the python backend has no device allocator to enforce "
            "or report a budget (use backend='cpp' or 'auto')"
        )

    import torch

    with _lock:
        current = torch._C._get_privateuse1_backend_name()
        if _installed is not None:
            if _installed["name"] != name:
                raise RuntimeError(
                    f"torch's PrivateUse1 backend is already named {_installed['name']!r} in this "
                    f"process (the fake device was installed under that name) and torch allows "
                    f"renaming it only once per process; install_fake_device({name!r}) needs a "
                    f"fresh process"
                )
            if backend not in ("auto", _installed["backend"]):
                raise RuntimeError(
                    f"the fake device {name!r} is already installed in this process with the "
                    f"{_installed['backend']!r} backend; backend={backend!r} needs a fresh process"
                )
            if (device_count, memory_per_device) != (_installed["device_count"], _installed["memory_per_device"]):
                raise RuntimeError(
                    f"the fake device {name!r} is already installed in this process with "
                    f"device_count={_installed['device_count']}, memory_per_device="
                    f"{_installed['memory_per_device']}; device_count={device_count}, "
                    f"memory_per_device={memory_per_device} needs a fresh process"
                )
            return torch.device(name, 0)
        if current != "privateuseone":
            raise RuntimeError(
                f"torch's PrivateUse1 backend is already named {current!r} in this process (by "
                f"another backend) and torch allows renaming it only once per process; "
                f"install_fake_device({name!r}) needs a fresh process"
            )
        if _is_known_device_type(torch, name):
            raise ValueError(f"{name!r} is one of torch's own device types; choose another device name")
        if hasattr(torch, name) or hasattr(torch.Tensor, name) or hasattr(torch.Tensor, f"is_{name}"):
            raise ValueError(f"{name!r} is already an attribute of torch; choose another device name")

        failures: list[str] = []
        chosen = None
        library: Path | None = None
        fallback_reason = "backend='python' was requested" if backend == "python" else None
        if memory_per_device is not None and backend == "auto":
            backend = "cpp"  # only the C++ backend has a budget: no silent fallback without one
        if backend in ("auto", "cpp"):
            try:
                library = _load_cpp_backend(retry_failed_build=backend == "cpp")
                torch.ops.attn_overlay_fake_device.configure(device_count, memory_per_device or 0)
                chosen = "cpp"
            except Exception as exc:  # reported below, or "python" is tried
                if backend == "cpp":
                    raise FakeDeviceUnavailable(f"the C++ fake device could not be built or loaded: {exc}") from exc
                failures.append(f"cpp: {type(exc).__name__}: {exc}")
                fallback_reason = _one_line_reason(exc)
                _log.info("fake device: C++ backend unavailable (%s); using the python backend", fallback_reason)
        if chosen is None:
            try:
                _check_python_backend_supported()
                chosen = "python"
            except Exception as exc:
                failures.append(f"python: {type(exc).__name__}: {exc}")
                raise FakeDeviceUnavailable(
                    "no fake device backend could be installed:\n  " + "\n  ".join(failures)
                ) from exc

        device_module = _make_device_module(name, chosen, device_count)
        if chosen == "cpp":
            torch.utils.rename_privateuse1_backend(name)
            torch.utils.generate_methods_for_privateuse1_backend()
            torch._register_device_module(name, device_module)
        else:
            from . import _python_backend

            _python_backend.install(name, device_module, device_count)
            _python_backend.install_accelerator_memory_functions(name)
        _installed = {
            "name": name,
            "backend": chosen,
            "library": None if library is None else str(library),
            "fallback_reason": None if chosen == "cpp" else fallback_reason,
            "device_count": device_count,
            "memory_per_device": memory_per_device,
        }
        return torch.device(name, 0)


def _is_known_device_type(torch: Any, name: str) -> bool:
    try:
        torch.device(name)
    except RuntimeError:
        return False
    return True


def fake_device_backend() -> str | None:
    """``"cpp"`` or ``"python"``: the implementation installed in this process; None before."""
    return None if _installed is None else _installed["backend"]


def fake_device_details() -> dict[str, Any] | None:
    """What :func:`install_fake_device` installed in this process (None before): ``name``,
    ``backend`` (``"cpp"`` or ``"python"``), ``device_count``, ``memory_per_device``, ``library``
    (the cached C++ library, or None) and ``fallback_reason`` (for the python backend: why the
    C++ one was not used, in one line, e.g. no C++ compiler found, ninja missing, the cache folder
    not writable, the compiler's first error; None for the C++ backend)."""
    return None if _installed is None else dict(_installed)


def fake_device_available(backend: str = "auto") -> bool:
    """Whether :func:`install_fake_device` can be expected to succeed in this process.

    Cheap: builds nothing. True once the fake device is installed (with a matching backend).
    For ``"cpp"``, true when the library is cached or a C++ compiler and ninja are present.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if _installed is not None:
        return backend in ("auto", _installed["backend"])
    import torch

    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        return False
    cpp = _cpp_library_path().exists() or _compiler_available()
    if backend == "cpp":
        return cpp
    try:
        _check_python_backend_supported()
        python = True
    except Exception:
        python = False
    return python if backend == "python" else cpp or python


def cache_root() -> Path:
    """attn-overlay's per-user cache folder: ``$ATTN_OVERLAY_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/attn-overlay``, else ``~/.cache/attn-overlay`` (the XDG base-directory
    convention: a relative ``XDG_CACHE_HOME`` is ignored). Only the fake device's C++ library is
    stored there; ``pip uninstall`` does not remove it."""
    from overlay import config

    explicit = config.cache_dir()  # the settings table's ATTN_OVERLAY_CACHE_DIR, ~ expanded
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attn-overlay"


def fake_device_cache_dir() -> Path:
    """Where compiled fake-device libraries are cached (one sub-folder per torch/source key)."""
    return cache_root() / "fake_device"


@contextlib.contextmanager
def safetensors_via_host() -> Iterator[None]:
    """While active, ``safetensors.safe_open(..., device=<fake device>)`` opens the file on the
    CPU instead of failing with ``device fakeaccel:0 is invalid`` (safetensors knows only its own
    device types); the caller then moves the tensors, as transformers does (``param.to(device)``).

    Replaces ``safe_open`` in ``safetensors`` and in every imported module that holds the same
    function under that name (e.g. ``transformers.modeling_utils``); restores them on exit.
    Not thread-safe: other threads see the replacement while it is active. Needed for
    ``from_pretrained(..., device_map={"": "fakeaccel:0"})`` on transformers 4.x, which opens
    the checkpoint on the target device; transformers 5 opens it on the CPU and needs nothing.
    An int device means ``cuda:<int>`` to safetensors: it is opened on the CPU when CUDA is not
    available."""
    import safetensors
    import torch

    original = safetensors.safe_open
    if getattr(original, "_attn_overlay_fake_device", False):  # nested: already in force
        yield
        return
    name = torch._C._get_privateuse1_backend_name()

    def host(device: Any) -> Any:
        if isinstance(device, int) and not isinstance(device, bool):
            return "cpu" if not torch.cuda.is_available() else device
        if isinstance(device, (str, torch.device)) and torch.device(device).type == name:
            return "cpu"
        return device

    def safe_open(filename: Any, framework: Any, device: Any = "cpu", **kwargs: Any) -> Any:
        return original(filename, framework=framework, device=host(device), **kwargs)

    safe_open._attn_overlay_fake_device = True  # type: ignore[attr-defined]
    safe_open.__wrapped__ = original  # type: ignore[attr-defined]
    holders = [
        module
        for module in list(sys.modules.values())
        if module is not None and getattr(module, "__dict__", {}).get("safe_open") is original
    ]
    for module in holders:
        module.safe_open = safe_open  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in holders:
            if module.__dict__.get("safe_open") is safe_open:
                module.safe_open = original  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------- C++


def _cpp_cache_key() -> str:
    import torch

    digest = hashlib.sha256()
    for part in (
        _CPP_SOURCE.read_bytes(),
        torch.__version__.encode(),
        str(getattr(torch.version, "git_version", "")).encode(),
        sys.implementation.cache_tag.encode(),
        sys.platform.encode(),
        platform.machine().encode(),
        " ".join(_EXTRA_CFLAGS).encode(),
    ):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:20]


def _cpp_library_path() -> Path:
    return fake_device_cache_dir() / _cpp_cache_key() / f"{_LIBRARY_NAME}.so"


def _missing_build_tools() -> list[str]:
    """What is missing to compile the C++ backend, in words (empty when nothing is)."""
    from torch.utils import cpp_extension

    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"no C++ compiler found ({compiler!r} is not on PATH; set CXX to one)")
    if not cpp_extension.is_ninja_available():
        missing.append("ninja missing (pip install ninja)")
    return missing


def _compiler_available() -> bool:
    return not _missing_build_tools()


def _one_line_reason(exc: BaseException) -> str:
    """Why the C++ backend failed, in one line: the message's first line, or for a failed
    compile the first line of the compiler's output that says ``error`` (cpp_extension puts the
    whole build log into its message)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    first = lines[0]
    if first.startswith("the C++ build failed") or "Error building extension" in first:
        # A compiler diagnostic ("file.cpp:3:1: error: ..."), else any line that says error;
        # not the echoed command lines, whose paths may contain the word.
        log = [line for line in lines[1:] if not line.startswith(("[", "FAILED:")) and " -o " not in line]
        errors = [line for line in log if re.search(r":\s*(fatal )?error:", line)] or [
            line for line in log if re.search(r"\berror\b", line, re.IGNORECASE)
        ]
        if errors:
            first = f"{first.split(':', 1)[0]}: {errors[0]}"
    return first if len(first) <= 300 else first[:299] + "…"


def _load_cpp_backend(retry_failed_build: bool) -> Path:
    """Loads the C++ library (building it into the cache first if needed); returns its path.
    A broken cache (a library that does not load, a file where a folder should be) is reported
    in one warning and rebuilt. Raises :class:`FakeDeviceUnavailable` saying why it cannot."""
    import torch

    library = _cpp_library_path()
    failure_note = library.with_name("build-failed.txt")
    broken = _remove_files_blocking_folders(library)
    seen = None
    if not broken and (library.exists() or library.is_symlink()):
        seen = _identity(library)
        # Checked before loading: dlopen of a truncated library can die of SIGBUS, not raise.
        problem = _library_problem(library)
        if problem is None:
            try:
                torch.ops.load_library(str(library))
                return library
            except Exception as exc:  # OSError from dlopen, mostly
                problem = f"it could not be loaded ({_one_line_reason(exc)})"
        broken = f"the cached library {library} is broken: {problem}"
        _log.warning("fake device: %s; deleting it and rebuilding", broken)
    missing = _missing_build_tools()
    if missing:
        where = f"the cached build in {library.parent} is broken" if broken else f"no cached build in {library.parent}"
        raise FakeDeviceUnavailable(f"{' and '.join(missing)}, and {where}")
    if failure_note.exists() and not retry_failed_build and not broken:
        # Do not spend a minute per process on a build known to fail ("cpp" retries).
        earlier = _one_line_reason(RuntimeError(failure_note.read_text(errors="replace")))
        raise FakeDeviceUnavailable(
            f"an earlier build failed: {earlier} (see {failure_note}; delete it or use backend='cpp' to retry)"
        )
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_build_lock(library.parent.parent))
        except OSError as exc:
            raise FakeDeviceUnavailable(
                f"the cache folder {library.parent.parent} is not usable ({type(exc).__name__}: "
                f"{exc.strerror or exc}); set ATTN_OVERLAY_CACHE_DIR to a writable folder"
            ) from exc
        if broken and (library.exists() or library.is_symlink()) and _identity(library) == seen:
            # Still the file that failed (not one another process rebuilt meanwhile).
            _remove_path(library)
        if not library.exists():  # another process may have built it meanwhile
            try:
                _build_cpp_library(library)
            except Exception as exc:
                with contextlib.suppress(OSError):  # the note only saves later processes time
                    failure_note.write_text(f"{type(exc).__name__}: {exc}\n")
                raise FakeDeviceUnavailable(f"the C++ build failed: {type(exc).__name__}: {exc}") from exc
            failure_note.unlink(missing_ok=True)
            return library  # cpp_extension.load has loaded it already
    torch.ops.load_library(str(library))
    return library


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _library_problem(library: Path) -> str | None:
    """What is wrong with a cached library, in words, or None: its sha256 must be the one its
    build recorded next to it (a few hundred KiB: about a millisecond)."""
    try:
        expected = _digest_path(library).read_text().strip()
    except FileNotFoundError:
        return f"no checksum recorded next to it ({_digest_path(library).name} is missing)"
    except OSError as exc:
        return f"its checksum file cannot be read ({type(exc).__name__}: {exc.strerror or exc})"
    try:
        actual = _file_digest(library)
    except OSError as exc:
        return f"it cannot be read ({type(exc).__name__}: {exc.strerror or exc})"
    if actual != expected:
        return "its sha256 differs from the one recorded when it was built (a truncated or altered file)"
    return None


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.lstat()
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _remove_files_blocking_folders(library: Path) -> str | None:
    """Removes a file (or a dangling link) where the cache's ``fake_device`` folder or the key's
    folder should be, with one warning; returns what was wrong, or None. (The cache root itself
    may be a folder the user named, so it is reported by the build, never removed.)"""
    for folder in (library.parent.parent, library.parent):
        if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
            problem = f"{folder} should be a folder of the fake device's build cache but is a file"
            _log.warning("fake device: %s; deleting it and rebuilding", problem)
            try:
                folder.unlink()
            except OSError as exc:
                raise FakeDeviceUnavailable(f"{problem}, which could not be deleted ({exc})") from exc
            return problem
    return None


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """One build at a time per cache folder (first runs of parallel test workers would otherwise
    all compile); a no-op where fcntl is missing: the atomic move keeps concurrent builds safe."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder / ".build.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_cpp_library(library: Path) -> None:
    """Compile and load the library, then move it into the cache. It is compiled in a private
    folder and moved atomically, so concurrent first runs never load a partial file."""
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    build_dir = tempfile.mkdtemp(prefix="build-", dir=library.parent)
    try:
        source = Path(build_dir) / "fake_device.cpp"
        shutil.copyfile(_CPP_SOURCE, source)
        built = cpp_extension.load(
            name=_LIBRARY_NAME,
            sources=[str(source)],
            extra_cflags=list(_EXTRA_CFLAGS),
            build_directory=build_dir,
            is_python_module=False,
            verbose=False,
        )
        # The checksum first: a library in place always has its checksum next to it.
        digest = Path(build_dir) / "library.sha256"
        digest.write_text(_file_digest(Path(built)) + "\n")
        os.replace(digest, _digest_path(library))
        os.replace(built, library)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------- python


def _check_python_backend_supported() -> None:
    import torch
    from torch.utils import backend_registration

    missing = [
        what
        for what, present in (
            ("torch.utils.backend_registration._setup_privateuseone_for_python_backend",
             hasattr(backend_registration, "_setup_privateuseone_for_python_backend")),
            ("torch._C._acc", hasattr(torch._C, "_acc")),
            ("torch.Tensor._make_wrapper_subclass", hasattr(torch.Tensor, "_make_wrapper_subclass")),
        )
        if not present
    ]
    if missing:
        raise FakeDeviceUnavailable(f"this torch ({torch.__version__}) lacks {', '.join(missing)}")


# --------------------------------------------------------------------------- device module


def _make_device_module(name: str, backend: str, device_count: int) -> types.ModuleType:
    """The ``torch.<name>`` module: what torch (autocast, seeding, lazy init) and libraries such
    as transformers and accelerate look up on ``torch.<device type>`` for a custom device. Its
    memory functions are torch.accelerator's, whose numbers the C++ device allocator keeps."""
    import torch

    # Any: the attributes below are set one by one on a bare module, which declares none of them.
    module: Any = types.ModuleType(f"torch.{name}", f"Host-memory fake device {name!r} (attn-overlay testing).")

    def _index(device: Any = None) -> int:
        if device is None:
            return current_device()
        if isinstance(device, int):
            index: int | None = device
        else:
            device = torch.device(device)
            if device.type != name:
                raise ValueError(f"expected a {name!r} device, got {device}")
            index = device.index
        if index is None:
            return current_device()
        if not 0 <= index < device_count:
            raise RuntimeError(
                f"Invalid device index {index}: the fake device has {device_count} "
                f"device{'s' if device_count != 1 else ''} (valid indices 0..{device_count - 1})"
            )
        return index

    def current_device() -> int:
        return torch.accelerator.current_device_index() if backend == "cpp" else 0

    def set_device(device: Any) -> None:
        index = _index(device)
        if backend == "cpp":
            torch.accelerator.set_device_index(index)
        elif index != 0:
            raise RuntimeError(
                f"the python fake device has no current device other than {name}:0 (torch calls no "
                f"Python device guard to switch it); name the index ({name}:{index}) or use backend='cpp'"
            )

    @contextlib.contextmanager
    def device_context(device: Any = None) -> Iterator[None]:
        index = _index(device)
        previous = current_device()
        set_device(index)
        try:
            yield
        finally:
            set_device(previous)

    def _noop(*args: Any, **kwargs: Any) -> None:
        return None

    def memory_function(function_name: str) -> Any:
        def function(device: Any = None) -> Any:
            return getattr(torch.accelerator, function_name)(_index(device))

        function.__name__ = function_name
        return function

    for function_name in (
        "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats",
        "reset_peak_memory_stats", "reset_accumulated_memory_stats",
    ):
        setattr(module, function_name, memory_function(function_name))
    # (free, total) bytes, as torch.cuda.mem_get_info (accelerate asks native modules for it).
    module.mem_get_info = memory_function("get_memory_info")
    module.empty_cache = lambda: torch.accelerator.empty_cache()
    module.device_count = lambda: device_count
    module.current_device = current_device
    module.set_device = set_device
    module.device = device_context
    module.synchronize = lambda device=None: (_index(device), None)[1]
    module.get_device_name = lambda device=None: f"{name} (attn-overlay host-memory fake device)"
    module.is_available = lambda: True
    module.is_initialized = lambda: True
    module._lazy_init = _noop
    module._is_in_bad_fork = lambda: False
    module.is_built = lambda: True
    # Autocast support: the dtypes torch.autocast(name, ...) may use.
    module.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16, torch.float32]
    module.is_bf16_supported = lambda including_emulation=True: True
    # Random numbers come from the CPU generator (see _fake_device.cpp).
    module.manual_seed = lambda seed: (torch.default_generator.manual_seed(int(seed)), None)[1]
    module.manual_seed_all = module.manual_seed
    module.seed = lambda: (torch.default_generator.seed(), None)[1]
    module.seed_all = module.seed
    module.initial_seed = lambda: torch.default_generator.initial_seed()
    module.get_rng_state = lambda device=None: torch.default_generator.get_state()
    module.set_rng_state = lambda new_state, device=None: torch.default_generator.set_state(new_state)
    module.get_rng_state_all = lambda: [torch.default_generator.get_state() for _ in range(device_count)]
    module.set_rng_state_all = lambda new_states: torch.default_generator.set_state(new_states[0])
    return module
