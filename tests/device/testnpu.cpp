// The suite's test device: a PrivateUse1 backend whose memory is host memory and whose kernels are
// the CPU's (as PyTorch tests third-party devices with its open-registration extension, reduced to
// what a training run needs). Every operator without a kernel of its own falls back to a boxed
// function that views each device tensor as a CPU tensor over the same memory (no copy), runs the
// CPU kernel and hands the results back as device tensors over the CPU results' memory (again no
// copy); an argument the CPU kernel resized to new memory is repointed at it. So views alias,
// in-place ops write through, and the numbers are the CPU's. The allocator counts bytes (the
// device module's memory statistics); the guard reports TESTNPU_DEVICES devices (default 8).
#include <torch/extension.h>

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstdlib>
#include <unordered_map>

namespace {

constexpr auto kDev = c10::DeviceType::PrivateUse1;
std::atomic<int64_t> g_allocated{0};
std::atomic<int64_t> g_peak{0};
thread_local c10::DeviceIndex g_current = 0;

c10::DeviceIndex device_count() {
  const char* env = std::getenv("TESTNPU_DEVICES");
  return static_cast<c10::DeviceIndex>(env ? std::atoi(env) : 8);
}

struct Block {
  void* ptr;
  size_t size;
};

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  g_allocated -= static_cast<int64_t>(block->size);
  c10::free_cpu(block->ptr);
  delete block;
}

struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* ptr = n ? c10::alloc_cpu(n) : nullptr;
    int64_t now = (g_allocated += static_cast<int64_t>(n));
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
    }
    return {ptr, new Block{ptr, n}, &free_block, c10::Device(kDev, g_current)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
HostAllocator g_allocator;

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDev; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = g_current;
    if (d.has_index()) g_current = d.index();
    return c10::Device(kDev, old);
  }
  c10::Device getDevice() const override { return c10::Device(kDev, g_current); }
  void setDevice(c10::Device d) const override {
    if (d.has_index()) g_current = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) g_current = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  bool isPinnedPtr(const void*) const override { return false; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();  // the device's random numbers are the CPU's
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::detail::createCPUGenerator(); }
  c10::Device getDeviceFromPtr(void*) const override { return c10::Device(kDev, g_current); }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  c10::DeviceIndex getCurrentDevice() const override { return g_current; }
};

// ---------------------------------------------------------------- the CPU fallback

// A CPU tensor over the memory of device tensor ``t`` (the same storage base, sizes, strides, offset).
at::Tensor host_view(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kDev) return t;
  auto* keep = new c10::Storage(t.storage());  // the device memory stays alive while the view does
  c10::DataPtr ptr(keep->mutable_data(), keep, [](void* ctx) { delete static_cast<c10::Storage*>(ctx); },
                   c10::Device(at::kCPU));
  // resizable: a kernel that resizes an out= argument moves the view onto new CPU memory (see fallback)
  c10::Storage cpu(c10::Storage::use_byte_size_t(), keep->nbytes(), std::move(ptr), c10::GetCPUAllocator(), true);
  auto typed = at::empty({0}, at::TensorOptions().dtype(t.dtype()).device(at::kCPU));
  typed.set_(cpu, t.storage_offset(), t.sizes(), t.strides());
  return typed;
}

