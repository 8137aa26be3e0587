"""Survey: does beam search's `vocab_size` (read from the config) match the logits' width?

On transformers 4.55.0 - 5.17.0, `GenerationMixin._beam_search` does not take the vocabulary width
from the logits: it reads it from the config (`self.config.get_text_config().vocab_size`, with a
few class-name special cases), then reshapes the log-probs to `(batch, num_beams * vocab_size)`. A
model whose logits are wider or narrower than that value fails any `num_beams > 1` run with
`RuntimeError: shape '[2, 256]' is invalid for input of size 524`. 5.18.0 reads the width off the
logits (`reshape(batch, -1)`, `vocab_size = accumulated_log_probs.shape[-1] // num_beams`).
docs/upstream-fixes.md row 34; the results are in docs/surveys/beam-vocab-width.md.

This script asks, for every generative model class the installed release maps in its auto classes
(causal LM, seq2seq LM, causal image modeling, image-text-to-text, vision-to-seq), whether the
library's own default-shaped configs reach the bug:

1. build the model type's default config, scaled down (hidden sizes ~32, 2 layers, the vocabulary
   left at its default: it is what is measured), randomly initialised, on CPU;
2. run one forward pass on a short prompt and read `logits.shape[-1]`;
3. evaluate the *installed release's own* expression: the lines of `_beam_search` that set
   `vocab_size` are cut out of its source and executed with `self` bound to the model, so the value
   is exactly what beam search reads in that release (no hand copy that could drift);
4. where the two differ, confirm with `generate(num_beams=2)` (expected to fail on stock) and
   `generate(num_beams=1)` (expected to work).

A model type that cannot be built or run in a few seconds on CPU falls back to (a) the default
config, unshrunk, built on the meta device and run there (shapes only), then (b) the width of the
output embedding of that meta model; each row says which measure it got, or why it was skipped.
Each row also carries the prediction of the `beam-search-logits-width` patch: its own
`logits_width(model, model.config.get_text_config())` (the output head's rows when the head is a
`torch.nn.Linear`, narrowed to `unpadded_vocab_size`), called on the same model, compared with the
measured width: `prediction = logits`, `prediction differs from logits` or `no prediction (head not
Linear)`; and whether the patch would act on it (prediction set, unlike the text config's
`vocab_size`, class not special-cased by the release). Importing the patch module patches nothing
(the worker's header checks `_beam_search` is still stock after the import).

Each model runs in a worker process with the overlay off (`ATTN_OVERLAY=0`: stock transformers)
under a per-model time limit; a worker that hangs or dies is replaced and the model recorded as
skipped.

Run it with a lane's python, e.g.::

    nice .nox/tf-5-17-0/bin/python scripts/survey_beam_vocab_width.py --markdown /tmp/bvw-5-17-0.md

`--only llama,t5` limits the model types; `--extras` adds the classes `_beam_search` names in its
special cases (BarkSemanticModel, MoshiDepthDecoder); `--workers 2` runs two workers side by side;
`--per-model-timeout` (seconds, default 45) bounds one model; `--json` writes the raw rows;
`--generate-always` runs the generate() confirmation for every model measured by a forward, not
only where the widths differ; `--with-overlay` runs the workers with the overlay applied (its
beam-search-logits-width patch among the rest), to see beam search work where the widths differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

# The auto mappings that hold generative heads, by the names the releases use (not every release
# has every one: 5.x folded vision-to-seq into image-text-to-text).
MAPPING_NAMES = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_IMAGE_MODELING_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
)

# Where beam search's width is set in 4.55.0 - 5.17.0 (two shapes: 4.57.1 added the Bark case).
BLOCK_START = "# TODO (joao): standardize special cases"
BLOCK_END = "decoder_prompt_len = cur_len"

# Scaled-down values, applied only to keys the default config already has (in the config and in
# every nested sub-config). The vocabulary is deliberately left alone.
SHRINK = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "d_model": 32,
    "d_ff": 64,
    "d_kv": 16,
    "num_heads": 2,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "ffn_dim": 64,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
    "n_inner": 64,
    "n_positions": 128,
    "max_position_embeddings": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "vision_layers": 2,
    "text_layers": 2,
    "depth": 2,
}

# For the meta-device fallback: the default widths as shipped, only fewer layers (depth changes no
# width, and a 40-layer forward on meta is slow for nothing).
LAYER_KEYS = (
    "num_hidden_layers",
    "num_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
    "n_layer",
    "vision_layers",
    "text_layers",
    "depth",
)
SHRINK_LAYERS_ONLY = {key: SHRINK[key] for key in LAYER_KEYS}


# --------------------------------------------------------------------------------------------
# Worker side: runs in a child process, one JSON line per event on stdout.
# --------------------------------------------------------------------------------------------


def _emit(record):
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def beam_search_width_code():
    """The installed release's own lines that set `vocab_size` in `_beam_search`, or None (5.18+)."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    source = inspect.getsource(GenerationMixin._beam_search)
    start = source.find(BLOCK_START)
    if start < 0:
        return None
    start = source.rfind("\n", 0, start) + 1  # from the line's start, so that dedent sees its indent
    end = source.find(BLOCK_END, start)
    return textwrap.dedent(source[start:end])


