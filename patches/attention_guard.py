"""A guard at the attention entry: q, k, v must go together, or the error says which one does not.

What breaks (no transformers release validates attention inputs at dispatch; covered
from 4.55.0 on): when query, key and value reach an attention kernel on different devices, in
different dtypes or with incompatible shapes, the user gets a raw kernel error from deep inside
torch ("Expected all tensors to be on the same device ...", "Expected query, key, and value to
have the same dtype ...", "expected scalar type ... but found ...", "query and key must have the
same dtype", a matmul shape error) that names neither the layer nor the tensor at fault.

Policy: the guard sits where every attention layer that dispatches through the registry gets its
kernel, ``AttentionInterface.get_interface`` (5.1.0 on: the one place that sees the registered
kernels *and* each model's own ``eager_attention_forward``), and hands back the kernel behind a
wrapper. The dtype fix itself lives in ``Cache.update`` (patch ``kv-cache-dtype``); this guard
names problems, and in ``align`` casts what still differs:
- transformers' own kernels, ``align`` (the default): the kernel runs unchecked; only when it
  raises does :func:`overlay.guard.diagnose_kernel_error` look at q, k, v: a dtype mismatch alone
  is cast to the query's dtype and the kernel called once more, any other problem raises
  :class:`overlay.guard.AttentionInputError` chained to the kernel's error, and if q, k, v go
  together the kernel's own error is re-raised unchanged;
- any other callable (users' or kernels hub's), every kernel in ``check``, and every kernel under
  ``torch.compile`` (decided at trace time): :func:`overlay.guard.check_attention_inputs` runs
  before the call (``align`` casts, ``check`` raises; on devices and shapes both raise);
- ``off``: the kernel unwrapped. Under autocast dtypes are left to autocast.

Releases: 5.1.0 - 5.18.0 and 5.19.0 on (``paged|`` prefix) are two variants of
``get_interface``; 4.55.0 - 5.0.0 have none, and the second target replaces the registry lookup,
``AttentionInterface.__getitem__`` (inherited from ``GeneralInterface``, set on
``AttentionInterface`` only, deleted again by a revert), with the same wrappers.

Limits: eager on 4.55.0 - 5.0.0 is not guarded (the models call their ``eager_attention_forward``
directly; the default ``sdpa`` goes through the registry). Not covered: models that index
``ALL_ATTENTION_FUNCTIONS[...]`` directly from 5.1.0 (SAM-family vision models, one Qwen2.5-Omni
branch) and models that write their attention inline (24 with a KV cache in 5.18.0: XLM,
ProphetNet, LED, MPT, ...; T5, Falcon, ... before 5.1.0); ``kv-cache-dtype`` still aligns their
cache dtypes. Covered: 326 of 500 model folders in 5.18.0, every current decoder LLM.

Cost when nothing needs fixing (transformers' kernels, ``align``), per attention call: the
registry lookup, one mode read, one call of :func:`_compiling`, one dict lookup keyed by the
kernel and one wrapper frame, calling the kernel with the model's keywords spelled out; no tensor
is read, copied or checked.

The full account (every case, coverage per release, costs): docs/patches/attention-guard.md.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from types import CodeType, FunctionType

from overlay import guard as _guard
from overlay.call_forwarding import RERAISE, call_shape, shaped_forwarder
from overlay.patch import Target, fingerprint, wraps
from overlay.releases import patch_with_release_facts

MODULE = "transformers.modeling_utils"
PATCH_ID = "attention-guard"

#: What kernels raise when q, k, v do not go together (torch: RuntimeError; flash/flex: ValueError,
#: TypeError, AssertionError; a shape unpack: ValueError/IndexError). Anything else passes through.
KERNEL_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, AssertionError)

#: transformers' kernel -> its wrapper, for the align fast path. Keyed by the function itself (plain
#: functions hash and compare by identity, in C); only module-level functions of transformers
#: modules are stored, so this keeps alive nothing that stock would free. A kernel registered under
#: two names is named in messages by the first name it was seen under.
_kernel_wrappers: dict = {}


def _compiling() -> bool:
    """False when it runs; True when dynamo traces it (its substitute, registered at apply time)."""
    return False


def _compiling_in_graph() -> bool:
    return True


_substitute_registered = False


def _register_compile_substitute() -> None:
    """Tell dynamo to read :func:`_compiling` as True. Imports nothing: torch._dynamo is already
    loaded whenever transformers.modeling_utils is (it imports it); without it, nothing to do."""
    global _substitute_registered
    if _substitute_registered or "torch._dynamo" not in sys.modules:
        return
    try:
        sys.modules["torch._dynamo"].substitute_in_graph(_compiling)(_compiling_in_graph)
    except Exception:  # an older torch without it: dynamo then traces the eager wrappers
        return
    _substitute_registered = True


def _is_transformers_kernel(function) -> bool:
    """A module-level function of a transformers module (a kernel known to reject bad q, k, v)."""
    if type(function) is not FunctionType:
        return False
    module_name = function.__module__ or ""
    if not module_name.startswith("transformers."):
        return False
    return getattr(sys.modules.get(module_name), function.__name__, None) is function


def _retry_arguments(error, attn_implementation, args, kwargs):
    """After a kernel raised ``error``: the arguments to call it again with, or None (re-raise)."""
    if len(args) >= 4:
        module, query, key, value = args[:4]
    else:
        return None  # q, k, v passed by keyword: transformers never does; leave the error alone
    aligned = _guard.diagnose_kernel_error(
        error, query, key, value, module=module, attn_implementation=attn_implementation
    )
    if aligned is None:
        return None
    import torch

    if not torch.compiler.is_compiling():
        from overlay import report

        casts = sorted({str(t.dtype) for t in (key, value) if t.dtype != query.dtype})
        report.record(PATCH_ID, f"cast {'/'.join(casts)} key/value to {query.dtype} at the attention entry")
    return (args[0], *aligned, *args[4:]), kwargs


def _wrapper_for_kernel(function, attn_implementation):
    """transformers' kernel in ``align``: call it; look at q, k, v only if it raises.

    The wrapper built here takes any call (``*args, **kwargs``). Its first call also builds a
    second one for that call's shape (:mod:`overlay.call_forwarding`: parameters named after the
    keywords the model passes, the kernel called with them spelled out, about 1,800 instructions
    cheaper per call than re-packing ``*args, **kwargs``), which replaces it in
    ``_kernel_wrappers``: models call a kernel the same way on every layer and step. A call of
    another shape goes through this generic wrapper again, and behaves exactly the same.
    """

    def on_error(error, args, kwargs):
        retry = _retry_arguments(error, attn_implementation, args, kwargs)
        if retry is None:
            return RERAISE
        try:
            return function(*retry[0], **retry[1])
        except KERNEL_ERRORS:
            # The cast did not make the inputs acceptable (e.g. a layout the kernel rejects
            # for another reason): fail with the error stock gives, not a new one.
            raise error from None

    @wraps(function)
    def guarded_attention(*args, **kwargs):
        # Still the stored wrapper: no call has had a shape a wrapper can be built for yet. (As
        # the shaped wrapper's fallback, for calls of another shape, it is not the stored one.)
        if _kernel_wrappers.get(function) is guarded_attention:
            _shape_wrapper(function, guarded_attention, on_error, args, kwargs)
        try:
            return function(*args, **kwargs)
        except KERNEL_ERRORS as error:
            result = on_error(error, args, kwargs)
            if result is RERAISE:
                raise
            return result

    return guarded_attention


def _shape_wrapper(function, generic, on_error, args, kwargs):
    """Build the wrapper for the shape of this call and store it in the generic one's place."""
    shape = call_shape(args, kwargs)
    if shape is None:  # a keyword no parameter can be named after: the generic wrapper stays
        return
    forwarder = wraps(function)(
        shaped_forwarder(function, shape, fallback=generic, on_error=on_error, catch=KERNEL_ERRORS,
                         name="guarded_attention")
    )
    _GUARD_CODES.add(forwarder.__code__)
    _kernel_wrappers[function] = forwarder


