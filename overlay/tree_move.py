"""Move every tensor nested in a Python structure onto one device, copying only what changes.

:func:`move_tree` is a small, engine-independent utility (the ``device-move-nested`` patch uses
it on the inputs of every decoding step, so it is built to be cheap when there is nothing to do):

- tensors found at any depth inside ``dict`` (and its subclasses: ``OrderedDict``,
  ``defaultdict``, transformers' ``ModelOutput``), ``collections.UserDict``, ``list`` (and
  subclasses), ``tuple``, namedtuples and ``torch.return_types`` structs are moved with
  ``tensor.to(device)``; flex attention ``BlockMask`` objects are moved with their own ``.to``;
- copy on write: a container is rebuilt only when something inside it moved, with its own type
  (namedtuples from their fields, dict subclasses and ``UserDict`` through ``copy.copy`` then
  item assignment), so the caller's structures are never mutated, and every untouched object,
  including the whole tree when nothing is off-device, is returned as the very same object;
- aliasing is kept: an object reachable along several paths is moved or rebuilt once and the
  result shared, and reference cycles are rebuilt as the same cycles;
- everything else is returned as is: non-tensor leaves, transformers ``Cache`` objects (their
  tensors belong to the cache's own placement logic), sets, dataclasses and other objects.

Two implementations give the same results. A plain recursive walk handles the common case
(shallow trees, no cycles) without any cycle bookkeeping: it builds no container when nothing is
off-device, and a memo only from the first move on. When it meets more depth or more containers
than any realistic model input holds, which is also how it notices a cycle, it gives up, having
mutated nothing, and the structure goes to an iterative, cycle-aware walk (strongly connected
components, so every container that can reach an off-device tensor, through a cycle or not, is
rebuilt) with no recursion limit.

This module imports torch, not transformers nor flex attention: ``Cache`` and ``BlockMask`` are
recognised through ``sys.modules``, since no instance of either can exist before its module has
been imported. Import this module lazily from code that must stay cheap (the patch does).
"""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict, UserDict
from typing import Any

import torch

__all__ = ["move_tree"]

_Tensor = torch.Tensor

#: Depth and container budget of the recursive walk. Generation inputs are two levels deep with a
#: handful of containers; anything past these limits (or a cycle, which has unbounded depth) goes
#: to the iterative walk. The depth stays far below Python's default recursion limit of 1000 so
#: the recursive walk is safe even when called from deep inside a model's call stack.
_FAST_MAX_DEPTH = 48
_FAST_MAX_CONTAINERS = 2048

#: Exact types that can never hold a tensor: skipped before any isinstance check.
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, torch.device, torch.dtype})

# Kinds of objects the walks distinguish.
_OTHER = 0  # returned as is
_TENSOR = 1
_BLOCK_MASK = 2  # a movable leaf with its own .to()
_DICT = 3  # dict and subclasses
_USER_DICT = 4
_LIST = 5  # list and subclasses
_TUPLE = 6  # tuple, namedtuples, structseqs


def move_tree(tree: Any, device: torch.device | str | int) -> Any:
    """Return ``tree`` with every tensor it holds on ``device``; see the module docstring.

    A tensor counts as on the device when ``tensor.to(device)`` returns the tensor itself, so a
    device without an index (``"cuda"``) matches tensors on the current device of that type.
    """
    if type(device) is not torch.device:
        device = torch.device(device)
    kind = _KIND_BY_CLASS.get(type(tree))
    if kind is None:
        kind = _kind_of_class(type(tree))
    if kind == _OTHER:
        return tree
    if kind == _TENSOR or kind == _BLOCK_MASK:
        return _move_leaf(tree, kind, device)
    state = _FastState()
    try:
        return _fast(tree, kind, device, 0, state)
    except (_GiveUp, RecursionError):
        # Nothing was mutated: the recursive walk only builds new objects. Tensor copies it
        # made are simply dropped.
        return _move_general(tree, device)


class _GiveUp(Exception):
    """The recursive walk met too deep or too large a structure (or a cycle)."""


class _FastState:
    __slots__ = ("containers_left", "memo")

    def __init__(self) -> None:
        self.containers_left = _FAST_MAX_CONTAINERS
        # id(original) -> replacement for everything moved or rebuilt so far. Created on the
        # first move only: when nothing is off-device the walk allocates nothing but the state.
        # Keys stay valid because every original is reachable from the tree during the call.
        self.memo: dict[int, Any] | None = None


