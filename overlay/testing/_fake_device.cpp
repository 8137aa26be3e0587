// A second torch device backed by host memory (see overlay/testing/fake_device.py).
//
// torch's PrivateUse1 backend gets:
//   * a device allocator (c10::DeviceAllocator where torch has it, 2.9+) that
//     hands out ordinary host memory but tags it with a PrivateUse1 device, so
//     tensors report `<name>:<index>` and `is_cpu == False`; it counts the
//     bytes each device holds (now, peak, in total) for torch.accelerator's
//     memory statistics, and caches nothing (empty_cache has nothing to free);
//   * a device guard and accelerator hooks for `device_count` devices (1 by
//     default; configure() below), with a current device per thread;
//   * native kernels for the operations that must keep aliasing or cross the
//     device boundary (empty, copies between devices, views, set_, resize_);
//   * a boxed fallback for every other operator: it first checks that all
//     tensor arguments live on one device (raising PyTorch's usual
//     "Expected all tensors to be on the same device" error otherwise, as a
//     real accelerator does) and then runs the CPU kernel on the same data via
//     at::native::cpu_fallback, so results equal the CPU results bit for bit.
//
// The library has no Python bindings: loading it with torch.ops.load_library
// registers everything through static initialisers, and one operator,
// torch.ops.attn_overlay_fake_device.configure(device_count, memory_per_device),
// sets the number of devices and their memory before the first tensor exists.

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
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

// c10::DeviceAllocator (what torch.accelerator's memory functions require of a
// device's allocator) arrived in torch 2.9.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#define FAKE_DEVICE_HAS_DEVICE_ALLOCATOR 1
#include <c10/core/CachingDeviceAllocator.h>
#endif

namespace {

constexpr c10::DeviceType kFakeType = c10::DeviceType::PrivateUse1;
constexpr c10::DispatchKeySet kFakeKeys(c10::DispatchKey::PrivateUse1);
// The most devices configure() accepts.
constexpr int kMaxDevices = 16;

// Set once by configure(), before the first tensor is made.
int device_count = 1;
int64_t memory_per_device = 0;  // bytes; 0: the host's memory, no limit
// The current device of this thread, as CUDA keeps one per thread.
thread_local c10::DeviceIndex current_device = 0;

c10::Device fake_device(c10::DeviceIndex index) {
  return c10::Device(kFakeType, index);
}

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count, "Invalid device index ", static_cast<int>(index),
              ": the fake device has ", device_count, device_count == 1 ? " device" : " devices",
              " (valid indices 0..", device_count - 1, "; install_fake_device(device_count=...) sets how many)");
}

// ---------------------------------------------------------------- allocator

uint64_t host_bytes(bool available) {
#if defined(_SC_PAGESIZE) && defined(_SC_PHYS_PAGES)
  const long page = sysconf(_SC_PAGESIZE);
#if defined(_SC_AVPHYS_PAGES)
  const long pages = sysconf(available ? _SC_AVPHYS_PAGES : _SC_PHYS_PAGES);
#else
  const long pages = sysconf(_SC_PHYS_PAGES);
#endif
  if (page > 0 && pages > 0) {
    return static_cast<uint64_t>(page) * static_cast<uint64_t>(pages);
  }
#endif
  return 0;
}

// What c10's allocator Stat counts, kept here so that the library builds on
// torch releases that place (or lack) that struct elsewhere.
struct Counter {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;
  void increase(size_t amount) {
    current += static_cast<int64_t>(amount);
    peak = std::max(peak, current);
    allocated += static_cast<int64_t>(amount);
  }
  void decrease(size_t amount) {
    current -= static_cast<int64_t>(amount);
    freed += static_cast<int64_t>(amount);
  }
  void reset_peak() {
    peak = current;
  }
  void reset_accumulated() {
    allocated = 0;
    freed = 0;
  }
};

struct Counts {
  Counter bytes;        // bytes held by live allocations
  Counter allocations;  // live allocations
};

std::mutex stats_mutex;
std::array<Counts, kMaxDevices> counts;
// Every live block: its size and device (for the deleter and getDeviceFromPtr).
std::unordered_map<void*, std::pair<size_t, c10::DeviceIndex>> blocks;

void free_host(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(stats_mutex);
    auto found = blocks.find(ptr);
    if (found != blocks.end()) {
      Counts& device_counts = counts[found->second.second];
      device_counts.bytes.decrease(found->second.first);
      device_counts.allocations.decrease(1);
      blocks.erase(found);
    }
  }
  c10::free_cpu(ptr);
}

std::optional<c10::DeviceIndex> device_of(void* ptr) {
  std::lock_guard<std::mutex> lock(stats_mutex);
  auto found = blocks.find(ptr);
  if (found == blocks.end()) {
    return std::nullopt;
  }
  return found->second.second;
}

#ifdef FAKE_DEVICE_HAS_DEVICE_ALLOCATOR
using AllocatorBase = c10::DeviceAllocator;
#else
using AllocatorBase = c10::Allocator;
#endif

