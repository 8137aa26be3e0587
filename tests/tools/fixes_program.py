"""The two calls issue 40's "done when" names, as functions (for tests in this process) and as a
program (for ``python -m overlay.apply --compare``): prints one line per call, the same on every run
of the same settings (seeded), so that stock and overlay runs can be compared line by line.

- ``precedence``: ``generate(generation_config=GenerationConfig(do_sample=False))`` on a tiny random
  Llama whose own generation config says ``do_sample=True`` (as instruct checkpoints ship it). Stock
  4.55.0 - 5.0.0rc2 samples (patch ``generation-config-precedence``, declared ``output``); the fixed
  releases, and the overlay with every fix, give the greedy ids.
- ``kv-cache-dtype``: a float32 ``StaticCache`` passed to a bfloat16 model's ``generate()``. Stock
  raises (``index_copy_``: self and source dtypes differ); patch ``kv-cache-dtype`` (declared
  ``errors``) makes it generate.

Run: ``python tests/tools/fixes_program.py [precedence] [kv-cache-dtype] [reference]`` (all three
without arguments); each line is ``<name>: <ids>`` or ``<name>: raised <type>``.
"""

from __future__ import annotations

import sys

NEW_TOKENS = 6
SEEDS = (0, 1, 2)
#: What instruct checkpoints ship, so that stock 4.55 - 5.0.0rc2 samples despite do_sample=False.
INSTRUCT = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20}


def _model(values: dict, **kwargs):
    from overlay.testing.models import tiny_model

    model = tiny_model("llama", **kwargs)
    for key, value in values.items():
        setattr(model.generation_config, key, value)
    return model


def _explicit_greedy(model) -> list:
    """The ids of each seed: a GenerationConfig(do_sample=False) built here, inside the run (the
    overlay records which keys a config was given when it is built)."""
    import torch
    from transformers import GenerationConfig

    from overlay.testing.models import PAD_TOKEN_ID, left_padded_batch

    batch = left_padded_batch((6, 4), seed=1)
    out = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=PAD_TOKEN_ID)
        with torch.no_grad():
            out.append(model.generate(**batch, generation_config=config, disable_compile=True).tolist())
    return out


def precedence() -> list:
    """Per seed, the ids of the instruct-configured model given ``GenerationConfig(do_sample=False)``."""
    return _explicit_greedy(_model(INSTRUCT))


def reference() -> list:
    """The greedy ids of the same weights with no sampling default anywhere (what the fix gives)."""
    return _explicit_greedy(_model({}))


def kv_cache_dtype() -> dict:
    """A bfloat16 model given a float32 static cache: ``{"ok": True, "ids": ...}`` or what it raised."""
    import torch

    from overlay.testing.models import greedy_outcome, left_padded_batch, static_cache

    model = _model({}, dtype=torch.bfloat16)
    batch = left_padded_batch((6,), seed=2)
    cache = static_cache(model.config, 1, 16, torch.float32)
    return greedy_outcome(model, batch, NEW_TOKENS, past_key_values=cache)


CALLS = {"precedence": precedence, "kv-cache-dtype": kv_cache_dtype, "reference": reference}


def main(names: list[str]) -> int:
    import warnings

    warnings.simplefilter("ignore")  # the cast warning goes to stderr anyway; stdout is the result
    for name in names or list(CALLS):
        result = CALLS[name]()
        if isinstance(result, dict) and not result["ok"]:
            print(f"{name}: raised {result['type']}")
        else:
            print(f"{name}: {result['ids'] if isinstance(result, dict) else result}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
