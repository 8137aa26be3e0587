"""A real, fresh virtual environment with the attn-overlay wheel installed, for the tests that
must see what users see: the startup hook read by the interpreter, spawn children, uninstall.

torch and transformers are not reinstalled there (that would cost minutes): a plain path line
makes the test runner's own site-packages importable after the fresh environment's own. It is a
path line only, so the runner's ``.pth`` files (e.g. an editable install of this repo) are not
processed: the overlay the fresh interpreter sees is the wheel's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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
        creating one costs seconds)."""
        return subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(self.python), "--disable-pip-version-check",
             "--no-input", *args],
            check=True, capture_output=True, text=True, timeout=300,
        )

    def files(self) -> set[str]:
        return {str(p.relative_to(self.site_packages)) for p in self.site_packages.rglob("*")}


def build_wheel(out_dir: Path, source: Path = REPO) -> Path:
    """Build the project's wheel with the runner's own setuptools (no network, no isolation);
    ``source``: another checkout of the project (the benchmarks' ``--overlay-root``, a BEFORE)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out_dir), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
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
        (site / "zz_runner_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return FreshEnv(root=root, python=python, site_packages=site)


def install_wheel(env: FreshEnv, wheel: Path) -> None:
    env.pip("install", "-q", "--no-deps", "--no-index", str(wheel))
