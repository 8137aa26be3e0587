"""A stand-in for optimum-habana's adaptation of transformers, for tests of a stack that
reassigns transformers' generation functions after the overlay patched them.

What it mirrors: optimum-habana 1.21.2 (the last release; it requires transformers >=4.55.0,<4.56.0),
``optimum/habana/transformers/modeling_utils.py``, ``adapt_transformers_to_gaudi()``, which users
call once after ``import transformers``, and the function it calls first,
``optimum/habana/transformers/security_patches.py``, ``apply_transformers_security_patches()``.
Only the pattern is reproduced, not the code: :func:`adapt_like_gaudi` assigns to the same owners,
under the same attribute names, with the same kind of assignment:

- plain class-attribute assignment on ``transformers.generation.GenerationMixin`` (the class of
  ``transformers.generation.utils``, where the overlay patches), with functions defined in a
  ``GenerationMixin`` subclass (:class:`GaudiLikeGenerationMixin`, as Gaudi's come from
  ``GaudiGenerationMixin``); ``prepare_inputs_for_generation`` receives the subclass's
  ``_prepare_inputs_for_generation``, ``_expand_inputs_for_generation`` is wrapped in
  ``staticmethod`` where transformers has a static method (4.55, 4.57);
- rebinding a class name on modules: ``GenerationConfig`` on ``transformers``,
  ``transformers.generation``, ``transformers.generation.configuration_utils`` and
  ``transformers.modeling_utils``, and ``LlamaForCausalLM`` on
  ``transformers.models.llama.modeling_llama`` (a subclass that overrides
  ``prepare_inputs_for_generation``, as ``GaudiLlamaForCausalLM`` does);
- ``__call__`` of ``MaxLengthCriteria``, ``MaxTimeCriteria``, ``EosTokenCriteria`` and
  ``StoppingCriteriaList``; ``PretrainedConfig.__init__`` (through ``transformers.PretrainedConfig``
  and ``transformers.configuration_utils.PretrainedConfig``, the same class);
  ``ModuleUtilsMixin.invert_attention_mask`` and ``.get_extended_attention_mask`` of
  ``transformers.modeling_utils``; ``BartForConditionalGeneration.prepare_inputs_for_generation``
  (inherited from ``GenerationMixin`` there: the assignment shadows it on that class only);
- ``ALL_ATTENTION_FUNCTIONS.register("gaudi_fused_sdpa", ...)``, an SDPA stand-in. Like Gaudi it
  registers no mask function under that key, and transformers builds no attention mask for such
  a key (``masking_utils``): a left-padded batch run with it generates other tokens than "sdpa".

Every replacement delegates to what it replaced (found when :func:`adapt_like_gaudi` ran), so
``generate()`` gives the tokens it gave before, and carries its own ``__module__`` and
``__qualname__`` (no ``__wrapped__``: Gaudi's functions are copies, not wrappers); each keeps the
signature of what it replaced, because transformers reads some of them (``_validate_model_kwargs``
reads ``prepare_inputs_for_generation``'s parameters). An attribute the running release does not
define is skipped, so this imports and runs on 4.55.4, 4.57.6 and 5.18.0 alike (4.57 dropped
``_dola_decoding``, ``_contrastive_search``, ``_group_beam_search`` and
``_constrained_beam_search``; 5.x dropped ``ModuleUtilsMixin``'s two mask methods).
:func:`undo` puts the originals back.

Left out: the attributes Gaudi adds that transformers does not have
(``GenerationMixin.update_model_kwargs_for_bucketing``, ``_get_hpu_graphs_kwargs``,
``_pad_past_key_values``, ``_remove_past_key_values``, ``_prepare_decoder_attention_mask``,
``PreTrainedModel._check_and_enable_sdpa``), what Gaudi's code does differently (tuple caches, HPU
graphs, padding to ``max_length``), the pipelines' ``_default_generation_config`` instances, and
the model-specific reassignments except the two named above (Gaudi rebinds several hundred model
classes and methods under ``transformers.models``), the quantizer, loss, ``Conv1D`` and
``transformers.utils.fx`` ones, and the ``AutoConfig`` / ``AutoModel*`` registrations.
``transformers.LlamaForCausalLM`` keeps whatever the top-level module resolved before; build from
``transformers.models.llama.modeling_llama.LlamaForCausalLM`` to get the replacement.

Order: call :func:`undo` before reverting the overlay (last applied, first undone), since
:func:`undo` restores exactly the objects it found.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import transformers
import transformers.configuration_utils
import transformers.generation
import transformers.generation.configuration_utils
import transformers.modeling_utils
import transformers.models.bart.modeling_bart
import transformers.models.llama.modeling_llama
from transformers.generation import GenerationMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

#: The attention key Gaudi registers (its fused SDPA kernel).
ATTENTION_KEY = "gaudi_fused_sdpa"

#: (attribute of GenerationMixin, name of the replacement on GaudiLikeGenerationMixin), in
#: Gaudi's order; the attributes transformers does not define are left out (see the docstring).
GENERATION_MIXIN_REASSIGNMENTS = (
    ("prepare_inputs_for_generation", "_prepare_inputs_for_generation"),
    ("generate", "generate"),
    ("_update_model_kwargs_for_generation", "_update_model_kwargs_for_generation"),
    ("_expand_inputs_for_generation", "_expand_inputs_for_generation"),
    ("_prepare_attention_mask_for_generation", "_prepare_attention_mask_for_generation"),
    ("_prepare_decoder_input_ids_for_generation", "_prepare_decoder_input_ids_for_generation"),
    ("_prepare_generation_config", "_prepare_generation_config"),
    ("_prepare_generated_length", "_prepare_generated_length"),
    ("_get_stopping_criteria", "_get_stopping_criteria"),
    ("_validate_model_kwargs", "_validate_model_kwargs"),
    ("_dola_decoding", "_dola_decoding"),
    ("_sample", "_sample"),
    ("_beam_search", "_beam_search"),
    ("_group_beam_search", "_group_beam_search"),
    ("_constrained_beam_search", "_constrained_beam_search"),
    ("_contrastive_search", "_contrastive_search"),
    ("_assisted_decoding", "_assisted_decoding"),
    ("_get_candidate_generator", "_get_candidate_generator"),
    ("_prepare_cache_for_generation", "_prepare_cache_for_generation"),
)

_MISSING = object()

# (owner, attribute) -> what the owner resolved there before adapt_like_gaudi() last replaced it:
# the raw class dict entry (a staticmethod stays one) or the module attribute, and whether the
# owner held it itself (False: inherited, so undo() deletes instead of restoring).
_found: dict[tuple[Any, str], tuple[Any, bool]] = {}
# (owner, attribute) -> the object adapt_like_gaudi() put there; insertion order is the order of
# the first assignment, undone in reverse.
_assigned: dict[tuple[Any, str], Any] = {}
_attention_before: list[Any] = []  # what ATTENTION_KEY mapped to before (or _MISSING), once


def _resolve_raw(owner: Any, attribute: str) -> tuple[Any, bool]:
    if isinstance(owner, type):
        if attribute in owner.__dict__:
            return owner.__dict__[attribute], True
        return inspect.getattr_static(owner, attribute), False
    return getattr(owner, attribute), True


def _callable_of(raw: Any) -> Callable:
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def _replaced(owner: Any, attribute: str) -> Callable:
    """What ``owner.attribute`` was before :func:`adapt_like_gaudi` replaced it."""
    try:
        raw, _ = _found[(owner, attribute)]
    except KeyError:
        raise RuntimeError(
            f"{getattr(owner, '__qualname__', owner)}.{attribute} was never replaced: "
            "call adapt_like_gaudi() before using its replacements"
        ) from None
    return _callable_of(raw)


def _reassign(owner: Any, attribute: str, value: Any) -> None:
    key = (owner, attribute)
    current, held = _resolve_raw(owner, attribute)
    if current is not _assigned.get(key):  # not ours already (adapt_like_gaudi() runs twice)
        _found[key] = (current, held)
        _assigned[key] = value
    setattr(owner, attribute, value)


def _delegate(owner: Any, attribute: str, module_qualname: str) -> Callable:
    """A function named ``module_qualname`` that calls what ``owner.attribute`` held when
    :func:`adapt_like_gaudi` replaced it, with that function's signature."""

    def replacement(*args, **kwargs):
        return _replaced(owner, attribute)(*args, **kwargs)

    original = _callable_of(_resolve_raw(owner, attribute)[0])
    replacement.__name__ = module_qualname.rpartition(".")[2]
    replacement.__qualname__ = module_qualname
    replacement.__module__ = __name__
    replacement.__doc__ = f"Stand-in for Gaudi's {module_qualname}: calls the replaced {attribute}."
    replacement.__signature__ = inspect.signature(original)
    return replacement


