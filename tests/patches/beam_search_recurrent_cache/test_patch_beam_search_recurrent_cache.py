"""beam-search-recurrent-cache: beam search with a cache gives what it gives without one on Mamba models.

Reproduced for real on the CPU (the slow torch path of the mixers), in this process: tiny random
``MambaForCausalLM``, ``Mamba2ForCausalLM`` and ``FalconMambaForCausalLM`` (seed 0, eval), one
6-token prompt and a batch of two, ``num_beams=3``, all 3 beams returned, 8 new tokens (``min_new_tokens`` too, so
every beam has the same length). The reference is the same beam search with ``use_cache=False``:
every step recomputes the whole sequence, so there is no cache to reorder. The reference's beams
really move between rows (asserted), so a cache that is not reordered shows.

On 4.55.0 - 5.12.1 stock gives other ids than the reference (the recurrent state is never
reordered); with the patch every model gives the reference's ids and scores to rounding, and the
patch reports one reorder per step and leaves neither its forward hook nor its routing of the
step behind (after a call that raised, too). 5.13.0+ ships the fix: the engine says "fixed upstream" and stock
gives the reference's ids. Where the patch must change nothing: greedy search on Mamba and beam
search on Llama (its cache is ``past_key_values``, which the release reorders) are bit for bit
stock's, and the patch reports nothing there.
"""

from __future__ import annotations

import inspect

import pytest

import overlay
from overlay.patch import Variant
from overlay.testing.harness import SCORE_TOLERANCE, PatchUnderTest

PATCH = PatchUnderTest("beam_search_recurrent_cache")
PATCH.skip_module_unless_covered()  # releases before 4.55.0 are out of the overlay's scope

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ("mamba", "mamba2", "falcon_mamba")
PROMPT_LENGTH = 6
NEW_TOKENS = 8
NUM_BEAMS = 3
#: One prompt, and a batch of two (the beam indices then carry each prompt's row offset).
ROWS = (1, 2)
ACTION = "reordered the recurrent cache"
STEP = "_get_running_beams_for_next_iteration"


def _model(kind: str):
    import torch
    import transformers

    sizes = dict(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        # Wider weights than the default: the tiny models' beams then differ and move between rows.
        initializer_range=0.5,
    )
    if kind == "mamba2":
        sizes.update(num_heads=8, head_dim=8, n_groups=1, chunk_size=16)
    names = {"mamba": "Mamba", "mamba2": "Mamba2", "falcon_mamba": "FalconMamba"}[kind]
    config = getattr(transformers, f"{names}Config")(**sizes)
    torch.manual_seed(0)
    return getattr(transformers, f"{names}ForCausalLM")(config).eval()


def _prompt(rows: int = 1):
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, 64, (rows, PROMPT_LENGTH), generator=generator)


def _beam_search(model, rows: int = 1, **options) -> dict:
    """Ids, scores, beam indices of one beam search returning every beam, and what the patch reported."""
    from overlay import report

    input_ids = _prompt(rows)
    report.reset()
    out = model.generate(
        input_ids, attention_mask=input_ids.new_ones(input_ids.shape), num_beams=NUM_BEAMS,
        num_return_sequences=NUM_BEAMS, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=2,
        **{"do_sample": False, **options},
    )
    return {
        "ids": out.sequences[:, PROMPT_LENGTH:].tolist(),
        "scores": out.sequences_scores,
        "beam indices": out.beam_indices,
        "fired": report.fired_actions().get(PATCH.id, {}),
    }


def _beams_move(beam_indices) -> bool:
    """Some returned beam continues, at some step, another row than the one it came from before."""
    steps = beam_indices[:, :NEW_TOKENS]
    assert bool((steps >= 0).all()), beam_indices
    return bool((steps[:, 1:] != steps[:, :-1]).any())


@pytest.fixture(scope="module")
def runs():
    """``{(kind, prompts): {"reference", "stock", "patched": run}}``."""
    import transformers.generation.utils  # noqa: F401  (the patch's module, so the engine judges it)

    results = {}
    for kind in KINDS:
        model = _model(kind)
        for rows in ROWS:
            with overlay.reverted():
                record = {
                    "reference": _beam_search(model, rows, use_cache=False),
                    "stock": _beam_search(model, rows),
                }
            with PATCH.applied():
                record["patched"] = _beam_search(model, rows)
                record["left behind"] = (len(model._forward_hooks), STEP in vars(model))
            results[kind, rows] = record
    return results


CASES = pytest.mark.parametrize("kind,rows", [(kind, rows) for kind in KINDS for rows in ROWS])


# -- the patch data ---------------------------------------------------------------------------------


def test_replacements_keep_name_docstring_and_signature():
    for target, stock in PATCH.present_targets():
        variant = target.variant_of(stock) or Variant("this release")  # fixed code (5.13.0+): metadata only
        replacement = target.replace(stock, variant)
        assert replacement.__wrapped__ is stock
        assert (replacement.__name__, replacement.__doc__) == (stock.__name__, stock.__doc__)
        assert inspect.signature(replacement) == inspect.signature(stock)


# -- the runs ---------------------------------------------------------------------------------------


@CASES
def test_the_reference_beams_move_between_rows(runs, kind, rows):
    assert _beams_move(runs[kind, rows]["reference"]["beam indices"]), "a case where the cache must be reordered"


@CASES
def test_beam_search_on_stock_transformers(runs, kind, rows):
    reference, stock = runs[kind, rows]["reference"], runs[kind, rows]["stock"]
    if PATCH.affected:
        assert stock["ids"] != reference["ids"], "the state is not reordered: other beams, silently"
    else:
        assert stock["ids"] == reference["ids"], "5.13.0+: the release reorders cache_params"
        import torch

        torch.testing.assert_close(stock["scores"], reference["scores"], **SCORE_TOLERANCE)


