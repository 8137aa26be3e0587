"""Static cache with ``prefill_chunk_size``: divide KV heads by ``tp_size`` only when attention is sharded,
and size each layer of a heterogeneous config (Gemma 4) on its own.

What breaks (5.13.0 - 5.19.0, fixed upstream in 5.20.0):
``GenerationMixin._get_static_cache_init_shape`` gives the head count a ``StaticCache`` is eagerly
allocated with when ``generate(cache_implementation="static", prefill_chunk_size=N)`` runs.
Under tensor parallelism it divides the KV heads by ``tp_size`` whatever the plan says; with
attention left out of the plan, or a key projection planned ``colwise_gather_output``
(OLMo2/OLMo3, OLMoE, FlexOlmo, MiniMax-M2 ship that plan), every rank computes all heads and the
first cache write fails: ``index_copy_(): Source/destination tensor must have same slice shapes``
(``Incompatible shapes for broadcasting`` on Neuron). 5.16.0 - 5.16.1 slip the other way: they
never assign ``model._tp_size``, so a ``colwise`` key projection (Llama's own plan) meets a cache
with every head. And 5.13.0 - 5.17.0 (fixed upstream in 5.18.0) read one head size and KV head
count for every layer, but Gemma 4's full-attention layers use ``global_head_dim`` and, with
``attention_k_eq_v``, ``num_global_key_value_heads``: the first chunked call fails, with or
without tensor parallelism, in ``index_copy_`` (5.13 - 5.14) or with
``AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer attribute`` (5.15 - 5.17).

Policy: the replacement decides from the model's effective plan (``model.tp_plan``, the plan
``from_pretrained`` sharded the model with) and then lets the release's own function compute the
shape, so the device-map check, the MLA check, per-layer head counts (5.18+), the uneven-heads
fallback to lazy initialisation (``None``) and the return types stay exactly as shipped. The
heads are divided only if a key projection (``k_proj``, ``qkv_proj``, ``query_key_value``) is
planned ``colwise``; gathered and row-parallel styles and plans without a key projection keep
every head; on 5.16.0 - 5.16.1 the size comes from :func:`sharded_tp_size`. For a config whose
layers differ in head size or KV heads (before 5.18.0) it sizes the cache as 5.18.0 does
(:func:`per_layer_head_shapes`: one value per layer, over the layers with a cache layer of their
own), dividing each layer's heads the same way. Without tensor parallelism nothing changes but
those per-layer shapes.

Limits: a style the overlay does not know (``packed_colwise``, ``sequence_parallel``, a style
registered by the user, upstream's proposed unit sharding) is not guessed: transformers' own
behaviour (divided by ``tp_size``), and one warning per style on the ``overlay`` logger naming it.

Cost, once per ``generate()`` with ``prefill_chunk_size``: one read of ``per_layer_attributes``
(or of ``global_head_dim``) for every model, and for configs whose layers differ one shallow copy
of the config per layer (what ``per_layer_config[i]`` returns) where upstream's makes the same.

The full account (the styles' table, Gemma 4, unit sharding): docs/patches/static-cache-tp-heads.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from overlay import report
from overlay.patch import Target, Variant, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "static-cache-tp-heads"

logger = logging.getLogger("overlay")

#: The head attributes that size a layer's cache and that a heterogeneous config may set per layer:
#: the ones 5.18.0 reads per layer (``configuration_utils.get_head_shapes``).
PER_LAYER_HEAD_ATTRIBUTES = ("head_dim", "num_key_value_heads")

#: Modules whose output holds the attention keys, fused or not (matched as the plan key's last part).
KEY_PROJECTIONS = frozenset({"k_proj", "qkv_proj", "query_key_value"})

#: The output keeps ``heads / tp_size`` heads on each rank: ``ColwiseParallel`` with a ``Shard(-1)``
#: output, handed on as the local shard.
HEAD_SHARDING_STYLES = frozenset({"colwise"})

#: The output holds every head on every rank: styles whose output layout is ``Replicate()``
#: (a gathered column-parallel output, or a row-parallel output after its all-reduce), as defined
#: in transformers' ``ParallelInterface`` in every release from 5.13.0 that has them.
FULL_HEADS_STYLES = frozenset(
    {"colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input", "rowwise_rep"}
)

_warned_styles: set[str] = set()
_warned_lock = threading.Lock()


def key_projection_styles(tp_plan: Mapping[str, Any] | None) -> dict[str, str]:
    """``{plan key: style}`` for every plan entry that names a key projection."""
    found: dict[str, str] = {}
    for key, style in (tp_plan or {}).items():
        # Module keys, e.g. "layers.*.self_attn.k_proj": the style of the module's forward hooks,
        # which decide what its output holds (the same reading as upstream's fix in 5.20.0).
        if str(key).rsplit(".", 1)[-1] in KEY_PROJECTIONS:
            found[str(key)] = str(style)
    return found


def kv_heads_sharding(tp_plan: Mapping[str, Any] | None) -> str:
    """How the plan leaves the KV heads on each rank.

    ``"sharded"``: a key projection is planned ``colwise``, each rank holds ``heads / tp_size``.
    ``"full"``: no key projection is sharded by head (no plan, attention not in the plan, or only
    styles whose output is replicated), each rank holds every head.
    ``"unknown"``: a key projection uses a style this patch does not know; not guessed.
    """
    styles = key_projection_styles(tp_plan)
    unknown = sorted({s for s in styles.values() if s not in HEAD_SHARDING_STYLES | FULL_HEADS_STYLES})
    if unknown:
        _warn_unknown_styles(unknown, styles)
        return "unknown"
    if any(s in HEAD_SHARDING_STYLES for s in styles.values()):
        return "sharded"
    return "full"


def _warn_unknown_styles(unknown: list[str], styles: Mapping[str, str]) -> None:
    with _warned_lock:
        new = [s for s in unknown if s not in _warned_styles]
        _warned_styles.update(new)
    for style in new:
        keys = ", ".join(sorted(k for k, v in styles.items() if v == style))
        logger.warning(
            "attn-overlay %s: tensor parallel style %r on the key projection (%s) is not known to this "
            "patch; the static cache keeps transformers' own shape (KV heads divided by tp_size)",
            PATCH_ID,
            style,
            keys,
        )


class _AsIfTpSize:
    """Stands in for the model while the release's own function computes the cache shape.

    It reports ``tp_size`` as the model's ``_tp_size`` (``None``: no tensor parallelism, so the
    original sizes the cache with every head) and forwards every other attribute to the model, so
    the original code runs unchanged.
    """

    __slots__ = ("_model", "_tp_size")

    def __init__(self, model: Any, tp_size: int | None) -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_tp_size", tp_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_model"), name)


def sharded_tp_size(model: Any) -> int:
    """The tensor-parallel size the model was sharded with, read where 5.16.x leave it.

    transformers 5.16.0 - 5.16.1 shard the model (``model._device_mesh``, and the
    ``DistributedConfig`` in ``model.config.distributed_config``) but never assign
    ``model._tp_size``; 5.17.0 assigns ``distributed_config.tp_size`` there. 1 when the model was
    not sharded for tensor parallelism.
    """
    if getattr(model, "_device_mesh", None) is None:
        return 1
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    size = distributed.get("tp_size") if isinstance(distributed, dict) else getattr(distributed, "tp_size", None)
    return size if isinstance(size, int) and size > 1 else 1


def _effective_tp_plan(model: Any) -> Mapping[str, Any]:
    # `tp_plan` is the plan the model was sharded with: the config's `base_model_tp_plan`, the
    # children's and class plans, or the user's override; in 5.13-5.18 the expert-parallel plan
    # when expert parallelism is on. The same property upstream's fix (5.20.0) reads.
    plan = getattr(model, "tp_plan", None)
    return plan if plan is not None else {}


def kv_heads_divisor(model: Any) -> tuple[int, int]:
    """``(what each rank's keys hold the heads divided by, what the release's own code divides by)``.

    The second is ``model._tp_size`` (1 without it). The first follows the plan: every head
    (1) when no key projection is sharded by head, the size the model was sharded with when one is
    ``colwise`` (on 5.16.x too, where ``_tp_size`` is never recorded), and the release's own
    divisor without tensor parallelism or for a style this patch does not know (not guessed).
    """
    recorded = getattr(model, "_tp_size", None) or 1
    tp_size = recorded if recorded > 1 else sharded_tp_size(model)
    if tp_size > 1:
        sharding = kv_heads_sharding(_effective_tp_plan(model))
        if sharding == "full":
            return 1, recorded
        if sharding == "sharded":
            return tp_size, recorded
    return recorded, recorded


def _values_per_layer(text_config: Any) -> dict[str, Callable[[int], Any]]:
    """``{attribute: layer index -> value}`` for those of :data:`PER_LAYER_HEAD_ATTRIBUTES` that
    differ between the config's layers (empty when none does)."""
    per_layer = getattr(text_config, "per_layer_attributes", None)
    if per_layer:
        # A heterogeneous config (5.14.0 on; Gemma 4 from 5.15.0): each layer's own config.
        view = text_config.per_layer_config
        # mypy cannot infer a lambda that binds a default argument.
        return {
            name: (lambda i, name=name: getattr(view[i], name))  # type: ignore[misc]
            for name in PER_LAYER_HEAD_ATTRIBUTES
            if name in per_layer
        }
    global_head_dim = getattr(text_config, "global_head_dim", None)
    layer_types = getattr(text_config, "layer_types", None)
    if not global_head_dim or not layer_types:
        return {}
    # Gemma 4's own attributes (5.13.0 - 5.14.x): a layer that is not sliding takes
    # `global_head_dim` and, with `attention_k_eq_v`, `num_global_key_value_heads`; read as those
    # releases' Gemma 4 attention reads them, and written per layer from 5.15.0 on.
    global_heads = getattr(text_config, "num_global_key_value_heads", None)
    shared_kv = bool(getattr(text_config, "attention_k_eq_v", False)) and global_heads is not None
    full = [i for i, kind in enumerate(layer_types) if kind != "sliding_attention"]
    found: dict[str, Callable[[int], Any]] = {}
    if full and global_head_dim != text_config.head_dim:
        found["head_dim"] = lambda i: global_head_dim if layer_types[i] != "sliding_attention" else text_config.head_dim
    if full and shared_kv and global_heads != text_config.num_key_value_heads:
        found["num_key_value_heads"] = lambda i: (
            global_heads if layer_types[i] != "sliding_attention" else text_config.num_key_value_heads
        )
    return found


