// A second torch device backed by host memory (see overlay/testing/fake_device.py).
//
// torch's PrivateUse1 backend gets:
//   * an allocator that hands out ordinary host memory but tags it with the
//     PrivateUse1 device, so tensors report `<name>:0` and `is_cpu == False`;
//   * a device guard and accelerator hooks for a single device, index 0;
//   * native kernels for the operations that must keep aliasing or cross the
//     device boundary (empty, copies between devices, views, set_, resize_);
//   * a boxed fallback for every other operator: it first checks that all
//     tensor arguments live on one device (raising PyTorch's usual
//     "Expected all tensors to be on the same device" error otherwise, as a
//     real accelerator does) and then runs the CPU kernel on the same data via
//     at::native::cpu_fallback, so results equal the CPU results bit for bit.
//
// The library has no Python bindings: loading it with torch.ops.load_library
// registers everything through static initialisers.

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string>

namespace {

constexpr c10::DeviceType kFakeType = c10::DeviceType::PrivateUse1;
const c10::Device kFakeDevice(kFakeType, 0);
constexpr c10::DispatchKeySet kFakeKeys(c10::DispatchKey::PrivateUse1);

// ---------------------------------------------------------------- allocator

void free_host(void* ptr) {
  c10::free_cpu(ptr);
}

struct HostMemoryAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes == 0 ? nullptr : c10::alloc_cpu(nbytes);
    return {data, data, &free_host, kFakeDevice};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_host;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

HostMemoryAllocator host_memory_allocator;
REGISTER_ALLOCATOR(kFakeType, &host_memory_allocator)

// ------------------------------------------------------ guard and hooks
// One device, index 0. The no-op guard of torch reports index -1, which
// would make tensors created without an explicit index print as `<name>`
// instead of `<name>:0`; this one always reports index 0. It implements the
// interface itself rather than deriving from torch's NoOpDeviceGuardImpl,
// which is `final` in some releases (torch 2.8, the Neuron stack's).

struct SingleDeviceGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kFakeType;
  }
  void setDevice(c10::Device /*unused*/) const override {}
  void uncheckedSetDevice(c10::Device /*unused*/) const noexcept override {}
  c10::DeviceIndex deviceCount() const noexcept override {
    return 1;
  }
  c10::Device exchangeDevice(c10::Device /*unused*/) const override {
    return kFakeDevice;
  }
  c10::Device getDevice() const override {
    return kFakeDevice;
  }
  c10::Stream getStream(c10::Device /*unused*/) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, kFakeDevice);
  }
  c10::Stream getNewStream(c10::Device /*unused*/, int /*priority*/ = 0) const override {
    return c10::Stream(c10::Stream::DEFAULT, kFakeDevice);
  }
  c10::Stream exchangeStream(c10::Stream /*unused*/) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, kFakeDevice);
  }
  // Work is synchronous: events and streams are trivially complete.
  void record(void** /*event*/, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {}
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override {
    return true;
  }
  void synchronizeDevice(const c10::DeviceIndex /*device_index*/) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, SingleDeviceGuard);

struct SingleDeviceHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override {
    return true;
  }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override {
    return 1;
  }
  void setCurrentDevice(c10::DeviceIndex /*device*/) const override {}
  c10::DeviceIndex getCurrentDevice() const override {
    return 0;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex /*device*/) const override {
    return 0;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex /*device*/) const override {
    return 0;
  }
  at::Device getDeviceFromPtr(void* /*data*/) const override {
    return kFakeDevice;
  }
  // Random numbers are drawn on the host by the CPU kernels (see the
  // fallback), so the device shares the CPU generator: seeding with
  // torch.manual_seed gives the same numbers as on CPU.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*device_index*/) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new SingleDeviceHooks());
  return true;
}();

// ----------------------------------------------------------- device checks

void check_single_device_index(std::optional<c10::Device> device) {
  if (device.has_value() && device->has_index()) {
    TORCH_CHECK(device->index() == 0, "the fake device has a single device, index 0; got ", *device);
  }
}

// Operators that accept index tensors on the host next to a device tensor on
// real accelerators (advanced indexing moves CPU indices to the device).
bool accepts_host_indices(const std::string& op_name) {
  return op_name == "aten::index" || op_name == "aten::index_put_" || op_name == "aten::index_put" ||
         op_name == "aten::_index_put_impl_" || op_name == "aten::_unsafe_index" ||
         op_name == "aten::_unsafe_index_put";
}

