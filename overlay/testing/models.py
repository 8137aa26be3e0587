"""Tiny randomly initialised models built from configs, and hand-made left-padded batches.

The one place tests, ``python -m overlay.doctor`` and the benchmarks get their models from: no
downloads, no tokenizer, seconds on a CPU. The kinds cover the code paths the patches care about:

``"gemma3"``
    ``Gemma3ForCausalLM`` with ``layer_types`` = sliding + full attention: the attention mask
    becomes a dict keyed by layer type, and caches get a sliding-window layer.
``"qwen3"``
    ``Qwen3ForCausalLM``: ``layer_types`` all full attention (still a mask dict), q/k norms.
``"llama"``
    ``LlamaForCausalLM``: no ``layer_types``, one plain mask tensor. The control model.
``"olmo2"``
    ``Olmo2ForCausalLM``: a Llama-like model whose own tensor-parallel plan gathers the k/v
    projections (``colwise_gather_output``), so every rank keeps every KV head.
``"t5"``
    ``T5ForConditionalGeneration``: the encoder-decoder (seq2seq) model; :func:`tiny_config`
    maps the shared size names onto T5's own (``d_model``, ``d_ff``, ``d_kv``, ``num_heads``).

Sizes: the defaults below (hidden 64, 4 query and 2 KV heads); a test that relies on other sizes
passes them as overrides (e.g. ``hidden_size=32, intermediate_size=64`` for head_dim 8).

Weights come from ``torch.manual_seed(seed)`` and transformers' own initialisation, always in
float32 on the CPU, then cast and moved: the same ``seed`` gives the same weights whatever the
``dtype`` and ``device`` asked for, so runs in different processes or on different devices are
comparable token for token.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "KINDS",
    "PAD_TOKEN_ID",
    "tiny_config",
    "tiny_model",
    "save_tiny_model",
    "left_padded_batch",
    "on_device",
    "greedy_ids",
    "hand_padded_batch",
    "tokens_and_logits",
    "cache_argument_name",
    "dynamic_cache",
    "static_cache",
    "cache_of_layers",
    "SEQ2SEQ_KINDS",
    "tiny_seq2seq",
    "seq2seq_outcome",
    "greedy_outcome",
    "user_static_cache",
]

#: Model kinds :func:`tiny_config` knows.
KINDS = ("gemma3", "qwen3", "llama", "olmo2", "t5")

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
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "t5": ("T5Config", "T5ForConditionalGeneration"),
}

# The shared size names -> T5Config's.
_T5_NAMES = {
    "hidden_size": "d_model",
    "head_dim": "d_kv",
    "intermediate_size": "d_ff",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
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
    ``sliding_window`` applies; the other kinds ignore ``sliding_window``. For ``"t5"`` the
    encoder and the decoder both have ``num_hidden_layers`` layers, there is no separate KV head
    count, and decoding starts from the pad token. ``overrides`` are passed to the config class
    as they are (e.g. ``base_model_tp_plan``, ``initializer_range``, ``per_layer_config``).
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
    if kind == "t5":
        # No KV head count, positions or bos; T5's default embedding tying; decoding starts at pad.
        for name in ("num_key_value_heads", "max_position_embeddings", "bos_token_id", "tie_word_embeddings"):
            del kwargs[name]
        kwargs.update(num_decoder_layers=num_hidden_layers, decoder_start_token_id=PAD_TOKEN_ID)
    if kind == "gemma3":
        kwargs.update(
            sliding_window=sliding_window,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_hidden_layers)],
            # The default (256) is sized for head_dim 256; keep the usual 1/sqrt(head_dim) scaling.
            query_pre_attn_scalar=hidden_size // num_attention_heads,
        )
    kwargs.update(overrides)
    if kind == "t5":  # T5's own names for the shared sizes
        kwargs = {_T5_NAMES.get(name, name): value for name, value in kwargs.items()}
    return config_class(**kwargs)


def tiny_model(
    kind: str,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    attn_implementation: str | None = "sdpa",
    *,
    seed: int = 0,
    config: Any = None,
    **config_overrides: Any,
):
    """A randomly initialised tiny model of ``kind``, in eval mode, on ``device``.

    ``dtype`` defaults to float32. ``config`` replaces :func:`tiny_config` (``config_overrides``
    go to :func:`tiny_config` otherwise). ``attn_implementation=None`` keeps the release's
    default (5.13's T5 has no sdpa). See the module documentation about ``seed``.
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
    if attn_implementation is not None:
        # Set on the config: the one spelling every 5.x release reads.
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


def save_tiny_model(directory: Any, kind: str, **config_overrides: Any) -> str:
    """Save :func:`tiny_model` of ``kind`` (float32, ``seed`` 0 unless given) with
    ``save_pretrained`` into ``directory``, for loaders that need a folder (tensor parallelism);
    returns the folder as a string. Call it before a process group exists: under an initialised
    group ``save_pretrained`` writes on rank 0 only."""
    import os

    directory = os.fspath(directory)
    tiny_model(kind, **config_overrides).save_pretrained(directory)
    return directory


def left_padded_batch(
    lengths: Sequence[int] = (6, 4),
    *,
    vocab_size: int = 128,
    pad_token_id: int = PAD_TOKEN_ID,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
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


def on_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """``batch`` with every value moved to ``device`` (a new dict)."""
    return {name: value.to(device) for name, value in batch.items()}


def tensor_devices(value: Any) -> set[str]:
    """The devices of every tensor in ``value``, at any depth of its dicts, lists and tuples (e.g.
    the keyword arguments a forward pre-hook sees: a per-layer-type mask dict included), as
    strings such as ``"cpu"`` or ``"fakeaccel:0"``."""
    import torch

    seen, stack = set(), [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            seen.add(str(item.device))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return seen


def generate_seeing_devices(model: Any, patch_id: str, **generate_kwargs: Any) -> dict[str, Any]:
    """One ``model.generate(**generate_kwargs)`` under :mod:`torch.no_grad`, recording what a
    device-placement test compares: ``ok`` and ``ids`` (on the host) or ``error`` (a
    ``RuntimeError``'s text), ``forward_devices`` (every device a tensor the model's forward was
    given sat on, sorted: :func:`tensor_devices` of its keyword arguments, as generate() passes
    them), and ``fired`` / ``actions`` (``overlay.report``'s count and actions for ``patch_id``
    over the call)."""
    import torch

    from overlay import report

    seen: set[str] = set()
    # Registered after any hook accelerate put on forward: sees what generate() passes.
    handle = model.register_forward_pre_hook(lambda _m, _a, kw: seen.update(tensor_devices(kw)), with_kwargs=True)
    report.reset()
    try:
        with torch.no_grad():
            out = model.generate(**generate_kwargs)
        result: dict[str, Any] = {"ok": True, "ids": out.cpu().tolist(), "forward_devices": sorted(seen)}
    except RuntimeError as err:
        result = {"ok": False, "error": str(err), "forward_devices": sorted(seen)}
    finally:
        handle.remove()
    result["fired"] = report.fired().get(patch_id, 0)
    result["actions"] = sorted(report.fired_actions().get(patch_id, {}))
    return result


def greedy_ids(
    model: Any, inputs: dict[str, Any], max_new_tokens: int, *, reuse_kept_cache: bool = False, **generate_kwargs: Any
) -> list[list[int]]:
    """Greedy ``generate()`` without gradients or torch.compile, pad id :data:`PAD_TOKEN_ID`;
    the sequences as lists of ids on the host. A static cache that releases up to 5.14.x keep on
    the model from an earlier call is dropped first, so every call starts clean; with
    ``reuse_kept_cache`` it stays, for tests of what generate() does with the cache it kept."""
    import torch

    if not reuse_kept_cache:
        vars(model).pop("_cache", None)
    kwargs: dict[str, Any] = dict(do_sample=False, disable_compile=True, pad_token_id=PAD_TOKEN_ID)
    kwargs.update(generate_kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, **kwargs)
    sequences = out.sequences if hasattr(out, "sequences") else out
    return sequences.cpu().tolist()


def greedy_outcome(model: Any, inputs: dict[str, Any], max_new_tokens: int, **generate_kwargs: Any) -> dict[str, Any]:
    """:func:`greedy_ids`, or what it raised, for tests that compare a stock failure with the
    overlay's ids: ``{"ok": True, "ids": ...}``, or ``{"ok": False, "type": <exception class
    name>, "error": <message>, "raised in": <the function the exception left from>}``."""
    import traceback

    try:
        return {"ok": True, "ids": greedy_ids(model, inputs, max_new_tokens, **generate_kwargs)}
    except Exception as exc:  # noqa: BLE001  (the tests read which one)
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return {"ok": False, "type": type(exc).__name__, "error": str(exc), "raised in": frame.name}


def hand_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: two rows of six, the first left-padded by two, written out
    by hand (the KV-cache tests' batch; its ids stay valid for any vocabulary of 15 or more)."""
    import torch

    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    return input_ids, (input_ids != PAD_TOKEN_ID).long()


def tokens_and_logits(model: Any, input_ids: Any, attention_mask: Any, new_tokens: int, **generate_kwargs: Any):
    """Greedy ``generate()`` (no torch.compile): the ``new_tokens`` generated ids and the logits of
    every step, stacked, for comparisons that must hold to the bit. Like :func:`greedy_ids` it
    drops a static cache an earlier call kept on the model (up to 5.14.x), so every call starts
    clean: a kept cache half-built by a failed call would fail this one."""
    import torch

    vars(model).pop("_cache", None)
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens, do_sample=False,
        disable_compile=True, return_dict_in_generate=True, output_logits=True, **generate_kwargs,
    )
    return out.sequences[:, -new_tokens:], torch.stack(out.logits)


def cache_argument_name(model: Any) -> str:
    """The keyword ``generate()``/``forward()`` take a cache by: ``"cache"`` from transformers
    5.24.0 on (the old name still works there, with a deprecation warning), ``"past_key_values"``
    before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# -- caches built the same way on every release ----------------------------------------------
# 4.55.x builds a cache's layers in its constructor from layer classes (``Cache(layer_classes,
# config, ..., max_batch_size, max_cache_len, device, dtype)``; static buffers allocated at once;
# ``DynamicCache`` takes no config); 4.56.0 on take layer objects (``Cache(layers=...)``), and
# static layers allocate lazily or through ``early_initialization``.


def dynamic_cache(config: Any = None):
    """``DynamicCache(config=config)`` where ``DynamicCache`` takes a config (4.56.0 on: sliding
    layers get sliding dynamic layers), a plain ``DynamicCache()`` on 4.55.x (whose constructor
    passes a config's sizes to its layers, which take none)."""
    import inspect

    from transformers import DynamicCache

    if config is not None and "config" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(config=config)
    return DynamicCache()


def static_cache(config: Any, batch_size: int, max_cache_len: int, dtype: Any, device: Any = "cpu"):
    """A ``StaticCache`` for ``config`` whose buffers exist already, in ``dtype`` on ``device``,
    as a user builds one ahead of ``generate()``: ``StaticCache(config=, max_cache_len=)`` then
    ``early_initialization(batch_size, config.num_key_value_heads, config.head_dim, dtype,
    device)`` (4.56.0 on); ``StaticCache(config=, max_batch_size=, max_cache_len=, dtype=,
    device=)`` on 4.55.x, whose constructor allocates them (with the same head count and size)."""
    from transformers import StaticCache

    if hasattr(StaticCache, "early_initialization"):
        cache = StaticCache(config=config, max_cache_len=max_cache_len)
        cache.early_initialization(batch_size, config.num_key_value_heads, config.head_dim, dtype, device)
        return cache
    return StaticCache(config=config, max_batch_size=batch_size, max_cache_len=max_cache_len, dtype=dtype, device=device)


def user_static_cache(config: Any, batch_size: int, max_cache_len: int, dtype: Any, device: Any = "cpu"):
    """A ``StaticCache`` for ``config`` as users build one ahead of ``generate()``:
    ``StaticCache(config=, max_cache_len=)``, whose layers allocate on their first write (4.56.0
    on: each layer takes its head count and head size from the keys and values written to it;
    ``batch_size``, ``dtype`` and ``device`` go unused); on 4.55.x, whose constructor allocates
    the buffers and needs them, :func:`static_cache`."""
    from transformers import StaticCache

    if hasattr(StaticCache, "early_initialization"):
        return StaticCache(config=config, max_cache_len=max_cache_len)
    return static_cache(config, batch_size, max_cache_len, dtype, device)


def cache_of_layers(layers: Sequence[Any]):
    """A bare ``Cache`` holding exactly ``layers`` (layer objects): ``Cache(layers=...)`` from
    4.56.0 on; on 4.55.x a ``Cache`` built with one ``DynamicLayer`` (no config, no processor)
    whose layer list and layer classes are then replaced by ``layers``."""
    import inspect

    from transformers import cache_utils

    if "layers" in inspect.signature(cache_utils.Cache.__init__).parameters:
        return cache_utils.Cache(layers=list(layers))
    cache = cache_utils.Cache(layer_classes=cache_utils.DynamicLayer)
    cache.layers[:] = list(layers)
    cache.layer_classes = [type(layer) for layer in layers]
    return cache


# -- encoder-decoder models whose decoder depth is their own (T5, BART) -----------------------------
# The encoder-decoder patches' tests (decoder-text-config-layers, encoder-decoder-cache-depth,
# encoder-decoder-dynamic-cache) build a decoder deeper or shallower than the encoder, and compare a
# stock failure with the overlay's ids on one batch.

#: Encoder-decoder kinds :func:`tiny_seq2seq` knows.
SEQ2SEQ_KINDS = ("t5", "bart")
#: Larger weights than the releases' defaults (T5's ``initializer_factor`` 1.0, BART's ``init_std``
#: 0.02), so a tiny model's greedy ids vary from step to step and comparisons tell runs apart.
T5_INITIALIZER_FACTOR = 8.0
BART_INIT_STD = 0.2
#: The tokens :func:`seq2seq_outcome` generates.
SEQ2SEQ_NEW_TOKENS = 6


def tiny_seq2seq(kind: str, encoder_layers: int = 2, decoder_layers: int = 2, *, seed: int = 0):
    """A randomly initialised tiny encoder-decoder model of ``kind`` (one of :data:`SEQ2SEQ_KINDS`)
    with ``encoder_layers`` and ``decoder_layers`` layers, float32 on the CPU, built as
    :func:`tiny_model` builds the other kinds: weights from ``seed``, eval mode, greedy, pad id
    :data:`PAD_TOKEN_ID`; the release's default attention (5.13's T5 has no sdpa).

    ``"t5"``: ``T5ForConditionalGeneration`` of :func:`tiny_config` ``("t5", num_hidden_layers=
    encoder_layers, num_decoder_layers=decoder_layers, initializer_factor=T5_INITIALIZER_FACTOR)``
    (hidden 64, 4 heads of 16, feed-forward 128, vocabulary 128; decoding starts at the pad token).
    ``"bart"``: ``BartForConditionalGeneration`` of ``BartConfig(vocab_size=128, d_model=32,
    encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_layers=, decoder_layers=, max_position_embeddings=64, init_std=BART_INIT_STD)``; its
    config keeps BART's own special ids (pad 1, bos 0, eos 2, decoding starts at 2): the attention
    mask, not the id, marks :func:`left_padded_batch`'s padding.

    Every lane from 4.55.4 to 5.25.0 accepts both configs, with any depths (a decoder deeper than
    its encoder included), and generates from them without a cache; whether a cached run does is
    what the encoder-decoder patches are about.
    """
    import transformers

    if kind == "t5":
        return tiny_model(
            "t5", attn_implementation=None, seed=seed, num_hidden_layers=encoder_layers,
            num_decoder_layers=decoder_layers, initializer_factor=T5_INITIALIZER_FACTOR,
        )
    if kind == "bart":
        config = transformers.BartConfig(
            vocab_size=128, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_layers=encoder_layers, decoder_layers=decoder_layers,
            max_position_embeddings=64, init_std=BART_INIT_STD,
        )
        return _built_like_tiny_model(
            transformers.BartForConditionalGeneration, config, seed=seed, attn_implementation=None
        )
    raise ValueError(f"unknown encoder-decoder kind {kind!r}; known: {', '.join(SEQ2SEQ_KINDS)}")


def seq2seq_outcome(model: Any, **generate_kwargs: Any) -> dict[str, Any]:
    """What one greedy run of ``model`` on the encoder-decoder tests' batch (:func:`left_padded_batch`
    of 7 and 5 tokens, ``seed`` 3) gives: ``{"ids": ...}`` (:func:`greedy_ids`,
    :data:`SEQ2SEQ_NEW_TOKENS` new tokens; ``generate_kwargs`` go there, ``reuse_kept_cache``
    too), or ``{"error": "<type>: <message>"}`` when it raises: the tests compare a stock failure
    with the overlay's ids and read which error it was."""
    run = greedy_outcome(model, left_padded_batch((7, 5), seed=3), SEQ2SEQ_NEW_TOKENS, **generate_kwargs)
    return {"ids": run["ids"]} if run["ok"] else {"error": f"{run['type']}: {run['error']}"}


# -- GPT-2: learned absolute position embeddings ------------------------------------------------
# Not one of KINDS: no KV head count, no layer types, its own config names. The architecture whose
# outputs show a wrong position most plainly (a position is an embedding added to the token's, no
# rotary angle that cancels between query and key).

#: The shared size names of :func:`tiny_config` -> GPT2Config's.
_GPT2_NAMES = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "intermediate_size": "n_inner",
    "max_position_embeddings": "n_positions",
}


def tiny_gpt2_config(
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    **overrides: Any,
):
    """A ``GPT2Config`` with :func:`tiny_config`'s sizes and special ids, under the shared names
    (mapped onto ``n_embd``, ``n_layer``, ``n_head``, ``n_inner``, ``n_positions``); ``overrides``
    are passed as they are (GPT-2's own names, ``initializer_range``...)."""
    import transformers

    sizes = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    kwargs: dict[str, Any] = {_GPT2_NAMES[name]: value for name, value in sizes.items()}
    kwargs.update(
        vocab_size=vocab_size, pad_token_id=PAD_TOKEN_ID, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID
    )
    kwargs.update(overrides)
    return transformers.GPT2Config(**kwargs)


def tiny_gpt2(
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    attn_implementation: str | None = "sdpa",
    *,
    seed: int = 0,
    **config_overrides: Any,
):
    """A randomly initialised tiny ``GPT2LMHeadModel`` from :func:`tiny_gpt2_config`
    (``config_overrides`` go there), built as :func:`tiny_model` builds the other kinds: float32
    weights from ``seed``, then cast and moved, eval mode, greedy, pad id :data:`PAD_TOKEN_ID`."""
    import torch
    import transformers

    config = tiny_gpt2_config(**config_overrides)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    model.to(dtype=dtype or torch.float32)
    model.to(device)
    model.eval()
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


# -- configs whose layers differ in head size or KV heads (Gemma 4 and its relatives) -------------
# Not among KINDS: their configs take Gemma 4's own names (`global_head_dim`,
# `num_global_key_value_heads`, per-layer inputs), and which of them exist depends on the release.
# From 5.15.0 their configs are heterogeneous (transformers' `integrations/heterogeneity`:
# `per_layer_config`); before, the same layers differ through the two global attributes.

#: Tiny heterogeneous kinds -> (configuration class, model class, text configuration class or
#: ``None`` when the configuration is the text one), by attribute name on the transformers package.
_HETEROGENEOUS_CLASSES = {
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", None),
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration", "Gemma4TextConfig"),
    "gemma4_unified_text": ("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM", None),
    "gemma4_unified": ("Gemma4UnifiedConfig", "Gemma4UnifiedForConditionalGeneration", "Gemma4UnifiedTextConfig"),
    "step3p7": ("Step3p7Config", "Step3p7ForConditionalGeneration", "Step3p7TextConfig"),
}
#: Every kind :func:`tiny_heterogeneous_config` knows (whether or not the installed release has it).
HETEROGENEOUS_KINDS = tuple(_HETEROGENEOUS_CLASSES)


def heterogeneous_kinds_installed() -> tuple[str, ...]:
    """The kinds of :data:`HETEROGENEOUS_KINDS` whose classes the installed transformers ships."""
    import transformers

    return tuple(
        kind
        for kind, names in _HETEROGENEOUS_CLASSES.items()
        if all(name is None or hasattr(transformers, name) for name in names)
    )


def tiny_heterogeneous_config(kind: str, *, kv_heads_per_layer: bool = False, **text_overrides: Any):
    """A tiny config of ``kind`` (one of :data:`HETEROGENEOUS_KINDS`) whose layers differ.

    The Gemma 4 kinds: hidden 32, 6 layers (full attention in the last one only), 4 query and 2
    KV heads of 8; the full-attention layers' heads are 16 wide (``global_head_dim``) and, with
    ``kv_heads_per_layer`` (``attention_k_eq_v``), 1 KV head (``num_global_key_value_heads``).
    ``step3p7``: the same sizes, sliding and full layers alternating, the sliding layers with 2
    query heads instead of 4 (``num_sliding_attention_heads``; its KV heads and head size are the
    same in every layer), a 1-layer vision tower. The multimodal kinds have their text config
    inside (``text_overrides`` go there); the Gemma 4 ones no vision or audio tower. No end of
    sequence token: every greedy run generates all the tokens it is asked for.
    """
    import transformers

    if kind not in _HETEROGENEOUS_CLASSES:
        raise ValueError(f"unknown heterogeneous kind {kind!r}; known: {', '.join(HETEROGENEOUS_KINDS)}")
    config_name, _, text_config_name = _HETEROGENEOUS_CLASSES[kind]
    missing = [name for name in (config_name, text_config_name) if name and not hasattr(transformers, name)]
    if missing:
        raise ValueError(f"transformers {transformers.__version__} has no {', '.join(missing)}: kind {kind!r} needs it")
    text: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=None,
    )
    if kind == "step3p7":
        text.update(
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(6)],
            sliding_window=4,
            num_sliding_attention_heads=2,
            mlp_layer_types=["dense"] * 6,
            moe_intermediate_size=16,
            share_expert_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
        )
    else:
        text.update(
            sliding_window=4,
            global_head_dim=16,
            num_global_key_value_heads=1,
            attention_k_eq_v=kv_heads_per_layer,
            tie_word_embeddings=True,
        )
        if kind in ("gemma4_text", "gemma4"):
            # Gemma 4's per-layer input embeddings (Gemma 4 Unified has none), kept tiny.
            text.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=128)
    text.update(text_overrides)
    if text_config_name is None:
        return getattr(transformers, config_name)(**text)
    text_config = getattr(transformers, text_config_name)(**text)
    if kind == "step3p7":
        vision = transformers.Step3p7VisionConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
        )
        return transformers.Step3p7Config(text_config=text_config, vision_config=vision)
    return getattr(transformers, config_name)(text_config=text_config)


