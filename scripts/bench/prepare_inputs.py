"""Figure 3: the cost of the patched ``prepare_inputs_for_generation``.

Three functions are called side by side on the same captured arguments of one decoding step of a
tiny Gemma 3 with a static cache (its attention mask is a dict keyed by layer type):

``overlay``
    the device-move patch's replacement, built from the installed function exactly as the engine
    builds it (``PATCH.targets[0].build(stock)``), after the same version and fingerprint gate;
``upstream-5.20``
    the installed (stock, affected) function with its step 6 -- the loop that moves top-level
    tensors -- replaced by 5.20.0's line ``model_inputs = move_to_device(model_inputs, self.device)``,
    compiled from the installed source in the installed module's globals. Between 5.18.0 and
    5.20.0 this line is the only difference in the whole function (and ``move_to_device`` the only
    helper it adds), so this *is* 5.20.0's function running against 5.18's other code:
    two transformers releases cannot be imported in one process. ``move_to_device`` is
    re-implemented here behaviour for behaviour: every tensor goes through ``.to(device)``, dicts
    are rebuilt as plain dicts, lists and tuples through ``type(value)(...)``, anything else kept;
``stock``
    the installed function, untouched.

Cases: inputs already on the model's device (nothing to move: all three do the same work; the
overlay adds its argument inspection and one ``self.device``), and host-side inputs with the model
on an accelerator (CUDA when present, else ``overlay.testing``'s fake device backed by host
memory), where ``overlay`` and ``upstream-5.20`` move the nested per-layer-type masks and
``stock`` leaves them on the host -- a wrong result, so overlay/stock is reported there for
information only.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from . import FIGURES, common
from .common import AT_MOST, NOT_RUN, OK, Case, ratio_case

FIGURE = 3
ID, TITLE = FIGURES[FIGURE]
GOAL = 1.05

_STEP6_LOOP = re.compile(
    r"^(?P<indent>[ \t]+)for key, value in model_inputs\.items\(\):\n"
    r"(?P=indent)[ \t]+if isinstance\(value, torch\.Tensor\):\n"
    r"(?P=indent)[ \t]+model_inputs\[key\] = value\.to\(self\.device\)\n",
    re.M,
)
_STEP6_CONDITION = (
    'if self.device.type != "meta" and input_tensor is not None and input_tensor.device != self.device:'
)


def settings(smoke: bool) -> dict[str, Any]:
    return {"rounds": 3, "inner": 3, "warmup": 1} if smoke else {"rounds": 60, "inner": 200, "warmup": 3}


def run(smoke: bool, options: dict[str, Any]) -> common.Figure:
    payload = {**settings(smoke), "host_device": options.get("host_device", "auto")}
    result = common.run_worker(ID, payload, timeout=300 if smoke else 1800)
    return common.figure_from_worker(FIGURE, ID, TITLE, result)


# -- worker side ---------------------------------------------------------------------------------


def move_to_device_as_in_5_20(value: Any, device: Any) -> Any:
    """What transformers 5.20.0's ``pytorch_utils.move_to_device`` does (see the module docstring)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: move_to_device_as_in_5_20(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(move_to_device_as_in_5_20(item, device) for item in value)
    return value


def upstream_5_20_variant(stock: Callable[..., Any]) -> tuple[Callable[..., Any] | None, str]:
    """The installed function with 5.20.0's step 6, or (None, why not)."""
    import sys

    from overlay.patch import source_of

    source = source_of(stock)
    if _STEP6_CONDITION not in source:
        return None, "the installed function has no step-6 condition as in 5.13.0-5.20.0"
    matches = list(_STEP6_LOOP.finditer(source))
    if len(matches) != 1:
        return None, "the installed function's step 6 is not the top-level move loop of 5.13.0-5.19.0"
    match = matches[0]
    rewritten = (
        source[: match.start()]
        + f"{match['indent']}model_inputs = _move_to_device_as_in_5_20(model_inputs, self.device)\n"
        + source[match.end():]
    )
    module = sys.modules[stock.__module__]
    namespace = dict(vars(module))
    namespace["_move_to_device_as_in_5_20"] = move_to_device_as_in_5_20
    code = compile(rewritten, "<installed prepare_inputs_for_generation, step 6 as in transformers 5.20.0>", "exec")
    exec(code, namespace)
    return namespace[stock.__name__], "installed source, step 6 replaced by 5.20.0's recursive move"


