"""A stack that reassigns transformers' generation functions after the overlay patched them (the
pattern of optimum-habana 1.21.2's ``adapt_transformers_to_gaudi``: ``tests/_gaudi_like.py``):
``status()`` says "displaced" for exactly the patches whose replacement it took the place of,
naming the stand-in, and "applied" again once it is undone. Runs on every lane (``lane``): on
Gaudi's own 4.55.x nothing the overlay patches there is reassigned (the one reassigned target,
``prepare_inputs_for_generation``, is patched from 5.13.0 on)."""

from __future__ import annotations

import importlib

import pytest

import overlay
from overlay import engine
from overlay.testing import models

pytestmark = [pytest.mark.lane, pytest.mark.usefixtures("one_thread")]


def _import_targets() -> None:
    for patch in overlay.known_patches():
        importlib.import_module(patch.module)


def _reassigned_targets(gaudi) -> set[str]:
    """``module:qualname`` of every GenerationMixin attribute the stand-in reassigns."""
    return {f"transformers.generation.utils:GenerationMixin.{attribute}"
            for attribute, name in gaudi.GENERATION_MIXIN_REASSIGNMENTS if name in vars(gaudi.GaudiLikeGenerationMixin)}


def test_a_gaudi_like_stack_displaces_exactly_the_patches_it_replaced():
    _import_targets()
    with overlay.applied():
        gaudi = importlib.import_module("tests._gaudi_like")
        applied = {s.id for s in overlay.status() if s.state == engine.APPLIED}
        reassigned = _reassigned_targets(gaudi)
        expected = {p.id for p in overlay.known_patches() if p.id in applied and {t.key for t in p.targets} & reassigned}
        # Not vacuous where it can happen: 5.13 - 5.19 patch prepare_inputs_for_generation.
        assert ("device-move-nested" in expected) == ("device-move-nested" in applied)
        model = models.tiny_model("llama")
        batch = models.left_padded_batch((6, 4))
        before = models.greedy_ids(model, batch, 4, cache_implementation="static")
        gaudi.adapt_like_gaudi()
        try:
            states = {s.id: s for s in overlay.status()}
            assert {pid for pid, s in states.items() if s.state == engine.DISPLACED} == expected
            for pid in expected:
                reason = states[pid].reason
                assert "is now tests._gaudi_like.GaudiLikeGenerationMixin." in reason, reason
                assert f"ATTN_OVERLAY_DISABLE={pid}" in reason
            assert {pid for pid, s in states.items() if s.state == engine.APPLIED} == applied - expected
            # The stand-ins delegate to what they found (here the overlay's replacements): same tokens.
            assert models.greedy_ids(model, batch, 4, cache_implementation="static") == before
        finally:
            gaudi.undo()  # before the overlay's revert: it puts back exactly what it found
        assert {s.id for s in overlay.status() if s.state == engine.APPLIED} == applied