def _same_kind(original_raw: Any, function: Callable) -> Any:
    # Gaudi wraps its _expand_inputs_for_generation in staticmethod, as transformers 4.55 declares
    # it; on 5.x transformers' is an ordinary method, and a staticmethod there would drop `self`.
    return staticmethod(function) if isinstance(original_raw, staticmethod) else function


class GaudiLikeGenerationMixin(GenerationMixin):
    """Holds the stand-ins for Gaudi's GaudiGenerationMixin methods (set below); never
    instantiated: adapt_like_gaudi() assigns its functions onto GenerationMixin."""


for _attribute, _name in GENERATION_MIXIN_REASSIGNMENTS:
    if _attribute in GenerationMixin.__dict__:
        setattr(
            GaudiLikeGenerationMixin,
            _name,
            _same_kind(
                GenerationMixin.__dict__[_attribute],
                _delegate(GenerationMixin, _attribute, f"GaudiLikeGenerationMixin.{_name}"),
            ),
        )
del _attribute, _name


class GaudiLikeGenerationConfig(transformers.generation.configuration_utils.GenerationConfig):
    """Stands in for GaudiGenerationConfig (which adds HPU options); adds nothing."""


class GaudiLikeLlamaForCausalLM(transformers.models.llama.modeling_llama.LlamaForCausalLM):
    """Stands in for GaudiLlamaForCausalLM: a subclass with its own prepare_inputs_for_generation."""

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return super().prepare_inputs_for_generation(*args, **kwargs)


