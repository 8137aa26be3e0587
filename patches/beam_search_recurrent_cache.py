"""Beam search reorders the recurrent state of Mamba, Mamba2 and Falcon Mamba with the beams.

What breaks (4.55.0 - 5.12.1): ``generate(num_beams=N)`` (N > 1; beam sampling too) with the default
``use_cache=True`` on ``MambaForCausalLM``, ``Mamba2ForCausalLM`` or ``FalconMambaForCausalLM``. No
error: other sequences and scores than the same call with ``use_cache=False``. Each step the search
keeps the best N continuations, often several from one beam and none from another, but every row of
the model's state goes on as the beam it was, not as the one it now continues.

The cause: ``GenerationMixin._beam_search`` reorders the cache only under ``past_key_values``; these
models keep theirs under ``cache_params`` (their own ``MambaCache``, ``Mamba2Cache``,
``FalconMambaCache`` up to 5.4, a ``DynamicCache`` of linear-attention layers from 5.5). Upstream
(PR #46819, in 5.13.0) reorders whichever cache name the step carries (and raises ``ValueError``
for a cache it cannot reorder: RWKV's ``state``, xLSTM's cache).

What the replacement does (it wraps ``GenerationMixin._beam_search`` and leaves its loop as it is):
for a call that uses the cache and carries no ``past_key_values``, it instruments the model for the
call only (undone in ``finally``). A forward hook notes the cache the model returns as
``cache_params`` (the object the loop feeds back); the loop's call that picks the next step's beams
(``self._get_running_beams_for_next_iteration``) goes to the class's own method and is followed by
the missing reorder, where upstream's loop reorders: source rows from the newest filled column of
the running beam indices it returns; a cache with ``reorder_cache`` (5.5+) through it, the Mamba
caches up to 5.4 by in-place copies (their buffers keep their addresses). A ``ContextVar`` keeps
two threads' calls on one model apart.

Limits: another cache class under ``cache_params`` (xLSTM's) is left as stock leaves it (5.13+
raises); RWKV (``state``) is not covered: its cached path differs from its uncached one even in
greedy search on these releases, so no reference can judge a reorder (5.13+ raises). Group and
constrained beam search (4.55.x) are not patched. The routing is an instance attribute; one the model
instance already holds under that name is called in place of the class's. Jamba, Bamba, Zamba,
Falcon H1 and the other hybrids use ``past_key_values``: the release reorders them itself. A model
that is not a torch module (OpenVINO's) gets the release's beam search.
Cost: per step one hook call, a gather of N x batch indices and one ``index_select`` per state
tensor (as upstream); nothing for greedy search, sampling, or a ``past_key_values`` cache, and
nothing per step for a model class none of whose ``forward`` methods takes ``cache_params``
(decided once per class: Llama's beam search is the release's own loop).
Longer account: docs/patches/beam-search-recurrent-cache.md.

Tested (``tests/patches/beam_search_recurrent_cache/``): tiny random Mamba, Mamba2 and Falcon Mamba,
``num_beams=3``, 8 new tokens, beams that move between rows: stock differs from ``use_cache=False``;
the overlay gives its ids (scores to rounding); greedy search and Llama's beam search are stock's.
"""

from __future__ import annotations

import contextvars
import threading
import types
import weakref

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "beam-search-recurrent-cache"
MODULE = "transformers.generation.utils"

#: Where the models this patch covers keep their state between steps (model_kwargs and outputs).
CACHE_NAMES = ("cache_params",)
#: Model caches up to 5.4 whose states are per-layer lists of [batch, ...] tensors.
_LISTED_STATES = ("MambaCache", "FalconMambaCache")
#: Mamba2's cache up to 5.4: one [layers, batch, ...] tensor per kind of state.
_STACKED_STATES = ("Mamba2Cache",)
#: The step of the loop that picks the next step's beams; the loop reorders the cache right after it.
STEP = "_get_running_beams_for_next_iteration"


class _Call:
    """One beam-search call: its model and the cache the model's forward last returned."""

    __slots__ = ("model", "cache")

    def __init__(self, model) -> None:
        self.model = model
        self.cache = None


_CURRENT: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("attn_overlay_beam_call", default=None)
# Per model: beam-search calls in flight that reorder its cache, and what its instance held under
# STEP before (normally nothing); the step is routed through _next_beams while any is in flight.
_LOCK = threading.Lock()
_ROUTED: weakref.WeakKeyDictionary[object, list] = weakref.WeakKeyDictionary()
_NOTHING = object()


def _reorder_in_place(cache, beam_idx) -> bool:
    """Reorder ``cache``'s rows (batch x beams) by ``beam_idx``; return whether it could."""
    reorder = getattr(cache, "reorder_cache", None)
    if callable(reorder):
        reorder(beam_idx)
        return True
    kind = type(cache).__name__
    if kind in _LISTED_STATES or kind in _STACKED_STATES:
        row_dim = 1 if kind in _STACKED_STATES else 0
        for name in ("conv_states", "ssm_states"):
            states = getattr(cache, name)
            for tensor in (states,) if kind in _STACKED_STATES else states:
                tensor.copy_(tensor.index_select(row_dim, beam_idx.to(tensor.device)))
        return True
    return False