def _built_like_tiny_model(model_class: Any, config: Any, *, seed: int, attn_implementation: str | None) -> Any:
    """``model_class(config)`` built as :func:`tiny_model` builds the other kinds: the attention
    implementation set on the config (unless ``None``), weights from ``seed``, float32 on the CPU,
    eval mode, greedy, pad id :data:`PAD_TOKEN_ID`."""
    import torch

    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_class(config)
    model.eval()
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def tiny_heterogeneous_model(kind: str, *, seed: int = 0, attn_implementation: str | None = "sdpa", **config_options: Any):
    """A randomly initialised float32 model of :func:`tiny_heterogeneous_config` (``config_options``
    go there) on the CPU, built as :func:`tiny_model` builds the other kinds: weights from
    ``seed``, eval mode, greedy, pad id :data:`PAD_TOKEN_ID`."""
    import transformers

    return _built_like_tiny_model(
        getattr(transformers, _HETEROGENEOUS_CLASSES[kind][1]), tiny_heterogeneous_config(kind, **config_options),
        seed=seed, attn_implementation=attn_implementation,
    )


# -- Gemma 3n: the last layers read another layer's keys and values (KV sharing) -----------------
# Not among KINDS: its config takes Gemma 3n's own names (per-layer inputs, AltUp, Laurel,
# activation sparsity). ``num_kv_shared_layers`` says how many of the last layers share (15 by
# default, 0: none); caches built from its config leave those layers out.


