"""``position_ids`` passed to ``generate()`` advance with each new token, as they do upstream now.

What breaks: ``model.generate(input_ids, attention_mask=..., position_ids=...)`` (a caller who
computes positions itself: packed or offset prompts, a prompt continued after a prefix held
elsewhere, a serving stack that always passes them) gives other tokens than the same call without
``position_ids``, with no error. Every new token is fed the *last prompt position*:
``prepare_inputs_for_generation`` builds positions from the attention mask only when none were
passed, and otherwise cuts the passed ones to the length of the step's input, while
``GenerationMixin._update_model_kwargs_for_generation`` grows the attention mask and the cache
position each step but leaves ``position_ids`` as they were. Rotary models (Llama, Qwen, Gemma,
...) then attend as if every generated token stood at the same place (upstream issue #36510).
Without a cache (``use_cache=False``) the whole sequence meets the prompt's positions and the
second step fails: ``RuntimeError: The size of tensor a (8) must match the size of tensor b (7)
at non-singleton dimension 2`` (the sizes are the sequence's and the prompt's).

Upstream: huggingface/transformers#43734 makes ``_update_model_kwargs_for_generation`` advance
them, and generate() derives positions itself when none are passed; from 5.3.0 the new tokens'
positions are appended to the old ones, with or without a cache.

What the replacement does: it wraps the original, whose code is the same on every affected
release, and afterwards appends the new tokens' positions (the last one plus 1 ..
``num_new_tokens``) to the ``position_ids`` (``decoder_position_ids`` for encoder-decoder models)
the caller passed, as 5.3.0+ does; the step's input takes its positions from the end. Leading
dimensions (Qwen2-VL's three rope sections) are kept. When no positions were passed to generate(),
nothing per decoding step (``needed_by_call``: the call runs the release's own step); when they
were, one small ``arange``, add and concatenation per step, as in the fixed releases.

Limits: assisted and prompt-lookup decoding with ``position_ids`` still give the candidates
stale positions (the fixed release also extends them per candidate batch there; not ported).
Models that override ``_update_model_kwargs_for_generation`` without calling ``super()``
(Mamba, Falcon Mamba, Moshi, some multimodal models) keep their own; so do classes defined outside
transformers whose override calls it (OpenVINO's appends the position itself). Chunked prefill
(``prefill_chunk_size``) drops passed positions after the prompt on these releases (the
``chunked-prefill`` patch's concern, not this one's).

Tested (``tests/patches/position_ids_advance/``): tiny Llama, Gemma 3 and Qwen 3, a batch with
and without left padding, greedy, beam search, sampling with a seed, no cache and a static
cache, with ``position_ids`` passed: stock gives other ids than the same call without them; the
overlay gives the same ids; a call without ``position_ids`` is unchanged.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "position-ids-advance"
MODULE = "transformers.generation.utils"


def _overridden_outside_transformers(cls) -> bool:
    """Whether ``cls`` gets this step from an override defined outside transformers (a stack's or
    the user's class), not from transformers' own code (the mixin, or a model of the library)."""
    step = getattr(cls, "_update_model_kwargs_for_generation", None)
    return not (getattr(step, "__module__", None) or "").startswith("transformers.")


def _call_passes_positions(model, args, kwargs):
    """``needed_by_call``: generate() keeps no positions between steps on these releases, so a
    step can only meet the ones the caller passed (chunked prefill's own are popped before the
    first step)."""
    return kwargs.get("position_ids") is not None or kwargs.get("decoder_position_ids") is not None


def _replace_update_model_kwargs(original, variant):
    @wraps(original)
    def _update_model_kwargs_for_generation(
        self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1
    ):
        position_ids = model_kwargs.get("decoder_position_ids" if is_encoder_decoder else "position_ids")
        if position_ids is None:
            # No positions passed (generate() keeps none between steps on these releases): the
            # release's own step, decided by one look-up before anything else.
            return original(self, outputs, model_kwargs, is_encoder_decoder, num_new_tokens)
        key = "decoder_position_ids" if is_encoder_decoder else "position_ids"
        model_kwargs = original(self, outputs, model_kwargs, is_encoder_decoder, num_new_tokens)
        if _overridden_outside_transformers(type(self)):
            # A stack's own model class that overrides this step and calls it (OpenVINO's
            # OVModelForCausalLM appends the next position itself on these releases): advancing
            # here too would advance twice. Its override decides, as on stock.
            return model_kwargs
        # Only positions the caller passed are here (generate() itself keeps none between steps on
        # these releases), and the original never touches them: advance them as the fixed release.
        if model_kwargs.get(key) is position_ids:
            import torch

            # The new tokens' positions follow the last one, appended as 5.3.0+ does: the step's
            # input then finds its own positions at the end, whatever its length.
            steps = torch.arange(1, num_new_tokens + 1, dtype=position_ids.dtype, device=position_ids.device)
            model_kwargs[key] = torch.cat([position_ids, position_ids[..., -1:] + steps], dim=-1)
            report.record_outside_compile(PATCH_ID, f"advanced the passed {key}")
        return model_kwargs

    return _update_model_kwargs_for_generation


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="both",
    title="position_ids passed to generate() advance with each new token",
    errors=(
        "(no error) generate(position_ids=...) gives other tokens than the same call without position_ids: "
        "every new token gets the last prompt position",
        "RuntimeError: The size of tensor a (8) must match the size of tensor b (7) at non-singleton dimension 2",
    ),
    why=(
        "_update_model_kwargs_for_generation grows the attention mask and cache position each step but "
        "leaves passed position_ids as they are, and prepare_inputs_for_generation then feeds every new "
        "token the last prompt position."
    ),
    upstream="huggingface/transformers#43734 (generate() advances position_ids; issue #36510), in {fixed_in}",
    targets=(
        Target(
            module=MODULE,
            qualname="GenerationMixin._update_model_kwargs_for_generation",
            replace=_replace_update_model_kwargs,
            needed_by_call=_call_passes_positions,
        ),
    ),
)
