"""The doctor's scenarios: what each one runs, and the code that runs it in a scenario subprocess.

A scenario is a handful of *cases*. A case is one ``generate()`` under test and the run it must
reproduce token for token (its *reference*), in the same process: the same model, the same
prompt, with the one thing the bug needs taken away (inputs already on the device; a cache
built in the compute dtype; no chunked prefill). A case passes when the run under test finishes
and its tokens equal the reference's. Control cases are the ones upstream gets right: they must
pass with and without the overlay.

The catalogue (:data:`SCENARIOS`) is plain data, imported by the parent without torch; the
``run_*`` functions import torch and transformers when called, in the scenario subprocess.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_NEW_TOKENS = 5
PROMPT_LENGTHS = (6, 4)  # a left-padded batch of two


@dataclass(frozen=True)
class Scenario:
    """One scenario. The patches it proves are not listed here: each patch names its scenarios
    (``Patch.doctor``), see :func:`patches_proving`."""

    id: str
    title: str
    distributed: bool = False  # needs torchrun with world size > 1
    # The release that fixed this scenario's bug upstream, where that is earlier than the fix of
    # the patch proving it (a patch can fix two bugs of one function): from it on stock passes.
    fixed_in: str | None = None


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "host-inputs-static",
        "host-side padded inputs, cache_implementation='static', model on the device",
    ),
    Scenario(
        "cache-dtype-static",
        "user StaticCache early-initialised in float32, bfloat16 model",
    ),
    Scenario(
        "cache-dtype-prefix",
        "DynamicCache prefix computed in float32, bfloat16 decoding",
    ),
    Scenario(
        "kept-static-cache",
        "a static cache kept on the model across generate() calls: after .to(dtype), .to(device), a failed call",
    ),
    Scenario(
        "chunked-prefill",
        "prefill_chunk_size with a static cache and with the default cache",
    ),
    Scenario(
        "tp-prefill-chunk",
        "tensor parallel, static cache, prefill_chunk_size, attention left unsharded",
        distributed=True,
    ),
    Scenario(
        "gemma4-prefill-chunk",
        "Gemma 4 (layers with their own head size), static cache, prefill_chunk_size",
        fixed_in="5.18.0",
    ),
    Scenario(
        "zero-kv-shared-static-cache",
        "Gemma 4 (num_kv_shared_layers=0, its default) and Gemma 3n set to 0, with a static cache",
    ),
)

BY_ID = {s.id: s for s in SCENARIOS}
SCENARIO_IDS: tuple[str, ...] = tuple(BY_ID)


def patches_proving(scenario_id: str, patches) -> tuple[str, ...]:
    """Ids of the patches (of ``patches``) that name ``scenario_id`` in their ``doctor`` field."""
    return tuple(p.id for p in patches if scenario_id in p.doctor)


# -- helpers for the scenario subprocess ------------------------------------------------------


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: first line of the message``, at most ``limit`` characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def where(exc: BaseException) -> str | None:
    """The innermost Python frame the exception came through, as ``path:line in function``
    (paths cut after ``site-packages/``)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    frame = frames[-1]
    path = frame.filename
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{frame.lineno} in {frame.name}"


# Called without arguments. `Callable[..., list]`, not `Callable[[], list]`: the scenarios bind loop
# variables as lambda defaults (`lambda model=model: ...`), which mypy cannot match against a
# zero-argument callable ("Cannot infer type of lambda", python/mypy#12557).
def run_case(name: str, control: bool, reference: Callable[..., list], under_test: Callable[..., list]) -> dict:
    """Runs the reference, then the run under test; a record of what happened (never raises)."""
    record: dict[str, Any] = {"name": name, "control": control, "ok": False, "error": None}
    try:
        record["reference_tokens"] = reference()
    except Exception as exc:
        record.update(error="the reference run failed: " + one_line(exc), error_type=type(exc).__name__, where=where(exc))
        record["traceback"] = traceback.format_exc(limit=-8)
        return record
    try:
        record["tokens"] = under_test()
    except Exception as exc:
        record.update(error=one_line(exc), error_type=type(exc).__name__, where=where(exc))
        record["traceback"] = traceback.format_exc(limit=-8)
        return record
    record["identical"] = record["tokens"] == record["reference_tokens"]
    record["ok"] = record["identical"]
    if not record["identical"]:
        record["error"] = "generated tokens differ from the reference run"
    return record


