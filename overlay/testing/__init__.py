"""Testing utilities of attn-overlay: the one kit the tests, the doctor and the benchmarks use.

- :func:`install_fake_device` gives torch a second device backed by host memory, so that
  device-placement bugs in generation code (a tensor left on the CPU next to tensors on the
  accelerator) reproduce on CPU-only machines with PyTorch's own error message. See
  :mod:`overlay.testing.fake_device` for usage and limits.
- :mod:`overlay.testing.models`: tiny random models of every kind the patches care about
  (Gemma 3, Qwen 3, Llama, OLMo 2, T5), left-padded batches, greedy generation.
- :mod:`overlay.testing.tensor_parallel`: tensor-parallel plans and loading a saved tiny model
  with one.
- :mod:`overlay.testing.harness`: a patch under test on the installed release (affected or fixed
  upstream, its stock function, applied for a block, its declared error texts) and fresh worker
  processes.

Importing this package (or any of those modules) does not import torch.
"""

from .fake_device import (
    DEFAULT_DEVICE_NAME,
    FakeDeviceUnavailable,
    fake_device_available,
    fake_device_backend,
    fake_device_cache_dir,
    install_fake_device,
)

__all__ = [
    "DEFAULT_DEVICE_NAME",
    "FakeDeviceUnavailable",
    "fake_device_available",
    "fake_device_backend",
    "fake_device_cache_dir",
    "install_fake_device",
]
