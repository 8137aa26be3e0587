"""Call a Python function through a wrapper without re-packing its arguments, for one call shape.

Why this exists: the attention guard puts a wrapper frame between a model and its attention kernel
on every layer and decoding step. Written the obvious way, ``def wrapper(*args, **kwargs): return
kernel(*args, **kwargs)``, the inner call is a ``CALL_FUNCTION_EX``: CPython (3.11 - 3.13) runs the
kernel in a new C-level evaluation loop and unpacks the keyword dict into a fresh argument vector,
about 3,500 machine instructions per call on top of the kernel (callgrind, Python 3.11). A wrapper
whose parameters name the keywords the model passes, and which calls the kernel with those
keywords spelled out, makes the inner call a plain one that runs in the same loop: about 1,700.

Models call their kernel the same way on every layer and step (the same positional count and
keyword names, from one call site), so the wrapper can be built for the shape of the first call:
:func:`call_shape` reads it, :func:`shaped_forwarder` writes (with ``exec``, as ``dataclasses``
and ``collections.namedtuple`` do) a function whose parameters are

    (p0=UNSET, ..., p{n-1}=UNSET, /, *extra_args, keyword_1=UNSET, ..., **extra_kwargs)

so that *any* call binds to it (never a ``TypeError`` raised in the caller's frame). When the call
has that shape (nothing in ``extra_args``/``extra_kwargs``, every named parameter given), the
function receives exactly the caller's positional objects in order and the same keyword names
bound to the same objects: ``function(p0, ..., keyword_1=keyword_1, ...)`` binds them to the same
parameters as the caller's call would. The only observable difference: the kernel's own
``**kwargs`` dict lists its keys in the shape's order, not the caller's, if one call site passed the
same keywords in another order (dicts compare equal; no kernel reads its kwargs by position).
Any other call is rebuilt (the given positionals, then the given keywords and the rest) and handed
to ``fallback``, the generic ``(*args, **kwargs)`` wrapper, which forwards it as before.

Errors: the direct call sits in ``try``; an exception of the ``catch`` types goes to
``on_error(error, args, kwargs)`` with the call's arguments, which returns a result, returns
:data:`RERAISE` (the wrapper then re-raises the very exception, traceback unchanged: a bare
``raise``), or raises something else itself.

Pure Python, standard library only; a leaf module (see ``tests/engine/test_layering.py``).
"""

from __future__ import annotations

import itertools
import keyword
import linecache
from collections.abc import Callable, Mapping
from typing import Any, cast

#: The names other modules use; the rest is this module's own.
__all__ = [
    "RERAISE", "call_shape", "shaped_forwarder",
]

#: A shape: how many positional arguments, and the keyword names in the caller's order.
CallShape = tuple[int, tuple[str, ...]]

#: Returned by ``on_error``: re-raise the kernel's own exception unchanged.
RERAISE = object()

#: Most positional arguments / keywords a shape may have (models pass 4-5 and 2-6).
MAX_POSITIONAL = 16
MAX_KEYWORDS = 32

_PREFIX = "_attn_overlay_"
_UNSET = object()
_numbers = itertools.count(1)


def call_shape(args: tuple, kwargs: Mapping[str, Any]) -> CallShape | None:
    """The shape of a call, or None when no forwarder can be written for it (a keyword that is not
    a plain identifier, a Python keyword or one of the forwarder's own names, or too many)."""
    names = tuple(kwargs)
    if len(args) > MAX_POSITIONAL or len(names) > MAX_KEYWORDS:
        return None
    for name in names:
        if not (type(name) is str and name.isidentifier()) or keyword.iskeyword(name) or name.startswith(_PREFIX):
            return None
    return len(args), names


def shaped_forwarder(
    function: Callable,
    shape: CallShape,
    *,
    fallback: Callable,
    on_error: Callable[[BaseException, tuple, dict], Any],
    catch: tuple[type[BaseException], ...],
    name: str = "forward",
) -> Callable:
    """A function that calls ``function`` directly for calls of ``shape`` (see the module
    docstring); any other call goes to ``fallback(*args, **kwargs)``."""
    positional, keywords = shape
    if call_shape((None,) * positional, dict.fromkeys(keywords)) != shape:
        raise ValueError(f"no forwarder can be written for the call shape {shape!r}")
    p = [f"{_PREFIX}p{i}" for i in range(positional)]
    u, f, fb, oe, rr = (f"{_PREFIX}{x}" for x in ("UNSET", "function", "fallback", "on_error", "RERAISE"))
    extra_args, extra_kwargs, error = f"{_PREFIX}args", f"{_PREFIX}kwargs", f"{_PREFIX}error"
    parameters = [*(f"{x}={u}" for x in p), *(["/"] if p else []), f"*{extra_args}",
                  *(f"{k}={u}" for k in keywords), f"**{extra_kwargs}"]
    unset = [f"{x} is {u}" for x in (p[-1:] + list(keywords))]
    direct = ", ".join([*p, *(f"{k}={k}" for k in keywords)])
    given_positional = f"tuple(v for v in ({', '.join(p)}{',' if len(p) == 1 else ''}) if v is not {u})"
    given_keywords = "{" + ", ".join(f"{k!r}: {k}" for k in keywords) + "}"
    lines = [
        f"def {name}({', '.join(parameters)}):",
        f"    if {' or '.join([extra_args, extra_kwargs, *unset])}:",
        f"        {extra_kwargs} = {{**{{k: v for k, v in {given_keywords}.items() if v is not {u}}}, **{extra_kwargs}}}",
        f"        return {fb}(*{given_positional}, *{extra_args}, **{extra_kwargs})",
        "    try:",
        f"        return {f}({direct})",
        f"    except {_PREFIX}catch as {error}:",
        f"        {_PREFIX}result = {oe}({error}, ({', '.join(p)}{',' if len(p) == 1 else ''}), {given_keywords})",
        f"        if {_PREFIX}result is {rr}:",
        "            raise",
        f"        return {_PREFIX}result",
    ]
    if not p:
        lines[3] = f"        return {fb}(*{extra_args}, **{extra_kwargs})"
    source = "\n".join(lines) + "\n"
    filename = f"<attn-overlay forwarder {next(_numbers)} for {getattr(function, '__qualname__', function)!s}>"
    # Tracebacks through the forwarder show its lines, as for any Python source.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {u: _UNSET, f: function, fb: fallback, oe: on_error, rr: RERAISE, f"{_PREFIX}catch": catch}
    exec(compile(source, filename, "exec"), namespace)
    return cast("Callable[..., Any]", namespace[name])
