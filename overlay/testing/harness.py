"""What the patch tests share: the patch under test on the installed release, and fresh processes.

:class:`PatchUnderTest` answers, from the engine's own gate, whether the installed transformers
carries a patch's bug (``affected``) or its upstream fix (``fixed_upstream``); it finds the
installed release's own function behind any replacement (``stock``), applies the patch for a block
(``applied``), and gives the exact error texts the patch declares (``error``), so a test asserts
the very messages users report instead of a copy of them::

    KEPT = PatchUnderTest("kept_static_cache")
    with KEPT.applied(expect="applied"):
        ...
    assert KEPT.error("'StaticLayer' object") in str(exc)

:func:`run_json_worker` runs a script in a fresh interpreter (the fake device can be named once per
process) and reads back the JSON it prints; :func:`heavy_imports` says which heavy packages a
module drags in when imported alone; :func:`counting_aten_ops` counts the aten ops a block runs.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import _patch_files
from ..patch import Patch

__all__ = [
    "PatchUnderTest", "label_names", "run_json_worker", "assert_generated", "heavy_imports", "counting_aten_ops",
    "SCORE_TOLERANCE", "max_score_difference", "assert_same_generation", "assert_bit_for_bit",
]

# The accelerator a patch's error text names, e.g. "cuda:0" or "neuron:0": error(device=) swaps it.
_DEVICE_IN_TEXT = re.compile(r"\b(?:cuda|neuron|xla|mps|hpu|xpu|npu):\d+")
# A leading exception type, as some patches spell their errors ("RuntimeError: ...").
_EXCEPTION_PREFIX = re.compile(r"^[A-Z]\w*(?:Error|Exception|Warning): ")


@dataclass(frozen=True)
class PatchUnderTest:
    """The patch in ``overlay.patches.<module>`` (e.g. ``"device_move"``) on the installed release."""

    module: str
    patch: Patch = field(init=False)

    def __post_init__(self) -> None:
        patch = _patch_files.module(self.module).PATCH
        object.__setattr__(self, "patch", patch)

    @property
    def id(self) -> str:
        return self.patch.id

    @property
    def patch_module(self):
        """The patch file's module (``overlay.patches.<module>``)."""
        return _patch_files.module(self.module)

    @property
    def transformers(self):
        """The installed transformers version (a ``packaging`` ``Version``), from its metadata."""
        from importlib.metadata import version

        from packaging.version import Version

        return Version(version("transformers"))

    @property
    def gate(self) -> str:
        """The engine's verdict from the version alone: ``"pending"`` (in range: the bug is
        there), ``"fixed upstream"``, ``"out of range"``..."""
        from .. import engine

        return engine.gate(self.patch, str(self.transformers))[0]

    @property
    def affected(self) -> bool:
        """The installed release is in the patch's ``affected`` range: stock carries the bug."""
        from .. import engine

        return self.gate == engine.PENDING

    @property
    def fixed_upstream(self) -> bool:
        """The installed release ships the upstream fix (``fixed_in`` or later)."""
        from .. import engine

        return self.gate == engine.FIXED_UPSTREAM

    def assert_reported(self, status: dict) -> None:
        """A worker's status record of this patch (``{"state", "variants"}``) is what this release
        gets: applied, through one variant whose label names the installed release, where the
        release is affected; fixed upstream where it ships the fix."""
        if self.affected:
            assert status["state"] == "applied", status
            (label,) = status["variants"]  # one target per release (the others absent there)
            assert label_names(label, self.transformers), status
        else:
            assert self.fixed_upstream and status["state"] == "fixed upstream", status

    def skip_module_unless_covered(self) -> None:
        """At a test module's top: skip the whole module on releases before the patch's range
        (a release neither affected nor fixed upstream)."""
        import pytest

        if not (self.affected or self.fixed_upstream):
            pytest.skip(
                f"{self.id} covers transformers {self.patch.affected}; found {self.transformers}",
                allow_module_level=True,
            )

    def stock(self, target: int = 0) -> Any:
        """The installed release's own function for ``patch.targets[target]``, even where the
        overlay has replaced it in this process (imports the target's module)."""
        spec = self.patch.targets[target]
        func = spec.stock(importlib.import_module(spec.module))
        if func is None:
            raise AttributeError(f"{spec.key} does not exist in transformers {self.transformers}")
        return func

    def present_targets(self) -> list:
        """``(target, the release's own function)`` for each of the patch's targets this release
        defines (optional ones may be absent), in declaration order."""
        found = []
        for spec in self.patch.targets:
            func = spec.stock(importlib.import_module(spec.module))
            if func is not None:
                found.append((spec, func))
        return found

    def assert_labels_within_range(self) -> None:
        """Every release a variant's label names is in ``affected``; every release a fixed label
        names is ``fixed_in`` or later."""
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        affected = SpecifierSet(self.patch.affected)
        for spec in self.patch.targets:
            for label in (variant.label for variant in spec.known_variants.values()):
                for bound in (b for run in _label_runs(label) for b in run):
                    assert affected.contains(Version(bound), prereleases=True), label
            for label in spec.fixed.values():
                for bound in (b for run in _label_runs(label) for b in run):
                    assert self.patch.fixed_in is not None, f"{label}: fixed code is known, but the patch has no fixed_in"
                    assert Version(bound) >= Version(self.patch.fixed_in), label

    @contextlib.contextmanager
    def applied(self, *also: str, expect: str | None = None, strict: bool | None = None) -> Iterator[dict]:
        """Apply this patch (and the patch ids in ``also``) through the engine for a block,
        gated on version and fingerprint as for users; yield ``{patch id: PatchStatus}`` for
        them; revert what the block applied. ``expect``: assert each one is in that state."""
        from .. import engine

        ids = [self.id, *also]
        with engine.applied(only=ids, strict=strict) as statuses:
            mine = {s.id: s for s in statuses if s.id in ids}
            if expect is not None:
                assert {i: s.state for i, s in mine.items()} == {i: expect for i in ids}, statuses
            yield mine

    def error(self, containing: str = "", *, device: str | None = None) -> str:
        """The one error text of the patch (``Patch.errors``) that contains ``containing``,
        without a leading exception type; with ``device``, the accelerator it names (``cuda:0``,
        ``neuron:0``) replaced by that device, as the same error reads there."""
        found = [text for text in self.patch.errors if containing in text]
        if len(found) != 1:
            raise LookupError(f"{len(found)} error texts of {self.id} contain {containing!r}: {found}")
        text = _EXCEPTION_PREFIX.sub("", found[0])
        if device is not None:
            text = _DEVICE_IN_TEXT.sub(str(device), text, count=1)
        return text