def tiny_gemma3n_config(*, num_kv_shared_layers: int = 0, **overrides: Any):
    """A tiny ``Gemma3nTextConfig``: hidden 32, 4 layers (sliding and full attention alternating,
    window 4), 4 query and 2 KV heads of 8, per-layer inputs of 8, no activation sparsity, the last
    ``num_kv_shared_layers`` layers sharing KV. No end of sequence token: every greedy run generates
    all the tokens it is asked for. ``overrides`` go to the config as they are. Every release from
    4.55 on accepts it."""
    import transformers

    kwargs: dict[str, Any] = dict(
        vocab_size=128,
        vocab_size_per_layer_input=128,
        hidden_size=32,
        hidden_size_per_layer_input=8,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        max_position_embeddings=64,
        num_kv_shared_layers=num_kv_shared_layers,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * 4,
        laurel_rank=4,
        altup_num_inputs=2,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=None,
    )
    kwargs.update(overrides)
    return transformers.Gemma3nTextConfig(**kwargs)


def tiny_gemma3n(*, seed: int = 0, attn_implementation: str | None = "sdpa", **config_options: Any):
    """A randomly initialised float32 ``Gemma3nForCausalLM`` of :func:`tiny_gemma3n_config`
    (``config_options`` go there) on the CPU, built as :func:`tiny_model` builds the other kinds:
    weights from ``seed``, eval mode, greedy, pad id :data:`PAD_TOKEN_ID`."""
    import transformers

    return _built_like_tiny_model(
        transformers.Gemma3nForCausalLM, tiny_gemma3n_config(**config_options), seed=seed, attn_implementation=attn_implementation
    )


