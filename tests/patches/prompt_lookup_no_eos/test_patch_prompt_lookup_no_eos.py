"""prompt-lookup-no-eos: ``generate(prompt_lookup_num_tokens=N)`` works without an eos token.

Reproduced for real on the CPU, in this process: tiny random Llama and Qwen 3 built without an
``eos_token_id`` (so their generation config has none, as a user's model without one does), a
batch of one row (prompt lookup takes no more): a prompt that repeats a phrase, and a random
prompt (the tiny models soon repeat themselves, which the lookup matches too). Greedy, default
settings otherwise. The control is the same prompt-lookup call on stock with an eos token the run
never generates (``UNUSED_EOS``, checked): the same code path, whose eos cut then cuts nothing, as
the fixed release's skipped cut does. It also begins with plain greedy decoding's ids (greedy
prompt lookup accepts only the tokens greedy would pick; on every release, fixed ones included,
assisted decoding may add one token past ``max_new_tokens``, which is not this bug).

On 4.55.0 - 5.12.1 stock raises the ``TypeError`` of ``torch.isin(..., None)`` the patch declares;
with the patch every run gives the control's ids, as stock does on 5.13.0+ (where the engine
reports "fixed upstream"). The other controls: the same models with an eos token, where stock works
and the overlay gives stock's ids without firing; and, at the candidate generator itself, a
generator with an eos token cuts its candidates at it with and without the overlay.
"""

from __future__ import annotations

import inspect

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("prompt_lookup_no_eos")
PATCH.skip_module_unless_covered()

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = ("llama", "qwen3")
PROMPTS = ("repeated phrase", "random")
LOOKUP_TOKENS = 3
MAX_NEW_TOKENS = 12
ISIN_ERROR = PATCH.error("isin()")
ACTION = "looked up candidates without an eos token"
#: An eos token the control runs never generate (checked): their eos cut cuts nothing.
UNUSED_EOS = 127


def _prompt(name: str) -> dict:
    import torch

    from overlay.testing.models import left_padded_batch

    if name == "random":
        return left_padded_batch((8,), seed=5)
    phrase = left_padded_batch((8,), seed=3)["input_ids"]
    input_ids = torch.cat([phrase, phrase, phrase[:, :3]], dim=1)  # the phrase, again, and its start
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _generate(model, batch, **kwargs) -> dict:
    """The ids of one greedy run, or the error it raised, with what the patch reported."""
    from overlay import report
    from overlay.testing.models import greedy_ids

    report.reset()
    try:
        run = {"ok": True, "ids": greedy_ids(model, batch, MAX_NEW_TOKENS, **kwargs)}
    except Exception as exc:  # noqa: BLE001  (the tests read which one)
        run = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
    run["fired"] = report.fired_actions().get(PATCH.id, {})
    return run


@pytest.fixture(scope="module")
def runs():
    """``{(model, with eos?): {"eos": the generation config's, prompt: {"greedy" (no prompt lookup),
    "control" (prompt lookup, stock, an eos token never generated), "stock", "patched"}}}``."""
    import transformers.generation.candidate_generator  # noqa: F401  (the patch's module)

    from overlay.testing.models import EOS_TOKEN_ID, tiny_model

    results: dict = {}
    for kind in MODELS:
        for has_eos in (False, True):
            model = tiny_model(kind, eos_token_id=EOS_TOKEN_ID if has_eos else None)
            record = results[kind, has_eos] = {"eos": model.generation_config.eos_token_id}
            for name in PROMPTS:
                batch = _prompt(name)
                lookup = dict(prompt_lookup_num_tokens=LOOKUP_TOKENS)
                with overlay.reverted():
                    greedy = _generate(model, batch)
                    control = _generate(model, batch, eos_token_id=UNUSED_EOS, **lookup)
                    stock = _generate(model, batch, **lookup)
                with PATCH.applied():
                    patched = _generate(model, batch, **lookup)
                record[name] = {"greedy": greedy, "control": control, "stock": stock, "patched": patched}
    return results


CASES = pytest.mark.parametrize("kind,prompt", [(k, p) for k in MODELS for p in PROMPTS])


# -- the patch data ---------------------------------------------------------------------------------


# -- generate() -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MODELS)
def test_the_models_have_no_eos_token_by_default(runs, kind):
    """Nothing but the model's own config: generate()'s default settings reach the bug."""
    assert runs[kind, False]["eos"] is None
    assert runs[kind, True]["eos"] is not None


