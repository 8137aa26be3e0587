"""Testing utilities of attn-overlay.

:func:`install_fake_device` gives torch a second device backed by host memory, so that
device-placement bugs in generation code (a tensor left on the CPU next to tensors on the
accelerator) reproduce on CPU-only machines with PyTorch's own error message. See
:mod:`overlay.testing.fake_device` for usage and limits.

Importing this package does not import torch.
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
    "install_fake_device",
    "fake_device_available",
    "fake_device_backend",
    "fake_device_cache_dir",
]
