"""What docs/stacks.md says of OpenVINO (optimum-intel), run on OpenVINO: ``nox -s openvino``.

Tiny random models are saved to a temporary folder and exported with
``OVModelForCausalLM.from_pretrained(folder, export=True)`` (a tiny Llama; a tiny Mamba, which
optimum-intel 2.2.0 exports as ``OVModelWithMambaForCausalLM`` up to transformers 5.3: the Mamba
tests skip, saying so, above that), then run with the overlay off
(``overlay.reverted()``) and on (``overlay.applied()``, every patch the release takes):

- ``position-ids-advance`` *steps aside*: ``generate(position_ids=...)`` gives the ids of the same
  call without them (OpenVINO's own override advances the positions; the overlay adds no second
  advance);
- ``beam-search-recurrent-cache`` / ``beam-search-logits-width`` *step aside*: the overlay leaves
  OpenVINO's beam search as it is; for Mamba that is the release's bug (the beams' states are not
  reordered: the ids of stock transformers' Mamba, not those of ``use_cache=False``), which the
  overlay fixes for the torch model only;
- prompt lookup (``prompt_lookup_num_tokens``) fails in transformers' ``_assisted_decoding``
  (``AttributeError: 'tuple' object has no attribute 'crop'``: the ``past_key_values`` OpenVINO's
  outputs hand back is a tuple, not a transformers cache) with and without the overlay; on a model without an eos token stock raises
  ``prompt-lookup-no-eos``'s ``TypeError`` first, and with the overlay the same ``AttributeError``
  follows: the patch changes the error, not the outcome.

Where a test fails because OpenVINO's behaviour changed, docs/stacks.md's OpenVINO rows need the
same change. Skipped where optimum-intel is not installed (the default suite and the release lanes),
and not a ``patch`` module (``LANE = False``): only the ``openvino`` session runs it.
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip(
    "optimum.intel.openvino", reason="optimum-intel with OpenVINO is not installed (the `nox -s openvino` lane installs it)"
)

import overlay  # noqa: E402
from overlay.testing.harness import PatchUnderTest  # noqa: E402

#: Not a patch module: the release lanes (``-m "patch or lane"``) have no OpenVINO.
LANE = False

POSITIONS = PatchUnderTest("position_ids_advance")
RECURRENT_BEAMS = PatchUnderTest("beam_search_recurrent_cache")
PROMPT_LOOKUP = PatchUnderTest("prompt_lookup_no_eos")

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW_TOKENS = 6
#: As tests/patches/beam_search_recurrent_cache: 8 new tokens, beams that move between rows.
BEAM_NEW_TOKENS = 8
#: As tests/patches/position_ids_advance: at the default 0.02 a tiny Llama's ids hardly depend on positions.
POSITION_SENSITIVE_INIT = 0.2
#: One OpenVINO inference thread: the cores are shared.
OV_CONFIG = {"INFERENCE_NUM_THREADS": "1"}
DOC = "docs/stacks.md (OpenVINO)"
PROMPT_LOOKUP_ERROR = "'tuple' object has no attribute 'crop'"


def _export(folder):
    from optimum.intel import OVModelForCausalLM

    return OVModelForCausalLM.from_pretrained(str(folder), export=True, ov_config=OV_CONFIG)


@contextlib.contextmanager
def _overlay_on(*patches: PatchUnderTest):
    """Every patch the release takes, applied for the block; those in ``patches`` must be among
    them where the release is in their range (else the test would prove nothing)."""
    with overlay.applied() as statuses:
        states = {status.id: status.state for status in statuses}
        for patch in patches:
            if patch.affected:
                assert states.get(patch.id) == "applied", statuses
        yield


def _positions_like_generate(attention_mask):
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 1)


def _tiny_mamba():
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    from overlay.testing.models import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID

    config = MambaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, state_size=8, intermediate_size=128,
        pad_token_id=PAD_TOKEN_ID, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
        initializer_range=POSITION_SENSITIVE_INIT,
    )
    torch.manual_seed(0)
    model = MambaForCausalLM(config).eval()
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """``(torch model, OpenVINO model)``: the same tiny random Llama."""
    from overlay.testing.models import save_tiny_model, tiny_model

    folder = save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", initializer_range=POSITION_SENSITIVE_INIT)
    return tiny_model("llama", initializer_range=POSITION_SENSITIVE_INIT), _export(folder)


@pytest.fixture(scope="module")
def llama_without_eos(tmp_path_factory):
    """The OpenVINO export of a tiny random Llama without an end-of-sequence token (the
    ``prompt-lookup-no-eos`` bug's condition)."""
    from overlay.testing.models import save_tiny_model

    exported = _export(save_tiny_model(tmp_path_factory.mktemp("llama-no-eos"), "llama", eos_token_id=None))
    assert exported.generation_config.eos_token_id is None
    return exported


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    """``(torch model, OpenVINO model)``: the same tiny random Mamba."""
    model = _tiny_mamba()
    folder = tmp_path_factory.mktemp("mamba")
    model.save_pretrained(folder)
    try:
        exported = _export(folder)
    except ValueError as exc:  # optimum-intel 2.2.0 exports Mamba up to transformers 5.3 only
        if "does not allow for the export" not in str(exc):
            raise
        pytest.skip(f"optimum-intel does not export Mamba here: {exc}")
    assert type(exported).__name__ == "OVModelWithMambaForCausalLM", type(exported)
    return model, exported


def _ids(model, batch, new_tokens=MAX_NEW_TOKENS, **generate_kwargs):
    from overlay.testing.models import greedy_ids

    return greedy_ids(model, batch, new_tokens, **generate_kwargs)


@pytest.mark.parametrize("kind", ["llama", "mamba"])
def test_the_export_gives_the_torch_models_ids(request, kind):
    """The premise of the comparisons below: greedy ids agree between torch and OpenVINO."""
    from overlay.testing.models import left_padded_batch

    model, exported = request.getfixturevalue(kind)
    batch = left_padded_batch((7,), seed=5)
    with overlay.reverted():
        assert _ids(exported, batch) == _ids(model, batch)


def test_position_ids_advance_steps_aside_and_openvino_gives_the_reference(llama):
    from overlay import report
    from overlay.testing.models import left_padded_batch

    model, exported = llama
    batch = left_padded_batch((7, 4), seed=5)
    with_positions = {**batch, "position_ids": _positions_like_generate(batch["attention_mask"])}
    with overlay.reverted():
        reference = _ids(exported, batch)
        stock = _ids(exported, with_positions)
        if POSITIONS.affected:  # the bug matters for these weights: torch's stock gets other ids
            assert _ids(model, with_positions) != reference
    assert stock == reference, f"OpenVINO's own advance of passed positions changed: update {DOC}"
    report.reset()
    with _overlay_on(POSITIONS):
        patched = _ids(exported, with_positions)
    assert patched == reference, "the overlay advanced OpenVINO's positions a second time"
    assert report.fired().get(POSITIONS.id, 0) == 0


def test_llama_beam_search_is_openvinos_own(llama):
    from overlay.testing.models import left_padded_batch

    _, exported = llama
    batch = left_padded_batch((7, 4), seed=5)
    with overlay.reverted():
        stock = _ids(exported, batch, num_beams=3)
    with _overlay_on(RECURRENT_BEAMS):
        patched = _ids(exported, batch, num_beams=3)
    assert patched == stock


def test_mamba_beams_stay_wrong_on_openvino(mamba):
    """``beam-search-recurrent-cache`` steps aside for a model that is not a torch module:
    OpenVINO's Mamba beams keep the release's ids (the beams' states not reordered), while the
    overlay fixes the same torch model's."""
    from overlay.testing.models import left_padded_batch

    model, exported = mamba
    batch = left_padded_batch((7,), seed=5)
    with overlay.reverted():
        reference = _ids(model, batch, BEAM_NEW_TOKENS, num_beams=3, use_cache=False)
        torch_stock = _ids(model, batch, BEAM_NEW_TOKENS, num_beams=3)
        openvino_stock = _ids(exported, batch, BEAM_NEW_TOKENS, num_beams=3)
    with _overlay_on(RECURRENT_BEAMS):
        torch_patched = _ids(model, batch, BEAM_NEW_TOKENS, num_beams=3)
        openvino_patched = _ids(exported, batch, BEAM_NEW_TOKENS, num_beams=3)
    if RECURRENT_BEAMS.affected:
        assert torch_stock != reference  # the bug, on torch, with these weights
        assert torch_patched == reference  # the fix, on torch
    assert openvino_patched == openvino_stock  # the overlay steps aside
    assert openvino_stock != reference, f"OpenVINO's Mamba beams now give use_cache=False's ids: update {DOC}"
    assert openvino_stock == torch_stock


@pytest.mark.parametrize("overlay_on", [False, True], ids=["stock", "overlay"])
def test_prompt_lookup_fails_before_the_patch_matters(llama, overlay_on):
    from overlay.testing.models import left_padded_batch

    _, exported = llama
    batch = left_padded_batch((7,), seed=5)
    with _overlay_on(PROMPT_LOOKUP) if overlay_on else overlay.reverted():
        try:
            ids = _ids(exported, batch, prompt_lookup_num_tokens=3)
        except AttributeError as exc:
            assert PROMPT_LOOKUP_ERROR in str(exc)
            return
    pytest.fail(
        f"prompt lookup on OpenVINO no longer raises AttributeError: {PROMPT_LOOKUP_ERROR} (got {ids}): "
        f"update {DOC}, whose prompt-lookup-no-eos row says it fails there, and test the patch on OpenVINO"
    )


def test_prompt_lookup_without_eos_fails_on_openvino_with_the_fix_too(llama_without_eos):
    """The patch's own case (no eos token, a prompt whose phrase repeats, so the lookup finds
    candidates): stock raises the patch's ``TypeError`` in ``get_candidates``; with the overlay
    that step passes and generation fails right after, in ``_assisted_decoding``'s ``crop``."""
    import torch

    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    batch = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    with overlay.reverted():
        with pytest.raises(Exception) as stock:
            _ids(llama_without_eos, batch, prompt_lookup_num_tokens=3)
    if PROMPT_LOOKUP.affected:
        assert stock.type is TypeError and PROMPT_LOOKUP.error("isin") in str(stock.value), stock.value
    with _overlay_on(PROMPT_LOOKUP):
        try:
            ids = _ids(llama_without_eos, batch, prompt_lookup_num_tokens=3)
        except AttributeError as exc:
            assert PROMPT_LOOKUP_ERROR in str(exc)
            return
    pytest.fail(f"prompt lookup with the overlay on OpenVINO no longer raises (got {ids}): update {DOC}")
