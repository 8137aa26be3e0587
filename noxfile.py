"""Test sessions: the whole suite, and one lane per transformers release.

    nox                     # what CI runs (tag "ci"): the suite on 5.18.0 + the representative lanes
    nox -t matrix           # every release lane (RELEASES in scripts/matrix_data.py: the full matrix)
    nox -s neuron-stack     # the Neuron stack's torch 2.8.0 + transformers 4.57.6 (large download)
    nox -s openvino         # optimum-intel 2.2.0 (OpenVINO) on transformers 4.57.6: tests/stacks/ (tag "stacks")
    nox -s newest           # maintainers: the newest transformers on the index, what each patch meets there
    nox -t pythons          # the torch-free tests on CPython 3.10 ... 3.13 (each must be on PATH;
                            # pyenv: PYENV_VERSION=3.11.7:3.10.13:3.12.1:3.13.0 nox -t pythons)
    nox -s tf-5.20.0        # one lane;  nox -s tf-5.20.0 -- -k device   passes pytest arguments
    nox -s tests            # the whole suite on 5.18.0
    nox -s lint             # ruff and mypy (pyproject.toml), run by CI too
    nox -s tf-5.20.0 --install-only   # build a lane's environment, run nothing
    nox -l                  # list the sessions

A lane is a virtual environment with one transformers release, torch 2.13.0 (CPU) and this
project (editable), where the patch reproductions and the matrix tests run: on an affected
release every bug reproduces without the overlay and is fixed with it; on a fixed release the
patch reports "fixed upstream" and changes nothing. Which release expects what comes from
``scripts/matrix_data.py``, the same data as the release table (docs/releases.md).

torch and its own dependencies (sympy, networkx, jinja2 ...) are installed once, into
``.nox/_shared/``, and every lane sees them through a path line in its site-packages: a lane costs
transformers, its requirements and the ``lane`` extra (about 290 MB and 30 s), not 800 MB of torch.
A lane that needs another version of one of torch's dependencies installs it into its own
site-packages, which comes first on ``sys.path``.
The ``tests`` session installs torch into its own environment instead, because the startup hook
tests build fresh environments that see the runner's site-packages folder only.
Environments are reused between runs (``reuse_venv``); ``--reuse-venv=no`` rebuilds them.
With ``ATTN_OVERLAY_DROP_ENVIRONMENTS=1`` (``.ci/run`` sets it when ``CI`` is set) each test
session deletes its environment when it ends: a clean clone's CI then needs about 4 GB of disk
at its peak (the shared torch, the suite's environment and the two lanes that run side by side)
instead of about 9 GB with every environment kept.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import nox

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "scripts"))

import matrix_data  # noqa: E402

nox.options.reuse_venv = "yes"
nox.options.tags = ["ci"]

TORCH_REQUIREMENT = f"torch=={matrix_data.TORCH}"
CI_LANES = frozenset(matrix_data.ci_lanes())
#: What a release lane runs: every test of every patch (the ``patch`` marker, which
#: tests/conftest.py sets on each module that holds a ``PatchUnderTest``: by patch, not by file
#: name) and the matrix checks (``lane``). A module skips itself where its patch does not apply.
LANE_SELECTION = ("-m", "patch or lane")

#: tests/_kit.py's switch for a release lane's share of the release-independent costly checks.
LANE_SHARE_VAR = "ATTN_OVERLAY_TESTS_LANE_SHARE"

# The tests build models from configs: nothing may reach for the model hub.
TEST_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


@contextlib.contextmanager
def _environment_dropped_after(session: nox.Session) -> Iterator[None]:
    """Delete the session's environment when the block ends (passed or failed), where
    ATTN_OVERLAY_DROP_ENVIRONMENTS=1 asks for it: a one-off run on a clean clone reuses nothing,
    and 21 kept environments fill a small disk. The shared torch stays: the next lane needs it."""
    try:
        yield
    finally:
        if os.environ.get("ATTN_OVERLAY_DROP_ENVIRONMENTS") == "1":
            location = Path(session.virtualenv.location)
            session.log(f"deleting {location} (ATTN_OVERLAY_DROP_ENVIRONMENTS=1)")
            shutil.rmtree(location, ignore_errors=True)


# The probes and installs below use ``session.run_install``: they are part of building an
# environment, so they must also run under ``nox --install-only`` (where ``session.run`` runs
# nothing and returns None). Under ``-R`` / ``--no-install`` on an environment that exists, nox
# skips them (they return None): the environment is then used as it is (see ``_install``).


def _purelib(session: nox.Session) -> Path:
    out = session.run_install("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True)
    return Path(out.strip().splitlines()[-1])


def _shared_torch(session: nox.Session) -> Path:
    """The shared torch folder (installed on first use), made importable in this session."""
    tag = session.run_install(
        "python", "-c", "import sys, platform; print(f'cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}')",
        silent=True,
    ).strip().splitlines()[-1]
    folder = Path(session.virtualenv.location).parent / "_shared" / f"torch-{matrix_data.TORCH}-{tag}"
    complete = f"{TORCH_REQUIREMENT} with its dependencies\n"  # a folder of an older layout is rebuilt
    if not (folder / ".complete").exists() or (folder / ".complete").read_text() != complete:
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        # With its dependencies: they are the same for every lane, and sympy alone is 80 MB.
        session.run_install("python", "-m", "pip", "install", "--target", str(partial), TORCH_REQUIREMENT)
        (partial / ".complete").write_text(complete)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    (_purelib(session) / "_attn_overlay_shared_torch.pth").write_text(f"{folder}\n")
    return folder


#: Prints transformers' own requirements (no extras), one per line, except the names given.
_DECLARED_REQUIREMENTS = """
import importlib.metadata, sys
from packaging.requirements import Requirement
for text in importlib.metadata.requires("transformers") or ():
    requirement = Requirement(text)
    if requirement.name not in sys.argv[1:] and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
        print(requirement)