def beam_search_width(model, code):
    """What `_beam_search` reads as the vocabulary width for this model, by the release's code."""
    namespace = {"self": model}
    exec(code, namespace)  # noqa: S102 - the release's own source, cut out above
    return int(namespace["vocab_size"])


def _shrunk_kwargs(config, depth=0, layers_only=False):
    """Constructor kwargs for a scaled-down copy of `config` (sub-configs as dicts)."""
    from transformers import PretrainedConfig

    kwargs = {}
    values = config.to_dict()
    shrink = dict(SHRINK_LAYERS_ONLY) if layers_only else dict(SHRINK)
    if not layers_only:
        # Keep the default head width (rotary sections such as Qwen2-VL's mrope_section are sized
        # for it): 2 heads of the default width, rather than a fixed head_dim.
        # An explicit head_dim stays as it is (the projections adapt to the small hidden size);
        # a derived one (hidden_size // heads) is kept by giving 2 heads a hidden size of 2 * it.
        heads = values.get("num_attention_heads")
        shrink.pop("head_dim")
        if (
            not isinstance(values.get("head_dim"), int)
            and isinstance(values.get("hidden_size"), int)
            and isinstance(heads, int)
            and heads
        ):
            shrink["hidden_size"] = 2 * (values["hidden_size"] // heads)
    for key, value in shrink.items():
        if key in values and values[key] is not None and not isinstance(values[key], (list, dict)):
            kwargs[key] = value
    # Per-layer lists sized for the default depth no longer fit 2 layers: let __init__ rebuild them.
    for key in ("layer_types", "mlp_only_layers", "block_types", "attn_layer_indices"):
        if key in values and isinstance(values[key], list):
            kwargs[key] = None
    if depth < 3:
        for key in values:
            child = getattr(config, key, None)
            if isinstance(child, PretrainedConfig):
                child_kwargs = _shrunk_kwargs(child, depth + 1, layers_only)
                kwargs[key] = {**child.to_dict(), **child_kwargs}
                # A size the parent repeats from its sub-config (Ovis2's hidden_size, the text
                # model's) must stay equal to it once shrunk.
                for name, value in child_kwargs.items():
                    if name in kwargs and values.get(name) == getattr(child, name, None):
                        kwargs[name] = value
        # A composite config's own hidden_size is its language model's (Ovis2 builds lm_head from
        # it), even where the two defaults disagree (Ovis2: 1536 against Qwen2's 4096).
        text = kwargs.get("text_config")
        if depth == 0 and isinstance(text, dict) and "hidden_size" in kwargs and "hidden_size" in text:
            kwargs["hidden_size"] = text["hidden_size"]
    return kwargs


def _layers_only(config_class, extra):
    default = config_class(**extra)
    try:
        return config_class(**_shrunk_kwargs(default, layers_only=True), **extra)
    except Exception:  # noqa: BLE001 - the unshrunk default is still a valid measure
        return default


def _prompt(config, text_config, encoder_decoder):
    import torch

    vocab = getattr(text_config, "vocab_size", None) or 100
    # Small ids, clear of the image/audio placeholder ids multimodal configs keep near the top.
    ids = torch.tensor([[5, 6, 7, 8, 9]]) % max(vocab, 2)
    if type(config).__name__.startswith("Musicgen"):
        # Musicgen's decoder takes one row per codebook: (batch * num_codebooks, length).
        ids = ids.repeat(getattr(text_config, "num_codebooks", 1), 1)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if encoder_decoder:
        start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            start = getattr(text_config, "decoder_start_token_id", None) or 0
        inputs["decoder_input_ids"] = torch.tensor([[start, 5]]) % max(vocab, 2)
    return inputs


def _accepted(model, inputs):
    """The inputs the model's forward takes (Transformer-XL has no attention_mask)."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return inputs
    return {key: value for key, value in inputs.items() if key in parameters}


def _logits_width(output):
    logits = output.logits if hasattr(output, "logits") else output[0]
    return int(logits.shape[-1])


def _build(model_class, config):
    config._attn_implementation = "eager"
    model = model_class(config)
    return model.eval()


def _confirm_with_generate(model, inputs):
    """generate() with num_beams=2 (should fail on stock when the widths differ) and num_beams=1."""
    import torch

    outcome = {}
    gen_inputs = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
    # With and without the cache: a model can have a second, unrelated generate() bug on the cached
    # path (CPM-Ant before 5.16 does), which must not hide whether num_beams=1 works.
    for use_cache in (True, False):
        for beams in (2, 1):
            key = f"num_beams={beams}" + ("" if use_cache else ", use_cache=False")
            try:
                with torch.no_grad():
                    out = model.generate(
                        **gen_inputs,
                        num_beams=beams,
                        do_sample=False,
                        max_new_tokens=3,
                        pad_token_id=0,
                        use_cache=use_cache,
                    )
                outcome[key] = "ok " + str(out.tolist() if hasattr(out, "tolist") else "")
            except Exception as error:  # noqa: BLE001 - the error is the result
                outcome[key] = f"{type(error).__name__}: {str(error)[:160]}"
    return outcome


#: Set by ``--with-overlay``: the workers run with the overlay active (its beam-search-logits-width
#: patch among the rest), to check that generate() works where the widths differ.
WITH_OVERLAY = "SURVEY_BEAM_WIDTH_WITH_OVERLAY"

#: Set by ``--generate-always`` for the workers: confirm with generate() where the widths agree too.
GENERATE_ALWAYS = "SURVEY_BEAM_WIDTH_GENERATE_ALWAYS"

PREDICTION_EQUAL = "prediction = logits"
PREDICTION_DIFFERS = "prediction differs from logits"
NO_PREDICTION = "no prediction (head not a Linear lm_head)"
PREDICTION_RAISED = "prediction raised"


def patch_prediction(model):
    """The patch's predicted logits width for `model`, by the patch's own function, and what it saw."""
    from transformers.generation.utils import GenerationMixin

    from overlay.patches.beam_search_logits_width import logits_width

    text_config = model.config.get_text_config()
    found = {
        "text_config_vocab_size": getattr(text_config, "vocab_size", None),
        # Beam search (and so the patch) is reached only through GenerationMixin.generate.
        "generation_mixin": isinstance(model, GenerationMixin),
    }
    try:
        head = model.get_output_embeddings()
        found["head_type"] = type(head).__name__
    except Exception as error:  # noqa: BLE001 - the patch catches some of these itself
        found["head_type"] = f"get_output_embeddings raised {type(error).__name__}"
    try:
        found["prediction"] = logits_width(model, text_config)
    except Exception as error:  # noqa: BLE001 - would escape the patch: a finding, recorded
        found["prediction_error"] = f"{type(error).__name__}: {str(error)[:140]}"
    return found


def _fallback_row(method, model, code, width, errors):
    """A row measured by a fallback: the release's read, the width found, why the earlier measures failed."""
    return {
        "method": method,
        "config_value": beam_search_width(model, code) if code else None,
        "logits_width": width,
        "fallback_from": errors,
        **patch_prediction(model),
    }


def measure(model_type, class_name, code, mapping=""):
    import torch
    import transformers
    from transformers import AutoConfig

    model_class = getattr(transformers, class_name, None)
    if model_class is None:  # not exported at the top (MoshiDepthDecoder): its modeling module
        import importlib

        try:
            module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
            model_class = getattr(module, class_name, None)
        except ImportError:
            model_class = None
    if model_class is None:
        return {"outcome": "skipped", "reason": f"{class_name} not importable (missing extra?)"}
    # The class's own config class: a decoder-only head of a composite model (MusicgenForCausalLM)
    # takes the decoder's config, not the model type's.
    config_class = getattr(model_class, "config_class", None) or type(AutoConfig.for_model(model_type))
    default = config_class()
    encoder_decoder = bool(getattr(default, "is_encoder_decoder", False))
    # An encoder architecture used as a causal LM (BERT, Reformer, ...) is built as a decoder, as
    # its docs tell users to (Reformer refuses to build otherwise).
    as_decoder = {"is_decoder": True} if mapping == "MODEL_FOR_CAUSAL_LM" and not encoder_decoder else {}
    errors = []

    # 1. Scaled-down default config, real forward on CPU.
    try:
        torch.manual_seed(0)
        # Only the overrides at the top (the rest keeps the class defaults, with no round trip
        # through to_dict that some configs do not survive); sub-configs go in as dicts.
        config = config_class(**_shrunk_kwargs(default), **as_decoder)
        model = _build(model_class, config)
        inputs = _accepted(model, _prompt(config, config.get_text_config(), encoder_decoder))
        with torch.no_grad():
            width = _logits_width(model(**inputs))
        read = beam_search_width(model, code) if code else None
        row = {"method": "cpu forward (shrunk)", "config_value": read, "logits_width": width, **patch_prediction(model)}
        if (read is not None and read != width) or os.environ.get(GENERATE_ALWAYS):
            row["generate"] = _confirm_with_generate(model, inputs)
        return row
    except Exception as error:  # noqa: BLE001 - fall through to the next measure
        errors.append(f"shrunk cpu: {type(error).__name__}: {str(error)[:140]}")

    # 2. Default config as shipped, on the meta device (shapes only, no arithmetic).
    try:
        with torch.device("meta"):
            model = _build(model_class, _layers_only(config_class, as_decoder))
            inputs = {
                k: v.to("meta")
                for k, v in _accepted(model, _prompt(model.config, model.config.get_text_config(), encoder_decoder)).items()
            }
            with torch.no_grad():
                width = _logits_width(model(**inputs))
        return _fallback_row("meta forward (default config)", model, code, width, errors)
    except Exception as error:  # noqa: BLE001
        errors.append(f"meta forward: {type(error).__name__}: {str(error)[:140]}")

    # 3. Default config on meta, the output head's width only (no forward at all).
    try:
        with torch.device("meta"):
            model = _build(model_class, _layers_only(config_class, as_decoder))
        head = model.get_output_embeddings()
        if isinstance(head, torch.nn.ModuleList):  # one head per codebook (Musicgen)
            head = head[0]
        width = int(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])
        return _fallback_row("head width (meta, no forward)", model, code, width, errors)
    except Exception as error:  # noqa: BLE001
        errors.append(f"head width: {type(error).__name__}: {str(error)[:140]}")
    return {"outcome": "skipped", "reason": " | ".join(errors)}


