"""chunked-prefill: ``generate(prefill_chunk_size=N)`` decodes from the right position, and on
5.0.0 works with the default cache.

Reproduced for real on the CPU, in this process (no device is involved): tiny random Llama and
Gemma 3 (a sliding layer of window 16 and a full one), a 17-token prompt in a batch of two (left
padded, and without padding), ``prefill_chunk_size=8``, 4 new tokens, greedy. Each chunked run is
compared with the same call without ``prefill_chunk_size`` (the reference), by generated ids, by
scores and by the ``cache_position`` every forward receives. On 5.0.0rc1 - 5.2.0 stock:

- ``cache_implementation="static"`` (greedy and beam search): the cache holds 20 slots, the last
  step writes at 20: the ``IndexError`` the patch declares;
- a user-built ``StaticCache(max_cache_len=64)``: no error, but the scores differ (shifted
  rotary positions, an unwritten slot attended);
- a dynamic cache: Gemma 3's scores differ (the sliding-window mask is off by one), Llama's do not;
- the default cache (nothing passed): the ``ValueError`` on 5.0.0 (and its release candidates),
  the dynamic cache's behaviour from 5.1.0.

With the patch every chunked run gives the reference's ids, its scores (to float rounding: chunks
multiply other shapes), and the same decode positions. Where stock works (no chunking anywhere;
chunking on 5.3.0+, where the engine reports "fixed upstream") the overlay's output is bit for bit
stock's. On 5.0.0rc1 - rc2 (not a lane; run by hand) the left-padded batch stays different after
the patch: those release candidates give every chunk position ids that ignore padding (upstream
issue 43082, fixed in 5.0.0), not this bug; the unpadded batch is fixed there.
"""

from __future__ import annotations

import inspect
import re

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import overlay
from overlay.patch import fingerprint
from overlay.testing.harness import PatchUnderTest, heavy_imports

PATCH = PatchUnderTest("chunked_prefill")
PATCH.skip_module_unless_covered()  # before 5.0.0rc1 the chunked prefill was other code (_prefill_chunking)
PATCH_ID = PATCH.id
TRANSFORMERS_VERSION = PATCH.transformers
AFFECTED = PATCH.affected
FIXED_UPSTREAM = PATCH.fixed_upstream
#: 5.0.0 (and its release candidates) prepares no cache for the default cache_implementation.
NO_DEFAULT_CACHE = AFFECTED and TRANSFORMERS_VERSION < Version("5.1.0")
#: From 5.2.0 generate() prepares position ids for the whole prompt before the prefill, and the
#: chunked branch hands them whole to every chunk (each keeps the last len(chunk) of them).
WHOLE_PROMPT_POSITION_IDS = AFFECTED and TRANSFORMERS_VERSION >= Version("5.2.0")
#: 5.0.0rc1 - rc2 give each chunk position ids that ignore left padding (issue 43082): not this bug.
PADDING_IGNORED_BY_CHUNKS = TRANSFORMERS_VERSION < Version("5.0.0")

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = ("llama", "gemma3")
BATCHES = {"left-padded": (17, 12), "unpadded": (17, 17)}
PROMPT_LENGTH = 17
CHUNK = 8
MAX_NEW_TOKENS = 4  # max_length 21: a static cache of 20 slots, as in the declared error
USER_CACHE_LENGTH = 64
CASES = ("static", "beam-static", "user-static", "dynamic", "default")
#: Chunks multiply matrices of other shapes than one prefill: the scores agree to rounding.
SCORE_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
#: A stock run that is silently wrong is off by far more than rounding.
WRONG_BY_AT_LEAST = 1e-3

INDEX_ERROR = PATCH.error("out of bounds")
CACHE_ERROR = PATCH.error("without a cache")


def _module():
    return PATCH.patch_module


def _numbers_blurred(text: str) -> str:
    return re.sub(r"\d+", "N", text)