def _checked_call(function, attn_implementation, module, query, key, value, *args, **kwargs):
    """Check q, k, v (cast in ``align``, raise on the rest), then call the kernel."""
    query, key, value = _guard.check_attention_inputs(
        query, key, value, module=module, attn_implementation=attn_implementation
    )
    return function(module, query, key, value, *args, **kwargs)


def _checked_wrapper(function, attn_implementation):
    """Any other callable, or ``check``: the check before the call. Built per call, never stored."""

    def guarded_attention(module, query, key, value, *args, **kwargs):
        return _checked_call(function, attn_implementation, module, query, key, value, *args, **kwargs)

    guarded_attention.__wrapped__ = function
    return guarded_attention


def _slow_path(function, attn_implementation):
    """``align``, a kernel seen for the first time (or not one of transformers')."""
    if function is None:
        return None
    if _is_transformers_kernel(function):
        wrapper = _wrapper_for_kernel(function, attn_implementation)
        _kernel_wrappers[function] = wrapper
        return wrapper
    return _checked_wrapper(function, attn_implementation)


#: ``GeneralInterface.__getitem__`` (the instance's own mapping first, then the class-wide one):
#: the code the ``__getitem__`` target's variant is (``patches/releases.json``), which every later
#: release has shipped too. Only where it is this code (and ``get`` and ``in`` are ``Mapping``'s,
#: which go through it) does the replacement read the two dicts itself instead of calling the
#: original; anything else gets the original, always.
LOOKUP_FINGERPRINTS = frozenset({"5e2a67a46b33a85220a6eafd94e158c664316fabaf37fd93e7f9839ac7a563ef"})