def per_layer_head_shapes(text_config: Any) -> tuple[int | list[int], int | list[int]] | None:
    """``(KV heads, head size)`` for a config whose layers differ in them, as 5.18.0 sizes its
    static cache (``configuration_utils.get_head_shapes``): one value per layer (a list) for an
    attribute that differs between layers, the global value for the other. The layers are those
    with a cache layer of their own: the last ``num_kv_shared_layers`` reuse another layer's keys
    and values. ``None`` when every layer has the same head size and KV head count: the release's
    function reads them right.
    """
    varying = _values_per_layer(text_config)
    if not varying:
        return None
    layers = range(text_config.num_hidden_layers - (getattr(text_config, "num_kv_shared_layers", 0) or 0))
    if "head_dim" in varying:
        head_dim: int | list[int] = [varying["head_dim"](i) for i in layers]
    else:
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    if "num_key_value_heads" in varying:
        heads: int | list[int] = [varying["num_key_value_heads"](i) for i in layers]
    else:
        heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    return heads, head_dim


def _per_layer_init_shape(model: Any, text_config: Any, shapes: tuple, divide_by: int):
    # The release's own checks first (they come before any head read in its function): no eager
    # cache when the layers sit on several devices, none for MLA models (distinct key and value sizes).
    if hasattr(model, "hf_device_map") and len(set(model.hf_device_map.values())) > 1:
        return None
    if getattr(text_config, "qk_head_dim", None) is not None:
        return None
    heads, head_dim = shapes
    # Slow path: the release's function raises here (5.15+) or sizes every layer alike (5.13 - 5.14).
    varying = " and ".join(name for name, value in (("head_dim", head_dim), ("KV heads", heads)) if isinstance(value, list))
    report.record_outside_compile(PATCH_ID, f"sized the static cache per layer (per-layer {varying})")
    if divide_by > 1:
        layer_heads = [heads] if isinstance(heads, int) else heads
        if any(count % divide_by for count in layer_heads):
            return None  # a layer cannot be sharded evenly by head: lazy initialisation, as 5.18.0
        # A scalar stays a scalar: early_initialization broadcasts it to every layer.
        heads = heads // divide_by if isinstance(heads, int) else [count // divide_by for count in heads]
    return heads, head_dim