"""


def _install(session: nox.Session, release: str, *, share_torch: bool, torch: str = matrix_data.TORCH,
             extras: str = "lane,multidevice") -> None:
    if session.run_install("python", "-c", "print('installing')", silent=True) is None:
        session.log("reusing the environment as it is (-R / --no-install): nothing installed or checked")
        return
    shared = _shared_torch(session) if share_torch else None
    # torch is named with its exact version in every install: pip then keeps the shared (or
    # already installed) 2.13.0 and can never reach for another build (multi-GB CUDA wheels).
    # multidevice (accelerate): loading a model with tensor parallelism needs it.
    left_out = matrix_data.REQUIREMENTS_LEFT_OUT.get(release)
    if left_out:
        # The release without the requirements the index cannot satisfy, then the rest of what it
        # declares (no extras), read from its installed metadata.
        session.install(f"torch=={torch}", "-e", f"{REPO}[{extras}]")
        session.install("--no-deps", f"transformers=={release}")
        declared = session.run_install("python", "-c", _DECLARED_REQUIREMENTS, *left_out, silent=True)
        session.install(f"torch=={torch}", *declared.splitlines())
        session.log(f"transformers {release} without " + "; ".join(f"{n} ({why})" for n, why in left_out.items()))
    else:
        session.install(f"torch=={torch}", f"transformers=={release}", "-e", f"{REPO}[{extras}]")
    found = session.run_install(
        "python", "-c",
        "import importlib.metadata as m, torch; "
        "print(m.version('transformers'), torch.__version__, torch.__file__)",
        silent=True,
    ).strip().splitlines()[-1]
    transformers_version, torch_version, torch_file = found.split(" ", 2)
    if transformers_version != release:
        session.error(f"expected transformers {release}, found {transformers_version}")
    if not torch_version.startswith(torch):
        session.error(f"expected torch {torch}, found {torch_version}")
    if shared is not None and not Path(torch_file).resolve().is_relative_to(shared.resolve()):
        session.error(f"torch should come from the shared {shared}, but comes from {torch_file}")
    session.log(f"transformers {transformers_version}, torch {torch_version} ({torch_file})")


@nox.session(tags=["ci"])
def tests(session: nox.Session) -> None:
    """The whole test suite on the release the project is developed against."""
    with _environment_dropped_after(session):
        _install(session, matrix_data.FULL_SUITE_RELEASE, share_torch=False, extras="test,multidevice")
        session.run("python", "-m", "pytest", "-ra", "--durations=10", *session.posargs, env=TEST_ENV)


#: The test modules that never import torch: the engine on throwaway packages, the startup hook
#: and the packaging in fresh environments, the import layering and the README tables. They run on
#: every CPython the package supports (``requires-python``), not only on the one this machine has
#: a torch wheel for.
TORCH_FREE_TESTS = (
    "tests/engine/test_engine.py",
    "tests/engine/test_engine_in_force.py",
    "tests/engine/test_call_forwarding.py",
    "tests/engine/test_layering.py",
    "tests/tools/test_readme_tables.py",
    "tests/engine/test_startup_hook.py",
    "tests/engine/test_packaging.py",
    "tests/engine/test_patch_format.py",
    "tests/tools/test_lanes.py",
)
#: One lane per CPython from requires-python's floor to the newest one tested (the classifiers
#: in pyproject.toml name the same versions).
PYTHON_LANES = ("3.10", "3.11", "3.12", "3.13")

# A lane whose interpreter is not on this machine fails, saying so: nox's default outside CI
# skips it, and a skipped session reads like a pass. download_python="never" (below): a missing
# interpreter is reported, never fetched.
nox.options.error_on_missing_interpreters = True


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff and mypy on the package, the patch files and the startup modules (their settings are
    in pyproject.toml). No torch or transformers: both are typed as Any (ignore_missing_imports)."""
    with _environment_dropped_after(session):
        session.install("ruff", "mypy", "packaging")
        session.run("ruff", "check", "overlay", "patches", "_attn_overlay_startup.py", "_attn_overlay_finder.py", "_attn_overlay_pytest.py")
        session.run("mypy")


