"""The device-move-nested patch (bug 1): nested input tensors left on the host.

Reproduced for real on a CPU-only machine with the fake second device of ``overlay.testing``
(host memory, its own device name): tiny random Gemma 3 (sliding + full layer types) and Qwen 3
models on the device, a left-padded batch of 2 kept on the host, a static cache. On an affected
transformers the stock run fails with PyTorch's device-mismatch error and the patched run
generates the same token ids as a pure CPU run and as the run with inputs on the device. Controls
(inputs on the device, a dynamic cache, Llama without ``layer_types``) pass either way. On
5.20.0+ the stock run passes and the engine reports the patch as fixed upstream.

torch can rename its PrivateUse1 backend once per process, so every device name runs in its own
subprocess: this file is also the worker (``python test_patch_device_move.py <device>``), which
runs the whole matrix once and prints the results as JSON; the tests read them. The decision
logic of the wrapper is tested in-process with a spy instead of a device.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.version import Version

from overlay.patch import Variant
from overlay.testing.harness import PatchUnderTest, assert_generated, fake_version_label, run_json_worker

PATCH = PatchUnderTest("device_move")
PATCH.skip_module_unless_covered()  # before 5.13.0 prepare_inputs_for_generation moves nothing
WORKER_TIMEOUT_S = 900  # imports, a first build of the fake device (about a minute), 40 tiny generations
RESULT_MARKER = "DEVICE_MOVE_RESULT="
MODELS = ("gemma3", "qwen3", "llama")
BUGGY_MODELS = ("gemma3", "qwen3")  # configs with layer_types: the static-cache mask is a dict


def _patch():
    return PATCH.patch




def stock_fails(model: str) -> bool:
    """Whether stock transformers fails with host inputs and a static cache for this model.

    Qwen 3's default config has one layer type (all full attention); 5.13.x returned a single
    mask tensor (top-level, so moved) when a config has one layer type, and the dict only from
    5.14.0 on. Gemma 3 here mixes sliding and full layers: a dict on every affected release.
    """
    if not PATCH.affected:
        return False
    return model != "qwen3" or PATCH.transformers >= Version("5.14.0")


def mismatch_error(device: str) -> str:
    return PATCH.error("neuron:0 and cpu!", device=device)


# -- the patch data ---------------------------------------------------------------------------------


# -- when the wrapper moves: decided like 5.20.0, tested with a spy ----------------------------------


def _stand_in(self, input_ids, inputs_embeds, is_first_iteration, attention_mask):
    """What the originals do that the wrapper relies on: step 1 stores the input tensor under its
    key, step 6 moves the top-level tensors when that tensor is off the model device."""
    import torch

    encoder_decoder = self.config.is_encoder_decoder
    key = "decoder_input_ids" if encoder_decoder else "input_ids"
    inputs = {}
    if not encoder_decoder and inputs_embeds is not None and is_first_iteration:
        inputs[key], inputs["inputs_embeds"] = None, inputs_embeds.clone()
    else:
        inputs[key] = input_ids.clone()
    inputs["attention_mask"] = {"full_attention": attention_mask}
    input_tensor = inputs.get("inputs_embeds", inputs[key])
    if self.device.type != "meta" and input_tensor.device != self.device:
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor):
                # The originals call .to(); meta tensors cannot be copied, an empty one stands in.
                inputs[name] = torch.empty_like(value, device=self.device)
    return inputs


def _original_518(self, input_ids, next_sequence_length=None, past_key_values=None, attention_mask=None,
                  inputs_embeds=None, is_first_iteration=False, **kwargs):
    """Stand-in with the 5.13-5.23 parameter list."""
    return _stand_in(self, input_ids, inputs_embeds, is_first_iteration, attention_mask)


def _original_524(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                  inputs_embeds=None, is_first_iteration=False, **kwargs):
    """Stand-in with 5.24.0's parameter list (``past_key_values`` renamed ``cache``)."""
    return _stand_in(self, input_ids, inputs_embeds, is_first_iteration, attention_mask)


@pytest.fixture
def spied_wrapper(monkeypatch):
    """Build the replacement around a stand-in original, with move_tree replaced by a spy."""
    import overlay.tree_move

    moves = []

    def spy(tree, device):
        moves.append(device)
        return tree

    monkeypatch.setattr(overlay.tree_move, "move_tree", spy)

    def build(original):
        # Synthetic stand-ins of each release's signature: no release's fingerprint, so the
        # replacement is built for them by hand (it reads nothing from its variant).
        return _patch().targets[0].replace(original, Variant("synthetic"))

    return build, moves


def _model(device="cpu", encoder_decoder=False):
    import torch

    return SimpleNamespace(device=torch.device(device), config=SimpleNamespace(is_encoder_decoder=encoder_decoder))


