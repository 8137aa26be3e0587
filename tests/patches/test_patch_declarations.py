"""Every patch's declarations, checked the same way for each (one parametrized test per check, on
every lane): the installed release's code of each target is a fingerprint the patch declares, with
a label that names this release (an original where the release is affected, fixed code where it is
at or after ``fixed_in``); every label lies inside the patch's own range; the patch file imports
neither torch nor transformers. What a single patch's replacement does is its own test file's."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

from overlay import _patch_files, engine
from overlay.patch import fingerprint
from overlay.registry import load_patches
from overlay.testing.harness import PatchUnderTest, heavy_imports, label_names

pytestmark = pytest.mark.lane

TRANSFORMERS = Version(version("transformers"))
REPO = Path(__file__).resolve().parents[2]
MODULES = {patch.id: name for patch, name in zip(load_patches(), _patch_files.package().PATCH_MODULES)}


def _under_test(module: str) -> PatchUnderTest:
    return PatchUnderTest(module)


@pytest.mark.parametrize("module", list(MODULES.values()), ids=list(MODULES))
def test_installed_code_is_a_declared_fingerprint_labelled_with_this_release(module):
    under_test = _under_test(module)
    patch = under_test.patch
    state, reason = engine.gate(patch, str(TRANSFORMERS))
    if state == engine.OUT_OF_RANGE:
        pytest.skip(f"{patch.id}: {reason}")
    present = under_test.present_targets()
    assert present, f"transformers {TRANSFORMERS} defines none of {patch.id}'s targets"
    for target, func in present:
        digest = fingerprint(func)
        if state == engine.PENDING:  # affected: the code must be an original the patch knows
            assert digest in target.originals, f"{target.key}: unknown original {digest}"
            label = target.originals[digest].label
        else:
            assert state == engine.FIXED_UPSTREAM, (state, reason)
            assert digest in target.fixed, f"{target.key}: unknown fixed code {digest}"
            label = target.fixed[digest]
        assert label_names(label, TRANSFORMERS), (target.key, label)


@pytest.mark.parametrize("module", list(MODULES.values()), ids=list(MODULES))
def test_every_label_lies_inside_the_patchs_range(module):
    _under_test(module).assert_labels_within_range()


@pytest.mark.parametrize("module", list(MODULES.values()), ids=list(MODULES))
def test_patch_file_imports_neither_torch_nor_transformers(module):
    assert heavy_imports(f"overlay.patches.{module}") == []


@pytest.mark.parametrize("module", list(MODULES.values()), ids=list(MODULES))
def test_patch_file_takes_its_release_facts_from_the_data(module):
    # Which release ships which code, affected and fixed_in live in patches/releases.json: a patch
    # file that typed them would be a second word on the same facts, and go stale with a release.
    import ast
    import inspect

    from overlay import releases

    source = inspect.getsource(_patch_files.module(module))
    (assignment,) = [n for n in ast.parse(source).body if isinstance(n, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "PATCH" for t in n.targets)]
    assert isinstance(assignment.value, ast.Call) and ast.unparse(assignment.value.func) == "patch_with_release_facts"
    declared = {kw.arg for node in ast.walk(assignment.value) if isinstance(node, ast.Call) for kw in node.keywords}
    assert declared.isdisjoint({"affected", "fixed_in", "introduced_in", "originals", "fixed"}), declared
    patch = _under_test(module).patch
    assert patch.id in releases.load()["patches"]


@pytest.mark.parametrize("module", list(MODULES.values()), ids=list(MODULES))
def test_a_workers_status_record_is_held_to_what_this_release_gets(module):
    # PatchUnderTest.assert_reported, which the patches' worker-run tests use: it refuses another
    # state, and (where the release is affected) a variant label that does not name the release.
    under_test = _under_test(module)
    with pytest.raises(AssertionError):
        under_test.assert_reported({"state": "failed", "variants": []})
    if under_test.affected:
        with pytest.raises(AssertionError):
            under_test.assert_reported({"state": "applied", "variants": ["1.0.0"]})
        known = [v.label for t in under_test.patch.targets for v in t.originals.values()
                 if label_names(v.label, TRANSFORMERS)]
        under_test.assert_reported({"state": "applied", "variants": known[:1]})
    elif under_test.fixed_upstream:
        under_test.assert_reported({"state": "fixed upstream", "variants": []})


#: A patch file's docstring says what breaks, the error, what the replacement does, its limits and
#: cost (CONTRIBUTING asks for about 40 lines); the history and every case go to docs/patches/.
MOST_DOCSTRING_LINES = 60


@pytest.mark.parametrize("module", list(MODULES.values()), ids=list(MODULES))
def test_the_patch_docstring_is_a_summary(module):
    import ast
    import inspect

    source = inspect.getsource(_patch_files.module(module))
    lines = len((ast.get_docstring(ast.parse(source), clean=False) or "").splitlines())
    assert 0 < lines <= MOST_DOCSTRING_LINES, f"{module}: a docstring of {lines} lines; move the account to docs/patches/"


@pytest.mark.parametrize("module", list(MODULES.values()), ids=list(MODULES))
def test_each_replacement_keeps_the_name_docstring_and_signature(module):
    # Where the installed code is one the patch was written for: the replacement the engine would
    # install wraps it (``__wrapped__``) and shows its name, docstring and signature.
    import inspect

    under_test = _under_test(module)
    built = 0
    for target, stock in under_test.present_targets():
        variant = target.variant_of(stock)
        if variant is None:
            continue
        replacement = target.replace(stock, variant)
        assert replacement.__wrapped__ is stock, target.key
        assert (replacement.__name__, replacement.__doc__) == (stock.__name__, stock.__doc__), target.key
        assert inspect.signature(replacement) == inspect.signature(stock), target.key
        built += 1
    if under_test.affected and engine.gate(under_test.patch, str(TRANSFORMERS))[0] == engine.PENDING:
        assert built, f"{module}: affected here, yet no target's code is one it was written for"


@pytest.mark.parametrize("module", list(MODULES.values()), ids=list(MODULES))
def test_applied_puts_every_replacement_in_force_and_revert_takes_it_back(module):
    # The engine's word for this release, and what is on the owners: each present target holds
    # the patch's replacement inside the block where the patch applies, stock's code otherwise.
    import importlib

    from overlay.patch import PATCH_MARKER, function_of

    under_test = _under_test(module)
    patch = under_test.patch
    state = engine.gate(patch, str(TRANSFORMERS))[0]
    if state == engine.OUT_OF_RANGE:
        pytest.skip(f"{patch.id}: out of range here")
    owner_module = importlib.import_module(patch.module)

    def markers() -> list:
        located = (target.locate(owner_module).raw for target in patch.targets)
        return [getattr(function_of(raw), PATCH_MARKER, None) for raw in located if raw is not None]

    with under_test.applied() as statuses:
        status, during = statuses[patch.id], markers()
    assert during, f"{patch.id}: none of its targets is here"
    if state == engine.PENDING:
        assert status.state == engine.APPLIED, status.reason
        assert set(during) == {patch.id}
    else:
        assert (state, status.state) == (engine.FIXED_UPSTREAM, engine.FIXED_UPSTREAM), status.reason
        assert set(during) == {None}
    assert set(markers()) == {None}, "reverted after the block"


# -- what each patch changes (Patch.changes; issue 40) ------------------------------------------------
#
# How each declaration was classified, and how this test holds it true:
#
# 1. Read: each patch's docstring ("What breaks"), its ``errors`` texts, and its tests in
#    tests/patches/<module>/. An ``errors`` text that begins "(no error)" names a call that completes
#    on stock with other output (tokens, scores, a caller's dict): the patch changes "output" (only
#    such texts) or "both" (beside texts of errors stock raises). A patch with no such text changes
#    "errors" only, and its tests must show that where stock completes the overlay is stock.
# 2. Evidence: CHANGES_EVIDENCE, in each patch's own test folder, names the test there that shows it: for "output" and
#    "both", a stock call that completes with other output than the fixed release's (so the fix changes
#    completed calls); for "errors", a test where stock completes and the overlay gives stock's output
#    bit for bit (or does not fire). Those tests run in every lane; this test checks the declaration,
#    the evidence and the error texts agree, and that each named test exists, so that a declaration
#    cannot change without its evidence changing with it.
# 3. Behaviour: tests/tools/test_fixes.py runs a battery of ordinary completing calls under
#    ATTN_OVERLAY_FIXES=errors against stock (token ids equal) and the two calls of the issue.

def _evidence(module: str) -> tuple[str, str, str]:
    """``CHANGES_EVIDENCE`` of the patch's own test folder (read from the source, not imported: a
    test module may skip itself at import on a release outside its patch's range): (what it
    changes, the test there that shows it, the evidence in words)."""
    import ast

    found = []
    for path in sorted((REPO / "tests" / "patches" / module).glob("test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CHANGES_EVIDENCE" for t in node.targets):
                found.append(ast.literal_eval(node.value))
    assert len(found) == 1, (
        f"tests/patches/{module}/ must define CHANGES_EVIDENCE = (changes, test name, words) once; found {len(found)}"
    )
    return found[0]


def _declared_keywords(module: str) -> dict:
    import ast
    import inspect

    source = inspect.getsource(_patch_files.module(module))
    (assignment,) = [n for n in ast.parse(source).body if isinstance(n, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "PATCH" for t in n.targets)]
    assert isinstance(assignment.value, ast.Call)
    return {kw.arg: kw.value for kw in assignment.value.keywords}


@pytest.mark.parametrize("module", list(MODULES.values()), ids=list(MODULES))
def test_the_patch_declares_what_it_changes_as_its_evidence_shows(module):
    import ast
    import re

    from overlay.patch import CHANGES, CHANGES_BOTH, CHANGES_ERRORS, CHANGES_OUTPUT

    patch = _under_test(module).patch
    declared = _declared_keywords(module).get("changes")
    # Written in the file, never the dataclass's cautious default: the README and ATTN_OVERLAY_FIXES read it.
    assert declared is not None, f"{module}: declare changes= in patch_with_release_facts(...)"
    assert isinstance(declared, ast.Constant) and declared.value in CHANGES, ast.unparse(declared)
    assert patch.changes == declared.value
    changes, test_name, _ = _evidence(module)
    assert patch.changes == changes, f"{patch.id} declares {patch.changes!r}; its evidence says {changes!r}"
    # The evidence test is one of the patch's own.
    folder = REPO / "tests" / "patches" / module
    defined = {name for path in folder.glob("test_*.py")
               for name in re.findall(r"^def (test_\w+)\(", path.read_text(encoding="utf-8"), re.M)}
    assert test_name in defined, f"{patch.id}: no {test_name} in {folder}"
    # The error texts agree: "(no error) ..." names a completed call whose output changes.
    silent = [text for text in patch.errors if text.startswith("(no error)")]
    raised = [text for text in patch.errors if re.search(r"\b\w*(Error|Exception)\b|index_copy_|Expected|expected", text)
              and not text.startswith("(no error)")]
    if patch.changes == CHANGES_ERRORS:
        assert not silent, f"{patch.id} says errors, yet names output it changes: {silent}"
    if patch.changes in (CHANGES_OUTPUT, CHANGES_BOTH):
        assert silent, f"{patch.id} says {patch.changes}: name the output it changes in a '(no error) ...' text"
    if patch.changes == CHANGES_OUTPUT:
        assert not raised, f"{patch.id} says output, yet names errors stock raises: {raised}"
    if patch.changes == CHANGES_BOTH:
        assert raised, f"{patch.id} says both, yet names no error stock raises"


def test_a_patch_that_declares_no_known_change_is_refused():
    from overlay.patch import Patch, Target

    target = Target(module="transformers.generation.utils", qualname="GenerationMixin.generate",
                    replace=lambda original, variant: original)
    with pytest.raises(ValueError, match=r"changes='tokens'; use one of 'errors', 'output', 'both'"):
        Patch(id="x", title="x", errors=(), why="x", upstream="x", affected=">=1", fixed_in=None,
              targets=(target,), changes="tokens")
