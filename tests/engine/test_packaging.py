"""What packagers and users get: the sdist builds the same wheel as the tree, an install from the
sdist (pip, and uv where it is installed) has an active hook, and installing never moves the
torch or transformers a user pinned.

These tests build with the runner's own setuptools (``--no-isolation``) where they can, and ask
the package registry only for what an install really resolves (``pip install --dry-run``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.freshenv import REPO, HarnessCommandFailed, fresh_env_can_import, make_fresh_env

#: transformers.cache_utils (kv-cache-dtype's module) imports torch: where a fresh environment
#: cannot import torch (the torch-free lanes, ``nox -s python_lanes``) the program imports
#: ``transformers`` itself, which starts the engine, and kv-cache-dtype rightly stays pending.
PATCHABLE = fresh_env_can_import("torch", "transformers")
STATUS = (
    f"import json, {'transformers.cache_utils' if PATCHABLE else 'transformers'}, overlay.engine as e; "
    "print(json.dumps({'active': e.is_active(), 'states': {s.id: s.state for s in e.status()}}))"
)


def _build(out: Path, *what: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", *what, "--outdir", str(out), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )
    if done.returncode != 0:
        raise HarnessCommandFailed(done, "(python -m build --no-isolation needs build and setuptools>=77 in the "
                                         "test runner: pip install build 'setuptools>=77')")


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    _build(out / "from-sdist")  # python -m build: the sdist, then the wheel built FROM the sdist
    _build(out / "from-tree", "--wheel")  # the wheel built straight from the tree
    (sdist,) = (out / "from-sdist").glob("attn_overlay-*.tar.gz")
    (wheel_from_sdist,) = (out / "from-sdist").glob("attn_overlay-*.whl")
    (wheel_from_tree,) = (out / "from-tree").glob("attn_overlay-*.whl")
    return sdist, wheel_from_sdist, wheel_from_tree


def _names(wheel: Path) -> list[str]:
    return sorted(zipfile.ZipFile(wheel).namelist())


def test_the_wheel_built_from_the_sdist_has_the_same_files_as_the_one_built_from_the_tree(dists):
    _, from_sdist, from_tree = dists
    assert _names(from_sdist) == _names(from_tree)
    assert {"attn_overlay.pth", "attn_overlay.start", "_attn_overlay_startup.py", "_attn_overlay_finder.py", "overlay/patches/__init__.py",
            "overlay/py.typed"} <= set(_names(from_tree))


def test_the_sdist_carries_what_its_tests_need(dists):
    sdist, _, _ = dists
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    tracked = set(subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split())
    needed = {n for n in tracked if n.startswith(("tests/", "scripts/", "patches/", "overlay/"))} | {
        "noxfile.py", "LICENSE", "README.md", "CHANGELOG.md", "attn_overlay.pth", "attn_overlay.start", "setup.py",
        "pyproject.toml",
    }
    assert needed <= names, sorted(needed - names)


def test_metadata_requires_neither_torch_nor_transformers(dists):
    _, _, wheel = dists
    (metadata,) = [n for n in _names(wheel) if n.endswith(".dist-info/METADATA")]
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    requires = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    unconditional = [r for r in requires if "extra ==" not in r]
    assert unconditional == ["packaging>=22"]
    assert "License-Expression: Apache-2.0" in text


@pytest.mark.parametrize("installer", ["pip", "uv"])
def test_an_install_from_the_sdist_has_an_active_hook(dists, tmp_path, installer):
    sdist, _, _ = dists
    env = make_fresh_env(tmp_path / "env")
    if installer == "pip":
        env.pip("install", "-q", "--no-deps", str(sdist))
    else:
        uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
        if not Path(uv).exists():
            pytest.skip("uv is not installed in the test environment")
        subprocess.run([uv, "pip", "install", "-q", "--no-deps", "--python", str(env.python), str(sdist)],
                       check=True, capture_output=True, text=True, timeout=600)
    assert (env.site_packages / "attn_overlay.pth").is_file()
    result = json.loads(env.run("-c", STATUS).stdout.strip().splitlines()[-1])
    assert result["active"] is True
    assert result["states"]["kv-cache-dtype"] == ("applied" if PATCHABLE else "pending")


def _dry_run(python: Path, *requirements: str, tmp_path: Path) -> list[dict]:
    report = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet", "--report",
         str(report), *requirements],
        check=True, capture_output=True, text=True, timeout=600,
    )
    return json.loads(report.read_text())["install"]


def test_an_eager_upgrade_install_moves_no_pinned_package(dists, tmp_path):
    # This test runner's environment has torch and transformers pinned (what users have):
    # `pip install -U --upgrade-strategy eager` of the overlay must change neither, nor anything
    # they depend on.
    _, _, wheel = dists
    would_install = _dry_run(Path(sys.executable), "-U", "--upgrade-strategy", "eager", str(wheel), tmp_path=tmp_path)
    names = {item["metadata"]["name"].lower() for item in would_install}
    assert names <= {"attn-overlay", "packaging"}, names


def test_an_empty_environment_gets_the_overlay_and_packaging_only(dists, tmp_path):
    _, _, wheel = dists
    env = make_fresh_env(tmp_path / "env", with_runner_packages=False)
    would_install = _dry_run(env.python, str(wheel), tmp_path=tmp_path)
    assert {item["metadata"]["name"].lower() for item in would_install} == {"attn-overlay", "packaging"}