def _label_names(label: str, release: Version) -> bool:
    """Whether a release label ("5.0.0-5.2.0", "5.0.0rc1") names ``release``: a range by release
    number (5.0.0rc3 ships 5.0.0's code), a single prerelease exactly."""
    low, _, high = label.partition("-")
    if not high:
        return Version(low) == release
    return Version(low) <= Version(release.base_version) <= Version(high)


# -- the patch data ---------------------------------------------------------------------------------


def test_fingerprint_of_installed_code_is_known_with_the_right_label():
    (target,) = PATCH.patch.targets
    digest = fingerprint(PATCH.stock())
    if AFFECTED:
        assert digest in target.originals
        label = target.originals[digest].label
    else:
        assert FIXED_UPSTREAM and digest in target.fixed
        label = target.fixed[digest]
    assert _label_names(label, TRANSFORMERS_VERSION), label


def test_declared_labels_agree_with_the_version_range():
    patch = PATCH.patch
    (target,) = patch.targets
    affected = SpecifierSet(patch.affected)
    for label in (variant.label for variant in target.originals.values()):
        for bound in label.split("-"):
            assert affected.contains(Version(bound), prereleases=True), label
    for label in target.fixed.values():
        for bound in label.split("-"):
            assert Version(bound) >= Version(patch.fixed_in), label


def test_patch_module_imports_neither_torch_nor_transformers():
    assert heavy_imports("overlay.patches.chunked_prefill") == []


def test_declared_errors_are_the_ones_stock_raises_here(runs):
    """The texts in ``Patch.errors`` are stock's own, for this test's lengths (17 + 4 - 1 slots)."""
    if not AFFECTED:
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} ships the fix: stock raises neither")
    run = runs["llama"]["left-padded"]["static"]["stock"]["chunked"]
    assert run["error"] == "IndexError: " + INDEX_ERROR
    if NO_DEFAULT_CACHE:
        run = runs["llama"]["left-padded"]["default"]["stock"]["chunked"]
        assert run["error"] == "ValueError: " + CACHE_ERROR


def test_replacement_keeps_signature_docstring_and_wraps_the_original():
    if not AFFECTED:
        pytest.skip("the replacement is built for the originals 5.0.0rc1 - 5.2.0 only")
    original = PATCH.stock()
    replacement = PATCH.patch.targets[0].build(original)
    assert replacement.__wrapped__ is original
    assert replacement.__doc__ == original.__doc__ and replacement.__name__ == original.__name__
    assert inspect.signature(replacement) == inspect.signature(original)


# -- the runs ---------------------------------------------------------------------------------------


def _generate(model, batch, **kwargs) -> dict:
    """One greedy (or beam) generate(): ids, scores and the cache_position of every forward, or the error."""
    import torch

    vars(model).pop("_cache", None)  # a static cache kept from an earlier call (up to 5.14.x)
    positions: list = []
    position_ids: list = []

    def seen(_module, _args, forward_kwargs):
        for name, found in (("cache_position", positions), ("position_ids", position_ids)):
            value = forward_kwargs.get(name)
            found.append(None if value is None else value.tolist())

    from overlay import report

    report.reset()
    hook = model.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        with torch.no_grad():
            out = model.generate(
                **batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, disable_compile=True,
                return_dict_in_generate=True, output_scores=True, **kwargs,
            )
        result = {"ok": True, "ids": out.sequences[:, -MAX_NEW_TOKENS:].tolist(), "scores": torch.stack(out.scores)}
    except Exception as exc:  # noqa: BLE001  (the tests read which one)
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        hook.remove()
    result["positions"] = positions
    result["position_ids"] = position_ids
    result["fired"] = report.fired_actions().get(PATCH_ID, {})
    return result


def _case_kwargs(case: str, model) -> dict:
    from transformers import StaticCache

    from overlay.testing.models import cache_argument_name

    if case == "static":
        return {"cache_implementation": "static"}
    if case == "beam-static":
        return {"cache_implementation": "static", "num_beams": 2}
    if case == "user-static":  # a fresh cache for every call
        return {cache_argument_name(model): StaticCache(config=model.config, max_cache_len=USER_CACHE_LENGTH)}
    if case == "dynamic":
        return {"cache_implementation": "dynamic"}
    assert case == "default"
    return {}