def _generate(model, inputs: dict, **kwargs) -> list:
    from overlay.testing.models import greedy_ids

    # greedy_ids drops a static cache 5.13-5.17 keep on the model: each run starts clean.
    return greedy_ids(model, inputs, MAX_NEW_TOKENS, **kwargs)


# -- the scenarios -------------------------------------------------------------------------------


def run_host_inputs_static(device, **_) -> list[dict]:
    """Host-side left-padded inputs, static cache, model on ``device``; reference: the same
    inputs moved to the device first. The fix: ``device-move-nested`` (upstream since 5.20.0)."""
    from overlay.testing.models import left_padded_batch, on_device, tiny_model

    batch = left_padded_batch(PROMPT_LENGTHS)
    cases = []
    for kind, cache, control in (
        ("gemma3", "static", False),
        ("qwen3", "static", False),
        ("llama", "static", True),  # no layer_types: one top-level mask tensor, moved upstream
        ("gemma3", "dynamic", True),  # the mask is built inside the model, on its device
    ):
        model = tiny_model(kind, device=device)
        kwargs = {"cache_implementation": cache} if cache == "static" else {}
        cases.append(
            run_case(
                f"{kind}, {cache} cache" + (" (control)" if control else ""),
                control,
                # Bound now: run_case calls them before the loop moves on, but say so in the code.
                reference=lambda model=model, kwargs=kwargs: _generate(model, on_device(batch, device), **kwargs),
                under_test=lambda model=model, kwargs=kwargs: _generate(model, batch, **kwargs),
            )
        )
    return cases


def run_cache_dtype_static(device, **_) -> list[dict]:
    """A user-built ``StaticCache`` early-initialised in float32, passed to a bfloat16 model;
    reference: the same cache built in bfloat16. The fix: ``kv-cache-dtype`` (no release)."""
    import torch

    from overlay.testing.models import cache_argument_name, left_padded_batch, on_device, static_cache, tiny_model

    batch = on_device(left_padded_batch(PROMPT_LENGTHS), device)
    max_cache_len = batch["input_ids"].shape[1] + MAX_NEW_TOKENS
    cases = []
    for kind in ("llama", "qwen3", "gemma3"):
        model = tiny_model(kind, dtype=torch.bfloat16, device=device)
        config = model.config

        def cache_in(dtype, model=model, config=config):
            cache = static_cache(config, batch["input_ids"].shape[0], max_cache_len, dtype, model.device)
            return {cache_argument_name(model): cache}

        cases.append(
            run_case(
                f"{kind}, float32 StaticCache",
                False,
                reference=lambda model=model, cache_in=cache_in: _generate(model, batch, **cache_in(torch.bfloat16)),
                under_test=lambda model=model, cache_in=cache_in: _generate(model, batch, **cache_in(torch.float32)),
            )
        )
    return cases