STAND_INS = pytest.mark.parametrize("original", [_original_518, _original_524], ids=["5.18-signature", "5.24-signature"])


@STAND_INS
def test_moves_exactly_when_the_input_tensor_is_off_the_model_device(spied_wrapper, original):
    import torch

    build, moves = spied_wrapper
    wrapper = build(original)
    host, elsewhere = torch.ones(1, 3), torch.ones(1, 3, device="meta")

    wrapper(_model("cpu"), host, attention_mask=host)
    assert moves == []  # inputs on the model device: nothing walked, as upstream

    wrapper(_model("cpu"), elsewhere, attention_mask=elsewhere)
    assert moves == [torch.device("cpu")]

    moves.clear()
    wrapper(_model("meta"), host, attention_mask=host)
    assert moves == []  # a model on the meta device is never a move target


@STAND_INS
def test_embeddings_decide_on_the_first_iteration_of_decoder_only_models(spied_wrapper, original):
    import torch

    build, moves = spied_wrapper
    wrapper = build(original)
    ids_on_device, embeds_elsewhere = torch.ones(1, 3), torch.ones(1, 3, 4, device="meta")

    wrapper(_model("cpu"), ids_on_device, inputs_embeds=embeds_elsewhere, is_first_iteration=True)
    assert moves == [torch.device("cpu")]
    moves.clear()
    # Positional arguments are found through the original's signature.
    wrapper(_model("cpu"), ids_on_device, None, None, None, embeds_elsewhere, True)
    assert moves == [torch.device("cpu")]
    moves.clear()
    # Later iterations use input_ids, and so do encoder-decoder models.
    wrapper(_model("cpu"), ids_on_device, inputs_embeds=embeds_elsewhere, is_first_iteration=False)
    wrapper(_model("cpu"), ids_on_device, inputs_embeds=embeds_elsewhere)
    wrapper(_model("cpu", encoder_decoder=True), ids_on_device, inputs_embeds=embeds_elsewhere, is_first_iteration=True)
    assert moves == []


@STAND_INS
def test_encoder_decoder_models_decide_on_the_decoder_input_ids(spied_wrapper, original):
    import torch

    build, moves = spied_wrapper
    wrapper = build(original)
    encoder_decoder = _model("cpu", encoder_decoder=True)
    wrapper(encoder_decoder, torch.ones(1, 3, device="meta"))
    assert moves == [torch.device("cpu")]
    moves.clear()
    wrapper(encoder_decoder, torch.ones(1, 3))
    assert moves == []


def test_replacement_keeps_signature_docstring_and_wraps_the_original():
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.__dict__["prepare_inputs_for_generation"]
    replacement = _patch().targets[0].build(original, otherwise=Variant("installed code, wrapped by hand"))
    assert replacement.__wrapped__ is original
    assert replacement.__doc__ == original.__doc__ and replacement.__name__ == original.__name__
    # generate() validates model kwargs against this signature.
    assert inspect.signature(replacement) == inspect.signature(original)


# -- the real failure and fix, one subprocess per device name -----------------------------------------


def _run_worker(device_spec: str, cwd: Path) -> dict:
    return run_json_worker(
        Path(__file__).resolve(), [device_spec], marker=RESULT_MARKER, timeout=WORKER_TIMEOUT_S, cwd=str(cwd)
    )


@pytest.fixture(scope="module", params=["fakeaccel", "neuron"])
def matrix(request, tmp_path_factory):
    return _run_worker(request.param, tmp_path_factory.mktemp(f"device-move-{request.param}"))


@pytest.mark.parametrize("model", BUGGY_MODELS)
def test_host_inputs_with_static_cache_on_stock_transformers(matrix, model):
    run = matrix["runs"][model]["stock"]["host_static"]
    if stock_fails(model):
        assert not run["ok"], "stock transformers was expected to fail with host inputs and a static cache"
        assert mismatch_error(matrix["device"]) in run["error"]
        assert "cpu" in run["forward_devices"]  # the nested masks reached the forward on the host
    else:
        assert_generated(run, matrix["runs"][model]["cpu"])


@pytest.mark.parametrize("model", BUGGY_MODELS)
def test_host_inputs_with_static_cache_with_the_overlay(matrix, model):
    runs = matrix["runs"][model]
    run = runs["patched"]["host_static"]
    assert run["ok"], run.get("error")
    assert run["forward_devices"] == [matrix["device"]]
    assert run["ids"] == runs["cpu"]
    assert run["ids"] == runs["patched"]["device_static"]["ids"]