def make_replacement(original: Callable[..., Any], variant: Variant) -> Callable[..., Any]:
    # 5.13.0-5.17.0 read one head count and one head size for every layer: Gemma 4's full-attention
    # layers get the sliding layers' shape (5.13-5.14), or the read raises on its heterogeneous
    # config (5.15-5.17). 5.18.0 on read them per layer.
    global_head_shapes = variant["global_head_shapes"]

    @wraps(original)
    def _get_static_cache_init_shape(self):
        divide_by, recorded = kv_heads_divisor(self)
        if global_head_shapes:
            text_config = self.config.get_text_config(decoder=True)
            shapes = per_layer_head_shapes(text_config)
            if shapes is not None:
                return _per_layer_init_shape(self, text_config, shapes, divide_by)
        if divide_by == recorded:
            # Sharded by head with tp_size recorded: the original divides (each layer's count on
            # 5.18+; None when uneven), which is right. No tensor parallelism, or an unknown style:
            # the original's behaviour, unguessed.
            return original(self)
        shape = original(_AsIfTpSize(self, divide_by if divide_by > 1 else None))
        if divide_by == 1:
            if shape is not None:
                # Slow path: the original would have divided heads that every rank holds.
                report.record_outside_compile(PATCH_ID, f"kept {shape[0]} KV heads per rank (plan leaves k_proj unsharded)")
        else:
            # 5.16.x: sharded by head, but the release never recorded tp_size, so its own code
            # would allocate every head. Divide by the size the model was sharded with.
            report.record_outside_compile(
                PATCH_ID, f"divided KV heads by the tensor-parallel size {divide_by} (k_proj sharded colwise)"
            )
        return shape

    return _get_static_cache_init_shape


