"""Unit and property tests of overlay.tree_move.move_tree, the recursive device mover.

The target device is ``meta``: moving a CPU tensor there is a real device change (a new tensor
object on another device) that costs no memory, so no second device is needed for these tests.
``_move_general`` (the iterative, cycle-aware walk) is tested against the same expectations as
the public function, because trees that are shallow and acyclic never reach it otherwise.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlay import tree_move
from overlay.testing.harness import heavy_imports
from overlay.tree_move import move_tree

META = torch.device("meta")
CPU = torch.device("cpu")

Pair = namedtuple("Pair", ["first", "second"])


class TypedPair(NamedTuple):
    key: Any
    value: Any


class TaggedDict(dict):
    """A dict subclass with instance state that a rebuilt copy must keep."""

    def __init__(self, *args, tag="", **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag


class TaggedList(list):
    pass


def movers():
    """Both walks: the public entry point and the iterative fallback."""
    return pytest.mark.parametrize("move", [move_tree, tree_move._move_general], ids=["move_tree", "general"])


def cpu_tensor(*values):
    return torch.tensor(values or (1.0,))


# -- each container type ---------------------------------------------------------------------------


@movers()
def test_top_level_tensor_is_moved_and_on_device_tensor_returned_as_is(move):
    host = cpu_tensor(1.0, 2.0)
    moved = move(host, META)
    assert moved.device == META and moved.shape == host.shape and moved.dtype == host.dtype
    on_device = torch.empty(3, device=META)
    assert move(on_device, META) is on_device


@movers()
def test_plain_dict_list_tuple_are_rebuilt_with_every_tensor_moved(move):
    tree = {"ids": cpu_tensor(), "masks": [cpu_tensor(), (cpu_tensor(), 3)], "flag": True}
    moved = move(tree, META)
    assert type(moved) is dict and list(moved) == ["ids", "masks", "flag"]
    assert moved["ids"].device == META
    assert type(moved["masks"]) is list and moved["masks"][0].device == META
    assert type(moved["masks"][1]) is tuple and moved["masks"][1][0].device == META
    assert moved["masks"][1][1] == 3 and moved["flag"] is True
    # The caller's structure is not mutated.
    assert tree["ids"].device == CPU and tree["masks"][1][0].device == CPU


@movers()
def test_namedtuples_are_rebuilt_from_their_fields(move):
    tree = [Pair(cpu_tensor(), "x"), TypedPair(key=1, value={"t": cpu_tensor()})]
    moved = move(tree, META)
    assert type(moved[0]) is Pair and moved[0].first.device == META and moved[0].second == "x"
    assert type(moved[1]) is TypedPair and moved[1].key == 1 and moved[1].value["t"].device == META


@movers()
def test_torch_return_types_struct_is_rebuilt_with_its_type(move):
    result = torch.max(torch.ones(2, 3), dim=1)
    moved = move({"max": result}, META)["max"]
    assert type(moved) is type(result)
    assert moved.values.device == META and moved.indices.device == META


@movers()
def test_ordered_dict_defaultdict_and_dict_subclass_keep_type_order_and_state(move):
    ordered = OrderedDict([("b", cpu_tensor()), ("a", 1)])
    ordered.move_to_end("b")
    factory_dict = defaultdict(list, {"t": cpu_tensor()})
    tagged = TaggedDict({"t": cpu_tensor()}, tag="kept")
    moved = move([ordered, factory_dict, tagged, TaggedList([cpu_tensor()])], META)

    assert type(moved[0]) is OrderedDict and list(moved[0]) == ["a", "b"] and moved[0]["b"].device == META
    assert type(moved[1]) is defaultdict and moved[1].default_factory is list and moved[1]["t"].device == META
    assert type(moved[2]) is TaggedDict and moved[2].tag == "kept" and moved[2]["t"].device == META
    assert type(moved[3]) is TaggedList and moved[3][0].device == META
    assert ordered["b"].device == CPU and factory_dict["t"].device == CPU and tagged["t"].device == CPU


@movers()
def test_user_dict_keeps_its_type(move):
    class Inputs(UserDict):
        pass

    tree = Inputs({"mask": {"full": cpu_tensor()}, "n": 2})
    moved = move(tree, META)
    assert type(moved) is Inputs and moved["n"] == 2 and moved["mask"]["full"].device == META
    assert tree["mask"]["full"].device == CPU


@movers()
def test_model_output_keeps_its_type_and_both_views(move):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    output = CausalLMOutputWithPast(logits=cpu_tensor(), hidden_states=(cpu_tensor(), cpu_tensor()))
    moved = move({"out": output}, META)["out"]
    assert type(moved) is CausalLMOutputWithPast
    assert moved.logits.device == META and moved["logits"] is moved.logits
    assert all(t.device == META for t in moved.hidden_states)
    assert moved.hidden_states is moved["hidden_states"]
    assert moved.loss is None and list(moved.keys()) == ["logits", "hidden_states"]
    assert output.logits.device == CPU


@movers()
def test_block_mask_is_moved_with_its_own_to(move):
    from torch.nn.attention.flex_attention import BlockMask

    assert callable(getattr(BlockMask, "to", None)), "flex attention BlockMask has no .to() in this torch"

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    kv_num_blocks = torch.ones(1, 1, 1, dtype=torch.int32)
    kv_indices = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=128, mask_mod=causal, seq_lengths=(128, 128))
    moved = move({"sliding_attention": mask}, META)["sliding_attention"]
    assert isinstance(moved, BlockMask) and moved is not mask
    assert moved.mask_mod is causal
    tensors = [getattr(moved, name) for name in BlockMask._TENSOR_ATTRS]
    assert any(t is not None for t in tensors)
    assert all(t.device == META for t in tensors if t is not None)
    # Already on the device: the very same mask comes back.
    assert move({"m": moved}, META)["m"] is moved


@movers()
def test_cache_objects_and_their_tensors_are_left_alone(move):
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    cache.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), layer_idx=0)
    tree = {"past_key_values": cache, "input_ids": cpu_tensor()}
    moved = move(tree, META)
    assert moved["past_key_values"] is cache
    assert cache.layers[0].keys.device == CPU
    assert moved["input_ids"].device == META


@movers()
def test_non_tensor_leaves_are_returned_as_the_same_objects(move):
    class Holder:
        def __init__(self):
            self.tensor = cpu_tensor()

    holder, text, number, tensor_set = Holder(), "text", 12345678901234567890, {1, 2}
    tree = [holder, text, number, tensor_set, None, 1.5, CPU, torch.float16, cpu_tensor()]
    moved = move(tree, META)
    for before, after in zip(tree[:-1], moved[:-1]):
        assert after is before
    assert holder.tensor.device == CPU  # arbitrary objects are not searched
    assert moved[-1].device == META


# -- identity, aliasing, cycles, depth ---------------------------------------------------------------


@movers()
def test_nothing_off_device_returns_the_same_tree_without_new_containers(move):
    on_device = torch.empty(2, device=META)
    tree = {"a": [on_device, (on_device, {"b": on_device})], "c": Pair(1, on_device), "d": OrderedDict(x=1)}
    snapshot = {id(node): node for node in _containers(tree)}
    assert move(tree, META) is tree
    assert {id(node): node for node in _containers(tree)} == snapshot


@movers()
def test_untouched_subtrees_keep_their_identity(move):
    on_device = torch.empty(2, device=META)
    untouched_list = [on_device, 1]
    untouched_dict = {"k": (on_device,)}
    tree = {"moved": [cpu_tensor()], "same_list": untouched_list, "same_dict": untouched_dict, "n": 3}
    moved = move(tree, META)
    assert moved is not tree
    assert moved["same_list"] is untouched_list and moved["same_dict"] is untouched_dict
    assert moved["moved"] is not tree["moved"] and moved["moved"][0].device == META


@movers()
def test_shared_tensors_and_containers_stay_shared(move):
    host = cpu_tensor()
    shared = {"t": host}
    tree = {"a": shared, "b": shared, "c": [host, host]}
    moved = move(tree, META)
    assert moved["a"] is moved["b"]
    assert moved["c"][0] is moved["c"][1] is moved["a"]["t"]


@movers()
def test_list_containing_itself(move):
    tree = [cpu_tensor()]
    tree.append(tree)
    moved = move(tree, META)
    assert moved is not tree and moved[1] is moved and moved[0].device == META
    assert tree[1] is tree and tree[0].device == CPU


@movers()
def test_cycle_through_dict_tuple_and_list_is_rebuilt_as_the_same_cycle(move):
    outer = {"mask": cpu_tensor()}
    inner = [outer]
    outer["loop"] = (inner, 1)
    moved = move(outer, META)
    assert moved["mask"].device == META
    assert type(moved["loop"]) is tuple and moved["loop"][1] == 1
    assert moved["loop"][0][0] is moved  # the cycle closes on the new dict, not the old one
    assert outer["loop"][0][0] is outer and outer["mask"].device == CPU


@movers()
def test_cycle_members_that_only_reach_a_tensor_through_the_cycle_are_rebuilt(move):
    # The walk enters a, then b, whose only edge leads back to a (still open) before a's
    # tensor has been seen. A walk that settles b there as "nothing to move" keeps the old b,
    # which points at the old a and its host tensor.
    a: dict = {}
    b = {"back": a}
    a["b"] = b
    a["t"] = cpu_tensor()
    moved = move(a, META)
    assert moved["t"].device == META
    assert moved["b"] is not b
    assert moved["b"]["back"] is moved


@movers()
def test_cycle_with_nothing_to_move_is_returned_as_is(move):
    tree: list = [torch.empty(1, device=META)]
    tree.append({"self": tree})
    assert move(tree, META) is tree


@movers()
def test_deep_nesting_far_beyond_the_recursion_limit(move):
    depth = sys.getrecursionlimit() * 5
    host = cpu_tensor()
    tree: Any = host
    for level in range(depth):
        tree = [tree] if level % 3 else ({"k": tree} if level % 2 else (tree,))
    moved = move(tree, META)
    node, original = moved, tree
    for _ in range(depth):
        assert type(node) is type(original)
        node, original = _only_child(node), _only_child(original)
    assert original is host and node.device == META

    on_device = torch.empty(1, device=META)
    clean: Any = on_device
    for _ in range(depth):
        clean = [clean]
    assert move(clean, META) is clean


def test_exponentially_shared_tree_is_walked_in_linear_time():
    # 2**60 paths, 61 distinct lists: the recursive walk gives up on its container budget and the
    # memoised walk visits each list once.
    node: Any = [cpu_tensor()]
    for _ in range(60):
        node = [node, node]
    moved = move_tree(node, META)
    assert moved[0] is moved[1]
    for _ in range(60):
        moved = moved[0]
    assert moved[0].device == META


def test_device_given_as_string_and_device_without_index():
    host = cpu_tensor()
    assert move_tree({"t": host}, "meta")["t"].device == META
    tree = {"t": host}
    # "cpu" names the device the tensor is on: nothing moves.
    assert move_tree(tree, "cpu") is tree


def test_module_import_does_not_import_transformers():
    assert heavy_imports("overlay.tree_move", ("transformers",)) == []


def test_matches_upstream_move_to_device_where_upstream_has_it():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    upstream = getattr(pytorch_utils, "move_to_device", None)
    if upstream is None:
        pytest.skip("this transformers release has no pytorch_utils.move_to_device (added in 5.20.0)")
    tree = {"ids": cpu_tensor(1, 2), "mask": {"full": cpu_tensor(3), "sliding": [cpu_tensor(4), (cpu_tensor(5), 6)]}}
    ours, theirs = move_tree(tree, META), upstream(tree, META)
    assert _shape_of(ours) == _shape_of(theirs)


# -- property tests -------------------------------------------------------------------------------


def _leaves():
    return st.one_of(
        st.builds(lambda n: torch.arange(float(n)), st.integers(0, 3)),
        st.builds(lambda n: torch.empty(n, device=META), st.integers(0, 3)),
        st.integers(-5, 5),
        st.text(max_size=3),
        st.none(),
    )


def _extend(children):
    keys = st.text(min_size=1, max_size=3)
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(OrderedDict),
        st.dictionaries(keys, children, max_size=4).map(UserDict),
        st.tuples(children, children).map(lambda pair: Pair(*pair)),
        st.dictionaries(keys, children, max_size=4).map(lambda d: TaggedDict(d, tag="t")),
    )


TREES = st.recursive(_leaves(), _extend, max_leaves=25)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=TREES, via_general=st.booleans())
def test_property_structure_kept_tensors_moved_untouched_kept(tree, via_general):
    before = _snapshot(tree)
    move = tree_move._move_general if via_general else move_tree
    moved = move(tree, META)
    _check_moved(tree, moved)
    assert _snapshot(tree) == before, "the input tree was mutated"


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=TREES, sharing=st.lists(st.integers(0, 50), max_size=6))
def test_property_fast_and_general_walks_agree_with_shared_subtrees(tree, sharing):
    # Re-use some subtrees in a second branch so that the tree becomes a DAG.
    nodes = list(_containers(tree)) + [tree]
    extra = [nodes[i % len(nodes)] for i in sharing]
    dag = {"tree": tree, "extra": extra}
    fast, general = move_tree(dag, META), tree_move._move_general(dag, META)
    _check_moved(dag, fast)
    _check_moved(dag, general)
    assert _shape_of(fast) == _shape_of(general)
    assert _alias_pattern(fast) == _alias_pattern(general)


# -- helpers --------------------------------------------------------------------------------------


def _is_container(node):
    return isinstance(node, (dict, list, tuple, UserDict))


def _children(node):
    if isinstance(node, UserDict):
        return list(node.data.values())
    if isinstance(node, dict):
        return list(node.values())
    return list(node)


def _only_child(node):
    (child,) = _children(node)
    return child


def _containers(tree):
    seen, stack = set(), [tree]
    while stack:
        node = stack.pop()
        if not _is_container(node) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(_children(node))


def _has_off_device_tensor(node, seen=None):
    seen = set() if seen is None else seen
    if isinstance(node, torch.Tensor):
        return node.device != META
    if not _is_container(node) or id(node) in seen:
        return False
    seen.add(id(node))
    return any(_has_off_device_tensor(child, seen) for child in _children(node))


def _check_moved(original, moved):
    """Same structure and types; tensors on META with the same metadata; other leaves identical;
    subtrees with nothing to move returned as the same object."""
    if isinstance(original, torch.Tensor):
        assert isinstance(moved, torch.Tensor) and moved.device == META
        assert (moved.shape, moved.dtype) == (original.shape, original.dtype)
        if original.device == META:
            assert moved is original
        return
    if not _is_container(original):
        assert moved is original
        return
    assert type(moved) is type(original)
    if not _has_off_device_tensor(original):
        assert moved is original
        return
    if isinstance(original, (dict, UserDict)):
        assert list(moved.keys()) == list(original.keys())
    if isinstance(original, TaggedDict):
        assert moved.tag == original.tag
    for child, moved_child in zip(_children(original), _children(moved), strict=True):
        _check_moved(child, moved_child)


def _snapshot(tree):
    """What mutation would change: every container's identity and children, every tensor's device."""
    state = []
    for node in _containers(tree):
        children = _children(node)
        keys = list(node.keys()) if isinstance(node, (dict, UserDict)) else None
        state.append((id(node), keys, [id(c) for c in children], [str(c.device) for c in children if isinstance(c, torch.Tensor)]))
    return state


def _shape_of(node):
    """A comparable description: types, keys, tensor device/shape/dtype, leaf values."""
    if isinstance(node, torch.Tensor):
        return ("tensor", str(node.device), tuple(node.shape), str(node.dtype))
    if isinstance(node, (dict, UserDict)):
        return (type(node).__name__, [(k, _shape_of(v)) for k, v in node.items()])
    if isinstance(node, (list, tuple)):
        return (type(node).__name__, [_shape_of(v) for v in node])
    return ("leaf", repr(node))


def _alias_pattern(tree):
    """Which positions (in a fixed traversal order) hold the same object as an earlier position."""
    order, first_seen, pattern = [], {}, []

    def visit(node):
        pattern.append(first_seen.setdefault(id(node), len(order)))
        order.append(node)
        if _is_container(node) and first_seen[id(node)] == len(order) - 1:
            for child in _children(node):
                visit(child)

    visit(tree)
    return pattern
