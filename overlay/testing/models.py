"""Tiny randomly initialised causal LMs built from configs, and hand-made left-padded batches.

For tests and for ``python -m overlay.doctor``: no downloads, no tokenizer, seconds on a CPU.
The three kinds cover the code paths the patches care about:

``"gemma3"``
    ``Gemma3ForCausalLM`` with ``layer_types`` = sliding + full attention: the attention mask
    becomes a dict keyed by layer type, and caches get a sliding-window layer.
``"qwen3"``
    ``Qwen3ForCausalLM``: ``layer_types`` all full attention (still a mask dict), q/k norms.
``"llama"``
    ``LlamaForCausalLM``: no ``layer_types``, one plain mask tensor. The control model.

Weights come from ``torch.manual_seed(seed)`` and transformers' own initialisation, always in
float32 on the CPU, then cast and moved: the same ``seed`` gives the same weights whatever the
``dtype`` and ``device`` asked for, so runs in different processes or on different devices are
comparable token for token.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["KINDS", "PAD_TOKEN_ID", "tiny_config", "tiny_model", "left_padded_batch", "cache_argument_name"]

#: Model kinds :func:`tiny_config` knows.
KINDS = ("gemma3", "qwen3", "llama")

PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
#: Token ids below this are special (pad/bos/eos); :func:`left_padded_batch` never draws them.
FIRST_ORDINARY_TOKEN_ID = 3

# (configuration class, model class), by attribute name on the transformers package.
_CLASSES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}


def tiny_config(
    kind: str,
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    sliding_window: int = 16,
    **overrides: Any,
):
    """A config for a tiny model of ``kind`` (one of :data:`KINDS`).

    ``head_dim`` is ``hidden_size // num_attention_heads`` unless given. For ``"gemma3"`` the
    layers alternate sliding and full attention (``layer_types``), starting with sliding, and
    ``sliding_window`` applies; the other kinds ignore ``sliding_window``. ``overrides`` are
    passed to the config class as they are (e.g. ``base_model_tp_plan``, ``initializer_range``).
    """
    import transformers

    if kind not in _CLASSES:
        raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(KINDS)}")
    config_class = getattr(transformers, _CLASSES[kind][0])
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=False,
    )
    if kind == "gemma3":
        kwargs.update(
            sliding_window=sliding_window,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_hidden_layers)],
            # The default (256) is sized for head_dim 256; keep the usual 1/sqrt(head_dim) scaling.
            query_pre_attn_scalar=hidden_size // num_attention_heads,
        )
    kwargs.update(overrides)
    return config_class(**kwargs)


def tiny_model(
    kind: str,
    dtype: "torch.dtype | str | None" = None,
    device: "torch.device | str" = "cpu",
    attn_implementation: str = "sdpa",
    *,
    seed: int = 0,
    config: Any = None,
    **config_overrides: Any,
):
    """A randomly initialised tiny causal LM of ``kind``, in eval mode, on ``device``.

    ``dtype`` defaults to float32. ``config`` replaces :func:`tiny_config` (``config_overrides``
    go to :func:`tiny_config` otherwise). See the module documentation about ``seed``.
    """
    import torch
    import transformers

    if config is None:
        config = tiny_config(kind, **config_overrides)
    elif config_overrides:
        raise TypeError("pass either config or config overrides, not both")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model_class = getattr(transformers, _CLASSES[kind][1])
    # The attention implementation is set on the config: the one spelling every 5.x release reads.
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_class(config)
    model.to(dtype=dtype or torch.float32)
    model.to(device)
    model.eval()
    # Greedy and unchanged by any generation_config default a release might ship.
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def left_padded_batch(
    lengths: Sequence[int] = (6, 4),
    *,
    vocab_size: int = 128,
    pad_token_id: int = PAD_TOKEN_ID,
    seed: int = 0,
) -> "dict[str, torch.Tensor]":
    """``{"input_ids", "attention_mask"}`` on the CPU: one row per length, left-padded with
    ``pad_token_id`` to the longest, as a tokenizer with ``padding_side="left"`` returns them.
    Token ids are drawn from a private generator (the global RNG is left alone)."""
    import torch

    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be positive, got {list(lengths)}")
    width = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(
            FIRST_ORDINARY_TOKEN_ID, vocab_size, (length,), generator=generator
        )
        attention_mask[row, width - length :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def cache_argument_name(model: Any) -> str:
    """The keyword ``generate()``/``forward()`` take a cache by: ``"cache"`` from transformers
    5.24.0 on (the old name still works there, with a deprecation warning), ``"past_key_values"``
    before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
