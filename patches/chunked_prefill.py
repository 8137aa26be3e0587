"""Chunked prefill (``prefill_chunk_size``) gives every chunk its rows' own position ids, starts
after the tokens a cache passed in already holds, hands decoding the right position, and on 5.0.0
works with the default cache: it generates what the same call without chunking generates.

What breaks, by release (all silent unless an error is named):
- 4.55.0 - 5.20.2: a cache that already holds a prefix. Every chunk loop starts at position 0, so
  the prefix is fed again: a dynamic cache holds it twice (22 entries instead of 16), other tokens.
  Fixed upstream in 5.21.0 (the chunks start at ``cache.get_seq_length()``).
- 4.55.0 - 5.0.0rc2: left-padded rows. Every chunk gets ``position_ids = cache_position`` for all
  rows, so a padded row's tokens are embedded too far (issue #43082, fixed by #43132 in 5.0.0rc3).
- 5.0.0rc1 - 5.2.0: the decode position. The chunked branch leaves ``cache_position = [P]`` and
  decoding advances it once more, so every token is written a slot late; a static cache overflows::

      IndexError: index_copy_(): index 20 is out of bounds for dimension 2 with size 20

  5.2.0 also hands every chunk the whole prompt's ``position_ids`` (the last chunk's ids win).
- 5.0.0rc1 - 5.0.0: the default cache. ``ValueError: Cannot use prefill chunking without a cache``.

What the replacement does:
- 4.55 - 4.57 (``_prefill_chunking``) and the release candidates' chunked branch: the chunk loop
  is re-implemented step for step as the release's, but sets no ``position_ids``: each chunk's
  ``prepare_inputs_for_generation`` derives them from its slice of the attention mask, which is
  exactly the slice an unchunked prefill uses (a caller's own ids are sliced per chunk).
- 5.0.0 - 5.2.0 (``_prefill``, wrapped): without chunking, the original alone. With it, the default
  cache key is provided when the model builds its own cache; the prompt's ``position_ids`` are held
  back from the chunks and put back after; ``cache_position`` becomes ``0 .. P-1``, the tensor an
  unchunked prefill leaves.
- A cache holding ``L > 0`` tokens, every release up to 5.20.2: the loop above runs from ``L`` (as
  5.21.0), and leaves the mask, position ids and ``cache_position`` as the release's unchunked
  prefill does (variant parameters ``prompt_repeats_the_cache``, ``cache_position_after``).

Cost: one attribute read per ``generate()`` call without chunking; with chunking, per call a
``get_seq_length()`` and an ``arange``, per chunk a ``cumsum`` of the mask slice. Nothing per step.

Not covered (stock behaviour kept): caller ``position_ids`` that are not the mask's, with several
chunks, on 5.0.0rc1 - 5.2.0; beam search on 4.55 - 4.57 (it does not chunk); onto a cache holding
tokens: encoder-decoder models, ``inputs_embeds`` and multimodal prompts, a cache holding the whole
prompt. Every case, its cause and the verification runs: ``docs/patches/chunked-prefill.md``;
tested in ``tests/patches/chunked_prefill/``.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "chunked-prefill"
MODULE = "transformers.generation.utils"
QUALNAME = "GenerationMixin._prefill"
#: The chunked prefill of 4.55.0 - 4.57.x (5.0.0rc1 folded it into ``_prefill``).
CHUNKING_QUALNAME = "GenerationMixin._prefill_chunking"

#: What ``overlay.report`` counts, one per ``generate()`` call that needed it.
CORRECTED_POSITION = "decoding continues at the prompt length after a chunked prefill"
DEFAULT_CACHE = "let the model build its default cache for a chunked prefill"
OWN_POSITION_IDS = "each chunk derives its own position ids"
MASK_POSITION_IDS = "each chunk's position ids follow its rows' attention mask (left padding)"
KEPT_CACHE = "the chunks start after the tokens the cache already holds"

# The stock text (4.55.0 - 5.20.2): the same ValueError where the release raises it.
_NO_CACHE = "Cannot use prefill chunking without a cache"
# The releases set this before chunking: flex attention is compiled even when the forward is not,
# and chunks of other lengths need more graphs than dynamo's default of 8.
_DYNAMO_CACHE_SIZE_LIMIT = 64


def _held_positions(model, model_kwargs) -> int:
    """How many positions the cache passed to ``generate()`` holds already: 0 for none, and for
    what the port leaves to the release (an encoder-decoder model, a prompt given as
    ``inputs_embeds``: the chunk loop splits ``input_ids`` only, on every release)."""
    cache = model_kwargs.get("past_key_values")
    if (
        cache is None
        or not hasattr(cache, "get_seq_length")
        or model.config.is_encoder_decoder
        or model_kwargs.get("inputs_embeds") is not None
    ):
        return 0
    return int(cache.get_seq_length())


def _prefill_in_chunks(model, prompt, generation_config, model_kwargs, eager_forward, *, skip=0, start=0,
                       cache_positions=True):
    """The chunk loop of the releases (the same steps in the same order), except for the position
    ids and where the chunks start.

    A chunk's position ids are left to ``prepare_inputs_for_generation``, which derives them from
    the chunk's slice of the attention mask as it does for an unchunked prefill (4.55.0 - 5.0.0rc2
    set ``arange(start, end)`` for every row, which ignores left padding); position ids the caller
    passed are sliced to the chunk instead (``[..., start:end]``, as 5.19.0 on do; 5.3.0 - 5.18.0
    slice the second dimension, the same for 2-D ids; the originals before overwrote them or, on
    5.2.0, handed them whole to every chunk). The chunks cover ``prompt[:, skip:]`` at
    positions ``start`` on: 5.21.0's loop onto a cache that holds ``start`` positions already
    (``skip``: how many of those the prompt repeats); the releases before it start at 0 whatever
    the cache holds. ``cache_positions``: each chunk gets its ``cache_position`` (up to 5.3.0).

    Puts the attention mask back; returns the last chunk's outputs, the position ids the caller
    passed (taken out of ``model_kwargs``) and the position after the last chunk.
    """
    import torch

    torch._dynamo.config.cache_size_limit = _DYNAMO_CACHE_SIZE_LIMIT
    chunks = torch.split(prompt[:, skip:] if skip else prompt, generation_config.prefill_chunk_size, dim=-1)
    if "past_key_values" not in model_kwargs:
        raise ValueError(_NO_CACHE)
    forward = eager_forward
    if model._valid_auto_compile_criteria(model_kwargs, generation_config):
        forward = model.get_compiled_call(generation_config.compile_config)

    attention_mask = model_kwargs.pop("attention_mask", None)
    given_position_ids = model_kwargs.pop("position_ids", None)
    outputs = None
    end = start
    for chunk in chunks:
        begin, end = end, end + chunk.shape[-1]
        if attention_mask is not None:
            model_kwargs["attention_mask"] = attention_mask[:, :end]
        if cache_positions:
            model_kwargs["cache_position"] = torch.arange(begin, end, dtype=torch.long, device=chunk.device)
        if given_position_ids is not None:
            model_kwargs["position_ids"] = given_position_ids[..., begin:end]
        outputs = forward(**model.prepare_inputs_for_generation(chunk, **model_kwargs), return_dict=True)
        model_kwargs["past_key_values"] = outputs.past_key_values

    model_kwargs["attention_mask"] = attention_mask
    return outputs, given_position_ids, end


def _record_mask_position_ids(model_kwargs) -> None:
    """Up to 5.0.0rc2: the chunks' position ids follow the mask where the originals' ignored it
    (not counted for a call that raises the release's ``ValueError`` without a cache)."""
    if (
        "past_key_values" in model_kwargs
        and model_kwargs.get("attention_mask") is not None
        and model_kwargs.get("position_ids") is None
    ):
        report.record_outside_compile(PATCH_ID, MASK_POSITION_IDS)


def _leave_as_the_early_loops_do(model_kwargs) -> None:
    """The state 4.55.0 - 5.2.0's chunk loops leave: ``cache_position`` one past the last chunk, no
    ``position_ids``."""
    model_kwargs["cache_position"] = model_kwargs["cache_position"][-1:] + 1
    model_kwargs.pop("position_ids", None)


def _replace_prefill_chunking(original, variant):
    # 4.55.0 - 4.57.x: called as model_kwargs = self._prefill_chunking(input_ids, generation_config,
    # **model_kwargs) by _sample only (beam search ignores prefill_chunk_size there), after
    # _get_initial_cache_position set cache_position to the prompt's uncached positions. The wrong
    # position ids are set inside the loop, between a chunk's slicing and its forward: no wrapper
    # reaches them, so the loop is re-implemented (_prefill_in_chunks), nothing else.

    @wraps(original)
    def _prefill_chunking(self, input_ids, generation_config, **model_kwargs):
        held = _held_positions(self, model_kwargs)
        if held >= input_ids.shape[-1]:  # the cache holds the whole prompt or more: as before (A)
            held = 0
        # The last prompt token is left to the decoding loop, as in the original; its forward is
        # the bound forward (no hooks), as in the original.
        prompt = input_ids[:, :-1]
        if held:
            report.record_outside_compile(PATCH_ID, KEPT_CACHE)
            if held == prompt.shape[-1]:  # nothing before the last token to prefill: as unchunked
                return model_kwargs
        _record_mask_position_ids(model_kwargs)
        _prefill_in_chunks(self, prompt, generation_config, model_kwargs, self.forward, skip=held, start=held)
        _leave_as_the_early_loops_do(model_kwargs)
        return model_kwargs

    return _prefill_chunking


def _replace_prefill(original, variant):
    # Every original (5.0.0rc1 - 5.20.2) takes (self, input_ids, generation_config, model_kwargs),
    # 5.3.0 on also is_first_iteration, and updates model_kwargs in place: the callers (_sample,
    # _beam_search) read it afterwards.
    chunks_ignore_padding = variant["chunks_ignore_padding"]
    decodes_one_late = variant["decodes_one_late"]
    repeats_the_cache = variant["prompt_repeats_the_cache"]
    cache_position_after = variant["cache_position_after"]

    @wraps(original)
    def _prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        if generation_config.prefill_chunk_size is None:
            return original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)

        held = _held_positions(self, model_kwargs)
        skip = held if held and repeats_the_cache(input_ids, generation_config, model_kwargs) else 0
        if held and input_ids.shape[-1] > skip:
            # A cache that holds tokens already (5.21.0's fix): chunk only what it does not hold,
            # from its length on, then leave what an unchunked prefill leaves.
            report.record_outside_compile(PATCH_ID, KEPT_CACHE)
            if chunks_ignore_padding:
                _record_mask_position_ids(model_kwargs)
            outputs, given_position_ids, end = _prefill_in_chunks(
                self, input_ids, generation_config, model_kwargs, self.__call__,
                skip=skip, start=held, cache_positions=cache_position_after is not None,
            )
            if given_position_ids is not None or not decodes_one_late:
                model_kwargs["position_ids"] = given_position_ids  # an unchunked prefill keeps them
            else:
                model_kwargs.pop("position_ids", None)
            if cache_position_after is not None:
                import torch

                first, last = cache_position_after(held, end)
                model_kwargs["cache_position"] = torch.arange(first, last, dtype=torch.long, device=input_ids.device)
            if decodes_one_late:
                report.record_outside_compile(PATCH_ID, CORRECTED_POSITION)
            return outputs

        if not decodes_one_late:  # 5.3.0 on: chunking onto an empty cache is right on stock
            return original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)

        if (
            "past_key_values" not in model_kwargs
            and model_kwargs.get("use_cache")
            and self._supports_default_dynamic_cache()
        ):
            # 5.0.0: no cache prepared for cache_implementation=None; the forward builds one.
            model_kwargs["past_key_values"] = None
            report.record_outside_compile(PATCH_ID, DEFAULT_CACHE)

        # Several chunks: each derives its own position ids from its slice of the attention mask
        # (prepare_inputs_for_generation), instead of taking the last len(chunk) of the whole
        # prompt's; decoding continues from the whole prompt's again, as without chunking.
        positions = model_kwargs.get("position_ids")
        if positions is not None and input_ids.shape[-1] > generation_config.prefill_chunk_size:
            del model_kwargs["position_ids"]
            report.record_outside_compile(PATCH_ID, OWN_POSITION_IDS)

        if chunks_ignore_padding:  # 5.0.0rc1 - rc2: the chunked branch is this loop, but for the ids
            _record_mask_position_ids(model_kwargs)
            outputs = _prefill_in_chunks(self, input_ids, generation_config, model_kwargs, self.__call__)[0]
            _leave_as_the_early_loops_do(model_kwargs)
        else:
            outputs = original(self, input_ids, generation_config, model_kwargs)

        if positions is not None:
            model_kwargs["position_ids"] = positions  # the original dropped them

        import torch

        left = model_kwargs["cache_position"]  # [P]: one past the last prompt position
        model_kwargs["cache_position"] = torch.arange(input_ids.shape[-1], dtype=left.dtype, device=left.device)
        report.record_outside_compile(PATCH_ID, CORRECTED_POSITION)
        return outputs

    return _prefill


