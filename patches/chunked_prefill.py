"""Chunked prefill (``prefill_chunk_size``) gives every chunk the position ids of its rows (left
padding included), starts after the tokens a cache passed in already holds, hands decoding the
right position, and on 5.0.0 works with the default cache.

What breaks (transformers 4.55.0 - 5.20.2): a cache that already holds tokens. A user runs a
prefix through the model into their own cache, then calls ``generate(prefix + continuation,
past_key_values=cache, prefill_chunk_size=N)``. Every chunk loop (below) starts at position 0
whatever the cache holds: its chunks feed the whole prompt again, with positions and mask slices
counted from 0. No error. A dynamic cache appends them: the prefix twice (22 entries instead of 16
for a 6-token prefix, a 12-token prompt, 5 new tokens) and other tokens; so does a static cache
from 5.4.0 (no ``cache_position``: a layer writes after what it holds) and a sliding static layer
from 4.56.0 (it counts what it is given). Up to 5.3.0 a static full-attention layer is written at
the chunks' own positions, over the prefix, with the same values: twice the prefill's work, and
the tokens right unless another bug below hits. 5.3.0 on also take a prompt of the new tokens only
(with the whole sequence's attention mask); the chunks then get the prefix's positions: other
scores. Without chunking every release is right (its prefill takes the tokens after
``cache.get_seq_length()``). 5.21.0 fixed it upstream: ``_prefill``'s chunked branch slices the
prompt with ``next_sequence_length`` and starts at ``cache.get_seq_length()``.

What breaks (transformers 4.55.0 - 5.0.0rc2): left-padded rows. The chunk loop (4.55.0 - 4.57.x
``GenerationMixin._prefill_chunking``, 5.0.0rc1 - rc2 the chunked branch of
``GenerationMixin._prefill``) sets every chunk's ``position_ids`` to ``cache_position.unsqueeze(0)``:
``start .. end-1`` for every row of the batch. A row padded on the left by ``k`` tokens has its
tokens embedded ``k`` positions too far (rotary or learned positions), while the last prompt token
and every decoded one (4.55 - 4.57 run them outside the chunks) get their positions from the
attention mask, as without chunking. No error: the padded rows generate other tokens than an
unchunked run, whatever the cache (static, dynamic, default); rows without padding are right (a
tiny Qwen3, a batch of two with the second row padded by 3, chunk 3: the second row's tokens
differ from the second one on, the first row's are the unchunked run's). 4.55.0 - 4.57.x chunk
only greedy search and sampling (``_sample``): beam search ignores ``prefill_chunk_size`` there.
Upstream issue #43082; 5.0.0rc3 removed the line (pull request #43132), leaving the ids to
``prepare_inputs_for_generation``.

What breaks (transformers 5.0.0rc1 - 5.2.0): the decode position. ``generate(...,
prefill_chunk_size=N)`` runs ``GenerationMixin._prefill``, whose chunked branch feeds the whole
prompt to the model chunk by chunk (positions ``0 .. P-1`` for a prompt of ``P`` tokens, all written
to the cache) and then leaves ``model_kwargs["cache_position"]`` holding ``[P]``: the last chunk's
last position plus one. The decoding loop treats the prefill as a step already taken and advances
that once more (``_update_model_kwargs_for_generation``: ``cache_position[-1:] + 1``), so the first
generated token is written at ``P + 1`` instead of ``P`` and every later one a slot late. With
``cache_implementation="static"`` (the cache holds ``max_length - 1`` slots) the last step writes
past the end::

    IndexError: index_copy_(): index 20 is out of bounds for dimension 2 with size 20

(prompt 17 tokens, ``max_new_tokens=4``, chunk 8; beam search too). With a larger cache (a
user-built ``StaticCache(max_cache_len=64)``), and with a dynamic cache for a model with
sliding-window layers (Gemma 3), nothing fails but the output is silently wrong: rotary positions
are shifted by one and attention sees an unwritten (zero) slot of a static cache; the
sliding-window mask is off by one. A prefill without chunking leaves ``cache_position =
arange(P)``, which the same update advances to ``P``: right. (4.55 - 4.57 prefill only ``P - 1``
tokens in chunks and leave ``[P - 1]``, which the loop's first step uses as it is: right.)

5.2.0 also: ``generate()`` now prepares ``position_ids`` for the whole prompt before the prefill
(``_prepare_position_ids_for_generation``), and the chunked branch passes them whole to every
chunk; ``prepare_inputs_for_generation`` keeps the last ``len(chunk)`` of them, so every chunk but
the last is embedded at the last chunk's positions (silently wrong output, whatever the cache).

5.0.0rc1 - 5.0.0 also: with the default cache (no ``cache_implementation``, no cache passed) the
chunked branch refuses to start::

    ValueError: Cannot use prefill chunking without a cache

``_prepare_cache_for_generation`` of those releases puts no cache into ``model_kwargs`` when
``cache_implementation`` is ``None`` (the model's forward builds its default cache on the first
call), and the chunked branch asks for the key before any chunk runs. 5.1.0 creates the default
cache in ``_prepare_cache_for_generation`` whenever a cache is used, so the key is always there.
5.3.0 fixed the rest upstream (``_prefill``'s chunked branch rewritten), but for a cache that
holds tokens (above).

What the replacement does.

A. 4.55.0 - 4.57.x (``_prefill_chunking``) and the chunked branch of 5.0.0rc1 - rc2
(``_prefill``, variant parameter ``chunks_ignore_padding``): the chunk loop runs in
``_prefill_in_chunks``, a re-implementation of the originals' few lines (their wrong ids are set
inside the loop, between a chunk's slicing and its forward: no wrapper reaches them). Every step
is the original's, in its order (dynamo's cache size limit, ``torch.split``, the same
``ValueError`` without a cache, the compiled forward where the release would compile, the bound
``forward`` on 4.55 - 4.57 and ``__call__`` on the release candidates, the attention mask sliced
to the end of the chunk, ``cache_position = arange(start, end)``, the cache handed on, the state
left after the loop) but one: no ``position_ids`` for the chunk. ``prepare_inputs_for_generation``
then derives them from the chunk's slice of the attention mask (cumulative sum minus one, padding
set to 1, the last ``len(chunk)`` kept), as 5.0.0rc3 - 5.1.0 do: the slice of the ids an unchunked
prefill gets from the whole mask (a cumulative sum over a prefix of the mask is the prefix of the
cumulative sum). Exact, for every model whose ``forward`` takes ``position_ids``; one that does not
builds its own from ``cache_position``, which is what it gets without chunking. Without an
attention mask the model falls back on ``cache_position``: ``start .. end-1``, the original's ids.
Position ids the caller passed to ``generate()`` are sliced to each chunk (``[..., start:end]``:
what an unchunked prefill uses of them; the originals overwrote them) and dropped afterwards, as
the originals drop them. The rest of 4.55 - 4.57 stays stock: the last prompt token is left to
the decoding loop, which gets ``cache_position = [P - 1]`` as from the original.

B. 5.0.0rc1 - 5.2.0 (``_prefill``): it wraps ``_prefill`` (on 5.0.0 - 5.2.0 no copied code; on the
release candidates the chunked branch is A). Without ``prefill_chunk_size`` it calls the original
and returns: nothing else happens. With it, onto an empty cache (or none; else C):

1. Before the call, only when ``model_kwargs`` has no ``past_key_values`` while the generation
   uses a cache (``use_cache``) the model builds by default (``_supports_default_dynamic_cache()``):
   it sets ``model_kwargs["past_key_values"] = None``. Exact: ``prepare_inputs_for_generation``
   takes ``past_key_values=None`` by default, so every chunk's forward receives what it would have
   received without the key; only the branch's membership test sees a difference. The first
   chunk's forward builds the model's own default cache, as a non-chunked 5.0.0 call does, and the
   branch hands it to the next chunks and to decoding (it stores ``outputs.past_key_values`` after
   each chunk). On 5.1.0 - 5.2.0 this never happens inside ``generate()``: their
   ``_prepare_cache_for_generation`` has put a cache there under exactly this condition (and on
   5.0.0 ``cache_implementation`` set, a user cache, ``use_cache=False``, a model with its own
   cache type all leave things as they are). It is a property of the call, not of the release
   number, so no variant parameter is needed (``_prefill`` is the same code on 5.0.0 and 5.1.0).
2. Before the call, when ``model_kwargs`` holds ``position_ids`` and the prompt is longer than one
   chunk, it takes them out for the chunks. Each chunk's ``prepare_inputs_for_generation`` then
   derives its own from its slice of the attention mask (``attention_mask[:, :end of chunk]``; on
   5.2.0 cumulative sum minus one, padding set to 0, the last ``len(chunk)`` kept): the slice of
   the whole prompt's ids that belongs to the chunk. Exact for the ids 5.2.0's ``generate()`` prepares
   itself: ``_prepare_position_ids_for_generation`` computes them from the whole mask with the same
   formula, and a cumulative sum over a prefix of the mask is the prefix of the cumulative sum.
   After the call it puts the whole prompt's ids back (the original drops them), so decoding
   advances from them exactly as after a non-chunked prefill, which keeps them.
3. After the call returns, it replaces ``model_kwargs["cache_position"]`` with every position the
   chunks wrote: ``0 .. P-1`` (``P = input_ids.shape[-1]``: ``torch.split`` along the last
   dimension, positions counted from 0 chunk after chunk), in the dtype and on the device of the
   tensor the original left (``long``, the device of ``input_ids``, where the chunks' positions
   were made). Exact: that is the very tensor the non-chunked branch leaves for a prompt written
   from position 0 (``ones(P).cumsum(0) - 1``, ``int64``, ``input_ids``' device), so the decoding
   loop continues exactly as after a non-chunked prefill: with a cache it reads the last element
   (``P - 1``) and decodes at ``P``, ``P + 1``, ...; with ``use_cache=False`` and a cache passed
   by the user it appends to the full list, as after a non-chunked prefill. Nothing else the
   original left is touched (the attention mask it put back, the cache, the logits it returns).

C. A cache that already holds ``L > 0`` positions (``get_seq_length()``), every release up to
5.20.2, ``prefill_chunk_size`` set: the chunk loop of A runs as 5.21.0's, instead of the original's
(``_prefill`` on 5.0.0rc1 - 5.20.2 is then not called; 5.3.0 - 5.20.2 call it onto an empty cache,
where their chunking is right). The chunks cover the prompt after its first ``L`` tokens (the
whole prompt where it holds only the new tokens: 5.3.0 on, when the attention mask is not as long
as the prompt, by the release's own rule, variant parameter ``prompt_repeats_the_cache``) at
positions ``L ..``: each with the mask up to its end, its slice of the position ids passed
(``[..., start:end]``, as 5.19.0 on slice them), or, where none were passed (up to 5.1.0), the ids
``prepare_inputs_for_generation`` derives from the mask. Afterwards it leaves what the release's
unchunked prefill leaves: the mask and the position ids whole, and ``cache_position`` as that
release's ``_get_initial_cache_position`` makes it (``L .. P-1`` up to 5.2.0, ``0 .. P-1`` on
5.3.0, none from 5.4.0: variant parameter ``cache_position_after``); 4.55 - 4.57 leave
``[P - 1]`` and the last token to the decoding loop as in A (with ``L = P - 1`` there is nothing
to chunk, and decoding starts as without chunking).

Cost: one attribute read per ``generate()`` call without chunking (4.55 - 4.57: none, the target
runs only with chunking); with chunking, per call one ``get_seq_length()`` of the cache passed
(what the unchunked prefill reads too) and one ``arange`` of the prompt length (up to 5.3.0), per
chunk one ``cumsum`` of the mask's slice inside ``prepare_inputs_for_generation`` (4.55 -
5.0.0rc2, or where no position ids were passed: instead of an ``unsqueeze``). Nothing per
decoding step.

Not covered (stock behaviour kept, on these releases as shipped): ``position_ids`` of the user's
own that are not the attention mask's (packed sequences...) together with a prompt of several
chunks on 5.0.0rc1 - 5.2.0: the chunks get the mask's positions (stock gives every chunk the last
chunk's, or ``arange``), decoding continues from the user's; beam search on 4.55 - 4.57, which
does not chunk; onto a cache that holds tokens: encoder-decoder models and prompts given as
``inputs_embeds`` (every chunk loop, 5.21.0's too, splits ``input_ids`` only), multimodal inputs
(5.23.0 splits them per chunk), and a cache that holds the whole prompt or more (as before this
port: A and B up to 5.2.0, the release's code from 5.3.0). 5.0.0rc3 ships 5.0.0's ``_prefill``
(the same fingerprint, labelled by release number); 5.0.0rc0 was not fingerprinted, nor any
release before 4.55.0: code the patch does not know is "unrecognised" or out of range, never
patched.

Tested (``tests/patches/chunked_prefill/test_patch_chunked_prefill.py``, in the lanes 4.55.4, 4.57.6, 5.0.0, 5.2.0,
5.18.0, and by hand in 4.56.2, 5.0.0rc1 and rc2 environments): tiny Llama and Gemma 3, a 17-token
prompt in a batch of two (left-padded and without padding), chunk 8, static (greedy and beam
search), user-built static, dynamic and default caches; and a left-padded batch on every
architecture of ``overlay.testing.models`` that decodes (Llama, Qwen3, Gemma 3, OLMo2) and GPT-2
(learned absolute positions), static and default caches: stock fails or differs where stated above
(the padded row's tokens, up to 5.0.0rc2); with the patch every chunked run gives the non-chunked
run's ids, scores and logits, and every forward sees the same ``cache_position`` and
``position_ids``. The kept cache (``tests/patches/chunked_prefill/test_patch_chunked_prefill_kept_cache.py``, in the lanes
4.55.4, 4.57.6, 5.0.0, 5.2.0, 5.3.0, 5.5.4, 5.9.0, 5.10.4, 5.20.2, 5.21.0, 5.24.0): tiny Llama,
Qwen3 and Gemma 3, a 6-column prefix run into a user's dynamic or static cache, then a 12-column
batch of two (left-padded and without padding), chunk 4: stock feeds the prefix again (or, for a
prompt of new tokens only, at the prefix's positions) and differs as stated above; with the patch
every chunked run gives the unchunked run's ids, scores, logits, cache length and position ids.
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
    upstream="fixed in transformers 5.21.0 (GenerationMixin._prefill's chunked branch starts at "
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
