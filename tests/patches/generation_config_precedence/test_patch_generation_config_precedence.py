"""generation-config-precedence (with generation-config-set-keys): the values a caller sets in the
``GenerationConfig`` it passes to ``generate()`` win over the model's saved generation config.

Reproduced for real on the CPU: a tiny random Llama whose ``model.generation_config`` is set the way
instruct checkpoints ship it (``do_sample=True``, ``temperature=0.7``, ``top_p=0.9``, ``top_k=20``,
plus ``repetition_penalty``, ``num_beams`` and ``length_penalty`` for the other cases), saved by the
installed release (so 4.55 - 5.0.0rc1 take the "model defaults" branch). Each case passes a
``GenerationConfig`` with values equal to the release's global defaults and reads what
``_prepare_generation_config`` makes of it, then ``generate()``'s ids:

- stock, 4.55.0 - 5.0.0rc1: every such value is replaced by the model's (and the warning the patch
  declares is logged); 5.0.0rc2: only the booleans (``do_sample=False``); 5.0.0rc3+: none;
- with both patches: none, on every release; values the caller did not set still come from the
  model's config; ``generate(generation_config=GenerationConfig(do_sample=False))`` gives exactly
  the greedy ids of the same weights with no sampling default (what 5.0.0rc3+ gives), where stock
  samples (other ids per seed).

``use_model_defaults=False`` / ``True`` (4.55 - 5.0.0rc1) and ``generate()`` keyword arguments are
the same with and without the overlay; a config's ``to_dict()``, JSON, ``==`` and ``hash()`` too. The
limits the patch names (a deep copy, a ``to_dict()`` round trip) are asserted as limits.
"""

from __future__ import annotations

import copy
import inspect
import logging

import pytest

import overlay
from overlay.patch import PATCH_MARKER, Variant
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("generation_config_precedence")
KEYS = PatchUnderTest("generation_config_set_keys")
PATCH.skip_module_unless_covered()
assert KEYS.affected == PATCH.affected, "the two halves cover the same releases"

pytestmark = pytest.mark.usefixtures("one_thread")

ACTION = PATCH.patch_module.ACTION
#: What instruct checkpoints ship (the ids test), and more non-default values (the config cases).
INSTRUCT = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20}
MODEL_VALUES = {**INSTRUCT, "repetition_penalty": 1.3, "num_beams": 2, "length_penalty": 2.0}
#: A caller's GenerationConfig: each sets values equal to the global defaults of 4.55 - 5.0.0rc1.
CASES = {
    "do_sample=False": {"do_sample": False},
    "num_beams=1": {"num_beams": 1},
    "temperature=1.0": {"do_sample": True, "temperature": 1.0},
    "top_k=50": {"do_sample": True, "top_k": 50},
    "top_p=1.0": {"do_sample": True, "top_p": 1.0},
    "repetition_penalty=1.0": {"do_sample": False, "repetition_penalty": 1.0},
    "length_penalty=1.0": {"num_beams": 2, "length_penalty": 1.0},
}
NEW_TOKENS = 8
SEEDS = (0, 1, 2)


def _stock_variant() -> Variant | None:
    target = PATCH.patch.targets[0]
    return target.variant_of(PATCH.stock()) if PATCH.affected else None


#: 4.55 - 5.0.0rc1 replace every default-equal value; 5.0.0rc2 only booleans (from the code's variant).
TAKES_FLAG = PATCH.affected and _stock_variant()["takes_model_defaults_flag"]


def _lost_on_stock(values: dict) -> dict:
    """The caller's values stock replaces by the model's, on the installed release."""
    if not PATCH.affected:
        return {}
    return {
        key: MODEL_VALUES[key] for key, value in values.items()
        if key in MODEL_VALUES and MODEL_VALUES[key] != value and (TAKES_FLAG or isinstance(value, bool))
    }


def _model(values: dict):
    from overlay.testing.models import tiny_model

    model = tiny_model("llama")
    for key, value in values.items():
        setattr(model.generation_config, key, value)
    return model


@pytest.fixture(scope="module")
def model():
    return _model(MODEL_VALUES)


def _prepared(model, config, **kwargs) -> dict:
    prepared, _ = model._prepare_generation_config(config, **kwargs)
    return {key: getattr(prepared, key) for key in MODEL_VALUES}


