"""chunked-prefill onto a cache that already holds tokens: ``generate(prefill_chunk_size=N)`` with a
kept prefix cache gives the unchunked run's output.

Reproduced for real on the CPU, in this process. A user runs the first 6 columns of a batch of two
(12 columns; left padded by 3, or without padding) through the model into their own cache (a
``DynamicCache``, or a ``StaticCache`` of 32 slots built ahead), then calls ``generate()`` with
that cache, ``prefill_chunk_size=4`` and 5 new tokens (tiny Llama, Qwen3 and Gemma 3 with a
sliding layer of window 16). The prompt is either the whole sequence, or (5.3.0 on, which slice the
prompt when the attention mask is longer) only the 6 new columns with the whole sequence's mask.
The reference is the same call without ``prefill_chunk_size``, with a cache prefilled the same way.

On 4.55.0 - 5.20.2 stock chunks from position 0 whatever the cache holds: its chunks feed the
prefix again (positions ``0 ..``). Where the cache appends what it is given (dynamic caches, every
cache from 5.4.0, a sliding static layer from 4.56.0) it ends with 22 entries instead of 16 and
other tokens; a static cache up to 5.3.0 gets the chunks' own positions and rewrites the prefix in
place with the same values, so for Llama and Qwen3 only this release's other chunked-prefill bugs
(tests/patches/chunked_prefill/test_patch_chunked_prefill.py) can show. The prompt of new tokens only gets the prefix's
positions: other scores (and, but for Gemma 3's unpadded batch on 5.18.0 - 5.20.2, other tokens). With the patch every chunked run gives the reference's ids, its scores and
logits (to float rounding), its cache length and its position ids. The unchunked run is stock's bit
for bit; on 5.3.0 - 5.20.2 so is a chunked run onto an empty cache (stock is right there), and on
5.21.0 on, where the engine reports "fixed upstream", every run.
"""

from __future__ import annotations

import pytest
from packaging.version import Version

import overlay
from overlay.testing.harness import PatchUnderTest, assert_bit_for_bit, assert_same_generation, max_score_difference

PATCH = PatchUnderTest("chunked_prefill")
PATCH.skip_module_unless_covered()  # releases before 4.55.0 are out of the overlay's scope
#: 5.3.0 on slice the prompt after the cache's length only when the mask is as long as the prompt:
#: a prompt of the new tokens only is theirs to take; up to 5.2.0 the prompt is the whole sequence.
TAKES_NEW_TOKENS_ONLY = PATCH.transformers >= Version("5.3.0")
#: 5.3.0 on, a chunked prefill onto an empty cache is right on stock (tests/patches/chunked_prefill/test_patch_chunked_prefill.py).
EMPTY_CACHE_RIGHT_ON_STOCK = PATCH.transformers >= Version("5.3.0")
#: Up to 5.3.0 the chunks get their own cache_position (from 0 on stock): a static layer writes
#: there, over the prefix; from 5.4.0 it writes after what it holds.
STATIC_WRITES_AT_CACHE_POSITION = PATCH.transformers < Version("5.4.0")
#: 4.56.0 on, a sliding static layer counts what it was given (``cumulative_length``).
SLIDING_LAYER_COUNTS = PATCH.transformers >= Version("4.56.0")
#: 4.55 - 4.57 leave the last prompt token to the decoding loop; 5.0.0rc1 on chunk the whole prompt.
CHUNKS_THE_WHOLE_PROMPT = PATCH.transformers >= Version("5.0.0rc1")

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = ("llama", "qwen3", "gemma3")
BATCHES = {"left-padded": (12, 9), "unpadded": (12, 12)}
CACHES = ("dynamic", "static")
PROMPTS = ("whole sequence", "new tokens only")
COLUMNS = 12
PREFIX = 6
CHUNK = 4
NEW_TOKENS = 5
STATIC_LENGTH = 32
#: What the cache holds after the reference: the prefix, the rest of the prompt, all new tokens
#: but the last.
REFERENCE_LENGTH = COLUMNS + NEW_TOKENS - 1
#: head_dim 8 and weights drawn wider than the default 0.02: attention sharp enough that a wrong
#: position moves the argmax (tests/patches/chunked_prefill/test_patch_chunked_prefill.py does the same).
SIZES = dict(hidden_size=32, intermediate_size=64, initializer_range=0.3)
#: A stock run that is silently wrong is off by far more than rounding.
WRONG_BY_AT_LEAST = 1e-3


def _fresh_cache(model, batch, cache: str):
    """A new ``DynamicCache``, or a ``StaticCache`` of :data:`STATIC_LENGTH` slots built ahead, as
    a user builds them."""
    import torch

    from overlay.testing.models import dynamic_cache, static_cache

    if cache == "dynamic":
        return dynamic_cache(model.config)
    return static_cache(model.config, batch["input_ids"].shape[0], STATIC_LENGTH, torch.float32)