_MISSING = object()


def _lookup_class(original):
    """The class whose instances the replacement may look kernels up in directly, or None.

    That is ``AttentionInterface`` itself (not a subclass: one could override the lookup), when
    its lookup is the known ``GeneralInterface.__getitem__`` reached through ``Mapping.get`` and
    ``Mapping.__contains__``. Reads the source of one method already loaded; imports nothing.
    """
    interface = original.__globals__.get("AttentionInterface")
    getitem = getattr(interface, "__getitem__", None)
    if interface is None or getattr(interface, "get", None) is not Mapping.get:
        return None
    if getattr(interface, "__contains__", None) is not Mapping.__contains__:
        return None
    try:
        known = fingerprint(getitem) in LOOKUP_FINGERPRINTS
    except (OSError, TypeError, AttributeError):  # no source to read: not recognised
        known = False
    return interface if known else None


def _replace_get_interface(original, variant):
    """The registry lookup, then the kernel behind the guard (see the module docstring).

    Cost matters here (once per layer and decoding step): for ``AttentionInterface`` instances
    with the known lookup (:func:`_lookup_class`) the replacement does what the original does
    with two dict reads instead of its five Python calls (``in self``, ``super().get``, each
    through ``__getitem__``), which pays for most of the wrapper frame around the kernel. Every
    case where the original does more than return an entry (``None``, an unknown name, which
    raises ``KeyError``, a ``paged|`` name from 5.19.0 on) still goes to the original, as does
    every subclass and every mode but ``align`` outside ``torch.compile``. ``variant["strips_paged_prefix"]``
    says which release's lookup the direct read mirrors (5.19.0 added the ``paged|`` prefix).
    """
    _register_compile_substitute()
    ALIGN, OFF = _guard.ALIGN, _guard.OFF
    lookup_class = _lookup_class(original)
    strips_paged_prefix = variant["strips_paged_prefix"]

    @wraps(original)
    def get_interface(self, attn_implementation, default):
        if _guard._mode == ALIGN and not _compiling():
            function = _MISSING
            if type(self) is lookup_class:
                # What the original returns, read directly (same order: the instance's mapping,
                # then the class-wide one; "eager" falls back to ``default``); subscripts, not
                # ``.get`` calls: a miss raises, and every miss goes to the original below.
                try:
                    local = self._local_mapping
                    if local and attn_implementation in local:
                        function = local[attn_implementation]
                    elif attn_implementation == "eager":
                        function = self._global_mapping.get("eager", default)
                    else:
                        function = self._global_mapping[attn_implementation]
                        if strips_paged_prefix and "|" in attn_implementation:
                            function = _MISSING  # "paged|X" means X from 5.19.0 on
                except Exception:  # unknown (KeyError), unhashable or odd names: the original decides
                    function = _MISSING
            if function is _MISSING:
                function = original(self, attn_implementation, default)
            try:
                return _kernel_wrappers[function]
            except (KeyError, TypeError):  # first seen, not one of transformers' kernels, unhashable
                return _slow_path(function, attn_implementation)
        function = original(self, attn_implementation, default)
        if _guard._mode == OFF or function is None:
            return function
        if _compiling():  # the check before the call, decided at trace time
            return functools.partial(_checked_call, function, attn_implementation)
        return _checked_wrapper(function, attn_implementation)  # check

    return get_interface


# -- releases without get_interface (4.55.0 - 5.0.0): the registry lookup itself -----------------

#: The code objects of the guard's own wrappers (``_wrapper_for_kernel``'s and ``_checked_wrapper``'s
#: ``guarded_attention``): how the lookup recognises one that was copied back into the registry.
_GUARD_CODES = {
    const
    for builder in (_wrapper_for_kernel, _checked_wrapper)
    for const in builder.__code__.co_consts
    if isinstance(const, CodeType)
}  # and each shaped wrapper's code, added as it is built (see _shape_wrapper)


