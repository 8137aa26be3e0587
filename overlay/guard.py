"""What the overlay does when the tensors that reach attention disagree: the mode, the checks, the messages.

Used by two patches: ``kv-cache-dtype`` (what the KV cache stores and hands back) and
``attention-guard`` (the query, key and value at the entry of every attention function dispatched
through ``AttentionInterface``). Both read one setting, the *mode*:

``align`` (default)
    Dtype disagreements are fixed: the cache hands back states in the compute dtype (see
    ``patches/kv_cache_dtype.py``); at the attention entry, key and value are cast to the query's
    dtype when they still differ (for transformers' own kernels: once the kernel has rejected them,
    see ``patches/attention_guard.py``). Everything else (devices, shapes) raises
    :class:`AttentionInputError`.
``check``
    Nothing is cast: q, k, v are checked before every call, and any disagreement, dtype
    included, raises :class:`AttentionInputError` naming the tensors. Meant for CI, to find where
    a mismatched cache comes from. Its old name, ``strict``, is still accepted, with a warning
    naming ``check``. (It is unrelated to ``ATTN_OVERLAY_STRICT``, the engine's
    strict mode, in which unrecognised code or a failed patch raises.)
``off``
    Both patches step aside: tensors pass through untouched, as on stock transformers. A kill
    switch that needs no re-import (the patches stay installed).

Set it with the environment variable ``ATTN_OVERLAY_ATTENTION_GUARD=align|check|off`` (its row
in the settings table, ``overlay/config.py``; read once, when this module is first imported,
which the engine does when it loads the patches) or with :func:`set_mode` / :func:`using_mode`
at run time. A value that is not a mode is reported once (logger ``overlay``) and ``align`` is
used.

Under ``torch.compile`` the mode is a module global: dynamo guards on it, so changing the mode
recompiles the affected frames once instead of being ignored.

Under autocast the dtype rule is left to autocast: on a device where autocast is enabled, query,
key and value legitimately arrive in different dtypes (rotary embeddings promote q and k to
float32 while v stays in the autocast dtype) and every attention kernel's autocast policy casts
them itself. The device and shape checks still run. Devices autocast does not know (``meta``, ``lazy``) count as
autocast off: asking torch about them raises, and the guard never replaces a kernel's error (or
its own named one) with an unrelated one.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from . import config

#: The names other modules use; the rest is this module's own.
__all__ = [
    "AttentionInputError", "CacheDtypeError", "KVCacheDtypeWarning", "MODES", "MODE_VAR", "STRICT",
    "check_attention_inputs", "diagnose_kernel_error", "get_mode", "reset_warnings", "set_mode", "using_mode",
    "warn_cache_cast_once", "warn_cache_rounding_once", "warn_cross_cache_cast_once",
]

#: Environment variable holding the mode (its row in the settings table: ``overlay/config.py``).
MODE_VAR = config.GUARD_VAR
MODES = config.GUARD_MODES  # the settings table's words, named here for the guard's own code
ALIGN, CHECK, OFF = MODES
DEFAULT_MODE = config.GUARD_DEFAULT
#: The old name of :data:`CHECK` (the same string): code comparing ``mode == guard.STRICT`` keeps working.
STRICT = CHECK


class AttentionInputError(RuntimeError):
    """Query, key, value (or a KV cache and the states written to it) cannot go together.

    The message names each offending tensor with its device, dtype and shape, and says what to do.
    """


class KVCacheDtypeWarning(UserWarning):
    """A KV cache holds states in another dtype than the one attention computes in (cast on read)."""


#: Read once, here: the patches read this global on every call, never the environment.
_mode: str = config.guard_mode()


def get_mode() -> str:
    """The current mode: ``"align"``, ``"check"`` or ``"off"``."""
    return _mode


def set_mode(mode: str | None) -> str:
    """Set the mode for this process and return the previous one. ``None``: the mode
    ``ATTN_OVERLAY_ATTENTION_GUARD`` sets (the environment read again). ``"strict"``, the old name
    of ``"check"``, is accepted with a :class:`DeprecationWarning`."""
    global _mode
    previous = _mode
    if mode is None:
        _mode = config.guard_mode()
        return previous
    normalised = str(mode).strip().lower()
    if normalised in config.DEPRECATED_GUARD_MODES:
        new = config.DEPRECATED_GUARD_MODES[normalised]
        warnings.warn(
            f"attention guard mode {mode!r} is deprecated: it is now called {new!r} (same behaviour)",
            DeprecationWarning,
            stacklevel=2,
        )
        normalised = new
    if normalised not in MODES:
        raise ValueError(
            f"attention guard mode must be one of {', '.join(MODES)}, not {mode!r}"
            " (see ATTN_OVERLAY_ATTENTION_GUARD in overlay/config.py)"
        )
    _mode = normalised
    return previous



@contextlib.contextmanager
def using_mode(mode: str) -> Iterator[None]:
    """Run a block under ``mode``, then restore the previous mode."""
    previous = set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)


# -- messages --------------------------------------------------------------------------------


def describe(name: str, tensor: Any) -> str:
    """``name: device=cpu, dtype=torch.bfloat16, shape=(2, 4, 1, 8)``."""
    return f"{name}: device={tensor.device}, dtype={tensor.dtype}, shape={tuple(tensor.shape)}"


def _where(module: Any, attn_implementation: str | None) -> str:
    parts = [type(module).__name__ if module is not None else "attention"]
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is not None:
        parts.append(f"layer {layer_idx}")
    if attn_implementation is not None:
        parts.append(f"attn_implementation={attn_implementation!r}")
    return f"{parts[0]} ({', '.join(parts[1:])})" if len(parts) > 1 else parts[0]


_ADVICE = {
    "device": (
        "move the model, the inputs and the cache to one device: build caches after model.to(device) "
        "(or pass device= to early_initialization), and check device_map/offloading placed every "
        "attention layer's cache with its layer"
    ),
    "dtype": (
        "build or cast the KV cache in the model's compute dtype (e.g. early_initialization(..., dtype=model.dtype), "
        "or .to(dtype) on a cache prefilled by another model), or set "
        f"{MODE_VAR}=align to let the overlay cast what the cache hands back"
    ),
    "shape": (
        "the cache was built for another configuration: rebuild it for this model and batch "
        "(batch size, num_key_value_heads, head_dim come from the model config), or check that a "
        "custom attention passes tensors shaped [batch, heads, seq_len, head_dim]"
    ),
}


def _raise(
    where: str,
    mode: str,
    problems: list[tuple[str, str]],
    tensors: dict[str, Any],
    named: list[str],
    cause: BaseException | None = None,
) -> None:
    kinds = []
    for kind, _ in problems:
        if kind not in kinds:
            kinds.append(kind)
    lines = [f"attn-overlay attention guard (mode={mode}): the inputs of {where} do not go together:"]
    lines += [f"  - {kind}: {text}" for kind, text in problems]
    lines.append("tensors:")
    lines += [f"  {describe(name, tensors[name])}" for name in named]
    lines.append("what to do:")
    lines += [f"  - {kind}: {_ADVICE[kind]}" for kind in kinds]
    if cause is not None:
        lines.append(f"(the kernel's own error, {type(cause).__name__}, is chained above)")
        raise AttentionInputError("\n".join(lines)) from cause
    raise AttentionInputError("\n".join(lines))


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# -- the attention-entry check ---------------------------------------------------------------


def check_attention_inputs(
    query: Any,
    key: Any,
    value: Any,
    *,
    module: Any = None,
    attn_implementation: str | None = None,
    mode: str | None = None,
) -> tuple[Any, Any, Any]:
    """Validate query, key and value before an attention kernel sees them; return them (aligned).

    Checks: one device; one dtype (cast key/value to the query's in ``align``, raise in
    ``check``, left to autocast where it is enabled); for ``[batch, heads, seq, head_dim]``
    tensors: batch sizes agree (or broadcast from 1), key and value have the same number of heads
    and positions, the query's heads are a multiple of the key's, the query's and key's head_dim
    agree. Tensors that are not 4-D (packed/varlen layouts) only get the device and dtype checks.

    This is the check *before* the kernel: ``patches/attention_guard.py`` runs it in ``check``,
    for kernels that transformers does not ship, and under ``torch.compile`` (where every branch is
    decided at trace time); transformers' own kernels in ``align`` get :func:`diagnose_kernel_error`
    only after they fail. Costs a few attribute reads when everything agrees: no copy, no kernel.
    """
    mode = _mode if mode is None else mode
    if mode == OFF:
        return query, key, value
    import torch

    tensor = torch.Tensor
    if not (isinstance(query, tensor) and isinstance(key, tensor) and isinstance(value, tensor)):
        return query, key, value
    if _all_agree(query, key, value):
        return query, key, value
    return _diagnose(query, key, value, module, attn_implementation, mode)


def _all_agree(query: Any, key: Any, value: Any) -> bool:
    device, dtype = query.device, query.dtype
    if key.device != device or value.device != device or key.dtype != dtype or value.dtype != dtype:
        return False
    if query.dim() == 4 and key.dim() == 4 and value.dim() == 4:
        q_batch, q_heads, _, q_dim = query.shape
        k_batch, k_heads, k_len, k_dim = key.shape
        v_batch, v_heads, v_len, _ = value.shape
        return (
            k_dim == q_dim
            and k_heads == v_heads
            and k_len == v_len
            and k_batch in (q_batch, 1)
            and v_batch in (q_batch, 1)
            and k_heads != 0
            and q_heads % k_heads == 0
        )
    return True


def diagnose_kernel_error(
    error: BaseException,
    query: Any,
    key: Any,
    value: Any,
    *,
    module: Any = None,
    attn_implementation: str | None = None,
    mode: str | None = None,
) -> tuple[Any, Any, Any] | None:
    """An attention kernel raised ``error`` on ``query``, ``key``, ``value``: what the guard makes of it.

    - raises :class:`AttentionInputError` (chained ``from error``) naming the tensors when they do
      not go together (devices, shapes; dtypes too in ``check``);
    - returns ``(query, key, value)`` with key/value cast to the query's dtype when a dtype
      mismatch is the only problem and the mode is ``align`` (the caller calls the kernel again);
    - returns ``None`` when nothing is wrong with the tensors (or under autocast, or in ``off``):
      the kernel failed for a reason of its own, and the caller re-raises its error unchanged.

    Never raises anything else: a failure while diagnosing also returns ``None``, so the kernel's
    error is what the user sees.
    """
    mode = _mode if mode is None else mode
    if mode == OFF:
        return None
    try:
        import torch

        tensor = torch.Tensor
        if not (isinstance(query, tensor) and isinstance(key, tensor) and isinstance(value, tensor)):
            return None
        if _all_agree(query, key, value):
            return None
        aligned = _diagnose(query, key, value, module, attn_implementation, mode, cause=error)
    except AttentionInputError:
        raise
    except Exception:
        return None
    if aligned[0] is query and aligned[1] is key and aligned[2] is value:
        return None
    return aligned


def _autocast_enabled(device: Any) -> bool:
    """``torch.is_autocast_enabled(device.type)``, False for devices autocast does not know (meta, lazy)."""
    import torch

    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:  # "unknown device type for autocast": meta, lazy, ...
        return False


def _diagnose(
    query: Any,
    key: Any,
    value: Any,
    module: Any,
    attn_implementation: str | None,
    mode: str,
    cause: BaseException | None = None,
):
    """The slow path: find every problem, align dtypes in ``align``, raise on the rest."""

    problems: list[tuple[str, str]] = []
    named: list[str] = []

    def name(*names: str) -> None:
        for n in names:
            if n not in named:
                named.append(n)

    if key.device != query.device or value.device != query.device:
        off_device = [n for n, t in (("key", key), ("value", value)) if t.device != query.device]
        verb = "is" if len(off_device) == 1 else "are"
        problems.append(("device", f"{_join(off_device)} {verb} not on the query's device {query.device}"))
        name("query", *off_device)

    dtype_mismatch = key.dtype != query.dtype or value.dtype != query.dtype
    # Under autocast, dtypes are autocast's business (see the module docstring).
    if dtype_mismatch and mode == CHECK and not _autocast_enabled(query.device):
        off_dtype = [n for n, t in (("key", key), ("value", value)) if t.dtype != query.dtype]
        dtypes = ", ".join(f"{n} is {t.dtype}" for n, t in (("key", key), ("value", value)) if t.dtype != query.dtype)
        problems.append(("dtype", f"{dtypes}, but query is {query.dtype}"))
        name("query", *off_dtype)

    if query.dim() == 4 and key.dim() == 4 and value.dim() == 4:
        q_batch, q_heads, _, q_dim = query.shape
        k_batch, k_heads, k_len, k_dim = key.shape
        v_batch, v_heads, v_len, _ = value.shape
        off_batch = [n for n, b in (("key", k_batch), ("value", v_batch)) if b != q_batch and b != 1]
        if off_batch:
            problems.append(
                ("shape", f"batch size (dim 0) of {_join(off_batch)} does not match the query's {q_batch}")
            )
            name("query", *off_batch)
        if k_dim != q_dim:
            problems.append(("shape", f"head_dim (last dim) of key is {k_dim}, of query {q_dim}: they must be equal"))
            name("query", "key")
        if k_heads != v_heads:
            problems.append(("shape", f"key has {k_heads} heads (dim 1), value {v_heads}: they must be equal"))
            name("key", "value")
        elif k_heads == 0 or q_heads % k_heads != 0:
            problems.append(("shape", f"query has {q_heads} heads (dim 1), not a multiple of the key's {k_heads}"))
            name("query", "key")
        if k_len != v_len:
            problems.append(("shape", f"key holds {k_len} positions (dim 2), value {v_len}: they must be equal"))
            name("key", "value")
    elif key.dim() >= 1 and value.dim() >= 1 and key.shape[:-1] != value.shape[:-1]:
        # Other layouts (packed 3-D, ...): key and value pair up position by position whatever the
        # layout, so all but their last dims must agree; a dtype cast would not make the call work.
        problems.append((
            "shape",
            f"key is {tuple(key.shape)}, value {tuple(value.shape)}: all but their last dim must be equal",
        ))
        name("key", "value")

    if problems:
        _raise(
            _where(module, attn_implementation),
            mode,
            problems,
            {"query": query, "key": key, "value": value},
            named,
            cause,
        )
    if dtype_mismatch and mode == ALIGN and not _autocast_enabled(query.device):
        # The query carries the compute dtype (docs/patches/kv-cache-dtype.md says why).
        if key.dtype != query.dtype:
            key = key.to(query.dtype)
        if value.dtype != query.dtype:
            value = value.to(query.dtype)
    return query, key, value


# -- the cache side --------------------------------------------------------------------------
# Used by patches/kv_cache_dtype.py (the policy: docs/patches/kv-cache-dtype.md).

#: (kind, which, stored dtype, other dtype) tuples already warned about in this process.
_warned_casts: set[tuple[str, ...]] = set()


def _first_time(*key: str) -> bool:
    if key in _warned_casts:
        return False
    _warned_casts.add(key)
    return True


def warn_cache_cast_once(layer_idx: Any, layer: Any, which: str, stored: Any, compute: Any) -> None:
    """Read side: one :class:`KVCacheDtypeWarning` per (keys/values, stored dtype, compute dtype) and process.

    Never call it from code dynamo traces (it would break the graph): callers skip it when
    ``torch.compiler.is_compiling()``. The same holds for the other ``warn_*`` functions here.
    """
    if not _first_time("cast", which, str(stored), str(compute)):
        return
    warnings.warn(
        f"attn-overlay: KV cache layer {layer_idx} ({type(layer).__name__}) holds {which} in {stored} but "
        f"attention computes in {compute}; the overlay casts what the cache hands back on every step "
        f"(one copy of that layer's cache per step). Build the cache in {compute} to avoid the copy. "
        f"(Shown once per dtype pair; {MODE_VAR}=check turns this into an error.)",
        KVCacheDtypeWarning,
        stacklevel=5,
    )


def warn_cache_rounding_once(layer_idx: Any, layer: Any, which: str, stored: Any, incoming: Any) -> None:
    """Write side: a static cache narrower than the states written to it rounds them (precision lost)."""
    if not _first_time("round", which, str(stored), str(incoming)):
        return
    state = "key" if which == "keys" else "value"
    warnings.warn(
        f"attn-overlay: KV cache layer {layer_idx} ({type(layer).__name__}) stores {which} in {stored} but the "
        f"model writes {state} states in {incoming}. A static cache cannot change dtype (compiled graphs and "
        f"exported programs hold its buffers), so the overlay rounds every new {state} state to {stored}: "
        f"PRECISION IS LOST, not only a copy made (stock transformers fails here in index_copy_). Build the cache "
        f"in {incoming} to keep full precision. (Shown once per dtype pair; {MODE_VAR}=check turns this into an "
        f"error.)",
        KVCacheDtypeWarning,
        stacklevel=5,
    )


def warn_cross_cache_cast_once(layer_idx: Any, layer: Any, which: str, stored: Any, compute: Any, narrows: bool) -> None:
    """An encoder-decoder cross-attention cache converted once, in place, to the compute dtype."""
    if not _first_time("cross", which, str(stored), str(compute)):
        return
    loss = (
        f"the {stored} values are not kept: attention computes in {compute} anyway, and stock transformers fails here"
        if narrows
        else "exact, nothing is lost"
    )
    warnings.warn(
        f"attn-overlay: cross-attention cache layer {layer_idx} ({type(layer).__name__}) held {which} in {stored} "
        f"but the decoder computes in {compute}; encoder-decoder models read that cache directly, so the overlay "
        f"converted it once, in place, to {compute} ({loss}). Build the cache in {compute} to avoid the "
        f"conversion. (Shown once per dtype pair; {MODE_VAR}=check turns this into an error.)",
        KVCacheDtypeWarning,
        stacklevel=5,
    )


def reset_warnings() -> None:
    """Forget which casts were already reported (for tests)."""
    _warned_casts.clear()


class CacheDtypeError(AttentionInputError):
    """Mode ``check``: a KV cache layer stores another dtype than the states the model writes to it."""

    def __init__(
        self, layer: Any, which: str, stored: Any, incoming: Any, layer_idx: Any = None, cache: str = "KV cache"
    ):
        self.layer, self.which, self.stored, self.incoming, self.layer_idx = layer, which, stored, incoming, layer_idx
        self.cache = cache
        state = "key_states" if which == "keys" else "value_states"
        where = f"{cache} layer {layer_idx} ({type(layer).__name__})" if layer_idx is not None else type(layer).__name__
        super().__init__(
            f"attn-overlay (mode={CHECK}): {where} stores {which} in {stored.dtype} but the model writes "
            f"{state} in {incoming.dtype}:\n"
            f"  {describe(f'cache {which}', stored)}\n"
            f"  {describe(state, incoming)}\n"
            f"what to do: {_ADVICE['dtype']}"
        )