def _prefilled_cache(model, batch, cache: str):
    """The user's cache with the batch's first :data:`PREFIX` columns run through the model."""
    import torch

    from overlay.testing.models import cache_argument_name

    kept = _fresh_cache(model, batch, cache)
    mask = batch["attention_mask"][:, :PREFIX]
    with torch.no_grad():
        model(
            input_ids=batch["input_ids"][:, :PREFIX], attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, **{cache_argument_name(model): kept},
        )
    return kept


def _generate(model, batch, prompt: str, cache, **kwargs) -> dict:
    """One greedy generate() with ``cache``: the new ids, scores, logits, the cache's length after,
    and the token count and position ids of every forward of the decoder inside; or the error."""
    import torch

    from overlay import report
    from overlay.testing.models import PAD_TOKEN_ID, cache_argument_name

    inputs = dict(batch)
    if prompt == "new tokens only":  # the mask stays the whole sequence's
        inputs["input_ids"] = batch["input_ids"][:, PREFIX:]
    forwards: list = []

    def seen(_module, args, forward_kwargs):
        tokens = forward_kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = forward_kwargs["inputs_embeds"]
        ids = forward_kwargs.get("position_ids")
        forwards.append((tokens.shape[1], None if ids is None else ids.tolist()))

    report.reset()
    hook = model.model.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        with torch.no_grad():
            out = model.generate(
                **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, disable_compile=True, pad_token_id=PAD_TOKEN_ID,
                return_dict_in_generate=True, output_scores=True, output_logits=True,
                **{cache_argument_name(model): cache}, **kwargs,
            )
        result = {
            "ok": True,
            "ids": out.sequences[:, -NEW_TOKENS:].tolist(),
            "scores": torch.stack(out.scores),
            "logits": torch.stack(out.logits),
            "length": int(cache.get_seq_length()),
        }
    except Exception as exc:  # noqa: BLE001  (the tests read which one)
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        hook.remove()
    result["forwards"] = forwards
    result["fired"] = report.fired_actions().get(PATCH.id, {})
    return result


@pytest.fixture(scope="module")
def runs():
    """``{model: {batch: {cache: {prompt: {"stock"|"patched": {"reference"|"chunked": run}},
    "empty": {"stock"|"patched": run}}}}}`` and the engine's status under ``"status"``."""
    import transformers.generation.utils  # noqa: F401  (the patch's module, so the engine judges it)

    from overlay.testing.models import left_padded_batch, tiny_model

    results: dict = {}
    with PATCH.applied() as statuses:
        status = statuses[PATCH.id]
        results["status"] = {"state": status.state, "variants": list(status.variants)}
    prompts = PROMPTS if TAKES_NEW_TOKENS_ONLY else PROMPTS[:1]
    for kind in MODELS:
        model = tiny_model(kind, **SIZES)
        for batch_name, lengths in BATCHES.items():
            batch = left_padded_batch(lengths, seed=3)
            for cache in CACHES:
                record = results.setdefault(kind, {}).setdefault(batch_name, {}).setdefault(cache, {})
                for prompt in prompts:
                    record[prompt] = {}
                    for state in ("stock", "patched"):
                        with overlay.reverted() if state == "stock" else PATCH.applied():
                            record[prompt][state] = {
                                "reference": _generate(model, batch, prompt, _prefilled_cache(model, batch, cache)),
                                "chunked": _generate(
                                    model, batch, prompt, _prefilled_cache(model, batch, cache), prefill_chunk_size=CHUNK
                                ),
                            }
                record["empty"] = {}
                for state in ("stock", "patched"):
                    with overlay.reverted() if state == "stock" else PATCH.applied():
                        record["empty"][state] = _generate(
                            model, batch, "whole sequence", _fresh_cache(model, batch, cache), prefill_chunk_size=CHUNK
                        )
    return results


CASES = [
    (kind, batch, cache, prompt)
    for kind in MODELS for batch in BATCHES for cache in CACHES for prompt in PROMPTS
]
ALL = pytest.mark.parametrize("kind,batch,cache,prompt", CASES)


def _record(runs, kind, batch, cache, prompt) -> dict:
    if prompt not in runs[kind][batch][cache]:
        pytest.skip(
            f"transformers {PATCH.transformers}: up to 5.2.0 generate() with a cache takes the whole sequence as "
            "the prompt (without chunking too)"
        )
    return runs[kind][batch][cache][prompt]


def _prefill_positions(run: dict) -> list:
    """Every position id the prompt's forwards got, row by row, chunk after chunk (the forwards
    before the last ``NEW_TOKENS - 1``, which decode)."""
    prefill = run["forwards"][: len(run["forwards"]) - (NEW_TOKENS - 1)]
    assert all(ids is not None for _, ids in prefill), prefill
    rows = len(prefill[0][1])
    return [sum((ids[row] for _, ids in prefill), []) for row in range(rows)]


def _prefill_tokens(run: dict) -> int:
    return sum(count for count, _ in run["forwards"][: len(run["forwards"]) - (NEW_TOKENS - 1)])


