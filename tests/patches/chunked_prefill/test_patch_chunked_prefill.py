"""chunked-prefill: ``generate(prefill_chunk_size=N)`` gives the unchunked run's output: every chunk
gets its rows' position ids (left padding included), decoding starts at the right position, and on
5.0.0 the default cache works.

Reproduced for real on the CPU, in this process (no device is involved). Each chunked run is
compared with the same call without ``prefill_chunk_size`` (the reference), by generated ids, by
scores and logits, and by the ``cache_position`` and ``position_ids`` every forward of the
decoder inside receives (4.55 - 4.57 call the chunks' ``forward`` directly: hooks on the outer
model see only decoding).

1. The decode position (tiny Llama and Gemma 3 with a sliding layer of window 16, a 17-token
   prompt in a batch of two, left padded and without padding, ``prefill_chunk_size=8``, 4 new
   tokens, greedy and beam search). On 5.0.0rc1 - 5.2.0 stock:

   - ``cache_implementation="static"`` (greedy and beam search): the cache holds 20 slots, the
     last step writes at 20: the ``IndexError`` the patch declares;
   - a user-built ``StaticCache(max_cache_len=64)``: no error, but the scores differ (shifted
     rotary positions, an unwritten slot attended);
   - a dynamic cache: Gemma 3's scores differ (the sliding-window mask is off by one), Llama's do
     not (unless padded, on the release candidates: see 2);
   - the default cache (nothing passed): the ``ValueError`` on 5.0.0 (and its release
     candidates), the dynamic cache's behaviour from 5.1.0.

2. The padded rows (4.55.0 - 5.0.0rc2: every chunk's position ids count from 0 for every row).
   In the runs of 1, stock's left-padded batch differs from the reference wherever the release
   chunks it (4.55 - 4.57 do not chunk beam search), its unpadded one does not (4.55 - 4.57).
   Then every architecture that decodes: Llama, Qwen3, Gemma 3, OLMo2 (``overlay.testing.models``)
   and GPT-2 (learned absolute positions), hidden size 32 (head_dim 8), weights drawn with
   ``initializer_range=0.3`` (sharp enough attention that a position moves the argmax), a batch
   of 11 and 8 tokens (the second row padded by 3), ``prefill_chunk_size=3``, 5 new tokens,
   static and default caches: stock gives the padded row other tokens than the reference (or
   raises, on the release candidates: 1's errors).

With the patch every chunked run gives the reference's ids, its scores and logits (to float
rounding: chunks multiply other shapes), and the same positions. Where stock works (no chunking
anywhere; chunking on 5.3.0+, where every case here starts from an empty cache, so the overlay
runs the release's own code, and from 5.21.0 the engine reports "fixed upstream"; an unpadded batch
and beam search on 4.55 - 4.57) the overlay's output is bit for bit stock's. A cache that already
holds tokens (the patch's range up to 5.20.2): tests/patches/chunked_prefill/test_patch_chunked_prefill_kept_cache.py.
"""

from __future__ import annotations

import inspect
import re

import pytest
from packaging.version import Version

import overlay
from overlay.patch import fingerprint
from overlay.testing.harness import (
    PatchUnderTest, assert_bit_for_bit, assert_same_generation, heavy_imports, label_names, max_score_difference,
)

PATCH = PatchUnderTest("chunked_prefill")
PATCH.skip_module_unless_covered()  # releases before 4.55.0 are out of the overlay's scope
#: 4.55.0 - 5.2.0: the bugs of a chunked prefill onto an empty cache, which this module proves;
#: 5.3.0 fixed them upstream. The patch goes on to 5.20.2 for a cache that already holds tokens
#: (tests/patches/chunked_prefill/test_patch_chunked_prefill_kept_cache.py); onto an empty cache it runs stock's code there.
EMPTY_CACHE_BUGS = PATCH.affected and PATCH.transformers < Version("5.3.0")
#: 5.0.0rc1 - 5.2.0 (``_prefill``): the chunked branch leaves decoding one position late.
DECODES_ONE_LATE = EMPTY_CACHE_BUGS and PATCH.transformers >= Version("5.0.0rc1")
#: 4.55.0 - 5.0.0rc2: every chunk's position ids are ``arange`` for every row (issue 43082).
CHUNKS_IGNORE_PADDING = PATCH.affected and PATCH.transformers < Version("5.0.0rc3")
#: 5.0.0 (and its release candidates) prepares no cache for the default cache_implementation.
NO_DEFAULT_CACHE = DECODES_ONE_LATE and PATCH.transformers < Version("5.1.0")
#: From 5.2.0 generate() prepares position ids for the whole prompt before the prefill, and the
#: chunked branch hands them whole to every chunk (each keeps the last len(chunk) of them).
WHOLE_PROMPT_POSITION_IDS = EMPTY_CACHE_BUGS and PATCH.transformers >= Version("5.2.0")
#: 5.0.0rc1 on chunk the whole prompt, in greedy and beam search alike; 4.55 - 4.57 chunk all
#: but its last token (the decoding loop's first step runs that one), in greedy search only.
CHUNKS_THE_WHOLE_PROMPT = PATCH.transformers >= Version("5.0.0rc1")

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = ("llama", "gemma3")
BATCHES = {"left-padded": (17, 12), "unpadded": (17, 17)}
PROMPT_LENGTH = 17
CHUNK = 8
MAX_NEW_TOKENS = 4  # max_length 21: a static cache of 20 slots, as in the declared error
USER_CACHE_LENGTH = 64
CASES = ("static", "beam-static", "user-static", "dynamic", "default")
#: A stock run that is silently wrong is off by far more than rounding.
WRONG_BY_AT_LEAST = 1e-3