def _next_beams(model, *args, **kwargs):
    """The loop's step (what the model's class or its instance had), then the reorder the loop skips."""
    with _LOCK:
        before = _ROUTED[model][1] if model in _ROUTED else _NOTHING
    step = getattr(type(model), STEP).__get__(model) if before is _NOTHING else before
    result = step(*args, **kwargs)
    call = _CURRENT.get()
    if call is None or call.model is not model or call.cache is None:
        return result  # another thread's call on this model, or no cache noted (yet)
    import torch

    running_beam_indices = result[2]  # [batch, beams, new tokens]: source rows; -1 where not generated yet
    newest = (running_beam_indices >= 0).sum(dim=-1, keepdim=True) - 1
    beam_idx = running_beam_indices.gather(-1, newest.clamp(min=0)).flatten().to(torch.long)
    if _reorder_in_place(call.cache, beam_idx):
        report.record_outside_compile(PATCH_ID, "reordered the recurrent cache")
    return result


def _route_step(model) -> None:
    with _LOCK:
        if model in _ROUTED:
            _ROUTED[model][0] += 1
            return
        _ROUTED[model] = [1, vars(model).get(STEP, _NOTHING)]
        vars(model)[STEP] = types.MethodType(_next_beams, model)


def _unroute_step(model) -> None:
    with _LOCK:
        entry = _ROUTED[model]
        entry[0] -= 1
        if entry[0]:
            return
        del _ROUTED[model]
        if entry[1] is _NOTHING:
            vars(model).pop(STEP, None)
        else:
            vars(model)[STEP] = entry[1]


#: Per model class: whether any class of its MRO has a ``forward`` that takes ``cache_params``
#: (decided once per class; a class without one has no recurrent state for this patch to follow).
_RECURRENT_CLASSES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def takes_cache_params(cls) -> bool:
    """Whether model class ``cls`` (or a class it inherits ``forward`` from) can carry a recurrent
    cache under ``cache_params``: Mamba, Mamba2, Falcon Mamba and their subclasses, not Llama."""
    known = _RECURRENT_CLASSES.get(cls)
    if known is None:
        import inspect

        known = False
        for klass in cls.__mro__:
            forward = vars(klass).get("forward")
            if forward is None:
                continue
            try:
                parameters = inspect.signature(forward).parameters
            except (TypeError, ValueError):  # a builtin or odd callable: assume it may
                known = True
                break
            if any(name in parameters for name in CACHE_NAMES):
                known = True
                break
        _RECURRENT_CLASSES[cls] = known
    return known


def make_beam_search(original, variant):
    @wraps(original)
    def _beam_search(self, *args, **model_kwargs):
        if model_kwargs.get("past_key_values") is not None or model_kwargs.get("use_cache") is False:
            return original(self, *args, **model_kwargs)  # the release reorders it, or there is none
        if not takes_cache_params(type(self)):
            # Decided once per model class: no forward in its classes takes cache_params, so the
            # hook would note nothing and every step's reorder would be skipped: the release's own
            # loop, with no hook on the model and no routed step (nothing per step).
            return original(self, *args, **model_kwargs)
        if not hasattr(self, "register_forward_hook"):
            # Not a torch module (OpenVINO's models run generate() on a compiled graph): no
            # cache_params for this patch to follow, and no hook to follow it with.
            return original(self, *args, **model_kwargs)
        call = _Call(self)

        def note_cache(module, inputs, output):
            if _CURRENT.get() is not call or not hasattr(output, "get"):
                return  # another thread's call on the same model, or an output without names
            for name in CACHE_NAMES:
                cache = output.get(name)
                if cache is not None:
                    call.cache = cache
                    return

        token = _CURRENT.set(call)
        handle = self.register_forward_hook(note_cache)
        try:
            _route_step(self)
            try:
                return original(self, *args, **model_kwargs)
            finally:
                _unroute_step(self)
        finally:
            handle.remove()
            _CURRENT.reset(token)

    return _beam_search


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="output",
    title="Beam search reorders the recurrent state of Mamba, Mamba2 and Falcon Mamba with the beams",
    errors=(
        "(no error) generate(num_beams=N) on Mamba, Mamba2 or Falcon Mamba gives other sequences and scores "
        "than with use_cache=False: the recurrent state is never reordered with the beams",
    ),
    why=(
        "GenerationMixin._beam_search reorders the cache only under past_key_values, while the Mamba family "
        "keeps it under cache_params: each row's state goes on as the beam it was, not as the one it continues."
    ),
    upstream=(
        "huggingface/transformers#46819 (beam search reorders every cache name; raises for a cache it cannot "
        "reorder), in {fixed_in}"
    ),
    targets=(Target(module=MODULE, qualname="GenerationMixin._beam_search", replace=make_beam_search),),
)