GaudiLikeLlamaForCausalLM.prepare_inputs_for_generation.__signature__ = inspect.signature(
    transformers.models.llama.modeling_llama.LlamaForCausalLM.prepare_inputs_for_generation
)

_STOPPING_CRITERIA = ("MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria", "StoppingCriteriaList")
_stopping_criteria_calls = {
    name: _delegate(
        getattr(transformers.generation, name), "__call__", f"gaudi_like_{name.lower()}_call"
    )
    for name in _STOPPING_CRITERIA
}
gaudi_like_pretrained_config_init = _delegate(
    transformers.configuration_utils.PretrainedConfig, "__init__", "gaudi_like_pretrained_config_init"
)
gaudi_like_bart_prepare_inputs_for_generation = _delegate(
    transformers.models.bart.modeling_bart.BartForConditionalGeneration,
    "prepare_inputs_for_generation",
    "gaudi_like_bart_prepare_inputs_for_generation",
)
_MODULE_UTILS_METHODS = ("invert_attention_mask", "get_extended_attention_mask")
_module_utils_methods = {
    name: _delegate(transformers.modeling_utils.ModuleUtilsMixin, name, f"gaudi_like_{name}")
    for name in _MODULE_UTILS_METHODS
    if name in transformers.modeling_utils.ModuleUtilsMixin.__dict__
}


def gaudi_like_fused_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """Stands in for Gaudi's fused SDPA kernel: transformers' own SDPA attention."""
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def adapt_like_gaudi() -> None:
    """Reassign transformers' attributes as ``adapt_transformers_to_gaudi()`` does (see the module
    docstring for which); the replacements call what they replaced. Safe to call twice."""
    config_class = transformers.configuration_utils.PretrainedConfig
    if config_class.__dict__.get("__init__") is not gaudi_like_pretrained_config_init:
        # Gaudi assigns it through both names (one class); the first assignment is the one recorded.
        _reassign(transformers.PretrainedConfig, "__init__", gaudi_like_pretrained_config_init)
        _reassign(config_class, "__init__", gaudi_like_pretrained_config_init)

    if not _attention_before:
        mapping = type(transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS)._global_mapping
        _attention_before.append(mapping.get(ATTENTION_KEY, _MISSING))
    transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS.register(
        ATTENTION_KEY, gaudi_like_fused_sdpa_attention_forward
    )

    for attribute, name in GENERATION_MIXIN_REASSIGNMENTS:
        if name in GaudiLikeGenerationMixin.__dict__:  # the release defines the attribute
            _reassign(GenerationMixin, attribute, GaudiLikeGenerationMixin.__dict__[name])
    # The top-level module as `import transformers` returns it now: transformers replaces its own
    # entry in sys.modules when processing_utils first runs (direct_transformers_import), so the
    # object bound at this file's import may be a stale copy by now. It goes first: its lazy
    # attribute resolves through transformers.generation, so read after that one was rebound it
    # would record the stand-in as the original, and undo() would leave the stand-in there.
    for module in (
        sys.modules["transformers"],
        transformers.generation,
        transformers.generation.configuration_utils,
        transformers.modeling_utils,
    ):
        _reassign(module, "GenerationConfig", GaudiLikeGenerationConfig)
    for name, call in _stopping_criteria_calls.items():
        _reassign(getattr(transformers.generation, name), "__call__", call)

    for name, method in _module_utils_methods.items():
        _reassign(transformers.modeling_utils.ModuleUtilsMixin, name, method)
    _reassign(
        transformers.models.bart.modeling_bart.BartForConditionalGeneration,
        "prepare_inputs_for_generation",
        gaudi_like_bart_prepare_inputs_for_generation,
    )
    _reassign(transformers.models.llama.modeling_llama, "LlamaForCausalLM", GaudiLikeLlamaForCausalLM)


def undo() -> None:
    """Put back what :func:`adapt_like_gaudi` found, last assignment first. An attribute that
    no longer holds our replacement (something replaced it since) is left as it is."""
    for (owner, attribute), value in reversed(list(_assigned.items())):
        current, _ = _resolve_raw(owner, attribute)
        # _found stays: a replacement still referenced somewhere keeps calling the original.
        original, held = _found[(owner, attribute)]
        del _assigned[(owner, attribute)]
        if current is not value:
            continue
        if held:
            setattr(owner, attribute, original)
        else:
            delattr(owner, attribute)
    if _attention_before:
        mapping = type(transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS)._global_mapping
        before = _attention_before.pop()
        if mapping.get(ATTENTION_KEY) is gaudi_like_fused_sdpa_attention_forward:
            if before is _MISSING:
                del mapping[ATTENTION_KEY]
            else:
                mapping[ATTENTION_KEY] = before