def worker(jobs):
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import transformers
    from transformers.generation.utils import GenerationMixin

    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    import overlay.patches.beam_search_logits_width  # noqa: F401 - imported before the stock check

    if os.environ.get(WITH_OVERLAY):
        import overlay

        overlay.apply()  # the patches of the installed release, beam-search-logits-width among them

    code = beam_search_width_code()
    stock = not hasattr(GenerationMixin._beam_search, "__wrapped__")
    _emit({"event": "ready", "code": code, "stock_beam_search": stock})
    for model_type, class_name, mapping in jobs:
        _emit({"event": "start", "model_type": model_type})
        started = time.monotonic()
        try:
            row = measure(model_type, class_name, code, mapping)
        except Exception as error:  # noqa: BLE001 - recorded, the survey goes on
            row = {"outcome": "skipped", "reason": f"{type(error).__name__}: {str(error)[:200]}"}
        row.update(model_type=model_type, model_class=class_name, mapping=mapping, seconds=round(time.monotonic() - started, 1))
        if "outcome" not in row:
            if row["config_value"] is None:
                row["outcome"] = "width read from logits (5.18+)"
            elif row["config_value"] == row["logits_width"]:
                row["outcome"] = "equal"
            elif row["method"].startswith("head width"):
                # No forward ran: a head is not always what produces the logits (Transformer-XL's
                # adaptive softmax), so this is a lead to check by hand, not a finding.
                row["outcome"] = "differ? (head only)"
            else:
                row["outcome"] = "differ"
            classify_prediction(row, code)
        _emit({"event": "row", **row})