INDEX_ERROR = PATCH.error("out of bounds")
CACHE_ERROR = PATCH.error("without a cache")


def _module():
    return PATCH.patch_module


def _numbers_blurred(text: str) -> str:
    return re.sub(r"\d+", "N", text)





# -- the patch data ---------------------------------------------------------------------------------


def test_fingerprint_of_installed_code_is_known_with_the_right_label():
    present = PATCH.present_targets()
    # One chunked prefill per release: _prefill_chunking (4.55 - 4.57) or _prefill (5.0.0rc1 on).
    assert [target.qualname for target, _ in present] == [
        _module().QUALNAME if CHUNKS_THE_WHOLE_PROMPT else _module().CHUNKING_QUALNAME
    ]
    ((target, func),) = present
    digest = fingerprint(func)
    if PATCH.affected:
        assert digest in target.originals
        label = target.originals[digest].label
    else:
        assert PATCH.fixed_upstream and digest in target.fixed
        label = target.fixed[digest]
    assert label_names(label, PATCH.transformers), label


def test_declared_labels_agree_with_the_version_range():
    PATCH.assert_labels_within_range()


def test_patch_module_imports_neither_torch_nor_transformers():
    assert heavy_imports("overlay.patches.chunked_prefill") == []


def test_declared_errors_are_the_ones_stock_raises_here(runs):
    """The texts in ``Patch.errors`` are stock's own, for this test's lengths (17 + 4 - 1 slots),
    on the releases that raise them; elsewhere stock's chunked prefill raises nothing."""
    run = runs["llama"]["left-padded"]["static"]["stock"]["chunked"]
    if not DECODES_ONE_LATE:  # 4.55 - 4.57 are silently wrong (padded rows); 5.3.0 on are right
        assert run["ok"], run.get("error")
        return
    assert run["error"] == "IndexError: " + INDEX_ERROR
    if NO_DEFAULT_CACHE:
        run = runs["llama"]["left-padded"]["default"]["stock"]["chunked"]
        assert run["error"] == "ValueError: " + CACHE_ERROR


def test_replacement_keeps_signature_docstring_and_wraps_the_original():
    if not PATCH.affected:
        pytest.skip("the replacements are built for the originals 4.55.0 - 5.2.0 only")
    ((target, original),) = PATCH.present_targets()
    replacement = target.build(original)
    assert replacement.__wrapped__ is original
    assert replacement.__doc__ == original.__doc__ and replacement.__name__ == original.__name__
    assert inspect.signature(replacement) == inspect.signature(original)


# -- the runs ---------------------------------------------------------------------------------------


def _generate(model, batch, max_new_tokens=MAX_NEW_TOKENS, **kwargs) -> dict:
    """One greedy (or beam) generate(): ids, scores, logits and the cache_position and position_ids
    of every forward of the decoder inside, or the error."""
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
    # The decoder inside (GPT-2's is "transformer"): 4.55 - 4.57 run the chunks through the outer
    # model's bound forward, which calls no hooks of its own.
    decoder = model.transformer if hasattr(model, "transformer") else model.model
    hook = decoder.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        with torch.no_grad():
            out = model.generate(
                **batch, max_new_tokens=max_new_tokens, do_sample=False, disable_compile=True,
                return_dict_in_generate=True, output_scores=True, output_logits=True, **kwargs,
            )
        result = {
            "ok": True,
            "ids": out.sequences[:, -max_new_tokens:].tolist(),
            "scores": torch.stack(out.scores),
            "logits": torch.stack(out.logits),
        }
    except Exception as exc:  # noqa: BLE001  (the tests read which one)
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        hook.remove()
    result["positions"] = positions
    result["position_ids"] = position_ids
    result["fired"] = report.fired_actions().get(PATCH.id, {})
    return result