def _capture_decode_step(model, batch, call_through: Callable[..., Any]) -> tuple[tuple, dict]:
    """Arguments ``generate`` passes to ``prepare_inputs_for_generation`` at a decoding step
    (not the prefill), recorded by an instance attribute that forwards to ``call_through``."""
    from .models import generate_kwargs

    calls: list[tuple[tuple, dict]] = []

    def recorder(*args, **kwargs):
        calls.append((args, dict(kwargs)))
        return call_through(model, *args, **kwargs)

    model.prepare_inputs_for_generation = recorder
    try:
        model.generate(**batch, **generate_kwargs(4, cache="static"))
    finally:
        del model.prepare_inputs_for_generation
    decode = [c for c in calls if not c[1].get("is_first_iteration", False)]
    if not decode:
        raise RuntimeError(f"generate made no decoding-step call ({len(calls)} calls recorded)")
    return decode[-1]


def _tensors(tree: Any, path: str = "") -> list[tuple[str, Any]]:
    import torch

    if isinstance(tree, torch.Tensor):
        return [(path, tree)]
    if isinstance(tree, dict):
        return [t for k, v in tree.items() for t in _tensors(v, f"{path}.{k}" if path else str(k))]
    if isinstance(tree, (list, tuple)):
        return [t for i, v in enumerate(tree) for t in _tensors(v, f"{path}[{i}]")]
    return []


def _off_device(tree: Any, device: Any) -> list[str]:
    return [path for path, t in _tensors(tree) if t.device != device]


def _same_values(a: Any, b: Any) -> bool:
    import torch

    ta, tb = _tensors(a), _tensors(b)
    return [p for p, _ in ta] == [p for p, _ in tb] and all(
        x.device == y.device and torch.equal(x.cpu(), y.cpu()) for (_, x), (_, y) in zip(ta, tb)
    )


def _host_device(choice: str) -> tuple[Any, str]:
    import torch

    if choice in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", 0), "cuda"
    if choice == "cuda":
        raise RuntimeError("host_device=cuda asked for, but torch sees no CUDA device")
    from overlay.testing import fake_device_backend, install_fake_device

    device = install_fake_device()
    return device, f"overlay.testing fake device ({fake_device_backend()} backend, host memory)"


def _time_variants(model, args, kwargs, functions: dict[str, Callable[..., Any]], payload) -> dict[str, list[float]]:
    import torch

    def sampler(function):
        def call():
            function(model, *args, **kwargs)

        def sample():
            with torch.no_grad():
                return common.timed_loop(call, payload["inner"])

        return sample

    return common.interleave({name: sampler(f) for name, f in functions.items()}, payload["rounds"], payload["warmup"])