def classify_prediction(row, code):
    """The patch's prediction against the measured width, and whether the patch would act."""
    prediction = row.get("prediction")
    if "prediction_error" in row:
        row["prediction_outcome"] = PREDICTION_RAISED
    elif prediction is None:
        row["prediction_outcome"] = NO_PREDICTION
    elif prediction == row["logits_width"]:
        row["prediction_outcome"] = PREDICTION_EQUAL
    else:
        row["prediction_outcome"] = PREDICTION_DIFFERS
    # The patch acts where its prediction is set and differs from the text config's width, unless the
    # release special-cases the class (the names in the release's own block, as the patch's variants).
    special_cased = bool(code) and f'"{row["model_class"]}"' in code
    row["patch_acts"] = (
        prediction is not None
        and "prediction_error" not in row
        and prediction != row.get("text_config_vocab_size")
        and not special_cased
    )
    # The case the patch must never reach: stock's read equals the logits (stock works), the patch acts
    # and its width is not the logits' (its run would fail).
    row["patch_breaks_stock"] = bool(
        row["patch_acts"] and prediction != row["logits_width"] and row.get("config_value") == row["logits_width"]
    )


# --------------------------------------------------------------------------------------------
# Parent side: lists the jobs, feeds workers, enforces the per-model time limit, renders.
# --------------------------------------------------------------------------------------------


