"""Tensor-parallel plans for the tiny Llama-like models, and loading a saved model with one.

For the tensor-parallel tests and the doctor's ``tp-prefill-chunk`` scenario. A plan is a
``base_model_tp_plan``: module patterns (as in transformers' own plans) -> sharding style.
``save_pretrained`` does not keep ``base_model_tp_plan``, so :func:`load_sharded` puts the plan
in the config it hands to ``from_pretrained``, which builds the model's plan from it.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ATTENTION_COLWISE", "ATTENTION_GATHERED", "MLP", "load_sharded", "local_rows"]

#: Attention really sharded: each rank computes its share of the heads.
ATTENTION_COLWISE = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
#: q/k/v sharded then gathered (OLMo2's own plan): every rank ends up with every head.
ATTENTION_GATHERED = {
    "layers.*.self_attn.q_proj": "colwise_gather_output",
    "layers.*.self_attn.k_proj": "colwise_gather_output",
    "layers.*.self_attn.v_proj": "colwise_gather_output",
    "layers.*.self_attn.o_proj": "rowwise_split_input",
}
#: The MLP sharded; alone, it leaves attention unsharded (every rank keeps every head).
MLP = {
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def load_sharded(model_dir: str, plan: Mapping[str, str] | None, world_size: int, dtype: Any = None):
    """``AutoModelForCausalLM.from_pretrained(model_dir)`` under tensor parallelism of
    ``world_size`` ranks (this process is one; the process group is initialised), with ``plan``
    as the config's ``base_model_tp_plan`` (``None`` keeps the model's own), in eval mode.

    5.18+ take ``distributed_config=DistributedConfig(tp_size=...)`` (the ``tp_plan``/``tp_size``
    arguments are deprecated there); older releases whose ``DistributedConfig`` has no
    ``tp_size`` get ``tp_plan="auto", tp_size=...``. ``dtype`` defaults to float32.
    """
    import importlib
    import inspect

    import torch
    import transformers

    try:
        config_class = importlib.import_module("transformers.distributed").DistributedConfig
    except (ImportError, AttributeError):
        config_class = None
    if config_class is not None and "tp_size" in inspect.signature(config_class).parameters:
        parallel: dict[str, Any] = {"distributed_config": config_class(tp_size=world_size)}
    else:
        parallel = {"tp_plan": "auto", "tp_size": world_size}
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if plan is not None:
        config.base_model_tp_plan = dict(plan)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=dtype or torch.float32, **parallel
    )
    return model.eval()


def local_rows(model: Any, name: str, layer: int = 0) -> int:
    """Rows of ``model.layers.<layer>.<name>``'s weight this rank holds: what the plan really
    sharded (a DTensor's local shard, or the whole weight)."""
    weight = model.get_submodule(f"model.layers.{layer}.{name}").weight
    return int((weight.to_local() if hasattr(weight, "to_local") else weight).shape[0])