// Mirrors the rule of TensorIterator and of the generated device checks of
// real accelerators: every defined tensor argument must be on one device,
// except zero-dimensional CPU tensors, which are treated as scalars.
// Returns the common device, if any tensor argument decided one.
std::optional<c10::Device> check_common_device(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const auto args = torch::jit::last(*stack, arguments.size());
  const std::string& op_name = schema.operator_name().name;
  const bool host_indices_ok = accepts_host_indices(op_name);

  std::optional<c10::Device> common;
  auto visit = [&](const at::Tensor& tensor, const std::string& arg_name, bool is_index_list) {
    if (!tensor.defined()) {
      return;
    }
    if (tensor.device().is_cpu() && (tensor.dim() == 0 || (is_index_list && host_indices_ok))) {
      return;
    }
    if (!common.has_value()) {
      common = tensor.device();
      return;
    }
    TORCH_CHECK(*common == tensor.device(), "Expected all tensors to be on the same device, but found at least two devices, ",
                *common, " and ", tensor.device(), "! (when checking argument for argument ", arg_name, " in method ",
                op_name, ")");
  };

  for (size_t i = 0; i < args.size(); ++i) {
    const auto& value = args[i];
    const std::string& arg_name = arguments[i].name();
    if (value.isTensor()) {
      visit(value.toTensor(), arg_name, false);
    } else if (value.isTensorList()) {
      for (const at::Tensor& tensor : value.toTensorList()) {
        visit(tensor, arg_name, false);
      }
    } else if (value.isList()) {
      // Tensor?[] (e.g. the indices of aten::index) is a generic list.
      const bool is_index_list = arg_name == "indices";
      for (const c10::IValue& element : value.toListRef()) {
        if (element.isTensor()) {
          visit(element.toTensor(), arg_name, is_index_list);
        }
      }
    }
  }
  return common;
}

// ----------------------------------------------------------------- fallback

void fake_device_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto common = check_common_device(op, stack);
  const auto num_returns = op.schema().returns().size();
  at::native::cpu_fallback(op, stack);
  // cpu_fallback sends fresh outputs to the device of the first tensor
  // argument; when that was a CPU scalar (e.g. torch.add(cpu_scalar, t)),
  // send them to the common device instead, as a real accelerator would.
  if (common.has_value() && common->type() == kFakeType) {
    for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
      c10::IValue& value = (*stack)[i];
      if (value.isTensor() && value.toTensor().defined() && value.toTensor().device().is_cpu()) {
        value = c10::IValue(value.toTensor().to(*common));
      }
    }
  }
}

// ------------------------------------------------------------------ kernels

// The same memory, seen as a CPU tensor (valid while `tensor` is alive).
at::Tensor host_view(const at::Tensor& tensor) {
  if (tensor.device().type() != kFakeType) {
    return tensor;
  }
  return at::from_blob(
      tensor.data_ptr(), tensor.sizes(), tensor.strides(), [](void* /*unused*/) {},
      tensor.options().device(at::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  check_single_device_index(device);
  return at::detail::empty_generic(size, &host_memory_allocator, kFakeKeys, c10::dtype_or_default(dtype),
                                   memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  check_single_device_index(device);
  return at::detail::empty_strided_generic(size, stride, &host_memory_allocator, kFakeKeys,
                                           c10::dtype_or_default(dtype));
}

// Copies between the fake device and the CPU (either direction) or within
// the fake device; dtype conversion is done by the CPU copy kernel.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  if (self.numel() == 0) {
    return dst;
  }
  at::Tensor src = self;
  if (src.is_conj() || src.is_neg()) {
    src = src.resolve_conj().resolve_neg();
  }
  if (dst.device().type() == kFakeType && (dst.is_conj() || dst.is_neg())) {
    // Writing into a lazily conjugated/negated view: go through a temporary.
    at::Tensor tmp = at::empty_like(dst.resolve_conj().resolve_neg(), dst.options().device(at::kCPU));
    tmp.copy_(host_view(src));
    dst.copy_(tmp);
    return dst;
  }
  host_view(dst).copy_(host_view(src));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    dst.resize_(self.sizes());
  }
  return copy_from(self, dst, false);
}

at::Tensor& set_empty_(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, &host_memory_allocator, /*resizable=*/true);
  return self.set_(storage, 0, {0}, {});
}

// scaled_dot_product_attention is a composite operator that asks a per-device
// "stub" which fused kernel to use, and falls back to a math decomposition on
// devices without one. Answering with the CPU's choice makes it call the same
// kernels as on CPU (e.g. _scaled_dot_product_flash_attention_for_cpu, which
// the fallback then runs on the host): identical results, and autograd
// records the same backward.
int64_t fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                         std::optional<double> scale, bool enable_gqa) {
  // Check devices here, naming the operator the user called.
  std::optional<c10::Device> common;
  const std::pair<const char*, const at::Tensor*> arguments[] = {
      {"query", &query}, {"key", &key}, {"value", &value}, {"attn_mask", attn_mask ? &*attn_mask : nullptr}};
  for (const auto& [name, tensor] : arguments) {
    if (tensor == nullptr || !tensor->defined()) {
      continue;
    }
    if (!common.has_value()) {
      common = tensor->device();
    }
    TORCH_CHECK(*common == tensor->device(), "Expected all tensors to be on the same device, but found at least two devices, ",
                *common, " and ", tensor->device(), "! (when checking argument for argument ", name,
                " in method aten::scaled_dot_product_attention)");
  }
  return at::_fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
}

}  // namespace

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &fused_sdp_choice)
}  // namespace at::native

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("view", at::native::view);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("set_.source_Storage", at::native::set_);
  m.impl("set_.source_Storage_storage_offset", at::native::set_storage_cpu_);
  m.impl("set_.source_Tensor", at::native::set_tensor_);
  m.impl("set_", set_empty_);
  m.impl("resize_", at::native::resize_);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fake_device_fallback>());
}
