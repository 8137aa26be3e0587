"""generation-config-set-keys: ``GenerationConfig(...)`` remembers the names of the values its
constructor was given, and is otherwise exactly the config stock builds.

What the record serves (``_prepare_generation_config`` keeping those values over the model's) is
proven with tiny models in ``tests/patches/generation_config_precedence/``. Here: the engine's status,
the replacement's metadata, the record itself (keys, metadata left out, subclasses and copies left
alone, entries dropped with their config), and that ``to_dict()``, the JSON, ``==`` and ``hash()`` of
a config are stock's.
"""

from __future__ import annotations

import copy
import gc
import inspect

import pytest

import overlay
from overlay.patch import PATCH_MARKER, Variant
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("generation_config_set_keys")
PATCH.skip_module_unless_covered()

pytestmark = pytest.mark.usefixtures("one_thread")


def test_replacement_keeps_name_docstring_and_signature():
    (target, stock), = PATCH.present_targets()
    replacement = target.build(stock, Variant("this release"))
    assert replacement.__wrapped__ is stock
    assert (replacement.__name__, replacement.__doc__) == (stock.__name__, stock.__doc__)
    assert inspect.signature(replacement) == inspect.signature(stock)


def test_engine_status():
    from transformers import GenerationConfig

    with PATCH.applied() as statuses:
        state = statuses[PATCH.id].state
        marker = getattr(GenerationConfig.__init__, PATCH_MARKER, None)
    assert (state, marker) == (("applied", PATCH.id) if PATCH.affected else ("fixed upstream", None))


def test_the_record_leaves_the_config_as_stock_builds_it():
    from transformers import GenerationConfig

    with overlay.reverted():
        stock = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=4)
    with PATCH.applied():
        patched = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=4)
        keys = PATCH.patch_module.set_keys(patched)
    assert vars(patched).keys() == vars(stock).keys()
    assert patched.to_json_string(use_diff=False) == stock.to_json_string(use_diff=False)
    assert patched.to_dict() == stock.to_dict()
    assert patched == stock and hash(patched) == hash(stock)
    assert keys == ({"do_sample", "num_beams", "max_new_tokens"} if PATCH.affected else frozenset())


def test_what_is_recorded_and_what_is_not():
    from transformers import GenerationConfig

    set_keys = PATCH.patch_module.set_keys
    if not PATCH.affected:
        with PATCH.applied():
            assert set_keys(GenerationConfig(do_sample=False)) == frozenset(), "fixed upstream: nothing recorded"
        return

    class OwnDefaults(GenerationConfig):
        def __init__(self, **kwargs):
            super().__init__(do_sample=True, **kwargs)

    with PATCH.applied():
        nothing = GenerationConfig()
        built = GenerationConfig(do_sample=False, max_new_tokens=4)
        loaded = GenerationConfig.from_dict({"do_sample": False, "transformers_version": "4.55.0", "_from_model_config": False})
        later = GenerationConfig(max_new_tokens=4)
        later.do_sample = False
        sub = OwnDefaults(max_new_tokens=4)
        assert set_keys(nothing) == frozenset()
        assert set_keys(built) == {"do_sample", "max_new_tokens"}
        assert set_keys(loaded) == {"do_sample"}, "metadata and private keys are not generation parameters"
        assert set_keys(copy.deepcopy(built)) == frozenset(), "a deep copy is built without __init__"
        assert set_keys(later) == {"max_new_tokens"}, "an attribute assigned later is not seen"
        assert set_keys(sub) == frozenset(), "a subclass's own defaults are not its caller's"
        assert set_keys(GenerationConfig(**built.to_dict())) >= {"do_sample", "top_k", "num_beams"}, "round trip: all"
    with overlay.reverted():
        assert set_keys(GenerationConfig(do_sample=False)) == frozenset(), "stock __init__ records nothing"


def test_an_entry_goes_with_its_config():
    from transformers import GenerationConfig

    registry = PATCH.patch_module._SET_KEYS
    with PATCH.applied():
        config = GenerationConfig(do_sample=False)
        key = id(config)
        assert (key in registry) == PATCH.affected
        del config
        gc.collect()
    assert key not in registry


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('output', 'test_the_record_leaves_the_config_as_stock_builds_it',
                    'records the keys set (changes nothing alone): the half of the precedence fix')