# How each release tells whether the prompt repeats the tokens a cache passed to generate() holds
# (``Variant.params["prompt_repeats_the_cache"]``), as its unchunked prefill decides.


def _always(input_ids, generation_config, model_kwargs) -> bool:
    """Up to 5.2.0 the prompt is the whole sequence: the unchunked prefill takes its tokens at the
    positions after the cache's (``_get_initial_cache_position``)."""
    return True


def _when_as_long_as_the_mask(input_ids, generation_config, model_kwargs) -> bool:
    """5.3.0 on (``_prefill``): when the attention mask is as long as the prompt (5.18.0 on: or the
    length ``generate()`` recorded before dropping an all-ones mask); otherwise the prompt holds
    only the new tokens and the mask the whole sequence."""
    mask = model_kwargs.get("attention_mask")
    length = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", -1)
    return length == input_ids.shape[1]


# What ``cache_position`` an unchunked prefill leaves, for a cache that held ``held`` positions and
# a prompt that ends at ``end`` (``Variant.params["cache_position_after"]``; ``None``: from 5.4.0
# generate() keeps no cache_position and the chunks get none).


def _uncached_positions(held, end):
    """Up to 5.2.0 (``_get_initial_cache_position``): the positions after the cache's."""
    return held, end


def _every_position(held, end):
    """5.3.0 (``_get_initial_cache_position``): every position from 0."""
    return 0, end