@pytest.mark.parametrize("model", MODELS)
def test_fired_counter_counts_the_steps_that_moved_nested_tensors(matrix, model):
    runs = matrix["runs"][model]
    fixing = runs["patched"]["host_static"]
    if model in BUGGY_MODELS and stock_fails(model):
        # Every step builds the nested masks on the host: each one is moved and counted.
        assert fixing["fired"] > 0
        assert fixing["actions"] == [f"moved nested tensors to {matrix['device']}"]
    else:
        assert fixing["fired"] == 0, "one top-level mask (Llama, Qwen 3 on 5.13.x) or fixed upstream: nothing nested"
    # Nothing to fix: inputs on the device, a dynamic cache, or the overlay off.
    for case in ("device_static", "host_dynamic", "device_dynamic"):
        assert runs["patched"][case]["fired"] == 0, case
    for case, run in runs["stock"].items():
        assert run["fired"] == 0, case


@pytest.mark.parametrize("case", ["device_static", "host_dynamic", "device_dynamic"])
@pytest.mark.parametrize("state", ["stock", "patched"])
@pytest.mark.parametrize("model", MODELS)
def test_controls_pass_with_and_without_the_overlay(matrix, model, state, case):
    run = matrix["runs"][model][state][case]
    assert_generated(run, matrix["runs"][model]["cpu"])


@pytest.mark.parametrize("state", ["stock", "patched"])
def test_llama_without_layer_types_passes_with_host_inputs(matrix, state):
    run = matrix["runs"]["llama"][state]["host_static"]
    assert_generated(run, matrix["runs"]["llama"]["cpu"])


def test_engine_status(matrix):
    PATCH.assert_reported(matrix["status"])


def test_model_overriding_prepare_inputs_and_calling_super(matrix):
    override = matrix["override"]
    assert override["super_calls_patched"] > 0
    patched = override["patched"]
    assert_generated(patched, matrix["runs"]["gemma3"]["cpu"])
    if PATCH.affected:
        assert not override["stock"]["ok"]
        assert mismatch_error(matrix["device"]) in override["stock"]["error"]
    else:
        assert override["stock"]["ok"], override["stock"].get("error")


@pytest.mark.parametrize("model", BUGGY_MODELS)
def test_wrapper_applied_by_hand_to_the_installed_code(matrix, model):
    # Bypasses the engine's gate: on 5.20.0+ this wraps the already-fixed code, and on 5.24.0 the
    # one whose cache argument is named `cache`, which the wrapper must handle unchanged.
    run = matrix["runs"][model]["by_hand"]["host_static"]
    assert run["ok"], run.get("error")
    assert run["forward_devices"] == [matrix["device"]]
    assert run["ids"] == matrix["runs"][model]["cpu"]


def test_the_code_decides_under_a_newer_version_label(tmp_path):
    # Issue 38: this release's code under package metadata that says 5.26.0 (a source tree or a
    # vendored copy first on the path, a fork with its own version) was "fixed upstream", and the
    # host-input static-cache case kept failing. The code is the bug's: the patch applies.
    if not PATCH.affected:
        pytest.skip(f"transformers {PATCH.transformers} ships the fix: its code decides the same")
    label = fake_version_label(tmp_path / "label", "5.26.0")
    matrix = run_json_worker(Path(__file__).resolve(), ["fakeaccel", "gemma3"], marker=RESULT_MARKER,
                             timeout=WORKER_TIMEOUT_S, cwd=str(tmp_path), env={"PYTHONPATH": label})
    assert matrix["status"]["state"] == "applied", matrix["status"]
    assert "the code decides, though the package metadata of transformers says 5.26.0" in matrix["status"]["reason"]
    runs = matrix["runs"]["gemma3"]
    assert not runs["stock"]["host_static"]["ok"] and mismatch_error(matrix["device"]) in runs["stock"]["host_static"]["error"]
    assert runs["patched"]["host_static"]["ids"] == runs["patched"]["device_static"]["ids"] == runs["cpu"]


@pytest.mark.gpu
def test_cuda_host_inputs_with_static_cache(tmp_path):
    """The host-input static-cache case on a real GPU (skipped without CUDA: tests/conftest.py)."""
    matrix = _run_worker("cuda", tmp_path)
    for model in BUGGY_MODELS:
        runs = matrix["runs"][model]
        if stock_fails(model):
            assert not runs["stock"]["host_static"]["ok"]
            assert "cpu" in runs["stock"]["host_static"]["error"]
        patched = runs["patched"]["host_static"]
        assert_generated(patched, runs["patched"]["device_static"]["ids"])
        # CUDA kernels may differ from CPU ones in the last bits; with random tiny weights the
        # greedy ids can differ from the CPU run, so the on-device-input run is the reference.
        assert patched["forward_devices"] == [matrix["device"]]