def worker(payload: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers.generation.utils import GenerationMixin

    from . import models
    from .overlay_access import device_move_patch, gate_device_move

    stock = GenerationMixin.__dict__["prepare_inputs_for_generation"]
    applies, gate_reason = gate_device_move(stock)
    details: dict[str, Any] = {"gate": gate_reason, "inner_calls_per_sample": payload["inner"]}
    if not applies:
        return {"status": NOT_RUN, "reason": f"device-move-nested does not apply here ({gate_reason})",
                "details": details, "cases": []}
    overlay_fn = device_move_patch().targets[0].build(stock)
    upstream_fn, how = upstream_5_20_variant(stock)
    details["upstream_5_20"] = how
    if upstream_fn is None:
        return {"status": NOT_RUN, "reason": f"cannot build the 5.20.0 logic: {how}", "details": details, "cases": []}
    functions = {"overlay": overlay_fn, "upstream-5.20": upstream_fn, "stock": stock}
    cases: list[Case] = []

    # -- inputs already on the model's device (CPU here; the device on a GPU machine too) -------
    model = models.gemma3()
    batch = models.left_padded_batch()
    args, kwargs = _capture_decode_step(model, batch, stock)
    with torch.no_grad():
        outputs = {name: f(model, *args, **kwargs) for name, f in functions.items()}
    details["on_device"] = {
        "device": str(model.device),
        "attention_mask_type": type(outputs["stock"].get("attention_mask")).__name__,
        "attention_mask_keys": sorted(outputs["stock"]["attention_mask"])
        if isinstance(outputs["stock"].get("attention_mask"), dict) else None,
        "results_identical": all(_same_values(outputs["stock"], o) for o in outputs.values()),
    }
    samples = _time_variants(model, args, kwargs, functions, payload)
    details["on_device"]["seconds_per_call_median"] = {k: common.summary(v)["median"] for k, v in samples.items()}
    cases.append(ratio_case("on-device inputs: overlay / upstream 5.20.0 logic",
                            ("overlay", samples["overlay"]), ("upstream-5.20", samples["upstream-5.20"]),
                            goal=GOAL, direction=AT_MOST, note="time per call"))
    cases.append(ratio_case("on-device inputs: overlay / stock",
                            ("overlay", samples["overlay"]), ("stock", samples["stock"]),
                            goal=GOAL, direction=AT_MOST, note="time per call"))
    cases.append(ratio_case("on-device inputs: upstream 5.20.0 logic / stock",
                            ("upstream-5.20", samples["upstream-5.20"]), ("stock", samples["stock"]),
                            note="information: what upstream's own fix costs"))

    # -- host-side inputs, model on an accelerator, nested mask dict ------------------------------
    try:
        device, device_note = _host_device(payload.get("host_device", "auto"))
    except Exception as exc:  # no CUDA and no fake device: say so, keep the on-device cases
        cases.append(Case(name="host-side inputs, nested mask dict: overlay / upstream 5.20.0 logic", unit="ratio",
                          stats=None, goal=GOAL, direction=AT_MOST, status=NOT_RUN,
                          note=f"no accelerator and no fake device: {type(exc).__name__}: {exc}"))
        return {"status": OK, "details": details, "cases": [c.as_dict() for c in cases]}
    model = models.gemma3().to(device)
    batch = models.left_padded_batch()  # stays on the host, as a tokenizer returns it
    args, kwargs = _capture_decode_step(model, batch, overlay_fn)
    with torch.no_grad():
        outputs = {name: f(model, *args, **kwargs) for name, f in functions.items()}
    details["host_inputs"] = {
        "model_device": str(device),
        "device": device_note,
        "input_device": str(args[0].device if args else kwargs["input_ids"].device),
        "left_off_device": {name: _off_device(o, device) for name, o in outputs.items()},
        "overlay_equals_upstream_5_20": _same_values(outputs["overlay"], outputs["upstream-5.20"]),
    }
    samples = _time_variants(model, args, kwargs, functions, payload)
    details["host_inputs"]["seconds_per_call_median"] = {k: common.summary(v)["median"] for k, v in samples.items()}
    cases.append(ratio_case("host-side inputs, nested mask dict: overlay / upstream 5.20.0 logic",
                            ("overlay", samples["overlay"]), ("upstream-5.20", samples["upstream-5.20"]),
                            goal=GOAL, direction=AT_MOST, note=f"time per call; model on {device}"))
    cases.append(ratio_case("host-side inputs, nested mask dict: overlay / stock",
                            ("overlay", samples["overlay"]), ("stock", samples["stock"]),
                            note="information: stock leaves the nested masks on the host (wrong), so it does less"))
    return {"status": OK, "details": details, "cases": [c.as_dict() for c in cases]}
