"""Offloaded models (accelerate's cpu_offload / disk_offload) get their inputs on the execution device.

What breaks (transformers 4.55.0 - 5.25.0, no fix upstream yet): a model offloaded with
``accelerate.cpu_offload(model, execution_device=accel)`` or ``accelerate.disk_offload`` keeps its
weights on the ``meta`` device and moves them onto the accelerator layer by layer. Given a batch
kept on the host (straight from the tokenizer), ``generate(..., cache_implementation="static")``
fails:

    RuntimeError: Expected all tensors to be on the same device, but found at least two devices,
    cuda:0 and cpu! (when checking argument for argument attn_mask in method
    aten::scaled_dot_product_attention)

and, while ``cache_position`` is passed to the forward (4.55.0 - 5.3.0), with
``index_copy_(): self, index and source expected to be in the same device, but got (self) cuda:0,
(index) cpu, and (source) cuda:0`` from the static cache's update; there the default cache fails
too (its mask is built on the device of the host ``cache_position``; run on 4.55 - 5.0).

The cause: these two helpers put one hook on the model itself that only sends outputs back to the
inputs' device (``AlignDevicesHook(execution_device=None, io_same_device=True)``); the hooks that
move tensors onto the accelerator sit on the leaf modules that own weights (embeddings, linears,
norms). ``input_ids`` reaches the device through the embedding's hook, but what
``prepare_inputs_for_generation`` builds on the device of ``input_ids`` (the static cache's
attention masks, ``cache_position``, ``position_ids``) reaches attention and the cache on the
host. generate() never moves them: ``model.device`` reads ``meta`` (its first parameter), and
5.13's step 6 ("move the tensors the forward consumes onto the model device") skips a ``meta``
model; before 5.13 there is no such step. ``dispatch_model`` / ``from_pretrained(device_map=...)``
offload (``"cpu"`` or ``"disk"`` parts) is not affected: their model-level hook has an execution
device and moves every input there itself. Inputs moved to the device first work as well.

What the replacement does: it wraps ``GenerationMixin.prepare_inputs_for_generation`` (no copied
code) and, only for a model carrying accelerate's model-level hook without an execution device,
finds the execution device from the first submodule hook that has one and moves every tensor of
the prepared inputs onto it, at any depth (:func:`overlay.tree_move.move_tree`; ``Cache`` objects
untouched: the static cache's layers follow the key states' device). Inputs already there are not
copied.

Cost where nothing is offloaded: one dictionary lookup per generate() call (``_hf_hook`` in the
model's ``__dict__``, ``needed_by_call``), and nothing per step: the call runs the release's own
method; called directly, outside generate(), the same look-up per call (about 0.35 us with the
wrapper layer); a model with accelerate's hook adds one weak-dictionary lookup per call. An
offloaded model walks its modules to the first hooked one once per model-level hook.

Not covered: models whose own ``prepare_inputs_for_generation`` does not call ``super()``;
tensors a model adds after ``super()`` returns; caches created on ``meta`` by callers. Details:
docs/patches/offload-execution-device.md.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "offload-execution-device"
MODULE = "transformers.generation.utils"
QUALNAME = "GenerationMixin.prepare_inputs_for_generation"


def _hook_device(hook):
    """The execution device of an accelerate hook (or of a ``SequentialHook``'s parts), or None."""
    device = getattr(hook, "execution_device", None)
    if device is None:
        for part in getattr(hook, "hooks", ()):
            device = getattr(part, "execution_device", None)
            if device is not None:
                break
    return device


def _offload_execution_device(model, hook):
    """Where an offloaded model computes, or None where accelerate moves the inputs itself.

    The model-level hook with an execution device (``dispatch_model``, ``device_map``) sends the
    forward's inputs there; the one without (``cpu_offload``, ``disk_offload``) leaves that to the
    hooks on the modules that own weights: the first of them names the device.
    """
    if _hook_device(hook) is not None:
        return None
    for module in model.modules():
        sub_hook = module.__dict__.get("_hf_hook")
        if sub_hook is not None:
            device = _hook_device(sub_hook)
            if device is not None:
                return device
    return None


def _cached_execution_device(devices, model, hook):
    """:func:`_offload_execution_device`, remembered per model-level hook object (accelerate
    attaches the leaf hooks before it, and offloading again makes a new one), so a model with a
    hook that is not an offload hook does not walk all its modules at every step."""
    try:
        return devices[hook]
    except KeyError:
        pass
    except TypeError:  # a hook that cannot be weakly referenced: no memo
        return _offload_execution_device(model, hook)
    device = devices[hook] = _offload_execution_device(model, hook)
    return device


def _call_is_offloaded(model, args, kwargs):
    """``needed_by_call``: only a model carrying accelerate's model-level hook can be offloaded."""
    return "_hf_hook" in model.__dict__


def _replace_prepare_inputs_for_generation(original, variant):
    import weakref

    from overlay.tree_move import move_tree

    devices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model-level hook -> device or None

    @wraps(original)
    def prepare_inputs_for_generation(self, *args, **kwargs):
        model_inputs = original(self, *args, **kwargs)

        # The one check every call pays: accelerate's hook on the model itself (an instance
        # attribute, so a dictionary lookup; nn.Module's __getattr__ is never reached).
        hook = self.__dict__.get("_hf_hook")
        if hook is None or not isinstance(model_inputs, dict):
            return model_inputs
        device = _cached_execution_device(devices, self, hook)
        if device is None:
            return model_inputs
        moved = move_tree(model_inputs, device)
        if moved is not model_inputs:  # move_tree hands back the very same dict when nothing moved
            model_inputs = moved
            report.record_outside_compile(PATCH_ID, f"moved inputs to the offload execution device {device}")
        return model_inputs

    return prepare_inputs_for_generation


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="generate() moves host inputs onto the execution device of a model offloaded with accelerate's "
    "cpu_offload or disk_offload",
    errors=(
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
        "(when checking argument for argument attn_mask in method aten::scaled_dot_product_attention)",
        "index_copy_(): self, index and source expected to be in the same device, but got (self) cuda:0, "
        "(index) cpu, and (source) cuda:0",
    ),
    why=(
        "A model offloaded with accelerate's cpu_offload or disk_offload reads model.device == meta, so "
        "generate() never moves host inputs (masks, cache_position) to the execution device; only the "
        "weight-owning submodules' hooks move their own arguments."
    ),
    upstream="none: no transformers release up to {newest_release} moves the inputs of a model whose device is meta",
    targets=(
        Target(
            module=MODULE,
            qualname=QUALNAME,
            replace=_replace_prepare_inputs_for_generation,
            needed_by_call=_call_is_offloaded,
        ),
    ),
)