def _lost(values: dict, prepared: dict) -> dict:
    return {key: prepared[key] for key, value in values.items() if prepared[key] != value}


# -- the patch data ---------------------------------------------------------------------------------


def test_replacements_keep_name_docstring_and_signature():
    for under_test, otherwise in ((PATCH, {"takes_model_defaults_flag": False}), (KEYS, {})):
        for target, stock in under_test.present_targets():
            # Built by hand on fixed releases too: only the wrapper's metadata is read here.
            replacement = target.build(stock, Variant("this release", otherwise))
            assert replacement.__wrapped__ is stock
            assert (replacement.__name__, replacement.__doc__) == (stock.__name__, stock.__doc__)
            assert inspect.signature(replacement) == inspect.signature(stock)


def test_engine_status():
    from transformers import GenerationConfig
    from transformers.generation.utils import GenerationMixin

    with PATCH.applied(KEYS.id) as statuses:
        states = {pid: status.state for pid, status in statuses.items()}
        markers = (getattr(GenerationMixin._prepare_generation_config, PATCH_MARKER, None),
                   getattr(GenerationConfig.__init__, PATCH_MARKER, None))
    if PATCH.affected:
        assert states == {PATCH.id: "applied", KEYS.id: "applied"}
        assert markers == (PATCH.id, KEYS.id)
    else:
        assert states == {PATCH.id: "fixed upstream", KEYS.id: "fixed upstream"}
        assert markers == (None, None)


# -- what _prepare_generation_config makes of the caller's config -----------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_caller_values_on_stock(model, case):
    from transformers import GenerationConfig

    values = CASES[case]
    with overlay.reverted():
        prepared = _prepared(model, GenerationConfig(max_new_tokens=4, **values))
    assert _lost(values, prepared) == _lost_on_stock(values)
    if PATCH.affected:
        assert (_lost(values, prepared) != {}) == (TAKES_FLAG or case in ("do_sample=False", "repetition_penalty=1.0"))


@pytest.mark.parametrize("case", list(CASES))
def test_caller_values_with_the_overlay(model, case):
    from transformers import GenerationConfig

    values = CASES[case]
    with overlay.reverted():
        stock = _prepared(model, GenerationConfig(max_new_tokens=4, **values))
    with PATCH.applied(KEYS.id):
        patched = _prepared(model, GenerationConfig(max_new_tokens=4, **values))
    assert _lost(values, patched) == {}
    # What the caller did not set is the model's, as on stock (upstream's intended behaviour).
    assert {k: v for k, v in patched.items() if k not in values} == {k: v for k, v in stock.items() if k not in values}
    assert {k: v for k, v in patched.items() if k not in values} == {
        k: v for k, v in MODEL_VALUES.items() if k not in values
    }


def test_a_config_that_sets_nothing_gets_the_model_values(model):
    from overlay import report
    from transformers import GenerationConfig

    with overlay.reverted():
        stock = _prepared(model, GenerationConfig(max_new_tokens=4))
    report.reset()
    with PATCH.applied(KEYS.id):
        patched = _prepared(model, GenerationConfig(max_new_tokens=4))
    assert patched == stock == MODEL_VALUES
    assert report.fired_actions().get(PATCH.id, {}) == {}, "nothing to keep: nothing reported"


def test_what_the_patch_reports(model):
    from overlay import report
    from transformers import GenerationConfig

    report.reset()
    with PATCH.applied(KEYS.id):
        _prepared(model, GenerationConfig(max_new_tokens=4, do_sample=False))
    assert report.fired_actions().get(PATCH.id, {}) == ({ACTION: 1} if PATCH.affected else {})


def test_generate_keyword_arguments_win_with_and_without_the_overlay(model):
    from transformers import GenerationConfig

    results = []
    for state in ("stock", "patched"):
        with overlay.reverted() if state == "stock" else PATCH.applied(KEYS.id):
            results.append(_prepared(model, GenerationConfig(do_sample=True, num_beams=1), do_sample=False, num_beams=1))
    assert results[0] == results[1]
    assert (results[0]["do_sample"], results[0]["num_beams"]) == (False, 1)


