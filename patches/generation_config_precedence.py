"""The values a caller sets in the ``GenerationConfig`` it passes to ``generate()`` win over the
model's saved generation config, as on 5.0.0rc3 and later.

What breaks (4.55.0 - 5.0.0rc2), with no error: ``model.generate(**inputs,
generation_config=GenerationConfig(do_sample=False))`` on a model whose ``generation_config`` has
``do_sample=True`` (as many instruct checkpoints ship it, with ``temperature`` / ``top_p``) samples:
other tokens on every run, not the greedy ones. Up to 5.0.0rc1 any value set to the release's global
default is lost the same way (``num_beams=1``, ``temperature=1.0``, ``top_k=50``, ``top_p=1.0``,
``repetition_penalty=1.0``, ``max_length=20``, ...) when the model's config holds another, and
``generate()`` logs ``generation_config default values have been modified to match model-specific
defaults: {...}``; 5.0.0rc2 loses only the booleans (``do_sample=False`` among them), silently.

The cause: ``GenerationMixin._prepare_generation_config`` fills the caller's config from the model's
wherever the caller's value equals the global default (4.55 - 5.0.0rc1, for a model config saved
by 4.50 or later, unless ``use_model_defaults=False``), or, in 5.0.0rc2, wherever a boolean equals
its default; a value set to the default cannot be told from one never set. 5.0.0rc3 defaults every
generation parameter to ``None`` ("not set"), so only unset values come from the model.

What the replacement does (wrapping the original): the companion patch ``generation-config-set-keys``
(``patches/generation_config_set_keys.py``) records which keys a ``GenerationConfig``'s constructor
was given. When the caller's config has such a record, the original runs unchanged, then each
recorded key whose value the original changed is set back to the caller's value (a copy), except
keys passed to ``generate()`` as keyword arguments (applied last, they already win) and keys the
caller left ``None`` (unset, as on 5.0.0rc3). Values the caller did not set still come from the
model's config, as upstream intends. ``use_model_defaults=True`` (the caller asks for the model's
values everywhere) and ``False`` (nothing is taken from the model) go to the original alone.

Limits: what the record cannot know is stock: attributes assigned after construction
(``config.do_sample = False`` on ``GenerationConfig()``), ``update()``, ``copy.deepcopy`` / pickle copies,
configs built before the overlay applied, subclasses (Bark's); ``GenerationConfig(**other.to_dict())``
counts every key as set. Passing the values as ``generate()`` keyword arguments works on every
release. The warning above is still logged by the original and lists the restored keys too. Both
patches must be active (``ATTN_OVERLAY_DISABLE`` of either one leaves stock behaviour).

Cost: one dictionary lookup per ``generate()`` call; with a record, a comparison per recorded key
after the original. Nothing in the decoding loop. ``overlay.report`` counts the calls where a value
was set back. Cases, releases and the verification runs: ``docs/patches/generation-config-precedence.md``;
tested in ``tests/patches/generation_config_precedence/``.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

from .generation_config_set_keys import set_keys

PATCH_ID = "generation-config-precedence"
MODULE = "transformers.generation.utils"
ACTION = "kept the generation config values the caller set"


def _same(a, b) -> bool:
    # Values are plain data in practice; anything whose == is not a bool (a tensor) counts as the
    # same only when it is the same object, so nothing is ever restored on a doubtful comparison.
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return True


def make_prepare(original, variant):
    takes_flag = variant["takes_model_defaults_flag"]

    @wraps(original)
    def _prepare_generation_config(self, generation_config, *args, **kwargs):
        keys = set_keys(generation_config) if generation_config is not None else None
        if not keys:
            return original(self, generation_config, *args, **kwargs)
        if takes_flag and (args[0] if args else kwargs.get("use_model_defaults")) is not None:
            return original(self, generation_config, *args, **kwargs)
        prepared, model_kwargs = original(self, generation_config, *args, **kwargs)
        kept = False
        for key in keys:
            if key in kwargs:
                continue
            mine = getattr(generation_config, key, None)
            if mine is None or _same(getattr(prepared, key, None), mine):
                continue
            import copy

            setattr(prepared, key, copy.deepcopy(mine))
            kept = True
        if kept:
            report.record(PATCH_ID, ACTION)
        return prepared, model_kwargs

    return _prepare_generation_config


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="output",
    title="An explicit GenerationConfig passed to generate() keeps its values over the model's generation config",
    errors=(
        "(no error) generate(generation_config=GenerationConfig(do_sample=False)) samples when the model's "
        "generation config has do_sample=True",
        "`generation_config` default values have been modified to match model-specific defaults",
    ),
    why=(
        "Up to 5.0.0rc2 _prepare_generation_config copies the model's generation config over every value of "
        "the caller's config that equals the global default (5.0.0rc2: every boolean), so do_sample=False, "
        "num_beams=1 or temperature=1.0 set by the caller are replaced by the model's values."
    ),
    upstream=(
        "huggingface/transformers#42702 (in 5.0.0rc2, booleans still overwritten); generation parameters "
        "default to None, booleans included, in {fixed_in}"
    ),
    targets=(
        Target(
            module=MODULE,
            qualname="GenerationMixin._prepare_generation_config",
            variants={
                "model_defaults_flag": {"takes_model_defaults_flag": True},
                "bool_overwrite": {"takes_model_defaults_flag": False},
            },
            replace=make_prepare,
        ),
    ),
)
