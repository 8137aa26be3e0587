"""The benchmarks' models and batches, built with the test kit (``overlay.testing.models``).

Gemma 3 (``layer_types`` sliding + full) is the model every figure uses: with a static cache its
attention mask is a dict keyed by layer type, the case the device-move patch exists for. Qwen 3
is the second ``layer_types`` family. Sizes are small so a CPU run takes seconds; ``scale``
makes them larger for the GPU figure, where a 2-layer toy would measure kernel launches only.
"""

from __future__ import annotations

from typing import Any

from overlay.testing.models import PAD_TOKEN_ID as PAD
from overlay.testing.models import left_padded_batch as _kit_batch
from overlay.testing.models import tiny_config, tiny_model

VOCAB = 128
DEEP_LAYERS = 8


def gemma3(*, scale: int = 1, dtype: Any = None, seed: int = 0, layers: int | None = None):
    """``layers``: that many layers (sliding and full alternating) instead of ``2 * scale``."""
    pairs = scale if layers is None else layers // 2
    return tiny_model(
        "gemma3", dtype, seed=seed, vocab_size=VOCAB * scale, hidden_size=64 * scale,
        intermediate_size=128 * scale, num_hidden_layers=2 * pairs, max_position_embeddings=512, sliding_window=8,
    )


def gemma3_deep(*, dtype: Any = None, seed: int = 0):
    """Gemma 3 with 8 layers of hidden size 512 (sliding + full alternating): large enough that a
    decoding step is mostly the model's own work, as in real use, not the 2-layer toy's Python."""
    return tiny_model(
        "gemma3", dtype, seed=seed, vocab_size=1024, hidden_size=512, intermediate_size=1536,
        num_hidden_layers=DEEP_LAYERS, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=512, sliding_window=16,
    )


def llama_config(*, layers: int = 2, attn_implementation: str = "sdpa"):
    """A tiny Llama config (hidden 64, 4 query heads, 2 KV heads of 16): the per-call figure's."""
    config = tiny_config("llama", num_hidden_layers=layers, max_position_embeddings=4096)
    config._attn_implementation = attn_implementation
    return config


def qwen3(*, dtype: Any = None, seed: int = 0):
    """Qwen 3 with a sliding and a full layer (``layer_types``)."""
    config = tiny_config(
        "qwen3", max_position_embeddings=512, layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True, max_window_layers=1,
    )
    config.sliding_window = 8  # tiny_config applies its sliding_window to Gemma 3 only
    return tiny_model("qwen3", dtype, seed=seed, config=config)


def left_padded_batch(*, prompt_len: int = 6, vocab: int = VOCAB, device: Any = "cpu"):
    """A batch of 2 prompts, the first left-padded by 2 tokens (what a tokenizer with
    ``padding_side="left"`` returns), as ``input_ids`` and ``attention_mask`` on ``device``."""
    batch = _kit_batch((prompt_len - 2, prompt_len), vocab_size=vocab, seed=1234)
    return {name: tensor.to(device) for name, tensor in batch.items()}


def generate_kwargs(new_tokens: int, *, cache: str | None) -> dict[str, Any]:
    """Greedy, exactly ``new_tokens`` tokens (no early stop), eager (no torch.compile)."""
    kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    kwargs.update(do_sample=False, pad_token_id=PAD, disable_compile=True)
    if cache is not None:
        kwargs["cache_implementation"] = cache
    return kwargs