def run_cache_dtype_prefix(device, **_) -> list[dict]:
    """A ``DynamicCache`` filled with a prompt prefix by a float32 copy of the model, then
    bfloat16 decoding from it; reference: the same prefix cache cast to bfloat16 by hand. The
    fix: ``kv-cache-dtype`` (no release)."""
    import torch

    from overlay.testing.models import cache_argument_name, dynamic_cache, tiny_model

    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 128, (2, 6), generator=generator).to(device)
    suffix = torch.randint(3, 128, (2, 3), generator=generator).to(device)
    prompt = torch.cat([prefix, suffix], dim=1)
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    cases = []
    for kind, attention in (("llama", "sdpa"), ("qwen3", "sdpa"), ("gemma3", "sdpa"), ("llama", "eager")):
        model32 = tiny_model(kind, dtype=torch.float32, device=device, attn_implementation=attention)
        model16 = copy.deepcopy(model32).to(torch.bfloat16)
        name = cache_argument_name(model32)

        def prefix_cache(model32=model32, name=name):
            cache = dynamic_cache(model32.config)
            with torch.no_grad():
                model32(input_ids=prefix, attention_mask=torch.ones_like(prefix), use_cache=True, **{name: cache})
            return cache

        def cast(cache, dtype):
            for layer in cache.layers:
                for attribute in ("keys", "values"):
                    tensor = getattr(layer, attribute, None)
                    if isinstance(tensor, torch.Tensor):
                        setattr(layer, attribute, tensor.to(dtype))
                if isinstance(getattr(layer, "dtype", None), torch.dtype):
                    layer.dtype = dtype
            return cache

        cases.append(
            run_case(
                f"{kind} ({attention}), float32 prefix cache",
                False,
                reference=lambda model16=model16, name=name, prefix_cache=prefix_cache, cast=cast: _generate(
                    model16, inputs, **{name: cast(prefix_cache(), torch.bfloat16)}
                ),
                under_test=lambda model16=model16, name=name, prefix_cache=prefix_cache: _generate(
                    model16, inputs, **{name: prefix_cache()}
                ),
            )
        )
    return cases


def _kept_generate(model, inputs: dict) -> list:
    """A static-cache ``generate()`` that keeps what generate keeps on the model (unlike
    :func:`_generate`, which drops a kept cache first): what a user calling generate twice meets."""
    import torch

    from overlay.testing.models import PAD_TOKEN_ID

    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, disable_compile=True,
            pad_token_id=PAD_TOKEN_ID, cache_implementation="static",
        )
    sequences = out.sequences if hasattr(out, "sequences") else out
    return sequences.cpu().tolist()


def run_kept_static_cache(device, **_) -> list[dict]:
    """generate() keeps its static cache on the model (up to 5.14.x) and reuses it when only the
    model changed: after ``model.to(torch.bfloat16)``, after ``model.to(device)`` (from the host),
    and after a call that failed before its first cache write (an out-of-memory prefill, a Ctrl-C:
    simulated by a hook that raises in the first decoder layer), which leaves the kept cache
    half-built. Reference: a fresh copy of the model in its final dtype and place. The fix:
    ``kept-static-cache`` (upstream since 5.15.0, where generate builds a new cache per call;
    the failed-call case is gone from 5.13.0)."""
    import torch

    from overlay.testing.models import left_padded_batch, on_device, tiny_model

    batch = left_padded_batch(PROMPT_LENGTHS)
    cases = []
    for kind in ("llama", "gemma3"):

        def after_dtype_change(kind=kind):
            model = tiny_model(kind, dtype=torch.float32, device=device)
            _kept_generate(model, on_device(batch, device))  # keeps a float32 cache
            return _kept_generate(model.to(torch.bfloat16), on_device(batch, device))

        def fresh_bfloat16(kind=kind):
            return _kept_generate(tiny_model(kind, dtype=torch.bfloat16, device=device), on_device(batch, device))

        cases.append(run_case(f"{kind}, kept cache after .to(torch.bfloat16)", False, fresh_bfloat16, after_dtype_change))

        def after_device_move(kind=kind):
            model = tiny_model(kind, device="cpu")
            _kept_generate(model, batch)  # keeps a cache on the host
            return _kept_generate(model.to(device), on_device(batch, device))

        def fresh_on_device(kind=kind):
            return _kept_generate(tiny_model(kind, device=device), on_device(batch, device))

        # On the host itself (--device cpu) nothing moves: the case is a control there.
        on_host = torch.device(device).type == "cpu"
        cases.append(run_case(
            f"{kind}, kept cache after .to({device})" + (" (control)" if on_host else ""),
            on_host, fresh_on_device, after_device_move,
        ))

        def after_failed_call(kind=kind):
            model = tiny_model(kind, device=device)
            # The call fails in the first decoder layer, before any cache write, as an
            # out-of-memory prefill or a Ctrl-C would (not an out-of-vocabulary id: on CUDA that
            # is a device-side assert that ends the whole process).
            def fail(module, args):
                raise RuntimeError("simulated failure before the first cache write")

            hook = model.get_decoder().layers[0].register_forward_pre_hook(fail)
            try:
                _kept_generate(model, on_device(batch, device))
            except RuntimeError as exc:
                if "simulated failure" not in str(exc):
                    raise
            finally:
                hook.remove()
            return _kept_generate(model, on_device(batch, device))

        cases.append(run_case(f"{kind}, valid call after a failed one", False, fresh_on_device, after_failed_call))
    return cases


