"""The pure-Python fake device: used where no C++ compiler is available.

torch's PrivateUse1 backend is set up from Python (``_setup_privateuseone_for_python_backend``
registers the device guard, hooks and device module). Tensors on the device are instances of
:class:`HostBackedTensor`, a wrapper subclass that reports the fake device and holds an ordinary
CPU tensor with the data. Its ``__torch_dispatch__`` checks that all tensor arguments are on one
device, runs the CPU kernel on the held tensors and wraps the results again; factory functions
called with ``device=<fake>`` reach a Python fallback on the PrivateUse1 key that does the same.

Limits (see the documentation of overlay.testing.fake_device): device tensors are instances of
a ``torch.Tensor`` subclass without ``data_ptr()`` or storage, every op costs a Python call, and
there is no device allocator (torch takes one only from C++): torch.accelerator's memory
functions are replaced by ones that say so, except ``empty_cache``, which has nothing to free.
"""

from __future__ import annotations

from typing import Any

# Library objects must stay alive for their registrations to stay in place.
_libraries: list[Any] = []

# Operators that move data between devices: no common-device rule.
_CROSS_DEVICE = frozenset({"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "to"})

# Operators that accept CPU index tensors next to a device tensor on real accelerators.
_HOST_INDICES_OK = frozenset(
    {"index", "index_put_", "index_put", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"}
)


def install(name: str, device_module: Any, device_count: int = 1) -> None:
    import torch
    from torch.utils._pytree import tree_map
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    # Renames PrivateUse1 and registers the device module, a device guard and hooks.
    _setup_privateuseone_for_python_backend(rename=name, backend_module=device_module)
    fake = torch.device(name, 0)
    cpu = torch.device("cpu")

    def fake_device(requested: torch.device) -> torch.device:
        """``requested`` (a device of this type) with its index, checked against the count."""
        index = 0 if requested.index is None else requested.index
        if not 0 <= index < device_count:
            raise RuntimeError(
                f"Invalid device index {index}: the fake device has {device_count} "
                f"device{'s' if device_count != 1 else ''} (valid indices 0..{device_count - 1}; "
                f"install_fake_device(device_count=...) sets how many)"
            )
        return fake if index == 0 else torch.device(name, index)
    _TENSOR_DATA = torch._C.TensorBase.__dict__["data"]  # torch's own getter and setter

    def is_fake(device: Any) -> bool:
        return isinstance(device, torch.device) and device.type == name

    def to_host_device(value: Any) -> Any:
        # Device arguments reach kernels as torch.device objects.
        return cpu if is_fake(value) else value

    class HostBackedTensor(torch.Tensor):
        """A tensor on the fake device; ``_host`` is the CPU tensor holding its data."""

        _host: torch.Tensor

        @staticmethod
        def __new__(cls, host: torch.Tensor, device: torch.device = fake, requires_grad: bool | None = None) -> Any:
            if requires_grad is not None:
                # Called as the class of a parameter: a parameter on the fake device is an instance
                # of this class (torch.nn.Parameter marks custom tensors instead of subclassing
                # them), and accelerate rebuilds parameters with type(param)(data, requires_grad=..).
                return torch.nn.Parameter(host, requires_grad=requires_grad)
            wrapper = torch.Tensor._make_wrapper_subclass(
                cls,
                host.size(),
                strides=host.stride(),
                storage_offset=host.storage_offset(),
                dtype=host.dtype,
                layout=host.layout,
                device=device,
                requires_grad=host.requires_grad,
            )
            wrapper._host = host
            return wrapper

        __torch_function__ = torch._C._disabled_torch_function_impl

        # ``tensor.data = other`` replaces the wrapper's metadata (dtype, shape) in C++, but not
        # the held CPU tensor: ``Module.to(dtype)`` does exactly that to every parameter, and
        # without this a "bfloat16" model kept computing on its old float32 data (so dtype
        # mismatches that fail on every real device went unseen). The held tensor follows.
        @property
        def data(self) -> torch.Tensor:
            return _TENSOR_DATA.__get__(self)

        @data.setter
        def data(self, new: torch.Tensor) -> None:
            _TENSOR_DATA.__set__(self, new)
            if isinstance(new, HostBackedTensor):
                self._host = new._host

        def __format__(self, format_spec: str) -> str:
            # torch.Tensor formats only plain 0-dim tensors as numbers (tensor printing needs it).
            if self.dim() == 0:
                return self.item().__format__(format_spec)
            return super().__format__(format_spec)

        def tolist(self) -> Any:
            # torch.Tensor.tolist refuses subclasses; the held CPU tensor has the same view.
            return self._host.tolist()

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return _run_on_host(func, args, kwargs or {})

    HostBackedTensor.__module__ = __name__
    HostBackedTensor.__qualname__ = HostBackedTensor.__name__

    def unwrap(value: Any) -> Any:
        if isinstance(value, HostBackedTensor):
            return value._host
        return to_host_device(value)

    def check_common_device(func: Any, args: tuple, kwargs: dict) -> torch.device | None:
        """Same rule as real accelerators (and the C++ backend): every tensor argument on one
        device, except zero-dimensional CPU tensors and, for advanced indexing, CPU indices."""
        op_name = func._schema.name.split("::")[-1]
        host_indices_ok = op_name in _HOST_INDICES_OK
        common = None
        for position, argument in enumerate(func._schema.arguments):
            if position < len(args):
                value = args[position]
            elif argument.name in kwargs:
                value = kwargs[argument.name]
            else:
                continue
            values = value if isinstance(value, (list, tuple)) else (value,)
            for tensor in values:
                if not isinstance(tensor, torch.Tensor):
                    continue
                device = tensor.device
                if device.type == "cpu" and (tensor.dim() == 0 or (host_indices_ok and argument.name == "indices")):
                    continue
                if common is None:
                    common = device
                elif device != common:
                    raise RuntimeError(
                        "Expected all tensors to be on the same device, but found at least two devices, "
                        f"{common} and {device}! (when checking argument for argument {argument.name} "
                        f"in method {func._schema.name})"
                    )
        return common

    def _run_on_host(func: Any, args: tuple, kwargs: dict, factory: bool = False) -> Any:
        op_name = func._schema.name.split("::")[-1]
        common = None if op_name in _CROSS_DEVICE else check_common_device(func, args, kwargs)
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        for value in (*args, *kwargs.values()):
            if isinstance(value, (list, tuple)):
                inputs.extend(v for v in value if isinstance(v, torch.Tensor))
        wrappers = [t for t in inputs if isinstance(t, HostBackedTensor)]
        # New results belong to the fake device, unless the op was asked for a result elsewhere
        # (e.g. _to_copy(device="cpu") for .to("cpu")).
        requested = kwargs.get("device")
        target = common if common is not None and common.type == name else None
        if requested is not None:
            requested = torch.device(requested)
            if requested.type == name:
                target = fake_device(requested)
        if target is None:
            # No fake-device argument decided it (e.g. copy_ from a CPU tensor into a device
            # tensor, whose result is the passed-in wrapper anyway): the first wrapper's device.
            target = wrappers[0].device if wrappers else fake
        to_fake = factory or requested is None or requested.type == name
        host_args = tree_map(unwrap, args)
        host_kwargs = tree_map(unwrap, kwargs)
        result = func(*host_args, **host_kwargs)
        for wrapper in wrappers:
            host = wrapper._host
            if (host.shape, host.stride(), host.storage_offset()) != (
                wrapper.shape,
                wrapper.stride(),
                wrapper.storage_offset(),
            ):
                # The op resized or restrided its argument in place (resize_, unsqueeze_, an out=
                # argument of the wrong size...): give the wrapper the new metadata. Assigning
                # .data keeps the very object the caller holds.
                replacement = HostBackedTensor(host, wrapper.device)
                with torch._C._DisableTorchDispatch():
                    wrapper.data = replacement
                wrapper._host = host
        # In-place and out= ops return their argument: give back the very object passed in (the
        # wrapper, or a CPU tensor, e.g. for cpu_tensor.copy_(device_tensor)).
        passed_in = {id(unwrap(t)): t for t in inputs}

        def wrap(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and not isinstance(value, HostBackedTensor):
                if id(value) in passed_in:
                    return passed_in[id(value)]
                if to_fake and value.device.type == "cpu":
                    return HostBackedTensor(value, target)
            return value

        return tree_map(wrap, result)

    def privateuse1_fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
        # Reached by factory functions called with device=<fake> (torch.empty, empty_strided,
        # ...): no argument is a HostBackedTensor yet, the results belong to the fake device.
        return _run_on_host(op, args, kwargs, factory=True)

    library = torch.library.Library("_", "IMPL")
    library.fallback(privateuse1_fallback, "PrivateUse1")
    _libraries.append(library)

    aten = torch.library.Library("aten", "IMPL")
    _libraries.append(aten)

    def direct_kernel(overload: Any) -> Any:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            return _run_on_host(overload, args, kwargs)

        return kernel

    # torch.tensor(data, device=...) and torch.as_tensor copy into the new device tensor with the
    # Python dispatch key excluded, so that copy_ reaches the PrivateUse1 kernel, where torch's
    # Python fallback cannot run it (internal assert in torch 2.13): give it a kernel of its own.
    aten.impl("copy_", direct_kernel(torch.ops.aten.copy_.default), "PrivateUse1")
    # A direct PrivateUse1 kernel keeps scaled_dot_product_attention from being decomposed before
    # __torch_dispatch__ sees it: the decomposition depends on the device type, and the CPU one
    # is what gives results identical to a CPU run.
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    aten.impl("scaled_dot_product_attention", direct_kernel(sdpa), "PrivateUse1")

    def sdpa_autograd(*args: Any, **kwargs: Any) -> Any:
        # With that kernel, autograd would not see how sdpa is computed. When a gradient is
        # needed, record torch's own decomposition instead (the math path: right gradients,
        # forward values may differ from a CPU run in the last bits).
        if torch.is_grad_enabled() and any(
            isinstance(value, torch.Tensor) and value.requires_grad for value in (*args, *kwargs.values())
        ):
            return sdpa.decompose(*args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            return sdpa(*args, **kwargs)

    aten.impl("scaled_dot_product_attention", sdpa_autograd, "AutogradPrivateUse1")
    device_module.HostBackedTensor = HostBackedTensor


# torch.accelerator's memory functions that need a C++ device allocator (torch asserts
# internally without one: "Allocator for <name> is not a DeviceAllocator").
_ALLOCATOR_FUNCTIONS = (
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "get_memory_info",
)


def install_accelerator_memory_functions(name: str) -> None:
    """Give ``torch.accelerator`` memory functions that work, or fail clearly, for this device.

    ``empty_cache`` becomes a no-op while the fake device is the accelerator (its tensors hold
    ordinary CPU tensors: nothing is cached), so ``accelerate``'s cache clearing works; the
    statistics raise :class:`RuntimeError` naming the limit instead of torch's internal assert.
    """
    import torch

    accelerator = torch.accelerator

    def is_fake() -> bool:
        current = accelerator.current_accelerator()
        return current is not None and current.type == name

    def empty_cache(original: Any = accelerator.empty_cache) -> None:
        if not is_fake():
            original()

    empty_cache.__doc__ = accelerator.empty_cache.__doc__
    accelerator.empty_cache = empty_cache

    def unsupported(function_name: str) -> Any:
        original = getattr(accelerator, function_name)

        def function(*args: Any, **kwargs: Any) -> Any:
            if not is_fake():
                return original(*args, **kwargs)
            raise RuntimeError(
                f"torch.accelerator.{function_name}: the python fake device {name!r} has no device "
                f"allocator, so no memory statistics (torch takes a device allocator only from C++); "
                f"install_fake_device(backend='cpp') has them"
            )

        function.__name__ = function_name
        function.__doc__ = original.__doc__
        return function

    for function_name in _ALLOCATOR_FUNCTIONS:
        if hasattr(accelerator, function_name):
            setattr(accelerator, function_name, unsupported(function_name))
