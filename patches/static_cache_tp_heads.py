"""Static cache under tensor parallelism: divide KV heads by ``tp_size`` only when attention is sharded.

``GenerationMixin._get_static_cache_init_shape`` (transformers 5.13.0 - 5.19.0) gives the head
count a ``StaticCache`` is eagerly allocated with when ``generate(cache_implementation="static",
prefill_chunk_size=N)`` runs. Under tensor parallelism it divides the KV heads by ``tp_size``
whatever the plan says. Only a key projection planned ``colwise`` leaves each rank with
``heads / tp_size`` heads; with attention left out of the plan, or a key projection planned
``colwise_gather_output`` (OLMo2/OLMo3, OLMoE, FlexOlmo, MiniMax-M2 ship that plan), every rank
computes all heads and the first cache write fails.

The replacement decides from the model's effective plan (``model.tp_plan``, the plan
``from_pretrained`` sharded the model with) and then lets the release's own function compute the
shape, so everything else each variant does stays exactly as shipped: the device-map check, the
MLA check, per-layer head counts (5.18+), the uneven-heads fallback to lazy initialisation
(``None``) and the return types.

transformers 5.16.0 - 5.16.1 slip the other way: they never assign ``model._tp_size`` when they
shard a model, so their own function never divides, and a ``colwise`` key projection (Llama's own
plan) meets a cache with every head: ``index_copy_(): Source/destination tensor must have same
slice shapes``. There the replacement reads the tensor-parallel size the model was sharded with
(:func:`sharded_tp_size`: ``model._device_mesh`` is set and ``model.config.distributed_config``
holds the size, exactly what 5.17.0 copies into ``_tp_size``) and lets the original divide by it,
for ``colwise`` plans only; plans that keep every head are already right there.

Which plans divide the KV heads, and why. A rank's cache must hold the heads that the rank's
key projection outputs. The overlay reads the model's effective plan, ``model.tp_plan``: the plan
the model was sharded with (the config's ``base_model_tp_plan``, the class and sub-model plans, a
``DistributedConfig(tp_plan=…)`` override, and in 5.13 – 5.18 the expert-parallel plan when
expert parallelism is on). It looks at the entries for a key projection: module keys whose last
part is ``k_proj``, ``qkv_proj`` or ``query_key_value`` (any prefix, e.g. ``layers.*.self_attn.k_proj``
or ``model.language_model.layers.*.self_attn.k_proj``).

| style on the key projection | what each rank's keys hold | static cache heads per rank |
| --- | --- | --- |
| ``colwise`` | a ``Shard(-1)`` output kept local: ``heads / tp_size`` | divided by ``tp_size``; each layer's count when layers differ; when a count does not divide evenly, the cache is allocated lazily from the first keys (``None``), as before |
| ``colwise_gather_output``, ``colwise_rep`` | the output is gathered (``Replicate()``): every head | not divided |
| ``rowwise``, ``rowwise_split_input``, ``rowwise_rep`` | the output is all-reduced (``Replicate()``): every head | not divided |
| no entry for a key projection (attention left out of the plan, an MLP- or expert-only plan, no plan) | the projection is not sharded: every head | not divided |
| any other style (``packed_colwise``, ``sequence_parallel``, a style registered by the user, …) | not known to the overlay | not guessed: transformers' own behaviour (divided by ``tp_size``), and one warning per style on the ``overlay`` logger naming it |

If any key projection is ``colwise``, the heads are divided (as upstream's fix does). Everything else
the release's function does (no eager cache when layers sit on several devices, none for MLA
models, per-layer head counts, the return types of each release) is kept: the overlay decides from
the plan and then lets the installed release's own function compute the shape, with tensor
parallelism hidden from it when the heads are whole. Without tensor parallelism nothing changes.

Unit sharding (``unit_colwise`` / ``colwise_units``). Upstream is proposing a style that shards
``unit_number × unit_dim`` outputs by whole units (heads), so no rank is left with a partial or empty
head (huggingface/transformers pull requests 48848 and 48855, open). No release up to 5.24.0 ships
it: neither name appears in any release's ``tensor_parallel.py`` (``transformers/integrations/`` and
``transformers/distributed/``) nor in any model configuration, 5.13.0 – 5.24.0. As the proposal describes it
(DTensor cannot shard unevenly, so the heads are split over part of the ranks and replicated over
the rest), for the KV cache it would mean: each rank holds ``heads / s`` whole heads, where ``s`` is
the number of ranks the heads are actually split over. That is ``heads / tp_size`` when ``tp_size``
divides the heads, as with ``colwise``; otherwise ``s`` is smaller than ``tp_size``, and the count per
rank cannot be derived from the head count and ``tp_size`` alone. The overlay
therefore treats it as an unknown style (warning, transformers' behaviour); a release that ships it
needs a rule of its own, best read from the local shape of the key projection's weight rather than
from the plan's name.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping

from overlay import report
from overlay.patch import Patch, Target, Variant, wraps

PATCH_ID = "static-cache-tp-heads"

logger = logging.getLogger("overlay")

#: Modules whose output holds the attention keys, fused or not (matched as the plan key's last part).
KEY_PROJECTIONS = frozenset({"k_proj", "qkv_proj", "query_key_value"})

#: The output keeps ``heads / tp_size`` heads on each rank: ``ColwiseParallel`` with a ``Shard(-1)``
#: output, handed on as the local shard.
HEAD_SHARDING_STYLES = frozenset({"colwise"})

#: The output holds every head on every rank: styles whose output layout is ``Replicate()``
#: (a gathered column-parallel output, or a row-parallel output after its all-reduce), as defined
#: in transformers' ``ParallelInterface`` in every release 5.13.0 - 5.24.0 that has them.
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


def make_replacement(original: Callable[..., Any], variant: Variant) -> Callable[..., Any]:
    @wraps(original)
    def _get_static_cache_init_shape(self):
        recorded = getattr(self, "_tp_size", None) or 1
        tp_size = recorded if recorded > 1 else sharded_tp_size(self)
        if tp_size > 1:
            sharding = kv_heads_sharding(_effective_tp_plan(self))
            if sharding == "full":
                shape = original(_AsIfTpSize(self, None))
                if recorded > 1 and shape is not None:
                    # Slow path: the original would have divided heads that every rank holds.
                    report.record_outside_compile(PATCH_ID, f"kept {shape[0]} KV heads per rank (plan leaves k_proj unsharded)")
                return shape
            if sharding == "sharded" and recorded <= 1:
                # 5.16.x: sharded by head, but the release never recorded tp_size, so its own code
                # would allocate every head. Divide by the size the model was sharded with.
                shape = original(_AsIfTpSize(self, tp_size))
                report.record_outside_compile(PATCH_ID, f"divided KV heads by the tensor-parallel size {tp_size} (k_proj sharded colwise)")
                return shape
        # Sharded by head with tp_size recorded: the original divides (each layer's count; None
        # when uneven), which is right. Unknown style: the original's behaviour, unguessed.
        return original(self)

    return _get_static_cache_init_shape



PATCH = Patch(
    id=PATCH_ID,
    title="Static cache under tensor parallelism divides KV heads by tp_size only when k_proj is sharded colwise",
    errors=(
        "RuntimeError: index_copy_(): Source/destination tensor must have same slice shapes.",
        "ValueError: Incompatible shapes for broadcasting",
    ),
    why=(
        "With prefill_chunk_size, generate() sizes the eagerly allocated static cache from the model's "
        "_tp_size alone, not from the tensor parallel plan, so its KV heads can differ from those each "
        "rank's keys hold."
    ),
    upstream="fixed in transformers 5.20.0 (distributed.tensor_parallel.get_kv_heads_per_rank)",
    affected=">=5.13.0,<5.20.0",
    fixed_in="5.20.0",
    targets=(
        Target(
            module="transformers.generation.utils",
            qualname="GenerationMixin._get_static_cache_init_shape",
            originals={
                "e16a197f8cf9c49d0bfe801006374b4746e8cd46e7fd83ce6167fc3ba9e70a5a": "5.13.0-5.17.0",
                "8c3b2a0d2b880fe84ad06bca8159bc6eedc3a0c0407dc46f7d927f13b52ade18": "5.18.0",
                "047200716efdb3d06748c4426a6b3a3b8e8e52bf2fb04d8142c3b7acfdd5f73e": "5.19.0",
            },
            fixed={
                "8ba958316e420772e268d02be4e80070649299499b239395a40b8a16c60bdeff": "5.20.0-5.22.2",
                "ee152e79e1894fd21a8b0dec9d25f9c8b45c609219a86da6c6c9e9596805cafc": "5.23.0-5.24.0",
            },
            replace=make_replacement,
        ),
    ),
    doctor=("tp-prefill-chunk",),
)
