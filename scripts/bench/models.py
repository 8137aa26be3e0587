"""Tiny random models and hand-made left-padded batches for the benchmarks (no hub downloads).

Gemma 3 (``layer_types`` sliding + full) is the model every figure uses: with a static cache its
attention mask is a dict keyed by layer type, the case the device-move patch exists for. Qwen 3
is the second ``layer_types`` family. Sizes are small so a CPU run takes seconds; ``scale``
makes them larger for the GPU figure, where a 2-layer toy would measure kernel launches only.
"""

from __future__ import annotations

from typing import Any

VOCAB = 128
PAD = 0


def gemma3(*, scale: int = 1, dtype: Any = None, seed: int = 0, layers: int | None = None):
    """``layers``: that many layers (sliding and full alternating) instead of ``2 * scale``."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    pairs = scale if layers is None else layers // 2
    config = Gemma3TextConfig(
        vocab_size=VOCAB * scale,
        hidden_size=64 * scale,
        intermediate_size=128 * scale,
        num_hidden_layers=2 * pairs,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16 * scale,
        max_position_embeddings=512,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * pairs,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _build(Gemma3ForCausalLM, config, dtype, seed)


def gemma3_deep(*, dtype: Any = None, seed: int = 0):
    """Gemma 3 with 8 layers of hidden size 512 (sliding + full alternating): large enough that a
    decoding step is mostly the model's own work, as in real use, not the 2-layer toy's Python."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=DEEP_LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=512,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * (DEEP_LAYERS // 2),
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _build(Gemma3ForCausalLM, config, dtype, seed)


DEEP_LAYERS = 8


def llama_config(*, layers: int = 2, attn_implementation: str = "sdpa"):
    """A tiny Llama config (hidden 64, 4 query heads, 2 KV heads of 16): the per-call figure's."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = attn_implementation
    return config


def qwen3(*, dtype: Any = None, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _build(Qwen3ForCausalLM, config, dtype, seed)


def _build(cls, config, dtype, seed):
    import torch

    torch.manual_seed(seed)
    model = cls(config).eval()
    if dtype is not None:
        model = model.to(dtype)
    return model


def left_padded_batch(*, prompt_len: int = 6, vocab: int = VOCAB, device: Any = "cpu"):
    """A batch of 2 prompts, the first left-padded by 2 tokens (what a tokenizer with
    ``padding_side="left"`` returns), as ``input_ids`` and ``attention_mask`` on ``device``."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab, (2, prompt_len), generator=generator)
    mask = torch.ones_like(ids)
    ids[0, :2] = PAD
    mask[0, :2] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def generate_kwargs(new_tokens: int, *, cache: str | None) -> dict[str, Any]:
    """Greedy, exactly ``new_tokens`` tokens (no early stop), eager (no torch.compile)."""
    kwargs: dict[str, Any] = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=PAD,
        disable_compile=True,
    )
    if cache is not None:
        kwargs["cache_implementation"] = cache
    return kwargs