def _user_static_cache(model, batch_size: int):
    """A fresh ``StaticCache`` of :data:`USER_CACHE_LENGTH` slots, as a user builds one."""
    import torch

    from overlay.testing.models import user_static_cache

    return user_static_cache(model.config, batch_size, USER_CACHE_LENGTH, torch.float32)


def _case_kwargs(case: str, model, batch_size: int) -> dict:
    from overlay.testing.models import cache_argument_name

    if case == "static":
        return {"cache_implementation": "static"}
    if case == "beam-static":
        return {"cache_implementation": "static", "num_beams": 2}
    if case == "user-static":  # a fresh cache for every call
        return {cache_argument_name(model): _user_static_cache(model, batch_size)}
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
        status = statuses[PATCH.id]
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
                            "reference": _generate(model, batch, **_case_kwargs(case, model, len(lengths))),
                            "chunked": _generate(
                                model, batch, prefill_chunk_size=CHUNK, **_case_kwargs(case, model, len(lengths))
                            ),
                        }
    return results


def _release_chunks(case: str) -> bool:
    """Whether this release chunks the prefill of the case at all (4.55 - 4.57: not beam search)."""
    return CHUNKS_THE_WHOLE_PROMPT or case != "beam-static"


def _stock_fails(kind: str, case: str) -> str | None:
    """The error stock raises on this release for a chunked run, or None."""
    if not DECODES_ONE_LATE:
        return None
    if case in ("static", "beam-static"):
        return "IndexError: " + INDEX_ERROR
    if case == "default" and NO_DEFAULT_CACHE:
        return "ValueError: " + CACHE_ERROR
    return None


def _stock_silently_wrong(kind: str, batch: str, case: str) -> bool:
    """Stock finishes on this release, but its scores are not the reference's."""
    if not EMPTY_CACHE_BUGS or _stock_fails(kind, case) or not _release_chunks(case):
        return False
    if CHUNKS_IGNORE_PADDING and batch == "left-padded":
        return True
    # 5.0.0rc1 - 5.2.0: a dynamic cache (and the default one, a dynamic cache from 5.1.0) only
    # misleads the sliding layers' mask, which Llama has none of; from 5.2.0 every chunk but the
    # last is embedded at the wrong positions, whatever the cache.
    return DECODES_ONE_LATE and (case == "user-static" or kind == "gemma3" or WHOLE_PROMPT_POSITION_IDS)


ALL = pytest.mark.parametrize("kind,batch,case", [(k, b, c) for k in MODELS for b in BATCHES for c in CASES])


def test_engine_status(runs):
    PATCH.assert_reported(runs["status"])


@ALL
def test_chunked_prefill_on_stock_transformers(runs, kind, batch, case):
    record = runs[kind][batch][case]["stock"]
    chunked, reference = record["chunked"], record["reference"]
    assert reference["ok"], reference.get("error")  # without chunking stock works everywhere
    error = _stock_fails(kind, case)
    if error is not None:
        assert not chunked["ok"], "stock transformers was expected to fail with a chunked prefill"
        assert _numbers_blurred(chunked["error"]) == _numbers_blurred(error), chunked["error"]
    elif _stock_silently_wrong(kind, batch, case):
        assert chunked["ok"], chunked.get("error")
        assert max_score_difference(chunked, reference) > WRONG_BY_AT_LEAST, "stock was expected to differ here"
    else:
        assert_same_generation(chunked, reference)


@ALL
def test_chunked_prefill_with_the_overlay_equals_the_unchunked_run(runs, kind, batch, case):
    record = runs[kind][batch][case]["patched"]
    assert_same_generation(record["chunked"], record["reference"])