#: The release's function reads one head count and one head size for every layer.
GLOBAL_HEAD_SHAPES = {"global_head_shapes": True}
#: The release's function reads each layer's head count and head size (5.18.0 on).
PER_LAYER_HEAD_SHAPES = {"global_head_shapes": False}


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title=(
        "Static cache under tensor parallelism divides KV heads by tp_size only when k_proj is sharded colwise; "
        "configs whose layers differ (Gemma 4) get per-layer shapes"
    ),
    errors=(
        "RuntimeError: index_copy_(): Source/destination tensor must have same slice shapes.",
        "ValueError: Incompatible shapes for broadcasting",
        # 5.15.0 - 5.17.0, Gemma 4 (its layers differ in head size, and with attention_k_eq_v in KV heads).
        "AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer attribute and may vary across layers.",
        "AmbiguousGlobalPerLayerAttributeError: 'num_key_value_heads' is a per-layer attribute and may vary across layers.",
    ),
    why=(
        "With prefill_chunk_size, generate() sizes the eagerly allocated static cache from the model's "
        "_tp_size alone, not from the tensor parallel plan, so its KV heads can differ from those each "
        "rank's keys hold; before 5.18.0 it reads one global head size and KV head count, which configs "
        "whose layers differ (Gemma 4) refuse to give."
    ),
    upstream=(
        "fixed in {fixed_in} (distributed.tensor_parallel.get_kv_heads_per_rank); "
        "layers that differ in head size or KV heads (Gemma 4) since 5.18.0 "
        "(GenerationMixin._get_static_cache_init_shape reads configuration_utils.get_head_shapes)"
    ),
    targets=(
        Target(
            module="transformers.generation.utils",
            qualname="GenerationMixin._get_static_cache_init_shape",
            variants={"global_head_shapes": GLOBAL_HEAD_SHAPES, "per_layer_head_shapes": PER_LAYER_HEAD_SHAPES},
            replace=make_replacement,
        ),
    ),
    doctor=("tp-prefill-chunk", "gemma4-prefill-chunk"),
)
