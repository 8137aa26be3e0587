"""Figure 6 (GPU only): host-side inputs cost next to nothing once the overlay moves them.

With the overlay applied, a small Gemma 3 (``layer_types`` sliding + full) on the GPU generates
with ``cache_implementation="static"`` from a left-padded batch kept on the host (as a tokenizer
returns it) and from the same batch already on the GPU; tokens/s ratio host / on-device per round.
Each decoding step with host inputs copies the step's inputs and per-layer-type masks to the
GPU, which is the whole difference. The same worker also records what stock transformers does
with the host batch (the device-mismatch error on affected releases) and that the overlay's
host-input run generates the very tokens of the on-device run.

On a machine without CUDA the figure is reported as not run. ``--gpu-device fakeaccel`` runs the
same code on ``overlay.testing``'s fake device, to check the script itself on a CPU machine; its
numbers say nothing about a GPU and the report marks them so.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from . import FIGURES, common
from .common import AT_LEAST, CHECK_ONLY, NOT_RUN, OK, ratio_case

FIGURE = 6
ID, TITLE = FIGURES[FIGURE]
GOAL = 0.98


def settings(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"rounds": 2, "warmup": 1, "new_tokens": 4, "scale": 1, "prompt_len": 8}
    return {"rounds": 20, "warmup": 2, "new_tokens": 64, "scale": 4, "prompt_len": 32}


def nvidia_device_present() -> bool:
    """Cheap look for an NVIDIA GPU, so a CPU machine does not start a worker just to learn it has
    none; where one is found the worker still asks torch (a CPU build of torch sees no CUDA)."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def run(smoke: bool, options: dict[str, Any]) -> common.Figure:
    payload = {**settings(smoke), "device": options.get("gpu_device", "cuda")}
    if payload["device"] == "cuda" and not nvidia_device_present():
        return common.Figure(FIGURE, ID, TITLE, status=NOT_RUN, reason="no CUDA (no NVIDIA device on this machine)")
    if payload["device"] != "cuda":
        payload.update(settings(True))  # a fake device is only a check of the script
    result = common.run_worker("gpu", payload, timeout=300 if smoke else 1200)
    return common.figure_from_worker(FIGURE, ID, TITLE, result)


def worker(payload: dict[str, Any]) -> dict[str, Any]:
    import torch

    wanted = payload.get("device", "cuda")
    if wanted == "cuda":
        if not torch.cuda.is_available():
            return {"status": NOT_RUN, "reason": "no CUDA (torch sees no CUDA device)", "cases": [], "details": {}}
        device = torch.device("cuda", 0)
        device_note = torch.cuda.get_device_name(device)
        dtype = torch.bfloat16
    else:
        from overlay.testing import install_fake_device

        device = install_fake_device(wanted)
        device_note = f"overlay.testing fake device {device} (a check of the script, not a GPU figure)"
        dtype = torch.float32

    from . import models
    from .overlay_access import apply_all, revert_all

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    model = models.gemma3(scale=payload["scale"], dtype=dtype).to(device)
    host_batch = models.left_padded_batch(prompt_len=payload["prompt_len"], vocab=model.config.vocab_size)
    device_batch = {k: v.to(device) for k, v in host_batch.items()}
    kwargs = models.generate_kwargs(payload["new_tokens"], cache="static")
    details: dict[str, Any] = {
        "device": device_note,
        "model": f"Gemma3ForCausalLM, hidden {model.config.hidden_size}, {model.config.num_hidden_layers} layers, {dtype}",
        "batch": f"2 prompts of {payload['prompt_len']} tokens, left-padded",
        "new_tokens": payload["new_tokens"],
    }

    # Stock transformers with the host batch (no overlay): the bug this figure's patch fixes.
    revert_all()
    try:
        with torch.no_grad():
            model.generate(**host_batch, **kwargs)
        details["stock_with_host_inputs"] = "ok"
    except Exception as exc:  # the device mismatch on affected releases
        details["stock_with_host_inputs"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"

    details["patch_states"] = apply_all()
    try:
        def sampler(batch):
            def sample() -> float:
                synchronize()
                start = time.perf_counter()
                with torch.no_grad():
                    model.generate(**batch, **kwargs)
                synchronize()
                return time.perf_counter() - start

            return sample

        samples = common.interleave({"host": sampler(host_batch), "device": sampler(device_batch)},
                                    payload["rounds"], payload["warmup"])
        with torch.no_grad():
            from_host = model.generate(**host_batch, **kwargs)
            from_device = model.generate(**device_batch, **kwargs)
        details["same_tokens_host_and_device"] = bool(torch.equal(from_host.cpu(), from_device.cpu()))
    finally:
        revert_all()
    tokens = host_batch["input_ids"].shape[0] * payload["new_tokens"]
    details["tokens_per_second_median"] = {k: tokens / common.summary(v)["median"] for k, v in samples.items()}
    case = ratio_case("static-cache generate tokens/s: host-side inputs / on-device inputs",
                      ("host", samples["host"]), ("device", samples["device"]),
                      goal=GOAL, direction=AT_LEAST, invert=True,
                      note=f"overlay applied; {device_note}")
    return {"status": OK if device.type == "cuda" else CHECK_ONLY,
            "reason": "" if device.type == "cuda" else "fake device: the script ran; the ratio means nothing for a GPU",
            "details": details, "cases": [case.as_dict()]}
