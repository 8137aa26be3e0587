"""Beam search takes the vocabulary width of a model whose output head differs from its config.

What breaks: ``generate(num_beams=N)`` (N > 1; beam sampling too) on a model whose logits are not
as wide as ``config.get_text_config().vocab_size`` fails at the first step with
``RuntimeError: shape '[1, 61440]' is invalid for input of size 63488``. Library models that reach
it with their default configs: CPM-Ant (4.55.0 - 5.15.1: a head ``prompt_types * prompt_length``
wider than the vocabulary), Ovis2 (4.56.0 - 5.0.0: the head takes the top-level vocabulary, the
text config another), and Inkling with ``unpadded_vocab_size`` set (5.14.0 - 5.17.0: the forward
drops the head's padding columns); so does any user model with a padded or narrowed head.

The cause: ``GenerationMixin._beam_search`` reads the width once, before its first step, from the
config (``MoshiDepthDecoder``, ``ImageGPTForCausalImageModeling`` and, from 4.57.1,
``BarkSemanticModel`` have class-name special cases), then reshapes the log-probs to
``(batch, num_beams * width)`` and splits the top-k indices into beam and token by it. Upstream
(the release after the last affected one, no pull request found) reads the width off the logits.

What the replacement does (it wraps ``_beam_search`` and leaves its loop as it is): the width of
the first logits is not known when the release reads it, so it is taken from the model: the
output head's rows (``get_output_embeddings()``, the model's ``lm_head``, a ``torch.nn.Linear``), narrowed to
the text config's ``unpadded_vocab_size`` where one is set (the columns Inkling's forward keeps).
Where that width equals the config's, the release runs untouched. Where it differs (every such
call fails on stock), the release's one read of ``self.config.get_text_config()`` in this call
and thread answers a view whose ``vocab_size`` is the head's width; the view is gone after that
read (instance attribute, removed in ``finally``; another thread's call reads the real config).
A forward hook, for the call only, checks the first logits against that width and raises a
``RuntimeError`` naming this patch if a model's forward cut its head's output to another width.

Limits: a model whose head is not a ``torch.nn.Linear`` named ``lm_head`` gets the release's read,
as does a special-cased class. A forward that narrows the head's output to exactly the config's width
(stock works) by any rule but ``unpadded_vocab_size`` gets that error instead of stock's run: no
library class does (``docs/surveys/beam-vocab-width.md`` compares head and logits of every
generative class). ``compute_transition_scores`` still reads the config's width, as upstream's does.
Cost: per beam search call one ``get_output_embeddings()`` and one ``get_text_config()``; nothing
per step, nothing for greedy search or sampling.

It wraps the same target as ``beam-search-recurrent-cache`` and sits under it (nothing runs between
its view and the release's read). Tested (``tests/patches/beam_search_logits_width/``); the full
account: docs/patches/beam-search-logits-width.md.
"""

from __future__ import annotations

import threading

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "beam-search-logits-width"
MODULE = "transformers.generation.utils"
ACTION = "beam search took the output head's width"
READ = "get_text_config"

_NOTHING = object()


class _TextConfigWithWidth:
    """The text config as the release's one read sees it: its own attributes, the head's width."""

    __slots__ = ("_text_config", "vocab_size")

    def __init__(self, text_config, vocab_size: int) -> None:
        self._text_config = text_config
        self.vocab_size = vocab_size

    def __getattr__(self, name):
        return getattr(self._text_config, name)


def logits_width(model, text_config) -> int | None:
    """The width of the logits ``model`` will give, from its output head (``None``: not known)."""
    import torch

    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(head, torch.nn.Linear):
        return None
    # The weight's rows, not out_features: a head tied to larger input embeddings (Ovis2 on
    # 5.0.0rc0 - rc3) keeps its declared out_features and gives the embeddings' width.
    width = head.weight.shape[0]
    if head is not getattr(model, "lm_head", None):  # an adaptive softmax's cluster (Transformer-XL)
        return None
    unpadded = getattr(text_config, "unpadded_vocab_size", None)
    if isinstance(unpadded, int) and 0 < unpadded < width:  # the forward drops the padding columns
        width = unpadded
    return width


class _ReadOnce:
    """For this thread, the next ``config.get_text_config()`` answers ``view``, once."""

    def __init__(self, config, view) -> None:
        self.config = config
        self.view = view
        self.owner = threading.get_ident()
        self.previous = vars(config).get(READ, _NOTHING)
        self.stock = getattr(config, READ)
        self.installed = self.read  # one bound method: restore() compares by identity

    def __enter__(self):
        vars(self.config)[READ] = self.installed
        return self

    def read(self, *args, **kwargs):
        if threading.get_ident() != self.owner or args or kwargs:
            return self.stock(*args, **kwargs)
        self.restore()
        return self.view

    def restore(self) -> None:
        if vars(self.config).get(READ) is self.installed:  # not yet read, or put back already
            if self.previous is _NOTHING:
                del vars(self.config)[READ]
            else:
                vars(self.config)[READ] = self.previous

    def __exit__(self, *exc) -> None:
        self.restore()


def _check_first_logits(width: int):
    checked: list[bool] = []

    def check(module, inputs, output):
        logits = getattr(output, "logits", None)
        if checked or logits is None:
            return
        checked.append(True)
        if logits.shape[-1] != width:
            raise RuntimeError(
                f"attn-overlay ({PATCH_ID}): the output head of {type(module).__name__} is {width} wide, "
                f"but its forward gave logits {logits.shape[-1]} wide; beam search cannot take its width "
                f"from the head. Turn this patch off for this model: ATTN_OVERLAY_DISABLE={PATCH_ID}"
            )

    return check


def _replace_beam_search(original, variant):
    special_cases = frozenset(variant["special_cases"])

    @wraps(original)
    def _beam_search(self, *args, **model_kwargs):
        if self.__class__.__name__ in special_cases:
            return original(self, *args, **model_kwargs)  # the release reads these widths itself
        config = self.config
        text_config = config.get_text_config()
        width = logits_width(self, text_config)
        if width is None or width == getattr(text_config, "vocab_size", None):
            return original(self, *args, **model_kwargs)
        report.record_outside_compile(PATCH_ID, ACTION)
        handle = self.register_forward_hook(_check_first_logits(width))
        try:
            with _ReadOnce(config, _TextConfigWithWidth(text_config, width)):  # the release's read, next
                return original(self, *args, **model_kwargs)
        finally:
            handle.remove()

    return _beam_search


_TWO_CASES = ("MoshiDepthDecoder", "ImageGPTForCausalImageModeling")

PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="errors",
    title="Beam search takes the vocabulary width of a model whose output head differs from its config",
    errors=(
        "RuntimeError: shape '[1, 61440]' is invalid for input of size 63488 (generate(num_beams=N), "
        "in _beam_search's torch.reshape(log_probs, (batch_size, num_beams * vocab_size)))",
    ),
    why=(
        "GenerationMixin._beam_search reads the vocabulary width from the config before its first step, "
        "so logits of another width (CPM-Ant, Ovis2, Inkling's unpadded vocabulary, a padded head) cannot "
        "be reshaped to it."
    ),
    upstream="fixed in {fixed_in}: _beam_search reads the width off the log-probs (no pull request found)",
    targets=(
        Target(
            module=MODULE,
            qualname="GenerationMixin._beam_search",
            replace=_replace_beam_search,
            variants={
                "moshi_imagegpt_cases": {"special_cases": _TWO_CASES},
                "moshi_imagegpt_bark_cases": {"special_cases": (*_TWO_CASES, "BarkSemanticModel")},
            },
        ),
    ),
)