@CASES
def test_beam_search_with_the_overlay_is_the_uncached_one(runs, kind, rows):
    import torch

    reference, patched = runs[kind, rows]["reference"], runs[kind, rows]["patched"]
    assert patched["ids"] == reference["ids"]
    torch.testing.assert_close(patched["scores"], reference["scores"], **SCORE_TOLERANCE)
    assert runs[kind, rows]["left behind"] == (0, False), "the call's hook and routing are undone after it"
    if PATCH.affected:  # one reorder per step, as upstream's loop does
        assert patched["fired"] == {ACTION: NEW_TOKENS}
    else:
        assert patched["fired"] == {}


# -- where the patch changes nothing ----------------------------------------------------------------


def test_greedy_search_and_llama_beam_search_are_stock():
    from overlay.testing.models import tiny_model

    mamba = _model("mamba")
    llama = tiny_model("llama")
    runs = {}
    for state in ("stock", "patched"):
        with overlay.reverted() if state == "stock" else PATCH.applied():
            input_ids = _prompt()
            greedy = mamba.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            runs[state] = {"greedy": greedy.tolist(), "llama": _beam_search(llama)}
    stock, patched = runs["stock"], runs["patched"]
    assert patched["greedy"] == stock["greedy"]
    assert patched["llama"]["ids"] == stock["llama"]["ids"]
    assert bool((patched["llama"]["scores"] == stock["llama"]["scores"]).all()), "bit for bit stock's scores"
    assert patched["llama"]["fired"] == {}


def test_beam_sampling_with_the_overlay_is_the_uncached_one():
    """``do_sample=True`` with beams runs the same loop: same seed, same draws as without the cache."""
    import torch

    model = _model("mamba2")
    runs = {}
    for state, use_cache in (("reference", False), ("stock", True), ("patched", True)):
        with overlay.reverted() if state != "patched" else PATCH.applied():
            torch.manual_seed(5)
            runs[state] = _beam_search(model, 2, do_sample=True, use_cache=use_cache)["ids"]
    assert runs["patched"] == runs["reference"]
    assert (runs["stock"] != runs["reference"]) == PATCH.affected


def test_threads_beam_searching_one_model_keep_their_own_cache():
    """Three threads run beam search on one model at once: each gets the reference."""
    import threading

    model = _model("mamba")
    reference = _reference_ids(model)
    got = []
    with PATCH.applied():
        threads = [threading.Thread(target=lambda: got.append(_beam_search(model)["ids"])) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert got == [reference] * 3
    assert (len(model._forward_hooks), STEP in vars(model)) == (0, False)


def test_a_call_that_raises_leaves_nothing_behind():
    """A stopping criterion that raises in the third step: the model keeps no hook and no routing."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Fails(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            Fails.calls += 1
            if Fails.calls == 3:
                raise RuntimeError("stop here")
            return input_ids.new_zeros(input_ids.shape[0], dtype=bool)

    model = _model("mamba")
    with PATCH.applied():
        with pytest.raises(RuntimeError, match="stop here"):
            _beam_search(model, stopping_criteria=StoppingCriteriaList([Fails()]))
        assert (len(model._forward_hooks), STEP in vars(model)) == (0, False)
        # and the next call on the model is right again
        assert _beam_search(model)["ids"] == _reference_ids(model)


def _reference_ids(model):
    with overlay.reverted():
        return _beam_search(model, use_cache=False)["ids"]


def test_a_model_that_is_not_a_torch_module_gets_the_release_beam_search():
    # OpenVINO's models are GenerationMixin subclasses but not torch modules: no forward hooks.
    from transformers.generation.utils import GenerationMixin

    calls = []

    def release_beam_search(self, *args, **model_kwargs):
        calls.append((self, args, model_kwargs))
        return "the release's result"

    replacement = PATCH.patch_module.make_beam_search(release_beam_search, None)

    class CompiledModel(GenerationMixin):
        pass

    model = CompiledModel()
    assert replacement(model, "input ids", use_cache=True) == "the release's result"
    assert calls == [(model, ("input ids",), {"use_cache": True})]
    assert STEP not in vars(model)


def test_a_model_class_without_cache_params_gets_nothing_per_step():
    """Issue 39: decided once per model class. Llama (no forward of its classes takes
    ``cache_params``) runs the release's own loop: no forward hook, no routed step, in any step;
    Mamba (the positive control) gets both on the releases the patch applies to."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from overlay.testing.models import tiny_model

    class Probe(StoppingCriteria):
        """Notes, at every step, whether the model carries the patch's hook and routing."""

        def __init__(self, model):
            self.model, self.seen = model, set()

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.add((len(self.model._forward_hooks), STEP in vars(self.model)))
            return input_ids.new_zeros(input_ids.shape[0], dtype=bool)

    beam_search = PATCH.patch_module
    llama, mamba = tiny_model("llama"), _model("mamba")
    assert not beam_search.takes_cache_params(type(llama))
    if PATCH.affected:  # 5.25.0's Mamba forward takes no cache_params any more (the patch steps aside there)
        assert beam_search.takes_cache_params(type(mamba))
    with PATCH.applied():
        probes = {name: Probe(model) for name, model in (("llama", llama), ("mamba", mamba))}
        for name, model in (("llama", llama), ("mamba", mamba)):
            _beam_search(model, stopping_criteria=StoppingCriteriaList([probes[name]]))
    assert probes["llama"].seen == {(0, False)}
    assert probes["mamba"].seen == ({(1, True)} if PATCH.affected else {(0, False)})


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('output', 'test_beam_search_on_stock_transformers',
                    'stock Mamba beam search completes with other sequences than use_cache=False')
