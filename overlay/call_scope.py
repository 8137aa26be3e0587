"""Per-step replacements that one ``generate()`` call cannot need are left out of that call.

A patch whose replacement runs at every decoding step (``prepare_inputs_for_generation``,
``_update_model_kwargs_for_generation``, ``_get_top_k_continuations``: methods the decoding loop
looks up on the model at each step) would otherwise charge its wrapper frame to every token of every
call, whether or not its fix can act. Such a target declares ``Target.needed_by_call``: a predicate
of the model and ``generate()``'s arguments that answers False only when no step of the call can
reach the code the fix changes (no ``position_ids`` passed, inputs already on the model's device,
not sampling, no offload hook). The engine then wraps ``GenerationMixin.generate`` once: at each call
it asks the predicates of the replacements in force for each such method (top layer first, walking
``__wrapped__`` down while a layer is not needed) and, if it skipped any, binds the first layer
that is needed (or the release's own function) on the model instance for the duration of the call.
Python finds an instance attribute before a class's function, so every step calls that directly:
nothing per step, one decision per call.

What stays exact:

- The classes are never touched: statuses, layering, other patchers and ``revert()`` see the
  same objects as before. Only the model's ``__dict__`` holds the bound method, and only during the
  call; it is removed when the call returns or raises.
- A model class that overrides the method (its own code, calling ``super()``) is not gated: the
  class attribute found first is then not an overlay layer, and every step runs as before. So is
  an instance that already holds the attribute itself (PEFT binds its own
  ``prepare_inputs_for_generation`` on the base model).
- A predicate that raises counts as "needed" (the layer stays).
- Two calls at once on the same model (threads; a nested call): every call registers, and the
  second one takes the first's bindings off before it starts and binds nothing itself, so both run
  every layer from then on. Bindings exist only while one call alone runs on the instance.

Code that calls the method directly (not through ``generate()``) always meets every layer.

Known limit: the wrapper is one more frame above ``generate()``. A warning that transformers raises
with ``stacklevel=2`` from its outermost decorator on ``generate`` (5.24+: ``deprecate_kwarg`` for
``past_key_values``) names this module's line instead of the caller's.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

#: Attribute set on a replacement whose target declares ``Target.needed_by_call``.
NEEDED_BY_CALL = "__overlay_needed_by_call__"
#: Attribute set on the ``generate`` wrapper this module installs.
SCOPE_MARKER = "__overlay_call_scope__"

MODULE = "transformers.generation.utils"
OWNER = "GenerationMixin"
NAME = "generate"

_lock = threading.Lock()
#: id(model) -> [number of calls running on it, {name: bound method this module set}]
_running: dict[int, list[Any]] = {}
#: Method names (on the model) that carry gated replacements: the engine keeps this current.
_gated_names: tuple[str, ...] = ()
#: The wrapper :func:`update` set on ``GenerationMixin.generate`` (None: none in place).
_installed: Any = None


def needed_layer(raw: Any, model: Any, args: tuple, kwargs: dict) -> Any:
    """The first layer from ``raw`` down (``raw`` itself, or what it wraps) that this call needs:
    gated overlay replacements whose predicate says False are passed over, anything else stops."""
    layer = raw
    while True:
        # (predicate, the layer that declared it): functools.wraps copies __dict__, so a wrapper
        # around a gated layer carries the pair too, naming another function. Never skip it.
        declared: Any = getattr(layer, NEEDED_BY_CALL, (None, None))
        predicate, owner = declared
        if owner is not layer:
            return layer
        try:
            needed = predicate(model, args, kwargs)
        except Exception:  # noqa: BLE001 - a predicate that cannot decide keeps its layer
            needed = True
        if needed:
            return layer
        layer = layer.__wrapped__


def _class_attribute(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        found = klass.__dict__.get(name)
        if found is not None:
            return found
    return None


def bindings_for(model: Any, args: tuple, kwargs: dict, names: Iterable[str] | None = None) -> dict[str, Any]:
    """``{name: bound method}`` to set on ``model`` for this call (empty: nothing to skip)."""
    found: dict[str, Any] = {}
    own = getattr(model, "__dict__", None)
    if own is None:
        return found
    cls = type(model)
    for name in _gated_names if names is None else names:
        if name in own:  # the instance's own attribute (PEFT's, another call's): leave it
            continue
        raw = _class_attribute(cls, name)
        if raw is None or not hasattr(raw, NEEDED_BY_CALL):
            continue
        layer = needed_layer(raw, model, args, kwargs)
        if layer is not raw and hasattr(layer, "__get__"):
            found[name] = layer.__get__(model, cls)
    return found


def _enter(model: Any, bindings: dict[str, Any]) -> dict[str, Any]:
    """Register a call on ``model``; bind ``bindings`` when it is the only one. Returns what it bound."""
    key = id(model)
    own = model.__dict__
    with _lock:
        entry = _running.get(key)
        if entry is not None:
            # Another call runs on this instance: both run every layer from now on.
            entry[0] += 1
            for name, bound in entry[1].items():
                if own.get(name) is bound:
                    del own[name]
            entry[1] = {}
            return {}
        _running[key] = [1, bindings]
        own.update(bindings)
        return bindings


def _leave(model: Any, bound: dict[str, Any]) -> None:
    key = id(model)
    own = model.__dict__
    with _lock:
        for name, method in bound.items():
            if own.get(name) is method:
                del own[name]
        entry = _running.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] <= 0:
                del _running[key]


def scoped(generate: Callable[..., Any]) -> Callable[..., Any]:
    """``generate`` with the per-call decision in front of it."""

    @functools.wraps(generate)
    def generate_for_call(self, *args, **kwargs):
        if not _gated_names or getattr(self, "__dict__", None) is None:
            return generate(self, *args, **kwargs)
        try:
            bindings = bindings_for(self, args, kwargs)
        except Exception:  # noqa: BLE001 - deciding must never break a generate() call
            bindings = {}
        # Registered even when it binds nothing: a call already running on this model (another
        # thread, or this call's caller) may hold bindings that this call must not run with.
        bound = _enter(self, bindings)
        try:
            return generate(self, *args, **kwargs)
        finally:
            _leave(self, bound)

    setattr(generate_for_call, SCOPE_MARKER, True)
    return generate_for_call


def _owner() -> Any:
    module = sys.modules.get(MODULE)
    return None if module is None else getattr(module, OWNER, None)


def is_installed() -> bool:
    """Whether the wrapper is in place (the very object on ``GenerationMixin``)."""
    owner = _owner()
    return owner is not None and _installed is not None and owner.__dict__.get(NAME) is _installed


def update(names: Iterable[str]) -> None:
    """Keep the scope in step with the replacements in force: ``names`` are the method names of
    the gated targets applied now. Installs the wrapper on ``GenerationMixin.generate`` when there
    are some, takes it off when there are none (only if it is still the object there: a wrapper
    someone set over it keeps it, and it then decides nothing)."""
    global _gated_names, _installed
    _gated_names = tuple(sorted(set(names)))
    owner = _owner()
    if owner is None:
        return
    current = owner.__dict__.get(NAME)
    if _gated_names:
        # A wrapper made with functools.wraps around ours copies its marker: it still runs ours.
        if current is not None and not getattr(current, SCOPE_MARKER, False):
            _installed = scoped(current)
            setattr(owner, NAME, _installed)
    elif _installed is not None:
        if current is _installed:
            setattr(owner, NAME, _installed.__wrapped__)
        _installed = None