@pytest.fixture(scope="module")
def runs():
    """``{model: {batch: {case: {"stock"|"patched": {"reference"|"chunked": run}}}}}``, plus the
    engine's status for the patch under ``"status"``."""
    from overlay.testing.models import left_padded_batch, tiny_model

    results: dict = {}
    with PATCH.applied() as statuses:
        status = statuses[PATCH_ID]
        results["status"] = {"state": status.state, "variants": list(status.variants)}
    for kind in MODELS:
        model = tiny_model(kind)
        for batch_name, lengths in BATCHES.items():
            batch = left_padded_batch(lengths)
            for case in CASES:
                record = results.setdefault(kind, {}).setdefault(batch_name, {}).setdefault(case, {})
                for state in ("stock", "patched"):
                    with overlay.reverted() if state == "stock" else PATCH.applied():
                        record[state] = {
                            "reference": _generate(model, batch, **_case_kwargs(case, model)),
                            "chunked": _generate(model, batch, prefill_chunk_size=CHUNK, **_case_kwargs(case, model)),
                        }
    return results


def _stock_fails(kind: str, case: str) -> str | None:
    """The error stock raises on this release for a chunked run, or None."""
    if not AFFECTED:
        return None
    if case in ("static", "beam-static"):
        return "IndexError: " + INDEX_ERROR
    if case == "default" and NO_DEFAULT_CACHE:
        return "ValueError: " + CACHE_ERROR
    return None


def _stock_silently_wrong(kind: str, case: str) -> bool:
    """Stock finishes on this release, but its scores are not the reference's."""
    if not AFFECTED or _stock_fails(kind, case):
        return False
    # A dynamic cache (and the default one, a dynamic cache from 5.1.0) only misleads the sliding
    # layers' mask, which Llama has none of; from 5.2.0 every chunk but the last is embedded at the
    # wrong positions, whatever the cache.
    return case == "user-static" or kind == "gemma3" or WHOLE_PROMPT_POSITION_IDS


def _max_difference(run: dict, reference: dict) -> float:
    return float((run["scores"] - reference["scores"]).abs().max())


def _assert_same_generation(run: dict, reference: dict) -> None:
    import torch

    assert run["ok"], run.get("error")
    assert run["ids"] == reference["ids"]
    torch.testing.assert_close(run["scores"], reference["scores"], **SCORE_TOLERANCE)


ALL = pytest.mark.parametrize("kind,batch,case", [(k, b, c) for k in MODELS for b in BATCHES for c in CASES])


def _padding_caveat(batch: str) -> None:
    if PADDING_IGNORED_BY_CHUNKS and batch == "left-padded":
        pytest.skip("5.0.0rc1 - rc2: every chunk's position ids ignore left padding (issue 43082, not this bug)")


def test_engine_status(runs):
    status = runs["status"]
    if AFFECTED:
        assert status["state"] == "applied", status
        (label,) = status["variants"]
        assert label in {v.label for v in PATCH.patch.targets[0].originals.values()}
    else:
        assert status["state"] == "fixed upstream", status


@ALL
def test_chunked_prefill_on_stock_transformers(runs, kind, batch, case):
    record = runs[kind][batch][case]["stock"]
    chunked, reference = record["chunked"], record["reference"]
    assert reference["ok"], reference.get("error")  # without chunking stock works everywhere
    error = _stock_fails(kind, case)
    if error is not None:
        assert not chunked["ok"], "stock transformers was expected to fail with a chunked prefill"
        assert _numbers_blurred(chunked["error"]) == _numbers_blurred(error), chunked["error"]
    elif _stock_silently_wrong(kind, case):
        assert chunked["ok"], chunked.get("error")
        assert _max_difference(chunked, reference) > WRONG_BY_AT_LEAST, "stock was expected to differ here"
    else:
        _padding_caveat(batch)
        _assert_same_generation(chunked, reference)


@ALL
def test_chunked_prefill_with_the_overlay_equals_the_unchunked_run(runs, kind, batch, case):
    _padding_caveat(batch)
    record = runs[kind][batch][case]["patched"]
    _assert_same_generation(record["chunked"], record["reference"])