CHUNKED_PROMPT_LENGTHS = (17, 12)  # a left-padded batch of two, longer than two chunks
PREFILL_CHUNK = 8


KEPT_PREFIX = 6  # columns of the batch run through the model before generate() (a kept prefix cache)


def _kept_prefix_cache(model, batch):
    """A ``DynamicCache`` holding the batch's first :data:`KEPT_PREFIX` columns, as a user keeps a
    prefix cache to continue from."""
    import torch

    from overlay.testing.models import cache_argument_name, dynamic_cache

    cache = dynamic_cache(model.config)
    mask = batch["attention_mask"][:, :KEPT_PREFIX]
    with torch.no_grad():
        model(
            input_ids=batch["input_ids"][:, :KEPT_PREFIX], attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, **{cache_argument_name(model): cache},
        )
    return cache


def run_chunked_prefill(device, **_) -> list[dict]:
    """``generate(prefill_chunk_size=8)`` on a 17-token prompt (left-padded batch of two);
    reference: the same call without ``prefill_chunk_size``. On 4.55.0 - 5.0.0rc2 the chunk loop
    embeds left-padded rows at wrong positions (other tokens, no error). With a static cache the
    chunked prefill of 5.0.0rc1 - 5.2.0 leaves decoding one position late and the last step writes past
    the cache (``IndexError``); with the default cache 5.0.0 refuses to chunk (``ValueError``).
    With a cache that already holds the prompt's first columns (a kept prefix cache), 4.55.0 -
    5.20.2 chunk the whole prompt from position 0 again: the prefix is cached twice and the tokens
    differ. No control case: every chunked prefill of those releases decodes one position late (5.2.0 also
    embeds the chunks at wrong positions), which only some models' tokens show. The fix:
    ``chunked-prefill`` (upstream since 5.21.0; the empty cache's bugs since 5.3.0, the default
    cache since 5.1.0)."""
    from overlay.testing.models import cache_argument_name, left_padded_batch, on_device, tiny_model

    batch = on_device(left_padded_batch(CHUNKED_PROMPT_LENGTHS), device)
    cases = []
    for kind, cache, control in (
        ("llama", "static", False),
        ("gemma3", "static", False),
        ("llama", None, False),  # the default cache: no cache_implementation, no cache passed
        ("llama", "kept prefix", False),  # a DynamicCache already holding the first columns
    ):
        model = tiny_model(kind, device=device)
        if cache == "kept prefix":
            def kwargs(model=model):
                return {cache_argument_name(model): _kept_prefix_cache(model, batch)}
        else:
            def kwargs(cache=cache):
                return {"cache_implementation": cache} if cache is not None else {}
        cases.append(
            run_case(
                f"{kind}, {cache or 'default'} cache" + (" (control)" if control else ""),
                control,
                reference=lambda model=model, kwargs=kwargs: _generate(model, batch, **kwargs()),
                under_test=lambda model=model, kwargs=kwargs: _generate(
                    model, batch, prefill_chunk_size=PREFILL_CHUNK, **kwargs()
                ),
            )
        )
    return cases