def _chunk_count(prefilled: int) -> int:
    return -(-prefilled // CHUNK)


#: How many prompt tokens the chunks cover: the whole prompt from 5.0.0rc1, all but the last before.
PREFILLED = PROMPT_LENGTH if CHUNKS_THE_WHOLE_PROMPT else PROMPT_LENGTH - 1


@ALL
def test_every_forward_sees_the_positions_of_the_unchunked_run(runs, kind, batch, case):
    """The chunks cover 0 .. 16 (4.55 - 4.57: 0 .. 15, then 16 in the loop), then decoding
    continues at 17, 18, 19 as without chunking."""
    if not EMPTY_CACHE_BUGS:
        pytest.skip("5.3.0 on: onto an empty cache the overlay runs the release's code (5.4.0+ pass no positions)")
    record = runs[kind][batch][case]
    reference = record["patched"]["reference"]["positions"]
    chunked = record["patched"]["chunked"]["positions"]
    assert reference[0] == list(range(PROMPT_LENGTH))
    assert reference[1:] == [[PROMPT_LENGTH + step] for step in range(MAX_NEW_TOKENS - 1)]
    if not _release_chunks(case):  # 4.55 - 4.57 beam search: one prefill, as without chunking
        assert chunked == reference == record["stock"]["chunked"]["positions"]
        return
    chunks = _chunk_count(PREFILLED)
    assert [p for chunk in chunked[:chunks] for p in chunk] == list(range(PREFILLED))
    last_prompt_token = [] if CHUNKS_THE_WHOLE_PROMPT else [[PROMPT_LENGTH - 1]]
    assert chunked[chunks:] == last_prompt_token + reference[1:]
    stock = record["stock"]["chunked"]["positions"]
    if case == "default" and NO_DEFAULT_CACHE:
        assert stock == []  # refused before the first chunk
    elif DECODES_ONE_LATE:
        assert stock[:chunks] == chunked[:chunks]
        assert stock[chunks] == [PROMPT_LENGTH + 1], "stock decodes one position late"
    else:  # 4.55 - 4.57 decode at the right positions
        assert stock == chunked


@ALL
def test_every_forward_sees_the_position_ids_of_the_unchunked_run(runs, kind, batch, case):
    """Each chunk gets its own rows' slice of the prompt's position ids (left padding included);
    decoding continues from them."""
    if not EMPTY_CACHE_BUGS:
        pytest.skip("5.3.0 on: onto an empty cache the overlay runs the release's code")
    record = runs[kind][batch][case]
    reference = record["patched"]["reference"]["position_ids"]
    chunked = record["patched"]["chunked"]["position_ids"]
    prompt = reference[0]
    assert prompt is not None and len(prompt[0]) == PROMPT_LENGTH
    if not _release_chunks(case):
        assert chunked == reference
        return
    chunks = _chunk_count(PREFILLED)
    joined = [sum((chunk[row] for chunk in chunked[:chunks]), []) for row in range(len(prompt))]
    assert joined == [row[:PREFILLED] for row in prompt]
    last_prompt_token = [] if CHUNKS_THE_WHOLE_PROMPT else [[row[-1:] for row in prompt]]
    assert chunked[chunks:] == last_prompt_token + reference[1:]
    stock = record["stock"]["chunked"]["position_ids"]
    if CHUNKS_IGNORE_PADDING and stock:  # one row for the whole batch, counted from 0
        bounds = [(start, min(start + CHUNK, PREFILLED)) for start in range(0, PREFILLED, CHUNK)]
        assert stock[:chunks] == [[list(range(start, end))] for start, end in bounds]
    if WHOLE_PROMPT_POSITION_IDS:  # the first chunk got the last chunk's positions
        assert stock[0] == [row[-CHUNK:] for row in prompt]


@ALL
def test_the_overlay_changes_nothing_where_stock_works(runs, kind, batch, case):
    record = runs[kind][batch][case]
    pairs = [("reference", "reference")]
    stock_chunked_is_right = not (_stock_fails(kind, case) or _stock_silently_wrong(kind, batch, case))
    # 5.0.0rc1 - 5.2.0 change the decode positions even where stock's scores come out right.
    if not EMPTY_CACHE_BUGS or (stock_chunked_is_right and not DECODES_ONE_LATE):
        pairs.append(("chunked", "chunked"))
    for stock_key, patched_key in pairs:
        assert_bit_for_bit(record["patched"][patched_key], record["stock"][stock_key])


@ALL
def test_what_the_patch_reports(runs, kind, batch, case):
    module = _module()
    record = runs[kind][batch][case]
    assert record["patched"]["reference"]["fired"] == {}  # no chunking: the original alone
    assert record["stock"]["chunked"]["fired"] == {}
    fired = record["patched"]["chunked"]["fired"]
    if not EMPTY_CACHE_BUGS or not _release_chunks(case):
        assert fired == {}
        return
    expected = {}
    if CHUNKS_IGNORE_PADDING:  # the chunk loop runs in the overlay, with an attention mask
        expected[module.MASK_POSITION_IDS] = 1
    if DECODES_ONE_LATE:
        expected[module.CORRECTED_POSITION] = 1
    if case == "default" and NO_DEFAULT_CACHE:
        expected[module.DEFAULT_CACHE] = 1
    if WHOLE_PROMPT_POSITION_IDS:  # generate() prepared them for the whole prompt
        expected[module.OWN_POSITION_IDS] = 1
    # 5.1.0 - 5.2.0 always prepare a cache: the default-cache step never fires there; before
    # 5.2.0 generate() passes the chunks no position ids: that step never fires there.
    assert fired == expected


# -- a padded batch, every architecture -------------------------------------------------------------

ARCHITECTURES = ("llama", "qwen3", "gemma3", "olmo2", "gpt2")
PADDED_CACHES = ("static", "default")
#: The second row padded by 3.
PADDED_LENGTHS = (11, 8)
PADDED_CHUNK = 3
PADDED_NEW_TOKENS = 5
#: head_dim 8; weights drawn wider than the default 0.02, so that attention is sharp enough for a
#: token's position to decide the argmax (with 0.02 a shifted row mostly keeps its tokens).
SIZES = dict(hidden_size=32, intermediate_size=64, initializer_range=0.3)


def _architecture(kind: str):
    from overlay.testing.models import tiny_gpt2, tiny_model

    return tiny_gpt2(**SIZES) if kind == "gpt2" else tiny_model(kind, **SIZES)


@pytest.fixture(scope="module")
def padded_runs():
    """``{architecture: {cache: {"stock"|"patched": {"reference"|"chunked": run}}}}``."""
    from overlay.testing.models import left_padded_batch

    batch = left_padded_batch(PADDED_LENGTHS)
    results: dict = {}
    for kind in ARCHITECTURES:
        model = _architecture(kind)
        for cache in PADDED_CACHES:
            kwargs = {"cache_implementation": cache} if cache != "default" else {}
            record = results.setdefault(kind, {}).setdefault(cache, {})
            for state in ("stock", "patched"):
                with overlay.reverted() if state == "stock" else PATCH.applied():
                    record[state] = {
                        "reference": _generate(model, batch, PADDED_NEW_TOKENS, **kwargs),
                        "chunked": _generate(model, batch, PADDED_NEW_TOKENS, prefill_chunk_size=PADDED_CHUNK, **kwargs),
                    }
    return results


PADDED = pytest.mark.parametrize("kind,cache", [(k, c) for k in ARCHITECTURES for c in PADDED_CACHES])


@PADDED
def test_padded_batch_on_stock_transformers(padded_runs, kind, cache):
    record = padded_runs[kind][cache]["stock"]
    chunked, reference = record["chunked"], record["reference"]
    assert reference["ok"], reference.get("error")
    if CHUNKS_IGNORE_PADDING:
        if DECODES_ONE_LATE:  # the release candidates: the decode position's errors come first
            error = "IndexError: " + INDEX_ERROR if cache == "static" else "ValueError: " + CACHE_ERROR
            assert _numbers_blurred(chunked.get("error", "")) == _numbers_blurred(error), chunked
            return
        assert chunked["ok"], chunked.get("error")
        assert chunked["ids"][0] == reference["ids"][0]  # the row without padding is right
        assert chunked["ids"][1] != reference["ids"][1], "stock was expected to give the padded row other tokens"
    elif not EMPTY_CACHE_BUGS:
        assert_same_generation(chunked, reference)
    else:
        pytest.skip(
            f"transformers {PATCH.transformers}: the chunks' position ids follow the padding (5.0.0rc3 on); "
            "this release's own chunked-prefill bug: test_chunked_prefill_on_stock_transformers"
        )


@PADDED
def test_padded_batch_with_the_overlay_equals_the_unchunked_run(padded_runs, kind, cache):
    record = padded_runs[kind][cache]["patched"]
    assert_same_generation(record["chunked"], record["reference"])


@PADDED
def test_padded_batch_unchunked_run_is_stock_bit_for_bit(padded_runs, kind, cache):
    record = padded_runs[kind][cache]
    assert_bit_for_bit(record["patched"]["reference"], record["stock"]["reference"])
    if not EMPTY_CACHE_BUGS:
        assert_bit_for_bit(record["patched"]["chunked"], record["stock"]["chunked"])


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('both', 'test_kept_cache_on_stock_transformers',
                    'a kept cache completes with other tokens on stock; the decode position raises IndexError')