# -- the worker -------------------------------------------------------------------------------------


def _worker(device_spec: str, models: tuple[str, ...] = MODELS) -> dict:
    import torch

    torch.set_num_threads(1)
    if device_spec == "cuda":
        device = torch.device("cuda:0")
    else:
        from overlay.testing import install_fake_device

        device = install_fake_device(device_spec)
    device_name = str(torch.empty(0, device=device).device)

    import transformers
    from transformers.generation.utils import GenerationMixin

    from overlay.patch import PATCH_MARKER
    from overlay.testing.models import generate_seeing_devices, tiny_config, tiny_model

    # Two query heads sharing one KV head of 16; Gemma 3: a sliding (window 4) and a full layer.
    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=64, sliding_window=4)
    configs = {kind: tiny_config(kind, **sizes) for kind in models}
    assert "gemma3" not in configs or configs["gemma3"].layer_types == ["sliding_attention", "full_attention"]
    assert "qwen3" not in configs or configs["qwen3"].layer_types
    assert "llama" not in configs or not hasattr(configs["llama"], "layer_types")

    host_ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])  # left-padded with pad id 0
    host_mask = (host_ids != 0).long()

    def generate(model, inputs_on_device, cache):
        ids, mask = (host_ids.to(device), host_mask.to(device)) if inputs_on_device else (host_ids, host_mask)
        # "fired": steps in which the patch moved something (overlay.report, its slow path only).
        return generate_seeing_devices(model, PATCH.id, input_ids=ids, attention_mask=mask, max_new_tokens=4,
                                       do_sample=False, cache_implementation=cache, disable_compile=True,
                                       pad_token_id=0)

    cases = {
        "host_static": (False, "static"),
        "device_static": (True, "static"),
        "host_dynamic": (False, "dynamic"),
        "device_dynamic": (True, "dynamic"),
    }

    def stock_code():
        assert not hasattr(GenerationMixin.prepare_inputs_for_generation, PATCH_MARKER)

    @contextlib.contextmanager
    def overlay_applied():
        with PATCH.applied() as statuses:
            yield statuses[PATCH.id]

    @contextlib.contextmanager
    def wrapped_by_hand():
        original = GenerationMixin.__dict__["prepare_inputs_for_generation"]
        GenerationMixin.prepare_inputs_for_generation = PATCH.patch.targets[0].build(original, otherwise=Variant("installed code, wrapped by hand"))
        try:
            yield
        finally:
            GenerationMixin.prepare_inputs_for_generation = original

    results = {"device": device_name, "transformers": transformers.__version__, "runs": {}}
    built = {}  # not `models`: that is the parameter, read below
    for name, config in configs.items():
        cpu_model = tiny_model(name, config=config)
        runs = {"cpu": generate(cpu_model, False, "static")["ids"]}
        # A separate instance for the device: generate keeps its static cache on the model and
        # some releases (5.13) reuse it on the next call, which would bring a CPU cache along.
        model = tiny_model(name, device=device, config=config)
        built[name] = model
        stock_code()
        runs["stock"] = {case: generate(model, *args) for case, args in cases.items()}
        with overlay_applied() as status:
            results["status"] = {"state": status.state, "reason": status.reason, "variants": list(status.variants)}
            runs["patched"] = {case: generate(model, *args) for case, args in cases.items()}
        stock_code()
        with wrapped_by_hand():
            runs["by_hand"] = {"host_static": generate(model, *cases["host_static"])}
        results["runs"][name] = runs

    if models != MODELS:  # a few models asked for: the override case runs with the whole matrix only
        return results

    class Gemma3WithOwnPrepareInputs(transformers.Gemma3ForCausalLM):
        super_calls = 0

        def prepare_inputs_for_generation(self, input_ids, **kwargs):
            type(self).super_calls += 1
            model_inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
            model_inputs.pop("token_type_ids", None)
            return model_inputs

    overriding = Gemma3WithOwnPrepareInputs(configs["gemma3"]).eval()
    overriding.load_state_dict(built["gemma3"].state_dict())
    overriding.to(device)
    results["override"] = {"stock": generate(overriding, *cases["host_static"])}
    Gemma3WithOwnPrepareInputs.super_calls = 0
    with overlay_applied():
        results["override"]["patched"] = generate(overriding, *cases["host_static"])
    results["override"]["super_calls_patched"] = Gemma3WithOwnPrepareInputs.super_calls
    return results


if __name__ == "__main__":
    import json

    print(RESULT_MARKER + json.dumps(_worker(sys.argv[1], tuple(sys.argv[2:]) or MODELS)), flush=True)


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('errors', 'test_controls_pass_with_and_without_the_overlay',
                    "moves only tensors on another device than the model's, which stock's kernels refuse")
