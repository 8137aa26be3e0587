"""Nested input tensors reach the model device: per-layer-type attention masks with host-side inputs.

What breaks (transformers 5.13.0 - 5.19.0): ``GenerationMixin.prepare_inputs_for_generation``
ends with step 6, "Move the tensors the forward consumes onto the model device", which moves
only the *top-level* tensors of ``model_inputs`` to ``self.device``. With a compilable cache
(``cache_implementation="static"``) the function builds the attention masks itself, and for a
config with ``layer_types`` (Gemma 3, Qwen 3, ...) ``attention_mask`` is a dict keyed by layer
type, built on the device of ``input_ids``. When the caller keeps its inputs on the host (a
padded batch straight from the tokenizer) and the model sits on an accelerator, the dict's masks
stay on the host and attention fails:

    RuntimeError: Expected all tensors to be on the same device, but found at least two devices,
    neuron:0 and cpu! (when checking argument for argument attn_mask in method
    aten::scaled_dot_product_attention)

Inputs already on the device, a dynamic cache (the mask is built later, inside the model, on the
model's device) and a config without ``layer_types`` (Llama: one top-level mask tensor) all pass.
5.20.0 fixed it upstream (``transformers.pytorch_utils.move_to_device``, recursive over dict,
list and tuple).

What the replacement does: it wraps the original (no copied code) and, after it returns, moves
every tensor still off the device, at any depth, with :func:`overlay.tree_move.move_tree`
(dicts and their subclasses, ``UserDict``, lists, tuples, namedtuples, flex attention
``BlockMask``; ``Cache`` objects untouched; types kept; untouched objects kept by identity).

When it moves -- exactly when 5.20.0's step 6 moves: when the model is not on the ``meta``
device and the step's input tensor is on another device than ``self.device``. The input tensor
is the one step 6 reads back from ``model_inputs``: ``inputs_embeds`` when the result holds
them (a decoder-only model's first iteration with embeddings given), else ``input_ids`` (or
``decoder_input_ids`` in encoder-decoder models); each is a slice or clone of the argument of the same name, on the
argument's device. Every original (5.13-5.19) moves the top-level tensors under that same
condition, so the wrapper reads it off the call instead of re-evaluating it: it notes the
argument (the caller's own, which the call leaves in its arguments, while ``model_inputs`` holds
only the moved copy) and compares devices. The input tensor in the result is on another device than its
argument exactly when step 6 moved it, and it then sits on ``self.device``, the target. This
costs a few dictionary lookups and two identity comparisons per step when the step's input is
the argument or a slice of it (a view: on the argument's device, so step 6 did not move it; every
step of a call whose inputs are already on the model's device), else a device comparison, where
evaluating ``self.device`` (a walk to the first parameter) would cost more than the rest of the
wrapper and the mover's fast path together. A generate() call whose input tensors are all on
``model.device`` never reaches the wrapper: its decision (``needed_by_call``, once per call,
:mod:`overlay.call_scope`) hands every step to the release's own method. As in 5.20.0:
inputs already on the device -> nothing is walked or moved; host inputs -> every tensor of the
result is on the device.

Arguments are found by name through the original's signature (computed once at patch time), so
the wrapper does not depend on the parameter list: 5.24.0 renamed ``past_key_values`` to
``cache`` and the wrapper works unchanged there. Model classes that override
``prepare_inputs_for_generation`` and call ``super()`` reach this wrapper through ``super()``
and get the same treatment; what they add to the dict afterwards is theirs, as upstream.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "device-move-nested"
MODULE = "transformers.generation.utils"
QUALNAME = "GenerationMixin.prepare_inputs_for_generation"

#: generate()'s arguments that become a step's input tensor (``inputs`` is its first parameter).
_STEP_INPUTS = ("inputs", "input_ids", "inputs_embeds", "decoder_input_ids", "decoder_inputs_embeds")


def _call_can_move(model, args, kwargs):
    """``needed_by_call``: whether a step of this generate() call can find its input tensor off
    ``model.device`` (where the release's step 6 moves, and this fix with it). Every step's input is
    a slice of, or grows from, the tensors passed here, on their device: when each of them is on
    ``model.device`` no step moves anything. No input passed (generate() makes one) counts as
    needed."""
    given = [args[0]] if args and hasattr(args[0], "device") else []
    given += [kwargs[name] for name in _STEP_INPUTS if hasattr(kwargs.get(name), "device")]
    if not given:
        return True
    device = model.device
    return any(tensor.device != device for tensor in given)


def _replace_prepare_inputs_for_generation(original, variant):
    import inspect

    from overlay.tree_move import move_tree

    # Position of each parameter among the call's positional arguments (``self`` excluded), or
    # None when it can only be passed by keyword (or is absent and would land in **kwargs).
    positional = [
        p.name
        for p in inspect.signature(original).parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ][1:]
    input_ids_at = positional.index("input_ids") if "input_ids" in positional else None
    inputs_embeds_at = positional.index("inputs_embeds") if "inputs_embeds" in positional else None

    def argument(args, kwargs, name, at):
        if at is not None and at < len(args):
            return args[at]
        return kwargs.get(name)

    @wraps(original)
    def prepare_inputs_for_generation(self, *args, **kwargs):
        model_inputs = original(self, *args, **kwargs)

        if not isinstance(model_inputs, dict):
            return model_inputs
        # The arguments are read after the call, and only the one the result took its input
        # from: ``args`` and ``kwargs`` still hold the caller's own tensors (the original got
        # copies of the tuple and the dict), so this reads what reading before would.
        prepared = model_inputs.get("inputs_embeds")
        if prepared is not None:
            given = argument(args, kwargs, "inputs_embeds", inputs_embeds_at)
        else:
            # generate() passes input_ids first, by position: read it inline (every step).
            given = args[0] if input_ids_at == 0 and args else argument(args, kwargs, "input_ids", input_ids_at)
            # Step 1 stores the input_ids argument as decoder_input_ids in encoder-decoder models
            # and as input_ids otherwise. Read from the result rather than from
            # self.config.is_encoder_decoder, whose attribute lookup alone costs microseconds.
            prepared = model_inputs.get("decoder_input_ids")
            if prepared is None:
                prepared = model_inputs.get("input_ids")
        if prepared is given:
            return model_inputs  # the very argument: not moved
        # Every step of a call whose inputs are on the model's device: the step's input is a slice
        # of the argument (a view of it, so on its device: step 6 did not move it). Two pointer
        # comparisons decide, without building the devices.
        base = getattr(prepared, "_base", None)
        if base is not None and (base is given or base is getattr(given, "_base", None)):
            return model_inputs
        given_device = getattr(given, "device", None)
        prepared_device = getattr(prepared, "device", None)
        if given_device is not None and prepared_device is not None and prepared_device != given_device:
            # Step 6 moved the top-level tensors to self.device; now the nested ones too.
            moved = move_tree(model_inputs, prepared_device)
            if moved is not model_inputs:  # something nested was off the device (move_tree
                model_inputs = moved  # hands back the very same dict when nothing was)
                report.record_outside_compile(PATCH_ID, f"moved nested tensors to {prepared_device}")
        return model_inputs

    return prepare_inputs_for_generation



PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="Move nested input tensors (per-layer-type attention masks) onto the model device",
    errors=(
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
        "(when checking argument for argument attn_mask in method aten::scaled_dot_product_attention)",
        "Expected all tensors to be on the same device, but found at least two devices, neuron:0 and cpu!",
        "attn_bias is on cpu, different from other tensors on cuda:0",
    ),
    why=(
        "prepare_inputs_for_generation moves only the top-level tensors of its result to the model "
        "device, so with host-side inputs the per-layer-type masks it nests in a dict (static cache, "
        "layer_types) stay on the host."
    ),
    upstream="fixed in {fixed_in} (transformers.pytorch_utils.move_to_device in "
    "GenerationMixin.prepare_inputs_for_generation)",
    targets=(
        Target(
            module=MODULE,
            qualname=QUALNAME,
            replace=_replace_prepare_inputs_for_generation,
            needed_by_call=_call_can_move,
        ),
    ),
    doctor=("host-inputs-static",),
)