// A device tensor over the memory of CPU tensor ``t`` (reusing ``known``'s storage when the memory is one
// of the arguments').
at::Tensor device_view(const at::Tensor& t, c10::DeviceIndex index,
                       const std::unordered_map<const void*, c10::Storage>& known) {
  if (!t.defined() || t.device().type() != at::kCPU) return t;
  c10::Storage cpu_storage = t.storage();
  c10::Storage storage;
  auto hit = known.find(cpu_storage.data());
  if (hit != known.end() && hit->second.nbytes() == cpu_storage.nbytes()) {
    storage = hit->second;
  } else {
    auto* keep = new c10::Storage(cpu_storage);
    c10::DataPtr ptr(cpu_storage.mutable_data(), keep, [](void* ctx) { delete static_cast<c10::Storage*>(ctx); },
                     c10::Device(kDev, index));
    storage = c10::Storage(c10::Storage::use_byte_size_t(), cpu_storage.nbytes(), std::move(ptr), nullptr, false);
  }
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                      t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return out;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto num_args = schema.arguments().size();
  auto args = torch::jit::last(stack, num_args);
  const auto start = stack->size() - num_args;
  c10::DeviceIndex index = g_current;
  bool to_device = false, device_arg = false;
  std::unordered_map<const void*, c10::Storage> known;
  std::vector<std::pair<at::Tensor, at::Tensor>> mutated;  // (device tensor, its CPU view)
  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& v = (*stack)[start + i];
    const auto* alias = schema.arguments()[i].alias_info();
    const bool writes = alias != nullptr && alias->isWrite();
    auto convert = [&](const at::Tensor& t) {
      if (!t.defined() || t.device().type() != kDev) return t;
      index = t.device().index();
      to_device = true;
      known.emplace(t.storage().data(), t.storage());
      auto h = host_view(t);
      if (writes) mutated.emplace_back(t, h);
      return h;
    };
    if (v.isTensor()) {
      v = convert(v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list[j] = convert(list[j]);
    } else if (v.isOptionalTensorList()) {
      auto list = v.toOptionalTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> o = list[j];
        if (o.has_value()) list[j] = convert(*o);
      }
    } else if (v.isDevice()) {
      device_arg = true;
      auto d = v.toDevice();
      to_device = d.type() == kDev;
      if (to_device) {
        index = d.has_index() ? d.index() : g_current;
        v = c10::IValue(c10::Device(at::kCPU));
      }
    }
  }
  (void)device_arg;
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  for (auto& [dev, host] : mutated) {  // an out= argument the kernel resized onto new memory
    if (host.storage().data() != dev.storage().data() || host.sizes() != dev.sizes()) {
      auto repointed = device_view(host, index, known);
      dev.unsafeGetTensorImpl()->set_storage_keep_dtype(repointed.storage());
      dev.unsafeGetTensorImpl()->set_sizes_and_strides(host.sizes(), host.strides(), host.storage_offset());
      known[host.storage().data()] = dev.storage();
    }
  }
  if (!to_device) return;
  const auto num_returns = schema.returns().size();
  const auto ret_start = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    c10::IValue& v = (*stack)[ret_start + i];
    const auto* alias = schema.returns()[i].alias_info();
    if (v.isTensor()) {
      auto t = v.toTensor();
      bool same = false;
      if (alias != nullptr && alias->isWrite()) {  // returns an argument written in place: that argument
        for (auto& [dev, host] : mutated) {
          if (host.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
            v = dev;
            same = true;
            break;
          }
        }
      }
      if (!same) v = device_view(t, index, known);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list[j] = device_view(list[j], index, known);
    }
  }
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  const auto dt = c10::dtype_or_default(dtype);
  c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  if (device.has_value() && device->has_index()) g_current = device->index();
  return at::detail::empty_generic(size, &g_allocator, ks, dt, memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  const auto dt = c10::dtype_or_default(dtype);
  c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  if (device.has_value() && device->has_index()) g_current = device->index();
  return at::detail::empty_strided_generic(size, stride, &g_allocator, ks, dt);
}

// copies between the host and the device (and on the device): a CPU copy between the memories
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  host_view(dst).copy_(host_view(self), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    auto fresh = at::empty(self.sizes(), dst.options());
    dst.unsafeGetTensorImpl()->set_storage_keep_dtype(fresh.storage());
    dst.unsafeGetTensorImpl()->set_sizes_and_strides(fresh.sizes(), fresh.strides(), 0);
  }
  return copy_from(self, dst, false);
}

int64_t memory_allocated() { return g_allocated.load(); }
int64_t max_memory_allocated() { return g_peak.load(); }
void reset_peak_memory_stats() { g_peak.store(g_allocated.load()); }

}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
}

// autocast: the CPU's policy for the operators a decoder's training step runs
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  KERNEL_PRIVATEUSEONE(bmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(mm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(linalg_vecdot, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(baddbmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(addmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(_addmm_activation, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(addbmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(linear, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(matmul, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(scaled_dot_product_attention, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(prod, fp32)
  KERNEL_PRIVATEUSEONE(cdist, fp32)
  KERNEL_PRIVATEUSEONE(mse_loss, fp32)
  KERNEL_PRIVATEUSEONE(nll_loss, fp32)
  KERNEL_PRIVATEUSEONE(nll_loss2d, fp32)
  KERNEL_PRIVATEUSEONE(cross_entropy_loss, fp32)
  KERNEL_PRIVATEUSEONE(kl_div, fp32)
  KERNEL_PRIVATEUSEONE(binary_cross_entropy_with_logits, fp32)
  KERNEL_PRIVATEUSEONE(stack, promote)
  KERNEL_PRIVATEUSEONE(cat, promote)
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  static bool registered = false;
  if (!registered) {
    c10::SetAllocator(kDev, &g_allocator);
    at::RegisterPrivateUse1HooksInterface(new Hooks());
    registered = true;
  }
  m.def("memory_allocated", &memory_allocated);
  m.def("max_memory_allocated", &max_memory_allocated);
  m.def("reset_peak_memory_stats", &reset_peak_memory_stats);
  m.def("device_count", []() { return static_cast<int64_t>(device_count()); });
  m.def("current_device", []() { return static_cast<int64_t>(g_current); });
  m.def("set_device", [](int64_t i) { g_current = static_cast<c10::DeviceIndex>(i); });
}