@nox.session(name="python_lanes", python=PYTHON_LANES, download_python="never", tags=["pythons"])
def python_lanes(session: nox.Session) -> None:
    """The torch-free tests, on one CPython per session (python_lanes-3.10 ... -3.13).

    transformers is installed without torch: the startup-hook tests see the hook start the engine
    on ``import transformers``, and the patches' modules (they import torch) stay pending. The
    patches themselves are proved where torch is (``tests`` and the release lanes, on 3.11)."""
    # No `.[test]`: its accelerate requires torch, a multi-GB download on these Pythons.
    session.install("pytest>=8", "hypothesis>=6", "build", "uv", "setuptools>=77",
                    f"transformers=={matrix_data.FULL_SUITE_RELEASE}", "-e", str(REPO))
    session.chdir(REPO)
    session.run("python", "-m", "pytest", "-ra", *TORCH_FREE_TESTS, *session.posargs, env=TEST_ENV)


@nox.session(name="neuron-stack", tags=["stacks"])
def neuron_stack(session: nox.Session) -> None:
    """The Neuron stack's pins, torch 2.8.0 + transformers 4.57.6 (optimum-neuron 0.4.x with its
    `neuronx` extra; torch-neuronx itself is on AWS's own index): the 4.57.6 lane's tests on the
    torch that stack runs. Not in CI: torch 2.8.0 is a multi-GB (CUDA) download here."""
    release, torch = matrix_data.NEURON_STACK
    _install(session, release, share_torch=False, torch=torch)
    session.run("python", "-m", "pytest", "-ra", "--durations=10", *LANE_SELECTION, *session.posargs, env=TEST_ENV)


#: The OpenVINO stack (docs/stacks.md): optimum-intel's release, the transformers release its lane runs.
OPENVINO_STACK = ("2.2.0", "4.57.6")


@nox.session(tags=["stacks"])
def openvino(session: nox.Session) -> None:
    """optimum-intel 2.2.0 with OpenVINO on transformers 4.57.6 and the shared torch 2.13.0:
    tests/stacks/test_openvino.py exports tiny random models to OpenVINO and checks what
    docs/stacks.md says of that stack. Not in CI: openvino, nncf and optimum make the environment
    about 700 MB (with transformers; torch is the shared one)."""
    optimum_intel, release = OPENVINO_STACK
    with _environment_dropped_after(session):
        _install(session, release, share_torch=True)
        if session.run_install("python", "-c", "print('installing')", silent=True) is not None:
            # torch and transformers named again: pip keeps them and resolves the rest around them.
            session.install(TORCH_REQUIREMENT, f"transformers=={release}", f"optimum-intel[openvino]=={optimum_intel}")
            # The torchvision it pulls in does not load beside the CPU torch 2.13.0 (issue 41);
            # nothing here needs it: removed.
            session.run_install("python", "-m", "pip", "uninstall", "-y", "torchvision")
        session.run("python", "-m", "pytest", "-ra", "--durations=10", "tests/stacks/test_openvino.py", *session.posargs,
                    env=TEST_ENV)