# -- Llama 4 text: chunked attention layers (``attention_chunk_size``) ------------------------------
# Not among KINDS: its config takes Llama 4's own names (``intermediate_size_mlp``, experts,
# ``no_rope_layers``). A layer with RoPE is a chunked attention layer (``layer_types`` is derived
# from ``no_rope_layers``: 1 = RoPE = ``"chunked_attention"``, 0 = ``"full_attention"``), and
# ``no_rope_layer_interval`` makes every n-th layer a full attention one.


def tiny_llama4_config(*, attention_chunk_size: int = 8, **overrides: Any):
    """A tiny ``Llama4TextConfig``: hidden 64, 2 layers (the first chunked attention, chunks of
    ``attention_chunk_size``; the second full attention: ``no_rope_layer_interval=2``), 4 query and
    2 KV heads of 16, dense MLPs only (no MoE layer), the special ids of :func:`tiny_config`.
    ``overrides`` go to the config as they are. Every release from 4.55 on accepts it."""
    import transformers

    kwargs: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_chunk_size=attention_chunk_size,
        no_rope_layer_interval=2,
        num_local_experts=1,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        moe_layers=[],
        max_position_embeddings=256,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    kwargs.update(overrides)
    return transformers.Llama4TextConfig(**kwargs)


def tiny_llama4(*, seed: int = 0, attn_implementation: str | None = "sdpa", **config_options: Any):
    """A randomly initialised float32 ``Llama4ForCausalLM`` of :func:`tiny_llama4_config`
    (``config_options`` go there) on the CPU, built as :func:`tiny_model` builds the other kinds:
    weights from ``seed``, eval mode, greedy, pad id :data:`PAD_TOKEN_ID`."""
    import transformers

    return _built_like_tiny_model(
        transformers.Llama4ForCausalLM, tiny_llama4_config(**config_options), seed=seed, attn_implementation=attn_implementation
    )