#: 5.0.0rc1 - rc2 give every chunk ``arange`` position ids whatever the padding (issue 43082);
#: 5.0.0rc3 removed that line (and ships 5.0.0's ``_prefill``). Up to 5.2.0 the chunked branch also
#: leaves decoding one position late; 5.3.0 fixed that and the rest but for a cache holding tokens.
CHUNKS_IGNORE_PADDING = {
    "chunks_ignore_padding": True, "decodes_one_late": True,
    "prompt_repeats_the_cache": _always, "cache_position_after": _uncached_positions,
}
CHUNKS_FOLLOW_PADDING = {**CHUNKS_IGNORE_PADDING, "chunks_ignore_padding": False}
#: 5.3.0: the chunks start at 0 whatever the cache holds; generate() still tracks cache_position.
STARTS_AT_ZERO_WITH_CACHE_POSITION = {
    "chunks_ignore_padding": False, "decodes_one_late": False,
    "prompt_repeats_the_cache": _when_as_long_as_the_mask, "cache_position_after": _every_position,
}
#: 5.4.0 - 5.20.2: the same, without cache_position.
STARTS_AT_ZERO = {**STARTS_AT_ZERO_WITH_CACHE_POSITION, "cache_position_after": None}

PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="both",
    title="Chunked prefill (prefill_chunk_size) gives every chunk its own position ids, left padding "
    "included, continues decoding at the prompt length and starts after the tokens a cache passed in "
    "already holds; on 5.0.0 it works with the default cache",
    errors=(
        "IndexError: index_copy_(): index 20 is out of bounds for dimension 2 with size 20",
        "ValueError: Cannot use prefill chunking without a cache",
        "(no error) generate(prefill_chunk_size=N, past_key_values=cache) with a cache that already holds "
        "a prefix gives other tokens than without prefill_chunk_size; cache.get_seq_length() counts the "
        "prefix twice",
    ),
    why=(
        "Up to 5.20.2 the chunked prefill starts at position 0 whatever the cache passed in holds, so it "
        "writes a kept prefix into the cache a second time; up to 5.0.0rc2 it also gives every row of every "
        "chunk position ids counted from 0, ignoring left padding; from 5.0.0rc1 to 5.2.0 "
        "GenerationMixin._prefill's chunked branch also leaves cache_position one past the prompt, so every "
        "decoding step writes and reads one position late (and on 5.2.0 hands every chunk the whole "
        "prompt's position_ids); 5.0.0 prepares no cache for the default cache_implementation, which the "
        "chunked branch requires."
    ),
    upstream="fixed in {fixed_in} (GenerationMixin._prefill's chunked branch starts at "
    "cache.get_seq_length(); no pull request found); the decode position and the rest since 5.3.0 "
    "(_prefill's chunked branch rewritten); the chunks' position ids with left padding since 5.0.0rc3 "
    "(huggingface/transformers#43132, issue #43082); the default cache since 5.1.0 "
    "(GenerationMixin._prepare_cache_for_generation)",
    targets=(
        Target(
            module=MODULE,
            qualname=CHUNKING_QUALNAME,
            replace=_replace_prefill_chunking,
            optional=True,  # 5.0.0rc1 on: the chunked branch of _prefill
        ),
        Target(
            module=MODULE,
            qualname=QUALNAME,
            variants={
                "chunks_ignore_padding": CHUNKS_IGNORE_PADDING,
                "chunks_follow_padding": CHUNKS_FOLLOW_PADDING,
                "starts_at_zero_with_cache_position": STARTS_AT_ZERO_WITH_CACHE_POSITION,
                "starts_at_zero": STARTS_AT_ZERO,
            },
            replace=_replace_prefill,
            optional=True,  # before 5.0.0rc1: _prefill_chunking
        ),
    ),
    doctor=("chunked-prefill",),
)