def _fast(obj: Any, kind: int, device: torch.device, depth: int, state: _FastState) -> Any:
    """The recursive walk over one container; leaves are handled inline (they are most nodes)."""
    if depth >= _FAST_MAX_DEPTH:
        raise _GiveUp
    state.containers_left -= 1
    if state.containers_left < 0:
        raise _GiveUp
    memo = state.memo
    if memo is not None:
        done = memo.get(id(obj))
        if done is not None:
            return done
    depth += 1

    kinds = _KIND_BY_CLASS
    is_tuple = kind == _TUPLE
    new = None  # the copy, made at the first change: a list of the items for tuples
    if kind == _DICT:
        pairs = obj.items()
    elif kind == _USER_DICT:
        pairs = obj.data.items()
    else:
        pairs = enumerate(obj)
    for key, value in pairs:
        value_kind = kinds.get(type(value))
        if value_kind is None:
            value_kind = _kind_of_class(type(value))
        if value_kind == _OTHER:
            continue
        if value_kind == _TENSOR:
            if value.device == device:
                continue
            # Inlined: this is the moving path's per-tensor cost.
            memo = state.memo
            if memo is None:
                memo = state.memo = {}
            moved = memo.get(id(value))
            if moved is None:
                moved = value.to(device)
                if moved is value:  # device without an index naming the current one
                    continue
                memo[id(value)] = moved
        elif value_kind == _BLOCK_MASK:
            moved = _fast_move_leaf(value, _BLOCK_MASK, device, state)
            if moved is value:
                continue
        else:
            moved = _fast(value, value_kind, device, depth, state)
            if moved is value:
                continue
        if new is None:
            new = list(obj) if is_tuple else _shallow_copy(obj, kind)
        new[key] = moved
    if new is None:
        return obj
    if is_tuple:
        new = _rebuild_tuple(type(obj), new)

    memo = state.memo
    if memo is None:
        memo = state.memo = {}
    memo[id(obj)] = new
    return new


def _fast_move_leaf(obj: Any, kind: int, device: torch.device, state: _FastState) -> Any:
    memo = state.memo
    if memo is not None:
        done = memo.get(id(obj))
        if done is not None:
            return done
    moved = _move_leaf(obj, kind, device)
    if moved is obj:
        return obj
    if memo is None:
        memo = state.memo = {}
    memo[id(obj)] = moved
    return moved


def _move_leaf(obj: Any, kind: int, device: torch.device) -> Any:
    if kind == _TENSOR:
        return obj if obj.device == device else obj.to(device)
    return obj.to(device) if _block_mask_off_device(obj, device) else obj


#: Kind of each class seen so far. The kind of a class never changes: a Cache or BlockMask
#: subclass cannot exist before its module is imported, so an answer given before that import
#: stays right. Bounded, because classes can be created at run time (namedtuples, say).
_KIND_BY_CLASS: dict[type, int] = {cls: _OTHER for cls in _ATOMS}
_KIND_BY_CLASS.update({torch.Tensor: _TENSOR, torch.nn.Parameter: _TENSOR, dict: _DICT, list: _LIST})
_KIND_BY_CLASS.update({tuple: _TUPLE, OrderedDict: _DICT})
_KIND_CACHE_LIMIT = 4096


def _kind_of_class(cls: type) -> int:
    kind = _classify(cls)
    if len(_KIND_BY_CLASS) < _KIND_CACHE_LIMIT:
        _KIND_BY_CLASS[cls] = kind
    return kind


def _classify(cls: type) -> int:
    if issubclass(cls, torch.Tensor):
        return _TENSOR
    cache_module = sys.modules.get("transformers.cache_utils")
    if cache_module is not None:
        cache_class = getattr(cache_module, "Cache", None)
        if cache_class is not None and issubclass(cls, cache_class):
            return _OTHER
    if issubclass(cls, dict):
        return _DICT
    if issubclass(cls, UserDict):
        return _USER_DICT
    if issubclass(cls, list):
        return _LIST
    if issubclass(cls, tuple):
        return _TUPLE
    flex_module = sys.modules.get("torch.nn.attention.flex_attention")
    if flex_module is not None:
        block_mask_class = getattr(flex_module, "BlockMask", None)
        if block_mask_class is not None and issubclass(cls, block_mask_class):
            return _BLOCK_MASK
    return _OTHER


def _kind(obj: Any) -> int:
    kind = _KIND_BY_CLASS.get(type(obj))
    if kind is None:
        kind = _kind_of_class(type(obj))
    return kind


def _block_mask_off_device(mask: Any, device: torch.device) -> bool:
    names = getattr(mask, "_TENSOR_ATTRS", None)
    if names is None:
        # A BlockMask without the attribute list: let its own .to() decide (it returns a new
        # mask even when nothing moves, so the mask is treated as moved).
        return True
    for name in names:
        value = getattr(mask, name, None)
        if isinstance(value, _Tensor) and value.device != device:
            return True
    return False


def _shallow_copy(obj: Any, kind: int) -> Any:
    """A copy of a mutable container, same type, same contents, ready for item assignment."""
    cls = type(obj)
    if cls is dict or cls is list or cls is OrderedDict:
        return obj.copy()
    try:
        # Keeps the type and any instance attributes: defaultdict's factory, ModelOutput's
        # field attributes (its __setitem__ keeps both views in step afterwards), UserDict data.
        return copy.copy(obj)
    except Exception:
        # A subclass that cannot be copied: fall back to the builtin base type, which is what
        # upstream transformers' move_to_device produces for every container.
        if kind == _DICT:
            return dict(obj)
        if kind == _USER_DICT:
            return UserDict(obj.data)
        return list(obj)