def _tp_plans() -> tuple[tuple[str, dict, bool], ...]:
    """(name, plan, control) for a Llama-like model, from :mod:`overlay.testing.tensor_parallel`."""
    from overlay.testing.tensor_parallel import ATTENTION_COLWISE, ATTENTION_GATHERED, MLP

    return (
        ("MLP-only plan (attention unsharded)", dict(MLP), False),
        ("q/k/v colwise_gather_output (OLMo2-style)", {**ATTENTION_GATHERED, **MLP}, False),
        ("attention colwise (control: heads really sharded)", {**ATTENTION_COLWISE, **MLP}, True),
    )


TP_PROMPT_LENGTH = 8
TP_PREFILL_CHUNK = 3


def _tp_model_dir(workdir: str) -> str:
    import os

    return os.path.join(workdir, "tiny-llama")


def prepare_tp_prefill_chunk(*, workdir: str, world_size: int) -> None:
    """Saves the tiny model each rank loads. Runs before the process group exists: under an
    initialised group, save_pretrained writes on rank 0 only, and ranks do not share a folder."""
    from overlay.testing.models import save_tiny_model

    # Head counts that divide by the world size, so that the colwise control shards evenly.
    heads = 2 * world_size
    save_tiny_model(
        _tp_model_dir(workdir),
        "llama",
        num_attention_heads=heads,
        num_key_value_heads=world_size,
        hidden_size=16 * heads,
        intermediate_size=32 * world_size,
    )


def run_tp_prefill_chunk(device, *, workdir: str, world_size: int, **_) -> list[dict]:
    """Under tensor parallelism (this process is one rank; the process group is initialised by
    the caller): the model of :func:`prepare_tp_prefill_chunk` loaded with each plan in
    :func:`_tp_plans`; ``generate(cache_implementation='static', prefill_chunk_size=3)`` on an
    8-token prompt; reference: the same model without ``prefill_chunk_size``. The fix:
    ``static-cache-tp-heads`` (upstream since 5.20.0)."""
    import torch

    from overlay.testing.tensor_parallel import load_sharded

    model_dir = _tp_model_dir(workdir)
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 128, (1, TP_PROMPT_LENGTH), generator=generator)

    cases = []
    for name, plan, control in _tp_plans():
        try:
            model = load_sharded(model_dir, plan, world_size, dtype=torch.float32)
        except Exception as exc:
            error = "loading with this plan failed: " + one_line(exc)
            cases.append({"name": name, "control": control, "ok": False, "error": error, "where": where(exc)})
            continue
        inputs = {"input_ids": prompt.to(model.device), "attention_mask": torch.ones_like(prompt).to(model.device)}
        cases.append(
            run_case(
                name,
                control,
                reference=lambda model=model, inputs=inputs: _generate(model, inputs, cache_implementation="static"),
                under_test=lambda model=model, inputs=inputs: _generate(
                    model, inputs, cache_implementation="static", prefill_chunk_size=TP_PREFILL_CHUNK
                ),
            )
        )
        del model
    return cases


GEMMA4_PROMPT_LENGTHS = (10, 7)  # a left-padded batch of two, three chunks of 4 for the longer
GEMMA4_PREFILL_CHUNK = 4


def run_gemma4_prefill_chunk(device, **_) -> list[dict]:
    """Gemma 4, whose full-attention layers have wider heads than its sliding ones
    (``global_head_dim``) and, with ``attention_k_eq_v``, fewer KV heads:
    ``generate(cache_implementation='static', prefill_chunk_size=4)`` on a left-padded batch;
    reference: the same call without ``prefill_chunk_size`` (the cache then takes each layer's
    shape from its first keys). Up to 5.17.0 the eagerly allocated cache has one shape for every
    layer: 5.13.0 - 5.14.x fail at the first full-attention write (``index_copy_``), 5.15.0 -
    5.17.0 raise ``AmbiguousGlobalPerLayerAttributeError``. The fix: ``static-cache-tp-heads``
    (upstream since 5.18.0)."""
    from overlay.testing.models import left_padded_batch, on_device, tiny_heterogeneous_model, tiny_model

    batch = on_device(left_padded_batch(GEMMA4_PROMPT_LENGTHS), device)
    cases = []
    for name, build, control in (
        ("gemma4, head size per layer", lambda: tiny_heterogeneous_model("gemma4_text"), False),
        (
            "gemma4, head size and KV heads per layer",
            lambda: tiny_heterogeneous_model("gemma4_text", kv_heads_per_layer=True),
            False,
        ),
        ("llama, every layer alike (control)", lambda: tiny_model("llama"), True),
    ):
        model = build().to(device)
        cases.append(
            run_case(
                name,
                control,
                reference=lambda model=model: _generate(model, batch, cache_implementation="static"),
                under_test=lambda model=model: _generate(
                    model, batch, cache_implementation="static", prefill_chunk_size=GEMMA4_PREFILL_CHUNK
                ),
            )
        )
    return cases