@ALL
def test_every_forward_sees_the_positions_of_the_unchunked_run(runs, kind, batch, case):
    """The chunks cover 0 .. 16, then decoding continues at 17, 18, 19 as without chunking."""
    if not AFFECTED:
        pytest.skip("fixed upstream: the engine leaves the release's code alone (5.4.0+ pass no positions)")
    record = runs[kind][batch][case]
    reference = record["patched"]["reference"]["positions"]
    chunked = record["patched"]["chunked"]["positions"]
    prompt = list(range(PROMPT_LENGTH))
    assert reference[0] == prompt
    chunks = -(-PROMPT_LENGTH // CHUNK)
    assert [p for chunk in chunked[:chunks] for p in chunk] == prompt
    assert chunked[chunks:] == reference[1:] == [[PROMPT_LENGTH + step] for step in range(MAX_NEW_TOKENS - 1)]
    stock = record["stock"]["chunked"]["positions"]
    if case == "default" and NO_DEFAULT_CACHE:
        assert stock == []  # refused before the first chunk
    else:
        assert stock[:chunks] == chunked[:chunks]
        assert stock[chunks] == [PROMPT_LENGTH + 1], "stock decodes one position late"


@ALL
def test_every_forward_sees_the_position_ids_of_the_unchunked_run(runs, kind, batch, case):
    """Each chunk gets its own slice of the prompt's position ids; decoding continues from them."""
    if not AFFECTED:
        pytest.skip("fixed upstream: the engine leaves the release's code alone")
    _padding_caveat(batch)
    record = runs[kind][batch][case]
    reference = record["patched"]["reference"]["position_ids"]
    chunked = record["patched"]["chunked"]["position_ids"]
    chunks = -(-PROMPT_LENGTH // CHUNK)
    prompt = reference[0]
    assert prompt is not None and len(prompt[0]) == PROMPT_LENGTH
    # (5.0.0rc1 - rc2 give the chunks one row of position ids, broadcast over the batch.)
    joined = [sum((chunk[row % len(chunk)] for chunk in chunked[:chunks]), []) for row in range(len(prompt))]
    assert joined == prompt
    assert chunked[chunks:] == reference[1:]
    stock = record["stock"]["chunked"]["position_ids"]
    if WHOLE_PROMPT_POSITION_IDS:  # the first chunk got the last chunk's positions
        assert stock[0] == [row[-CHUNK:] for row in prompt]


@ALL
def test_the_overlay_changes_nothing_where_stock_works(runs, kind, batch, case):
    import torch

    record = runs[kind][batch][case]
    pairs = [("reference", "reference")]
    if not AFFECTED:
        pairs.append(("chunked", "chunked"))
    for stock_key, patched_key in pairs:
        stock, patched = record["stock"][stock_key], record["patched"][patched_key]
        assert stock["ok"] and patched["ok"], (stock.get("error"), patched.get("error"))
        assert patched["ids"] == stock["ids"]
        assert torch.equal(patched["scores"], stock["scores"]), "not bit for bit stock's scores"


@ALL
def test_what_the_patch_reports(runs, kind, batch, case):
    module = _module()
    record = runs[kind][batch][case]
    assert record["patched"]["reference"]["fired"] == {}  # no chunking: the original alone
    assert record["stock"]["chunked"]["fired"] == {}
    fired = record["patched"]["chunked"]["fired"]
    if not AFFECTED:
        assert fired == {}
        return
    expected = {module.CORRECTED_POSITION: 1}
    if case == "default" and NO_DEFAULT_CACHE:
        expected[module.DEFAULT_CACHE] = 1
    if WHOLE_PROMPT_POSITION_IDS:  # generate() prepared them for the whole prompt
        expected[module.OWN_POSITION_IDS] = 1
    # 5.1.0 - 5.2.0 always prepare a cache: the default-cache step never fires there; before
    # 5.2.0 generate() passes the chunks no position ids: that step never fires there.
    assert fired == expected