def _rebuild_tuple(cls: type, items: list[Any]) -> tuple[Any, ...]:
    if cls is tuple:
        return tuple(items)
    make = getattr(cls, "_make", None)
    if make is not None:  # namedtuple: rebuilt from its fields
        return make(items)
    return cls(items)  # tuple subclasses with the default constructor, torch.return_types


def _pairs(obj: Any, kind: int) -> Any:
    if kind == _DICT:
        return obj.items()
    if kind == _USER_DICT:
        return obj.data.items()
    return enumerate(obj)


def _move_general(root: Any, device: torch.device) -> Any:
    """Iterative, cycle-aware version of the walk: same results, no depth limit.

    1. Tarjan's strongly connected components over the containers, moving leaves on the way:
       a container is dirty when it can reach a moved leaf; all members of a cycle share one
       answer, decided when the component closes.
    2. Every dirty mutable container gets its copy first (an empty promise of the result), so
       cycles can point at it; dirty tuples are then built children first (tuples alone cannot
       form a cycle); finally the mutable copies get their moved entries.
    """
    kind = _kind(root)
    if kind == _TENSOR or kind == _BLOCK_MASK:
        return _move_leaf(root, kind, device)
    if kind == _OTHER:
        return root

    memo: dict[int, Any] = {}  # id -> moved leaf or rebuilt container
    index: dict[int, int] = {}
    lowlink: dict[int, int] = {}
    reaches_moved: dict[int, bool] = {}  # own edges only, until the component closes
    dirty: dict[int, bool] = {}  # final answer, set when the component closes
    kinds: dict[int, int] = {}
    on_stack: set[int] = set()
    component_stack: list[Any] = []
    dirty_containers: list[Any] = []

    def enter(obj: Any, obj_kind: int) -> tuple[Any, Any]:
        key = id(obj)
        index[key] = lowlink[key] = len(index)
        reaches_moved[key] = False
        kinds[key] = obj_kind
        on_stack.add(key)
        component_stack.append(obj)
        return obj, iter(list(_pairs(obj, obj_kind)))

    frames = [enter(root, kind)]
    while frames:
        node, children = frames[-1]
        node_key = id(node)
        descended = False
        for _, child in children:
            child_kind = _kind(child)
            if child_kind == _OTHER:
                continue
            child_key = id(child)
            if child_kind == _TENSOR or child_kind == _BLOCK_MASK:
                if child_key not in memo:
                    moved = _move_leaf(child, child_kind, device)
                    if moved is child:
                        continue
                    memo[child_key] = moved
                reaches_moved[node_key] = True
                continue
            if child_key not in index:
                frames.append(enter(child, child_kind))
                descended = True
                break
            if child_key in on_stack:
                lowlink[node_key] = min(lowlink[node_key], index[child_key])
            elif dirty[child_key]:
                reaches_moved[node_key] = True
        if descended:
            continue

        frames.pop()
        if lowlink[node_key] == index[node_key]:
            members = []
            while True:
                member = component_stack.pop()
                on_stack.discard(id(member))
                members.append(member)
                if member is node:
                    break
            component_dirty = any(reaches_moved[id(member)] for member in members)
            for member in members:
                dirty[id(member)] = component_dirty
            if component_dirty:
                dirty_containers.extend(members)
        if frames:
            parent_key = id(frames[-1][0])
            lowlink[parent_key] = min(lowlink[parent_key], lowlink[node_key])
            # A closed component passes on its final answer; an open one its partial answer,
            # which the component's root merges when it closes.
            if dirty.get(node_key, False) or reaches_moved[node_key]:
                reaches_moved[parent_key] = True

    if not dirty_containers:
        return root

    for container in dirty_containers:
        container_kind = kinds[id(container)]
        if container_kind != _TUPLE:
            memo[id(container)] = _shallow_copy(container, container_kind)

    for container in dirty_containers:
        if kinds[id(container)] == _TUPLE and id(container) not in memo:
            _build_tuples(container, memo, dirty)

    for container in dirty_containers:
        container_kind = kinds[id(container)]
        if container_kind == _TUPLE:
            continue
        new = memo[id(container)]
        for key, child in list(_pairs(container, container_kind)):
            replacement = memo.get(id(child))
            if replacement is not None:
                new[key] = replacement

    return memo[id(root)]


def _build_tuples(top: tuple[Any, ...], memo: dict[int, Any], dirty: dict[int, bool]) -> None:
    """Build the dirty tuple ``top`` and the dirty tuples it holds, children first."""
    stack = [top]
    while stack:
        current = stack[-1]
        if id(current) in memo:
            stack.pop()
            continue
        pending = [
            child
            for child in current
            if isinstance(child, tuple)
            and dirty.get(id(child), False)
            and id(child) not in memo
        ]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        items = [memo.get(id(child), child) for child in current]
        memo[id(current)] = _rebuild_tuple(type(current), items)