def run_zero_kv_shared_static_cache(device, **_) -> list[dict]:
    """A text config with ``num_kv_shared_layers=0`` (Gemma 4's default, 5.5.0 on; Gemma 3n set to
    0, every release) with ``cache_implementation='static'`` and with a ``StaticCache`` built from
    its config, on a left-padded batch; reference: the same call with the default dynamic cache.
    4.56.0 - 5.9.0 build the static cache with no layers (``layer_types[:-0]``) and fail at the
    first write (``IndexError: list index out of range``). The fix:
    ``static-cache-zero-kv-shared-layers`` (upstream since 5.10.1)."""
    from transformers import StaticCache

    from overlay.testing.models import (
        cache_argument_name,
        heterogeneous_kinds_installed,
        left_padded_batch,
        on_device,
        tiny_gemma3n,
        tiny_heterogeneous_model,
        tiny_model,
    )

    batch = on_device(left_padded_batch(PROMPT_LENGTHS), device)
    max_cache_len = batch["input_ids"].shape[1] + MAX_NEW_TOKENS
    models = []
    if "gemma4_text" in heterogeneous_kinds_installed():  # Gemma 4: 5.5.0 on
        models.append(("gemma4", lambda: tiny_heterogeneous_model("gemma4_text"), False))
    models += [
        ("gemma3n, num_kv_shared_layers=0", lambda: tiny_gemma3n(num_kv_shared_layers=0), False),
        ("gemma3n, num_kv_shared_layers=2 (control)", lambda: tiny_gemma3n(num_kv_shared_layers=2), True),
    ]
    cases = []
    for label, build, control in models:
        model = build().to(device)
        for user_cache in (False, True):
            name = f"{label}, " + ("a StaticCache built from its config" if user_cache else "cache_implementation='static'")

            def static(model=model, user_cache=user_cache):
                if user_cache:
                    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
                    return _generate(model, batch, **{cache_argument_name(model): cache})
                return _generate(model, batch, cache_implementation="static")

            cases.append(run_case(name, control, reference=lambda model=model: _generate(model, batch), under_test=static))
    model = tiny_model("llama").to(device)
    cases.append(run_case(
        "llama, cache_implementation='static' (control)", True,
        reference=lambda: _generate(model, batch),
        under_test=lambda: _generate(model, batch, cache_implementation="static"),
    ))
    return cases


#: Work a distributed scenario does in each rank before the process group is set up.
PREPARERS: dict[str, Callable[..., None]] = {"tp-prefill-chunk": prepare_tp_prefill_chunk}

RUNNERS: dict[str, Callable[..., list[dict]]] = {
    "host-inputs-static": run_host_inputs_static,
    "cache-dtype-static": run_cache_dtype_static,
    "cache-dtype-prefix": run_cache_dtype_prefix,
    "kept-static-cache": run_kept_static_cache,
    "chunked-prefill": run_chunked_prefill,
    "tp-prefill-chunk": run_tp_prefill_chunk,
    "gemma4-prefill-chunk": run_gemma4_prefill_chunk,
    "zero-kv-shared-static-cache": run_zero_kv_shared_static_cache,
}