struct HostMemoryAllocator final : public AllocatorBase {
  // On the current device of the calling thread (kernels set it from their
  // device argument with a device guard, as CUDA's do).
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex index = current_device;
    check_index(index);
    if (nbytes == 0) {
      return {nullptr, nullptr, &free_host, fake_device(index)};
    }
    void* data = c10::alloc_cpu(nbytes);
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      blocks[data] = {nbytes, index};
      counts[index].bytes.increase(nbytes);
      counts[index].allocations.increase(1);
    }
    return {data, data, &free_host, fake_device(index)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_host;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

#ifdef FAKE_DEVICE_HAS_DEVICE_ALLOCATOR
  bool initialized() override {
    return true;
  }
  // Nothing is cached: memory goes back to the host as soon as a tensor dies.
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {}
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(stats_mutex);
    const Counts& device_counts = counts[device];
    c10::CachingDeviceAllocator::DeviceStats stats;
    auto stat = [](const Counter& counter) {
      c10::CachingAllocator::Stat result;
      result.current = counter.current;
      result.peak = counter.peak;
      result.allocated = counter.allocated;
      result.freed = counter.freed;
      return result;
    };
    // No caching and no splitting: every live block is one segment, allocated,
    // active and reserved at once, of exactly the requested size.
    for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes, &stats.requested_bytes}) {
      (*array)[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)] = stat(device_counts.bytes);
      (*array)[static_cast<size_t>(c10::CachingAllocator::StatType::LARGE_POOL)] = stat(device_counts.bytes);
    }
    for (auto* array : {&stats.allocation, &stats.segment, &stats.active}) {
      (*array)[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)] = stat(device_counts.allocations);
      (*array)[static_cast<size_t>(c10::CachingAllocator::StatType::LARGE_POOL)] = stat(device_counts.allocations);
    }
    stats.num_device_alloc = device_counts.allocations.allocated;
    stats.num_device_free = device_counts.allocations.freed;
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(stats_mutex);
    counts[device].bytes.reset_accumulated();
    counts[device].allocations.reset_accumulated();
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(stats_mutex);
    counts[device].bytes.reset_peak();
    counts[device].allocations.reset_peak();
  }
  // (free, total) bytes: with a memory_per_device, that capacity less what the
  // device holds; else the host's available and physical memory. Allocations
  // beyond the capacity are not refused: without a cache, transformers' warm-up
  // block and the weights would hold twice the memory a caching GPU allocator
  // needs, and refusing would fail loads that fit on a real device.
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_index(device);
    if (memory_per_device > 0) {
      std::lock_guard<std::mutex> lock(stats_mutex);
      const int64_t held = counts[device].bytes.current;
      const int64_t free_bytes = held >= memory_per_device ? 0 : memory_per_device - held;
      return {static_cast<size_t>(free_bytes), static_cast<size_t>(memory_per_device)};
    }
    return {static_cast<size_t>(host_bytes(true)), static_cast<size_t>(host_bytes(false))};
  }
#endif
};

HostMemoryAllocator host_memory_allocator;
REGISTER_ALLOCATOR(kFakeType, &host_memory_allocator)

void configure(int64_t count, int64_t memory) {
  TORCH_CHECK(count >= 1 && count <= kMaxDevices, "device_count must be 1..", kMaxDevices, ", got ", count);
  TORCH_CHECK(memory >= 0, "memory_per_device must be >= 0, got ", memory);
  {
    std::lock_guard<std::mutex> lock(stats_mutex);
    TORCH_CHECK(blocks.empty() || (count == device_count && memory == memory_per_device),
                "the fake device is in use: configure it before the first tensor is made");
  }
  device_count = static_cast<int>(count);
  memory_per_device = memory;
}

// ------------------------------------------------------ guard and hooks
// `device_count` devices with a current device per thread. Tensors created
// without an explicit index land on the current device (index 0 unless set),
// so they print as `<name>:0`, not `<name>`. It implements the interface
// itself rather than deriving from torch's NoOpDeviceGuardImpl, which is
// `final` in some releases (torch 2.8, the Neuron stack's).

struct FakeDeviceGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kFakeType;
  }
  void setDevice(c10::Device device) const override {
    check_index(device.index());
    current_device = device.index();
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0 && device.index() < device_count) {
      current_device = device.index();
    }
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(device_count);
  }
  c10::Device exchangeDevice(c10::Device device) const override {
    const c10::Device previous = fake_device(current_device);
    setDevice(device);
    return previous;
  }
  c10::Device getDevice() const override {
    return fake_device(current_device);
  }
  c10::Stream getStream(c10::Device device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream getNewStream(c10::Device device, int /*priority*/ = 0) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream exchangeStream(c10::Stream stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, stream.device());
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

C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeDeviceGuard);

struct FakeDeviceHooks final : public at::PrivateUse1HooksInterface {
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
    return static_cast<c10::DeviceIndex>(device_count);
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    check_index(device);
    current_device = device;
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return current_device;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const c10::DeviceIndex previous = current_device;
    setCurrentDevice(device);
    return previous;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    return fake_device(device_of(data).value_or(current_device));
  }
  // Random numbers are drawn on the host by the CPU kernels (see the
  // fallback), so every device shares the CPU generator: seeding with
  // torch.manual_seed gives the same numbers as on CPU.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*device_index*/) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    // The new block belongs to the storage's device, not the current one.
    c10::OptionalDeviceGuard guard(storage.device());
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new FakeDeviceHooks());
  return true;
}();

// ----------------------------------------------------------- device checks

// The device a factory kernel allocates on: its argument's index, else the
// current device (as on CUDA).
c10::Device target_device(std::optional<c10::Device> device) {
  if (device.has_value() && device->has_index()) {
    check_index(device->index());
    return *device;
  }
  return fake_device(current_device);
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
  c10::DeviceGuard guard(target_device(device));
  return at::detail::empty_generic(size, &host_memory_allocator, kFakeKeys, c10::dtype_or_default(dtype),
                                   memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  c10::DeviceGuard guard(target_device(device));
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

TORCH_LIBRARY(attn_overlay_fake_device, m) {
  m.def("configure(int device_count, int memory_per_device) -> ()", &configure);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fake_device_fallback>());
}