def _appends(kind: str, cache: str) -> bool:
    """Whether stock's chunks land after what the cache holds (so it ends with the prefix twice),
    rather than over it at their own positions (a static layer up to 5.3.0)."""
    return cache == "dynamic" or not STATIC_WRITES_AT_CACHE_POSITION or (kind == "gemma3" and SLIDING_LAYER_COUNTS)


def test_engine_status(runs):
    PATCH.assert_reported(runs["status"])


@ALL
def test_the_unchunked_reference_is_right_and_stock_bit_for_bit(runs, kind, batch, cache, prompt):
    record = _record(runs, kind, batch, cache, prompt)
    reference = record["stock"]["reference"]
    assert reference["ok"], reference.get("error")
    assert reference["length"] == REFERENCE_LENGTH
    # The prompt's forward takes the tokens after the prefix, at their own positions.
    assert _prefill_tokens(reference) == COLUMNS - PREFIX
    assert_bit_for_bit(record["patched"]["reference"], reference, "length", "forwards")
    assert record["patched"]["reference"]["fired"] == {}


@ALL
def test_kept_cache_on_stock_transformers(runs, kind, batch, cache, prompt):
    record = _record(runs, kind, batch, cache, prompt)
    chunked, reference = record["stock"]["chunked"], record["stock"]["reference"]
    assert chunked["ok"], chunked.get("error")
    if not PATCH.affected:  # 5.21.0 on: the chunks start after what the cache holds
        assert_same_generation(chunked, reference)
        assert chunked["length"] == REFERENCE_LENGTH
        assert _prefill_positions(chunked) == _prefill_positions(reference)
        return
    # The bug: the chunks start at position 0 whatever the cache holds.
    assert _prefill_positions(chunked) != _prefill_positions(reference)
    if prompt == "whole sequence":
        assert _prefill_tokens(chunked) == COLUMNS, "stock feeds the prefix through the model again"
        if _appends(kind, cache):
            assert chunked["length"] == REFERENCE_LENGTH + PREFIX, "the prefix twice in the cache"
            assert chunked["ids"] != reference["ids"]
        return
    assert _prefill_tokens(chunked) == COLUMNS - PREFIX
    # The new tokens embedded at the prefix's positions: other scores (Gemma 3's unpadded batch
    # keeps its argmax on 5.18.0 - 5.20.2).
    assert max_score_difference(chunked, reference) > WRONG_BY_AT_LEAST


@ALL
def test_kept_cache_with_the_overlay_equals_the_unchunked_run(runs, kind, batch, cache, prompt):
    record = _record(runs, kind, batch, cache, prompt)
    chunked, reference = record["patched"]["chunked"], record["patched"]["reference"]
    assert_same_generation(chunked, reference)
    assert chunked["length"] == reference["length"] == REFERENCE_LENGTH
    assert _prefill_tokens(chunked) == COLUMNS - PREFIX
    assert _prefill_positions(chunked) == _prefill_positions(reference)
    # Decoding: the same positions as after the unchunked prefill.
    assert chunked["forwards"][-(NEW_TOKENS - 1):] == reference["forwards"][-(NEW_TOKENS - 1):]
    if not PATCH.affected:
        assert_bit_for_bit(chunked, record["stock"]["chunked"], "length", "forwards")


@ALL
def test_what_the_patch_reports(runs, kind, batch, cache, prompt):
    module = PATCH.patch_module
    record = _record(runs, kind, batch, cache, prompt)
    assert record["stock"]["chunked"]["fired"] == {}
    fired = record["patched"]["chunked"]["fired"]
    if not PATCH.affected:
        assert fired == {}
        return
    expected = {module.KEPT_CACHE: 1}
    if PATCH.transformers < Version("5.0.0rc3"):  # the chunk loop runs in the overlay, with a mask
        expected[module.MASK_POSITION_IDS] = 1
    if CHUNKS_THE_WHOLE_PROMPT and PATCH.transformers < Version("5.3.0"):
        expected[module.CORRECTED_POSITION] = 1
    assert fired == expected


@pytest.mark.parametrize("kind,batch,cache", [(k, b, c) for k in MODELS for b in BATCHES for c in CACHES])
def test_an_empty_cache_is_stock_where_stock_is_right(runs, kind, batch, cache):
    """5.3.0 on, a chunked prefill onto an empty cache is right on stock, and the overlay runs the
    release's code (up to 5.2.0 it is the other bugs' case: tests/patches/chunked_prefill/test_patch_chunked_prefill.py)."""
    record = runs[kind][batch][cache]["empty"]
    if not EMPTY_CACHE_RIGHT_ON_STOCK:
        pytest.skip(f"transformers {PATCH.transformers}: stock's chunked prefill onto an empty cache has this "
                    "release's other bugs (tests/patches/chunked_prefill/test_patch_chunked_prefill.py)")
    assert_bit_for_bit(record["patched"], record["stock"], "length", "forwards")
    assert record["patched"]["fired"] == {}
    assert record["stock"]["length"] == REFERENCE_LENGTH
