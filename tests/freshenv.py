"""A real, fresh virtual environment with the attn-overlay wheel installed, for the tests that
must see what users see: the startup hook read by the interpreter, spawn children, uninstall.

torch and transformers are not reinstalled there (that would cost minutes): a plain path line
makes the test runner's own site-packages importable after the fresh environment's own. It is a
path line only, so the runner's ``.pth`` files (e.g. an editable install of this repo) are not
processed: the overlay the fresh interpreter sees is the wheel's.

pip never sees that path line (``FreshEnv.pip`` hides it while pip runs): pip running in the
fresh interpreter would otherwise count the runner's packages as installed there. A runner with
attn-overlay installed from a wheel (the README's ``.venv``) then made ``pip install`` of the
same version a no-op ("already installed with the same version as the provided wheel"), exit
status 0, and the fresh environment stayed empty.

Every CPython the project supports runs these helpers (``nox -s python_lanes``). Where a fresh
environment cannot import torch (no torch wheel for that Python on the machine, or a runner that
reaches torch through a path line of its own, as the release lanes do), the tests ask
:func:`fresh_env_can_import` and expect what the engine says without torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: The path line that shows the fresh interpreter the runner's site-packages, and the name it
#: has while pip runs (not ``.pth``: the interpreter skips it).
RUNNER_PACKAGES_LINE = "zz_runner_packages.pth"
_HIDDEN_SUFFIX = ".hidden-while-pip-runs"


class HarnessCommandFailed(subprocess.CalledProcessError):
    """A set-up command of the harness failed: the message carries its output and what to do
    (still a ``CalledProcessError``, with ``cmd``, ``returncode``, ``stdout`` and ``stderr``)."""

    def __init__(self, done: subprocess.CompletedProcess, hint: str = ""):
        super().__init__(done.returncode, done.args, done.stdout, done.stderr)
        self.hint = hint

    def __str__(self) -> str:
        tail = "\n".join(f"{name}:\n{text[-3000:]}" for name, text in (("stdout", self.stdout), ("stderr", self.stderr))
                         if text)
        return f"{super().__str__()}{(' ' + self.hint) if self.hint else ''}\n{tail}"


def _run_checked(command: list[str], *, timeout: float, hint: str = "") -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise HarnessCommandFailed(done, hint)
    return done


def fresh_env_can_import(*modules: str) -> bool:
    """Whether a fresh environment with the runner's packages (``make_fresh_env``) can import
    these top-level modules: found in the runner's site-packages folder itself, the one its path
    line names (a module another path line adds to the runner, as the release lanes' shared torch
    folder, stays out of reach there). Found, not imported: no torch import for
    ``fresh_env_can_import("torch")``."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for name in modules:
        spec = importlib.util.find_spec(name)
        where = spec and (spec.origin or next(iter(spec.submodule_search_locations or ()), None))
        if not where or site not in Path(where).resolve().parents:
            return False
    return True


@dataclass
class FreshEnv:
    root: Path
    python: Path
    site_packages: Path

    def run(self, *args: str, env: dict | None = None, timeout: float = 240, check: bool = True,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("ATTN_OVERLAY")}
        full_env.pop("PYTHONPATH", None)
        full_env.update(env or {})
        done = subprocess.run([str(self.python), *args], env=full_env, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd or str(self.root))
        if check and done.returncode != 0:
            raise AssertionError(f"{args} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}")
        return done

    def pip(self, *args: str) -> subprocess.CompletedProcess:
        """The runner's pip, driving this environment's interpreter (the fresh env has no pip:
        creating one costs seconds). pip sees this environment only: the runner's packages are
        hidden from it while it runs."""
        with self._runner_packages_hidden():
            return _run_checked(
                [sys.executable, "-m", "pip", "--python", str(self.python), "--disable-pip-version-check",
                 "--no-input", *args],
                timeout=300,
                hint=f"(the runner's pip, driving {self.python})",
            )

    @contextlib.contextmanager
    def _runner_packages_hidden(self):
        line = self.site_packages / RUNNER_PACKAGES_LINE
        hidden = line.with_name(line.name + _HIDDEN_SUFFIX)
        if not line.exists():
            yield
            return
        os.replace(line, hidden)
        try:
            yield
        finally:
            os.replace(hidden, line)

    def files(self) -> set[str]:
        return {str(p.relative_to(self.site_packages)) for p in self.site_packages.rglob("*")}


def build_wheel(out_dir: Path, source: Path = REPO) -> Path:
    """Build the project's wheel with the runner's own setuptools (no network, no isolation);
    ``source``: another checkout of the project (the benchmarks' ``--overlay-root``, a BEFORE)."""
    _run_checked(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out_dir), str(source)],
        timeout=300,
        # Python 3.12 on: `python -m venv` no longer seeds setuptools, and a build without
        # isolation uses the runner's.
        hint="(building without isolation needs setuptools>=77 in the test runner: pip install 'setuptools>=77')",
    )
    (wheel,) = out_dir.glob("attn_overlay-*.whl")
    return wheel


def make_fresh_env(root: Path, *, with_runner_packages: bool = True) -> FreshEnv:
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = root / "bin" / "python"
    site = Path(subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    if with_runner_packages:
        # "zz" sorts after attn_overlay.pth: the wheel's own files come first on sys.path anyway.
        (site / RUNNER_PACKAGES_LINE).write_text(sysconfig.get_paths()["purelib"] + "\n")
    return FreshEnv(root=root, python=python, site_packages=site)


def install_wheel(env: FreshEnv, wheel: Path) -> None:
    done = env.pip("install", "--no-deps", "--no-index", str(wheel))
    # pip says "already installed" and exits 0 when it finds the same version anywhere on the
    # interpreter's path: check that the wheel really landed in this environment.
    if not list(env.site_packages.glob("attn_overlay-*.dist-info")):
        raise AssertionError(f"pip installed nothing into {env.site_packages} (it holds {sorted(env.files())}):\n"
                             f"{done.stdout}{done.stderr}")
