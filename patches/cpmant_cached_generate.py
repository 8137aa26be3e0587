"""CPM-Ant's cached ``generate()`` gets the whole sequence each step, and beam search keeps its cache.

What breaks (4.55.0 - 5.15.1): ``CpmAntForCausalLM.generate()`` with the cache (the default), greedy
search too, fails at its second step:

    RuntimeError: The size of tensor a (9) must match the size of tensor b (5) at non-singleton
    dimension 3

(the sizes depend on the prompt and the config), and beam search on 4.56 - 4.57 at the step after
its first reorder: ``AttributeError: 'list' object has no attribute 'get_seq_length'`` (on 4.55 and
5.x beam search fails with the ``RuntimeError``).

The cause: ``CpmAntModel.forward`` slices the cached prefix off by itself (``past_length`` from the
cache: the embeddings, the position bias and the attention mask are built for the whole sequence,
then cut), so it needs the full ``input_ids`` at every step; but the class inherits
``GenerationMixin.prepare_inputs_for_generation``, which passes only the tokens the cache has not
seen. And on 4.55 - 4.57 ``CpmAntForCausalLM._reorder_cache`` rebuilds the cache as a list of
``[key, value]`` lists (the legacy format), which the next forward cannot read on 4.56 - 4.57 (it
converts only tuples; 4.55's converts anything that is not a ``Cache``, a copy every step).
Upstream (5.16.0, in the commit that also narrows the head to ``vocab_size``) adds a three-line
override that calls the base with ``next_sequence_length=None``; 5.0.0 had already dropped
``_reorder_cache`` (beam search then reorders the ``Cache`` itself).

What the replacement does (two targets, wrapping the originals, both set on ``CpmAntForCausalLM``
only; every other model keeps the release's code):

- ``prepare_inputs_for_generation`` (inherited from ``GenerationMixin``): how the base cuts the ids
  is the variant's. 5.3.0 - 5.15.1 cut by ``next_sequence_length``: the base is called with
  ``None`` there, as 5.16.0's override does (so 5.13+'s move of the inputs to the model's device
  moves the full ids). 4.55.0 - 5.2.0 cut by ``cache_position``, which the model's forward also
  reads: the base runs as it is and the full ids are put back into its result, cloned as the base
  clones them (these releases do not move the ids to the model's device afterwards).
- ``_reorder_cache`` (4.55 - 4.57; absent from 5.0.0 on): a ``Cache`` is reordered in place
  (``Cache.reorder_cache``, what those releases' beam search does for a model without
  ``_reorder_cache``) and returned as it is; legacy tuples keep the release's own code.

Cost: a comparison of two lengths per step (4.55 - 5.2) or none (5.3 - 5.15), only for CPM-Ant.
The forward itself is unchanged: it still recomputes the embeddings, mask and position bias of the
whole sequence every step, as 5.16.0 does.

Not covered: beam search also needs ``beam-search-logits-width`` (CPM-Ant's head is wider than its
vocabulary up to 5.15.1); with that patch off it fails first with that patch's error. Prompt
embeddings (``inputs_embeds``) and static caches: the forward takes neither.

Tested (``tests/patches/cpmant_cached_generate/``): a tiny random CPM-Ant; stock fails with the
errors above, the overlay gives the ids of a cached loop driven by hand (the full ids and the cache
each step; argmax, and beam search by hand); with ``device-move-nested`` too on 5.13 - 5.15.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "cpmant-cached-generate"
MODULE = "transformers.models.cpmant.modeling_cpmant"


def make_prepare_inputs(original, variant):
    if variant["uncut_by_argument"]:

        @wraps(original)
        def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, *args, **kwargs):
            # 5.16.0's override: no length, no cut; the forward drops the cached prefix itself.
            if next_sequence_length is not None and next_sequence_length < input_ids.shape[1]:
                report.record_outside_compile(PATCH_ID, "passed CPM-Ant the whole sequence")
            return original(self, input_ids, None, *args, **kwargs)

        return prepare_inputs_for_generation

    @wraps(original)
    def prepare_inputs_for_generation_restored(self, input_ids, *args, **kwargs):
        model_inputs = original(self, input_ids, *args, **kwargs)
        cut = model_inputs.get("input_ids")
        # Cut only where the cache holds a prefix; the prefill (and use_cache=False) pass them whole.
        if cut is not None and cut.shape[1] != input_ids.shape[1]:
            import torch

            model_inputs["input_ids"] = input_ids.clone(memory_format=torch.contiguous_format)
            report.record_outside_compile(PATCH_ID, "passed CPM-Ant the whole sequence")
        return model_inputs

    return prepare_inputs_for_generation_restored


def make_reorder_cache(original, variant):
    @wraps(original)
    def _reorder_cache(self, past_key_values, beam_idx):
        reorder = getattr(past_key_values, "reorder_cache", None)
        if reorder is None:  # legacy tuples: the release's own list of lists is what it expects
            return original(self, past_key_values, beam_idx)
        reorder(beam_idx)
        report.record_outside_compile(PATCH_ID, "kept CPM-Ant's cache a Cache across a beam reorder")
        return past_key_values

    return _reorder_cache


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="CPM-Ant's cached generate() passes the whole sequence to its forward and keeps its cache a Cache in beam search",
    errors=(
        "RuntimeError: The size of tensor a (9) must match the size of tensor b (5) at non-singleton dimension 3",
        "AttributeError: 'list' object has no attribute 'get_seq_length'",
    ),
    why=(
        "CpmAntModel.forward cuts the cached prefix off the full input_ids itself, but CpmAntForCausalLM "
        "inherits a prepare_inputs_for_generation that passes only the new tokens, and (up to 4.57) its "
        "_reorder_cache turns the cache into a list."
    ),
    upstream="none found (the prepare_inputs_for_generation override arrived in {fixed_in} with the head narrowed to vocab_size)",
    targets=(
        Target(
            module=MODULE,
            qualname="CpmAntForCausalLM.prepare_inputs_for_generation",
            inherited_from="transformers.generation.utils:GenerationMixin.prepare_inputs_for_generation",
            variants={
                "cut_by_cache_position": {},
                "cut_by_next_sequence_length": {"uncut_by_argument": True},
            },
            defaults={"uncut_by_argument": False},
            replace=make_prepare_inputs,
        ),
        Target(
            module=MODULE,
            qualname="CpmAntForCausalLM._reorder_cache",
            replace=make_reorder_cache,
            optional=True,
        ),
    ),
)