def label_names(label: str, release: Any) -> bool:
    """Whether a release label (``"5.0.0-5.2.0"``, ``"5.0.0rc0-5.0.0rc1, 5.3.0"``) names ``release``
    (a ``packaging`` Version; a local build, ``5.18.0+neuron``, by its public part):
    :func:`overlay.releases.label_covers`, refusing text that is not a label."""
    from ..releases import label_covers

    covers = label_covers(label, release.public)
    if covers is None:
        raise ValueError(f"not a release label: {label!r}")
    return covers


def _label_runs(label: str) -> list[tuple[str, str]]:
    from ..releases import label_runs

    runs = label_runs(label)
    if runs is None:
        raise ValueError(f"not a release label: {label!r}")
    return runs


def fake_version_label(directory: Any, label: str, distribution: str = "transformers") -> str:
    """A folder (made in ``directory``) whose metadata says ``distribution`` is release ``label``:
    first on ``PYTHONPATH`` it is what ``importlib.metadata`` reads, while ``import`` still finds the
    installed code (a source tree or vendored copy first on the path, a fork with its own version)."""
    dist = os.path.join(os.fspath(directory), f"{distribution}-{label}.dist-info")
    os.makedirs(dist)
    with open(os.path.join(dist, "METADATA"), "w", encoding="utf-8") as f:
        f.write(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {label}\n")
    return os.fspath(directory)


def _environment(extra: dict[str, str] | None) -> dict:
    # The overlay stays off unless the worker applies it; one thread per worker on shared CPUs.
    env = dict(os.environ, ATTN_OVERLAY="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra or {})
    return env


def run_json_worker(
    script: str,
    args: Sequence[str] = (),
    *,
    marker: str,
    timeout: float,
    cwd: Any = None,
    env: dict[str, str] | None = None,
) -> Any:
    """Run ``python script *args`` in a fresh interpreter (overlay off, one thread) and return
    the JSON on its last stdout line that starts with ``marker``; raise ``AssertionError`` with
    the output's tail when it exits non-zero or prints no such line."""
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True, text=True, timeout=timeout, env=_environment(env), cwd=cwd,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(marker)]
    if done.returncode != 0 or not lines:
        raise AssertionError(
            f"{os.path.basename(str(script))} {' '.join(args)} exited {done.returncode}\n"
            f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-8000:]}"
        )
    return json.loads(lines[-1][len(marker):])


def assert_generated(run: dict, ids: Any) -> None:
    """A worker's run record (``{"ok", "ids"}`` or ``{"ok": False, "error"}``) finished and
    generated exactly ``ids``."""
    assert run["ok"], run.get("error")
    assert run["ids"] == ids


#: Generation computed another way than stock's (in chunks, say) multiplies matrices of other shapes:
#: its float32 scores and logits agree with the reference to rounding.
SCORE_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def max_score_difference(run: dict, reference: dict) -> float:
    """The largest difference between two run records' ``scores`` (tensors)."""
    return float((run["scores"] - reference["scores"]).abs().max())


def assert_same_generation(run: dict, reference: dict) -> None:
    """``run`` finished with ``reference``'s ids, and its scores and logits agree to rounding
    (:data:`SCORE_TOLERANCE`)."""
    import torch

    assert run["ok"], run.get("error")
    assert run["ids"] == reference["ids"]
    torch.testing.assert_close(run["scores"], reference["scores"], **SCORE_TOLERANCE)
    torch.testing.assert_close(run["logits"], reference["logits"], **SCORE_TOLERANCE)


def assert_bit_for_bit(run: dict, stock: dict, *also: str) -> None:
    """Both runs finished, and ``run`` has exactly ``stock``'s ids, scores and logits (and the
    fields named in ``also``): where the overlay must change nothing."""
    import torch

    assert stock["ok"] and run["ok"], (stock.get("error"), run.get("error"))
    assert run["ids"] == stock["ids"]
    assert torch.equal(run["scores"], stock["scores"]), "not bit for bit stock's scores"
    assert torch.equal(run["logits"], stock["logits"]), "not bit for bit stock's logits"
    for name in also:
        assert run[name] == stock[name], name


def heavy_imports(module: str, heavy: Sequence[str] = ("torch", "transformers")) -> list[str]:
    """Which of ``heavy`` importing ``module`` alone loads, in a fresh interpreter."""
    code = f"import sys, {module}\nprint(sorted(m for m in {tuple(heavy)!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"'))


@contextlib.contextmanager
def counting_aten_ops() -> Iterator[Counter]:
    """Count the aten ops dispatched while the block runs, by name (``"index_copy_"``, ``"_to_copy"``),
    those that raise included (counted before they run): how tests see the copies, casts and
    refused writes a patch adds or saves. Imports torch when entered."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter = Counter()

    class _CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with _CountOps():
        yield counts