@nox.session(tags=["maintainers"])
def newest(session: nox.Session) -> None:
    """The newest transformers release on the package index, whatever the matrix holds: per patch,
    what the overlay would say there (applied, fixed upstream, unrecognised code), read from the
    release's wheel by scripts/fingerprint_release.py (no install: a new release may need
    dependencies the index lacks), with the tool's advice. Exits 1 when the release needs work:
    follow CONTRIBUTING.md ("Adding a transformers release")."""
    session.install("-e", str(REPO))
    listing = session.run("python", "-m", "pip", "index", "versions", "transformers", silent=True, external=False)
    if not listing:  # --install-only: nothing to report
        return
    newest_release = listing.split("(", 1)[1].split(")", 1)[0]  # "transformers (5.25.0)"
    from overlay import releases  # matrix_data made this checkout's overlay importable

    in_data = newest_release in releases.load()["releases"]
    known = ("in the matrix" if newest_release in matrix_data.RELEASES else "not in the matrix yet") + (
        "" if in_data else f"; not in patches/releases.json yet: scripts/fingerprint_release.py --add {newest_release}"
    )
    session.log(f"newest transformers on the index: {newest_release} ({known})")
    session.run("python", str(REPO / "scripts" / "fingerprint_release.py"), "--check", newest_release, *session.posargs)
    # Then its lane, as a release lane runs it: every test of every patch. Installed with what it
    # declares where the index can satisfy that; otherwise without the requirements it cannot get
    # (named in the log), as REQUIREMENTS_LEFT_OUT does for a release in the matrix.
    left_out = _install_newest(session, newest_release)
    env = dict(TEST_ENV)
    if "kernels" in left_out:
        env["USE_HUB_KERNELS"] = "0"  # from_pretrained asks for hub kernels by default from 5.25.0
    session.run("python", "-m", "pytest", "-ra", *LANE_SELECTION, env=env)


def _install_newest(session: nox.Session, release: str) -> list[str]:
    """Install ``release`` with torch and this project; the requirements the index cannot satisfy
    are left out, one by one, and returned."""
    import nox.command

    _shared_torch(session)
    try:
        session.install(TORCH_REQUIREMENT, f"transformers=={release}", "-e", f"{REPO}[lane,multidevice]")
        return []
    except nox.command.CommandFailed:
        session.log(f"transformers {release} with all its requirements does not install here; trying them one by one")
    session.install(TORCH_REQUIREMENT, "-e", f"{REPO}[lane,multidevice]")
    session.install("--no-deps", f"transformers=={release}")
    left_out = []
    for requirement in session.run_install("python", "-c", _DECLARED_REQUIREMENTS, silent=True).splitlines():
        try:
            session.install(TORCH_REQUIREMENT, requirement)
        except nox.command.CommandFailed:
            left_out.append(requirement.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip())
    session.log(f"transformers {release} installed without: {', '.join(left_out) or 'nothing'}")
    return left_out


def _make_lane(release: str):
    def lane(session: nox.Session) -> None:
        with _environment_dropped_after(session):
            _install(session, release, share_torch=True)
            # A lane is one of many: release-independent costly checks run their share here
            # (tests/_kit.py, LANE_SHARE_VAR), and all of them in the whole suite or with the
            # variable at 0 in nox's environment.
            share = os.environ.get(LANE_SHARE_VAR, "1")
            env = {**TEST_ENV, LANE_SHARE_VAR: share, **matrix_data.LANE_ENVIRONMENT.get(release, {})}
            session.run("python", "-m", "pytest", "-ra", "--durations=10", *LANE_SELECTION, *session.posargs, env=env)

    lane.__doc__ = (
        f"transformers {release}"
        + "".join(f" (installed without {name}: {why})"
                  for name, why in matrix_data.REQUIREMENTS_LEFT_OUT.get(release, {}).items())
        + "".join(f" ({name}={value})" for name, value in matrix_data.LANE_ENVIRONMENT.get(release, {}).items())
        + ": expected "
        + ", ".join(f"{pid} {state}" for pid, state in matrix_data.expected_statuses(release).items())
    )
    return lane


for _release in matrix_data.RELEASES:
    nox.session(
        _make_lane(_release),
        name=f"tf-{_release}",
        tags=["matrix", *(["ci"] if _release in CI_LANES else [])],
    )