@CASES
def test_the_control_run(runs, kind, prompt):
    """Prompt lookup with an eos token never generated: the fixed code path's ids, which begin
    with plain greedy decoding's."""
    record = runs[kind, False][prompt]
    greedy, control = record["greedy"], record["control"]
    assert greedy["ok"] and control["ok"], record
    (ids,) = control["ids"]
    assert UNUSED_EOS not in ids, "the control's eos token must never be generated"
    assert ids[: len(greedy["ids"][0])] == greedy["ids"][0]
    assert len(ids) - len(greedy["ids"][0]) in (0, 1), "at most the one token assisted decoding adds"


@CASES
def test_prompt_lookup_without_eos_on_stock_transformers(runs, kind, prompt):
    record = runs[kind, False][prompt]
    stock = record["stock"]
    if PATCH.affected:
        assert (stock["ok"], stock.get("type")) == (False, "TypeError"), stock
        assert ISIN_ERROR in stock["error"]
    else:  # 5.13.0+: upstream's fix
        assert stock["ok"] and stock["ids"] == record["control"]["ids"], stock


@CASES
def test_prompt_lookup_without_eos_with_the_overlay(runs, kind, prompt):
    record = runs[kind, False][prompt]
    patched = record["patched"]
    assert patched["ok"], patched
    assert patched["ids"] == record["control"]["ids"]
    if PATCH.affected:
        # Each call that found candidates is one stock would have raised in.
        assert set(patched["fired"]) == {ACTION} and patched["fired"][ACTION] >= 1, patched["fired"]
    else:
        assert patched["fired"] == {}
        assert patched["ids"] == record["stock"]["ids"], "the fixed release's own ids"


@CASES
def test_models_with_an_eos_token_are_unchanged(runs, kind, prompt):
    record = runs[kind, True][prompt]
    assert record["stock"]["ok"], record["stock"]
    assert record["patched"] == record["stock"], "same ids, nothing fired"


# -- the candidate generator itself -----------------------------------------------------------------


def _candidates(eos_token_id) -> dict:
    """A prompt-lookup generator's candidates for ``1 2 3 4 5 6 1 2``: the match ``1 2`` proposes
    ``3 4 5``; ``eos_token_id`` is ``None`` or a tensor of ids. Also the attribute afterwards."""
    import torch
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    generator = PromptLookupCandidateGenerator(
        eos_token_id=eos_token_id, num_output_tokens=3, max_matching_ngram_size=2, max_length=20
    )
    input_ids = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2]])
    extra = {}
    if "is_first_iteration" in inspect.signature(generator.get_candidates).parameters:  # 5.0.0 - 5.2.0
        extra["is_first_iteration"] = False
    try:
        candidates, _ = generator.get_candidates(input_ids, **extra)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "type": type(exc).__name__, "error": str(exc), "eos after": generator.eos_token_id}
    return {"ok": True, "candidates": candidates.tolist(), "eos after": generator.eos_token_id}


def test_candidate_generator_without_eos():
    with overlay.reverted():
        stock = _candidates(None)
    with PATCH.applied():
        patched = _candidates(None)
    assert patched == {"ok": True, "candidates": [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]], "eos after": None}
    if PATCH.affected:
        assert (stock["ok"], stock["type"]) == (False, "TypeError") and ISIN_ERROR in stock["error"], stock
    else:
        assert stock == patched


@pytest.mark.parametrize("eos", (4, 9))
def test_candidate_generator_with_eos_is_unchanged(eos):
    """An eos token among the candidates (4) cuts them before it; one that is not (9) cuts nothing."""
    import torch

    results = {}
    for state in ("stock", "patched"):
        with overlay.reverted() if state == "stock" else PATCH.applied():
            run = _candidates(torch.tensor([eos]))
        assert run["ok"], run
        run["eos after"] = run["eos after"].tolist()
        results[state] = run
    expected = [[1, 2, 3, 4, 5, 6, 1, 2, 3]] if eos == 4 else [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]]
    assert results["stock"] == results["patched"] == {"ok": True, "candidates": expected, "eos after": [eos]}


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_models_with_an_eos_token_are_unchanged',
                    "only models without an eos token, where stock's isin() raises TypeError")