# The classes `_beam_search` names in its special cases: not in the auto mappings, but the reason
# the special cases exist (`--extras` adds them).
EXTRA_JOBS = (
    ("bark", "BarkSemanticModel", "EXTRA_BEAM_SEARCH_SPECIAL_CASE"),
    ("moshi", "MoshiDepthDecoder", "EXTRA_BEAM_SEARCH_SPECIAL_CASE"),
)


def list_jobs(only, extras=False):
    from transformers.models.auto import modeling_auto

    jobs, seen = [], set()
    if extras:
        jobs.extend(job for job in EXTRA_JOBS if not only or job[0] in only)
        seen.update((job[0], job[1]) for job in jobs)
    for mapping_name in MAPPING_NAMES:
        mapping = getattr(modeling_auto, mapping_name, None)
        if mapping is None:
            continue
        for model_type, class_name in mapping.items():
            if isinstance(class_name, (list, tuple)):
                class_name = class_name[0]
            key = (model_type, class_name)
            if key in seen or (only and model_type not in only):
                continue
            seen.add(key)
            jobs.append((model_type, class_name, mapping_name.replace("_MAPPING_NAMES", "")))
    return jobs


def run_survey(jobs, per_model_timeout):
    import selectors

    env = {
        **os.environ,
        "ATTN_OVERLAY": "1" if os.environ.get(WITH_OVERLAY) else "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    rows, header, pending = [], None, list(jobs)
    start_failures = 0
    while pending:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        proc.stdin.write(json.dumps(pending))
        proc.stdin.close()
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        current, deadline = None, time.monotonic() + 300
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(timeout=remaining):
                reason = (
                    f"over the per-model limit ({per_model_timeout:.0f}s)"
                    if current
                    else "the worker did not start (import over 300 s)"
                )
                break
            line = proc.stdout.readline()
            if not line:
                reason = f"worker died (exit {proc.poll()})"
                break
            event = json.loads(line)
            if event["event"] == "ready":
                header = header or event
            elif event["event"] == "start":
                current = event["model_type"]
                deadline = time.monotonic() + per_model_timeout
            elif event["event"] == "row":
                event.pop("event")
                rows.append(event)
                pending = [job for job in pending if job[0] != event["model_type"] or job[1] != event["model_class"]]
                print(
                    f"{event['model_type']:32} {event['outcome']:8} {event.get('config_value')} "
                    f"{event.get('logits_width')} prediction={event.get('prediction')} "
                    f"[{event.get('prediction_outcome', '-')}{', acts' if event.get('patch_acts') else ''}] "
                    f"{event.get('method', event.get('reason', ''))[:80]}",
                    flush=True,
                )
                current = None
                deadline = time.monotonic() + per_model_timeout
        proc.kill()
        proc.wait()
        if current is None and not pending:
            break
        if current is None:
            # The worker failed before or between models (on a loaded machine an import can take
            # minutes): start another for the same jobs, twice, before recording the next as skipped.
            start_failures += 1
            if start_failures <= 2:
                continue
            current = pending[0][0]
        start_failures = 0
        job = next(job for job in pending if job[0] == current)
        rows.append({"model_type": job[0], "model_class": job[1], "mapping": job[2], "outcome": "skipped", "reason": reason})
        print(f"{job[0]:32} skipped  {reason}", flush=True)
        pending.remove(job)
    return header, rows


def run_sharded(jobs, per_model_timeout, workers):
    """Split the jobs over `workers` survey loops running side by side (threads feeding processes)."""
    from concurrent.futures import ThreadPoolExecutor

    shards = [jobs[index::workers] for index in range(max(workers, 1))]
    with ThreadPoolExecutor(len(shards)) as pool:
        results = list(pool.map(lambda shard: run_survey(shard, per_model_timeout), shards))
    header = next((header for header, _ in results if header), None)
    return header, [row for _, shard_rows in results for row in shard_rows]


def render_markdown(header, rows, release, seconds):
    totals = {}
    for row in rows:
        totals[row["outcome"]] = totals.get(row["outcome"], 0) + 1
    lines = [
        f"### transformers {release}",
        "",
        "Beam search's width expression in this release: "
        + ("`" + " ".join(header["code"].split()) + "`" if header and header["code"] else "none (reads the logits)"),
        f"Stock `_beam_search` (overlay {'on' if os.environ.get(WITH_OVERLAY) else 'off'}): "
        f"{header and header['stock_beam_search']}. "
        f"{len(rows)} model classes, {seconds:.0f} s.",
        "",
        "Totals: " + ", ".join(f"{k}: {v}" for k, v in sorted(totals.items())),
        "",
        *render_prediction_summary(rows),
        "",
        "| model type | class | mapping | config value (beam search) | logits width | prediction (patch) "
        "| outcome | measure / reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r["outcome"] != "differ", r["model_type"])):
        detail = row.get("method") or row.get("reason", "")
        if row.get("generate"):
            detail += "; generate: " + "; ".join(f"{k}: {v}" for k, v in row["generate"].items())
        detail = detail.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {row['model_type']} | {row['model_class']} | {row['mapping'].replace('MODEL_FOR_', '')} "
            f"| {row.get('config_value', '')} | {row.get('logits_width', '')} | {prediction_cell(row)} "
            f"| {row['outcome']} | {detail} |"
        )
    return "\n".join(lines) + "\n"


def prediction_cell(row):
    """The patch's prediction as a table cell: the width, `-` (none), marked where it acts or differs."""
    if "prediction_outcome" not in row:
        return ""
    if "prediction_error" in row:
        return "raised: " + row["prediction_error"].replace("|", "\\|")
    if row["prediction"] is None:
        return f"- ({row.get('head_type', '?')})"
    marks = [mark for flag, mark in ((row["prediction_outcome"] == PREDICTION_DIFFERS, "≠ logits"),
                                     (row.get("patch_acts"), "acts")) if flag]
    return str(row["prediction"]) + (f" ({', '.join(marks)})" if marks else "")


def render_prediction_summary(rows):
    """Counts of the patch's prediction against the logits, and every row that is not `= logits`."""
    measured = [row for row in rows if "prediction_outcome" in row]
    counts = {}
    for row in measured:
        counts[row["prediction_outcome"]] = counts.get(row["prediction_outcome"], 0) + 1
    # A "head width" row measured no logits: its width is the head's out_features, so there the
    # comparison only checks the head's rows against its declared width.
    head_only = {}
    for row in measured:
        if row["method"].startswith("head width"):
            head_only[row["prediction_outcome"]] = head_only.get(row["prediction_outcome"], 0) + 1
    lines = [
        f"The patch's prediction ({len(measured)} classes measured): "
        + ", ".join(f"{k}: {v} ({head_only.get(k, 0)} of them head width only)" for k, v in sorted(counts.items()))
        + f"; the patch acts on {sum(bool(row.get('patch_acts')) for row in measured)}; "
        f"**breaks a class stock runs: {sum(bool(row.get('patch_breaks_stock')) for row in measured)}**",
    ]
    for row in sorted(measured, key=lambda r: (r["prediction_outcome"], r["model_type"], r["model_class"])):
        if row["prediction_outcome"] == PREDICTION_EQUAL and not row.get("patch_acts"):
            continue
        lines.append(
            f"- {row['prediction_outcome']}: `{row['model_type']}` {row['model_class']}: release's read "
            f"{row.get('config_value')}, logits {row['logits_width']}, prediction {row.get('prediction')}, "
            f"text config {row.get('text_config_vocab_size')}, head {row.get('head_type')}, "
            f"patch acts: {row.get('patch_acts')}, GenerationMixin: {row.get('generation_mixin')} ({row['method']})"
            + (f"; {row['prediction_error']}" if "prediction_error" in row else "")
        )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--per-model-timeout", type=float, default=45.0)
    parser.add_argument("--extras", action="store_true", help="add the classes _beam_search special-cases")
    parser.add_argument("--workers", type=int, default=1, help="worker processes side by side")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--json", help="write the raw rows here")
    parser.add_argument("--with-overlay", action="store_true",
                        help="workers run with the overlay active (default: off, stock transformers)")
    parser.add_argument("--generate-always", action="store_true",
                        help="confirm with generate() for every model measured by a forward, not only where widths differ")
    args = parser.parse_args(argv)
    if args.worker:
        worker([tuple(job) for job in json.loads(sys.stdin.read())])
        return 0
    os.environ["ATTN_OVERLAY"] = "0"
    if args.generate_always:  # read by the workers, which inherit the environment
        os.environ[GENERATE_ALWAYS] = "1"
    if args.with_overlay:
        os.environ[WITH_OVERLAY] = "1"
    import transformers

    only = {name.strip() for name in args.only.split(",") if name.strip()}
    jobs = list_jobs(only, args.extras)
    print(f"transformers {transformers.__version__}: {len(jobs)} model classes", flush=True)
    started = time.monotonic()
    header, rows = run_sharded(jobs, args.per_model_timeout, args.workers)
    seconds = time.monotonic() - started
    text = render_markdown(header, rows, transformers.__version__, seconds)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"release": transformers.__version__, "header": header, "rows": rows}, handle, indent=1)
    print(text.split("\n| model type")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
