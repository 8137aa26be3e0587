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
      so later processes load it in milliseconds. ``pip uninstall`` leaves that folder; delete
      it by hand (``rm -rf ~/.cache/attn-overlay``). Operators without a kernel of their own
      check devices and then run their CPU kernel on the same memory (torch's
      ``cpu_fallback``), so any dense CPU operator works, autograd included.
  ``"python"``
      No compiler needed: a tensor subclass whose ``__torch_dispatch__`` checks devices and runs
      the CPU kernels on the host tensor it wraps (one Python call per op: several times slower).
      Device tensors are instances of a ``torch.Tensor`` subclass, have no ``data_ptr()`` or
      storage, and ops that check devices themselves (e.g. ``index_copy_``) report the generic
      message instead of their own. ``scaled_dot_product_attention`` under autograd runs torch's
      math decomposition: right gradients, forward values that may differ from CPU in the last
      bits (without autograd, e.g. in ``generate``, results equal the CPU ones bit for bit).
  ``"auto"`` (default)
      ``"cpp"`` when it builds or is cached, else ``"python"``.

  :func:`fake_device_backend` says which one is installed, :func:`fake_device_details` also
  why (the reason the C++ one was not used) and where the C++ library is cached.
* Device rules follow real accelerators: all tensor arguments of an op must be on one device,
  except zero-dimensional CPU tensors (treated as scalars) and CPU index tensors of advanced
  indexing (``x[idx]``, ``x[idx] = v``). Copies between devices (``.to()``, ``copy_``) work.
* Once installed, the device is torch's current accelerator (``torch.accelerator``), as a GPU
  would be: code that picks "the accelerator" by itself picks it.
* There is one device, index 0. Random numbers come from the CPU generator, so
  ``torch.manual_seed`` gives the same numbers on both devices.
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
]

DEFAULT_DEVICE_NAME = "fakeaccel"
_BACKENDS = ("auto", "cpp", "python")
_CPP_SOURCE = Path(__file__).with_name("_fake_device.cpp")
_LIBRARY_NAME = "attn_overlay_fake_device"
# Part of the cache key: a change here must not reuse a library built with other flags.
_EXTRA_CFLAGS = ("-O2",)

_log = logging.getLogger(__name__)
_lock = threading.Lock()
# What this process installed: {"name": str, "backend": "cpp" | "python", "library": path of
# the C++ library or None, "fallback_reason": why not the C++ backend, or None}; None before.
_installed: dict[str, str | None] | None = None


class FakeDeviceUnavailable(RuntimeError):
    """No implementation of the fake device could be installed in this process."""


def install_fake_device(name: str = DEFAULT_DEVICE_NAME, backend: str = "auto") -> torch.device:
    """Install the host-memory device under ``name`` and return ``torch.device(f"{name}:0")``.

    ``backend`` is ``"auto"``, ``"cpp"`` or ``"python"`` (see the module documentation).
    Idempotent for the same name. Raises :class:`RuntimeError` if torch's PrivateUse1 backend is
    already named differently in this process (a fresh process is needed then), and
    :class:`FakeDeviceUnavailable` if the requested backend cannot be installed.
    """
    global _installed
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"device name must be lowercase letters, digits and '_', got {name!r}")

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
        if backend in ("auto", "cpp"):
            try:
                library = _load_cpp_backend(retry_failed_build=backend == "cpp")
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

        device_module = _make_device_module(name)
        if chosen == "cpp":
            torch.utils.rename_privateuse1_backend(name)
            torch.utils.generate_methods_for_privateuse1_backend()
            torch._register_device_module(name, device_module)
        else:
            from . import _python_backend

            _python_backend.install(name, device_module)
        _installed = {
            "name": name,
            "backend": chosen,
            "library": None if library is None else str(library),
            "fallback_reason": None if chosen == "cpp" else fallback_reason,
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


def fake_device_details() -> dict[str, str | None] | None:
    """What :func:`install_fake_device` installed in this process (None before): ``name``,
    ``backend`` (``"cpp"`` or ``"python"``), ``library`` (the cached C++ library, or None) and
    ``fallback_reason`` (for the python backend: why the C++ one was not used, in one line, e.g.
    no C++ compiler found, ninja missing, the cache folder not writable, the compiler's first
    error; None for the C++ backend)."""
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
    Raises :class:`FakeDeviceUnavailable` saying why it cannot."""
    import torch

    library = _cpp_library_path()
    failure_note = library.with_name("build-failed.txt")
    if not library.exists():
        missing = _missing_build_tools()
        if missing:
            raise FakeDeviceUnavailable(f"{' and '.join(missing)}, and no cached build in {library.parent}")
        if failure_note.exists() and not retry_failed_build:
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
                    f"the cache folder {library.parent.parent} is not writable ({type(exc).__name__}: "
                    f"{exc.strerror or exc}); set ATTN_OVERLAY_CACHE_DIR to a writable folder"
                ) from exc
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


def _make_device_module(name: str) -> types.ModuleType:
    """The ``torch.<name>`` module: what torch (autocast, seeding, lazy init) and libraries such
    as transformers look up on ``torch.<device type>`` for a custom device."""
    import torch

    # Any: the attributes below are set one by one on a bare module, which declares none of them.
    module: Any = types.ModuleType(f"torch.{name}", f"Host-memory fake device {name!r} (attn-overlay testing).")

    def _index(device: Any = None) -> int:
        if device is None:
            return 0
        index = device if isinstance(device, int) else torch.device(device).index
        if index not in (None, 0):
            raise RuntimeError(f"the fake device {name!r} has a single device, index 0; got {device!r}")
        return 0

    def _noop(*args: Any, **kwargs: Any) -> None:
        return None

    module.is_available = lambda: True
    module.is_initialized = lambda: True
    module._lazy_init = _noop
    module._is_in_bad_fork = lambda: False
    module.is_built = lambda: True
    module.device_count = lambda: 1
    module.current_device = lambda: 0
    module.set_device = lambda device: (_index(device), None)[1]
    module.device = lambda device=None: (_index(device), contextlib.nullcontext())[1]
    module.synchronize = lambda device=None: (_index(device), None)[1]
    module.get_device_name = lambda device=None: f"{name} (attn-overlay host-memory fake device)"
    module.empty_cache = _noop
    module.memory_allocated = lambda device=None: 0
    module.max_memory_allocated = lambda device=None: 0
    module.memory_reserved = lambda device=None: 0
    module.reset_peak_memory_stats = _noop
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
    module.get_rng_state_all = lambda: [torch.default_generator.get_state()]
    module.set_rng_state_all = lambda new_states: torch.default_generator.set_state(new_states[0])
    return module
