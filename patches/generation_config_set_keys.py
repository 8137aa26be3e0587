"""``GenerationConfig(...)`` remembers which values its caller gave it: the half of
``generation-config-precedence`` (``patches/generation_config_precedence.py``) that lives in
``transformers.generation.configuration_utils`` (the engine patches one module per patch).

What it serves (4.55.0 - 5.0.0rc2): ``model.generate(generation_config=GenerationConfig(do_sample=False))``
on a model whose saved generation config says ``do_sample=True`` samples anyway, without an error:
``generate()`` fills in the model's values wherever the caller's config holds the release's global
default, and a value the caller set to that default (``do_sample=False``, ``num_beams=1``,
``temperature=1.0``, ``top_k=50``, ...) cannot be told from one never set. 5.0.0rc3 makes these
defaults ``None`` ("not set"), so the question answers itself there; before, nothing on the object
says what its caller set, and this patch keeps that fact.

What the replacement does: ``GenerationConfig.__init__`` runs as before, then, for a config of
exactly that class built with keyword arguments, records their names (metadata such as
``transformers_version`` and private ``_`` keys left out) in a registry of this module keyed by the
object's identity and held through a weak reference: nothing is added to the object, so
``to_dict()``, ``to_json_string()``, ``save_pretrained``, ``==`` and ``hash()`` (and the
``_original_object_hash`` the legacy path compares) are exactly stock. :func:`set_keys` reads it;
``_prepare_generation_config`` (the other patch) keeps those values over the model's.

Limits: only what goes through the constructor is known: ``GenerationConfig(...)``, and
``from_dict`` / ``from_pretrained`` (they construct with the file's keys). An attribute assigned
afterwards (``config.do_sample = False``), ``update()``, a ``copy.deepcopy`` or pickle of a config
(the copy is built without ``__init__``), and a config built before the overlay was applied, carry no
record: for them ``generate()`` behaves as stock. ``GenerationConfig(**other.to_dict())`` records
every key, so no value of it is taken from the model. Subclasses (Bark's) are left alone: their
constructors pass their own defaults up, which are not their caller's choice.

Cost: one ``frozenset`` and one weak reference per config built with arguments (``generate()`` itself
builds argument-less ones: nothing recorded); nothing on the decoding path. Nothing is reported
here: the record changes no behaviour by itself. Tested with the other half, in
``tests/patches/generation_config_precedence/``; the account is ``docs/patches/generation-config-precedence.md``.
"""

from __future__ import annotations

import weakref

from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "generation-config-set-keys"
MODULE = "transformers.generation.configuration_utils"

#: ``id(config) -> (weak reference to it, the names its constructor was given)``. Keyed by identity:
#: ``GenerationConfig`` hashes and compares by content, which changes, so a weak-key dictionary
#: would lose or confuse entries.
_SET_KEYS: dict[int, tuple[weakref.ref, frozenset]] = {}

#: Keys of a serialised config that say where it came from, not how to generate.
_METADATA = frozenset({"transformers_version"})


def _forget(key: int, ref: weakref.ref) -> None:
    # The identity may already name a newer config whose entry replaced this one.
    entry = _SET_KEYS.get(key)
    if entry is not None and entry[0] is ref:
        del _SET_KEYS[key]


def set_keys(config) -> frozenset:
    """The generation parameters ``config``'s constructor was given (empty where nothing is known:
    see the module's limits)."""
    entry = _SET_KEYS.get(id(config))
    if entry is None or entry[0]() is not config:
        return frozenset()
    return entry[1]


def make_init(original, variant):
    module_name = original.__module__

    @wraps(original)
    def __init__(self, **kwargs):
        keys = frozenset(key for key in kwargs if not key.startswith("_") and key not in _METADATA)
        original(self, **kwargs)
        cls = type(self)
        if keys and cls.__qualname__ == "GenerationConfig" and cls.__module__ == module_name:
            key = id(self)
            _SET_KEYS[key] = (weakref.ref(self, lambda ref, key=key: _forget(key, ref)), keys)

    return __init__


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="output",
    title="GenerationConfig(...) remembers the values its caller set (used by generation-config-precedence)",
    errors=(
        "(no error) generate(generation_config=GenerationConfig(do_sample=False)) samples when the model's "
        "generation config has do_sample=True",
    ),
    why=(
        "Up to 5.0.0rc2 GenerationConfig's defaults are real values (do_sample=False, num_beams=1, "
        "temperature=1.0, ...), so a value set to the default cannot be told from one never set."
    ),
    upstream="huggingface/transformers#42702 (generation parameters default to None), in {fixed_in}",
    targets=(
        Target(module=MODULE, qualname="GenerationConfig.__init__", replace=make_init),
    ),
)