@pytest.mark.parametrize("flag", (False, True))
def test_use_model_defaults_goes_to_the_original(model, flag):
    from transformers import GenerationConfig

    if "use_model_defaults" not in inspect.signature(PATCH.stock()).parameters:
        assert not TAKES_FLAG, "5.0.0rc2+: _prepare_generation_config has no use_model_defaults argument"
        return
    values = {"do_sample": False, "num_beams": 1, "top_k": 50}
    with overlay.reverted():
        stock = _prepared(model, GenerationConfig(max_new_tokens=4, **values), use_model_defaults=flag)
    with PATCH.applied(KEYS.id):
        patched = _prepared(model, GenerationConfig(max_new_tokens=4, **values), use_model_defaults=flag)
    assert patched == stock
    # False: nothing comes from the model (the caller is not affected); True: every default-equal value does.
    assert _lost(values, stock) == ({} if not flag else {k: MODEL_VALUES[k] for k in values})


def test_the_warning_stock_logs():
    from transformers import GenerationConfig

    # A value no other test uses, so that warning_once has not seen this message yet.
    odd = _model({**MODEL_VALUES, "top_k": 17})
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with overlay.reverted():
            _prepared(odd, GenerationConfig(max_new_tokens=4, top_k=50, do_sample=True))
    finally:
        logger.removeHandler(handler)
    logged = [r.getMessage() for r in records if PATCH.error("default values") in r.getMessage()]
    assert bool(logged) == TAKES_FLAG, [r.getMessage() for r in records]
    if logged:
        assert "'top_k': 17" in logged[0]


# -- the ids: do_sample=False through a GenerationConfig is greedy -----------------------------------


@pytest.fixture(scope="module")
def runs():
    import torch
    from transformers import GenerationConfig

    from overlay.testing.models import left_padded_batch

    batch = left_padded_batch((6, 4), seed=1)

    def generate(model, seed):
        torch.manual_seed(seed)
        config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        with torch.no_grad():
            return model.generate(**batch, generation_config=config, disable_compile=True).tolist()

    instruct = _model(INSTRUCT)
    with overlay.reverted():
        reference = generate(_model({}), 0)  # the same weights, no sampling default anywhere
        stock = [generate(instruct, seed) for seed in SEEDS]
    with PATCH.applied(KEYS.id):
        patched = [generate(instruct, seed) for seed in SEEDS]
    return {"reference": reference, "stock": stock, "patched": patched}


def test_greedy_through_a_generation_config_on_stock(runs):
    if PATCH.affected:  # sampled: other ids than the greedy ones (on at least one seed, in practice all)
        assert any(ids != runs["reference"] for ids in runs["stock"]), runs
    else:
        assert runs["stock"] == [runs["reference"]] * len(SEEDS)


def test_greedy_through_a_generation_config_with_the_overlay(runs):
    assert runs["patched"] == [runs["reference"]] * len(SEEDS)


# -- the limits of the record, as generate() sees them (the record's own tests:
# tests/patches/generation_config_set_keys/) ------------------------------------------------------


def test_limits_of_the_record(model):
    from transformers import GenerationConfig

    set_keys = KEYS.patch_module.set_keys
    if not PATCH.affected:  # fixed upstream: GenerationConfig.__init__ is not replaced, nothing recorded
        with PATCH.applied(KEYS.id):
            assert set_keys(GenerationConfig(do_sample=False, max_new_tokens=4)) == frozenset()
        return
    with PATCH.applied(KEYS.id):
        built = GenerationConfig(do_sample=False, max_new_tokens=4)
        copied = copy.deepcopy(built)
        later = GenerationConfig(max_new_tokens=4)
        later.do_sample = False
        round_trip = GenerationConfig(**GenerationConfig(max_new_tokens=4).to_dict())
        # A copy and a value assigned later carry no record: stock behaviour (the documented limit).
        assert _prepared(model, copied)["do_sample"] is True
        assert _prepared(model, later)["do_sample"] is True
        assert _prepared(model, built)["do_sample"] is False
        # A to_dict() round trip counts every key as set: only what it holds as None (unset on
        # 5.0.0rc2) comes from the model; on 4.55 - 5.0.0rc1, where no default is None, nothing does.
        expected = {k: MODEL_VALUES[k] if getattr(round_trip, k) is None else getattr(round_trip, k) for k in MODEL_VALUES}
        assert _prepared(model, round_trip) == expected
        if TAKES_FLAG:
            assert expected == {k: getattr(GenerationConfig(), k) for k in MODEL_VALUES}


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('output', 'test_greedy_through_a_generation_config_on_stock',
                    'stock completes, sampling despite GenerationConfig(do_sample=False)')