def _unguarded(function):
    """The callable behind the guard's own wrappers, else ``function`` itself.

    On releases where the registry lookup hands out the guarded kernel, code that copies an entry
    into the registry stores the wrapper: executorch's ``ALL_ATTENTION_FUNCTIONS.register(
    "sdpa_without_vmap", ALL_ATTENTION_FUNCTIONS["sdpa"])``, the hub-kernels integration's
    ``functools.partial`` of ``ALL_ATTENTION_FUNCTIONS.get(...)``. Reading such an entry back
    gives the kernel's one wrapper, not a wrapper of the wrapper (a ``partial`` of one is a
    callable like any other: checked before the call).
    """
    code = getattr(function, "__code__", None)
    while type(code) is CodeType and code in _GUARD_CODES:
        function = function.__wrapped__
        code = getattr(function, "__code__", None)
    return function


def _slow_lookup(function, attn_implementation):
    """``align``: an entry whose wrapper is not stored yet (first seen, one of the guard's own
    wrappers copied into the registry, not one of transformers' kernels, unhashable)."""
    function = _unguarded(function)
    try:
        return _kernel_wrappers[function]
    except (KeyError, TypeError):
        return _slow_path(function, attn_implementation)


def _replace_registry_lookup(original, variant):
    """``AttentionInterface.__getitem__`` (inherited from ``GeneralInterface``) on the releases
    without ``get_interface``: the entry, then the kernel behind the guard (see the module
    docstring). The same wrappers, in the same cases, as :func:`_replace_get_interface`.

    The entry is read as the matched code reads it (``GeneralInterface.__getitem__``: the
    instance's own mapping, then the class-wide one), inlined: the fingerprint guarantees that is
    the code, and it saves calling the original (a second Python frame per attention call). Every
    outcome of stock's lookup is kept: a missing name raises stock's ``KeyError``, an unhashable
    one its ``TypeError``. Installed on ``AttentionInterface`` only: the other registries
    (``AttentionMaskInterface``, ...) keep ``GeneralInterface``'s lookup.
    """
    _register_compile_substitute()
    ALIGN, OFF = _guard.ALIGN, _guard.OFF

    @wraps(original)
    def __getitem__(self, key):
        local = self._local_mapping
        function = local[key] if key in local else self._global_mapping[key]
        if _guard._mode == ALIGN and not _compiling():
            try:
                return _kernel_wrappers[function]
            except (KeyError, TypeError):  # see _slow_lookup
                return _slow_lookup(function, key)
        if _guard._mode == OFF or function is None:
            return function  # what the registry holds, as stock returns it
        if _compiling():  # the check before the call, decided at trace time
            return functools.partial(_checked_call, function, key)
        return _checked_wrapper(_unguarded(function), key)  # check

    return __getitem__


PATCH = patch_with_release_facts(
    id="attention-guard",
    changes="errors",
    title="Attention entry guard: q, k, v on one device, one dtype, compatible shapes (named errors)",
    errors=(
        "Expected all tensors to be on the same device, but found at least two devices",
        "Expected query, key, and value to have the same dtype",
        "expected scalar type BFloat16 but found Float",
        "query and key must have the same dtype",
    ),
    why=(
        "Attention kernels validate their inputs themselves, deep inside torch, with messages that name "
        "neither the layer nor the tensor at fault; nothing in transformers checks q, k, v where they meet."
    ),
    upstream="none: no transformers release up to {newest_release} validates attention inputs at dispatch",
    targets=(
        # Where it exists (5.1.0 on), get_interface is the dispatch point; before, the registry
        # lookup is: exactly one of the two targets is present in a release (see "Releases").
        Target(
            module=MODULE,
            qualname="AttentionInterface.get_interface",
            variants={"keeps_paged_prefix": {"strips_paged_prefix": False}, "strips_paged_prefix": {"strips_paged_prefix": True}},
            optional=True,
            replace=_replace_get_interface,
        ),
        Target(
            module=MODULE,
            qualname="AttentionInterface.__getitem__",
            inherited_from="transformers.utils.generic:GeneralInterface.__getitem__",
            unless="AttentionInterface.get_interface",
            optional=True,
            replace=_replace_registry_lookup,
        ),
    ),
    doctor=("cache-dtype-prefix",),
)
