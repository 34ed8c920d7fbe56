// Host memory for large `.cpu()` results and pinned memory: blocks of the host-block
// cache (dataplane/host_blocks.h, shared with the server's storages), which a freed result
// hands back for the next one.
//
// Why: a training loop downloads a fresh tensor every step. Fresh memory from malloc is
// mmap'd and untouched, so the kernel zeroes every page of it (a page fault per 4 KiB, or
// one MADV_POPULATE_WRITE call that zeroes them all) before the bytes can land, and unmaps
// it again when the tensor dies: zeroing alone was 11% of the client's profile of a 256
// MiB round trip. A cached block was faulted in once and is simply written again.
//
// A result is handed to the user only once every byte of it was written by the download;
// a failed download drops the tensor and its block goes back.
#include "host_cache.h"
#include "device.h"
#include "host_blocks.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/_to_copy_native.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <cstring>
#include <map>
#include <mutex>

namespace remote_accel {
namespace {

host_blocks::Cache& cache() {
  // REMOTE_ACCEL_CLIENT_CACHE_MB: bytes of free blocks kept for reuse (0: no caching,
  // every large result is plain malloc'd memory). Never destroyed: storages may die
  // during exit.
  static auto* c = new host_blocks::Cache("REMOTE_ACCEL_CLIENT_CACHE_MB", 1024);
  return *c;
}

// The client is one owner of its blocks (the server has one per session), with no limit.
uint64_t owner() {
  static const uint64_t o = cache().open();
  return o;
}

// CPU memory: cached blocks for large sizes, the ordinary CPU allocator for the rest (and
// whenever mapping fails, so that it reports out of memory in its usual words).
struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n >= kHostCacheMin) {
      if (host_blocks::Block* b = cache().take(n, owner())) {
        return {b->ptr, b, &host_blocks::Cache::release, c10::Device(c10::kCPU)};
      }
    }
    return c10::GetCPUAllocator()->allocate(n);
  }

  // Two kinds of DataPtr with their own deleters: no single raw deleter.
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

HostAllocator& host_allocator() {
  static HostAllocator instance;
  return instance;
}

// `.cpu()` (and `.to("cpu")`) of a remote tensor. torch's own _to_copy allocates the result
// with the CPU allocator, then copies into it; this does the same with the cached one when
// the result is large and a plain dense copy of the source (the common case: what the
// download writes straight into). Everything else is torch's own kernel.
at::Tensor to_copy(const at::Tensor& self, std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                   std::optional<c10::Device> device, std::optional<bool> pin_memory, bool non_blocking,
                   std::optional<c10::MemoryFormat> memory_format) {
  const auto format = memory_format.value_or(c10::MemoryFormat::Preserve);
  const bool plain = device && device->is_cpu() && dtype.value_or(self.scalar_type()) == self.scalar_type() &&
      layout.value_or(c10::kStrided) == c10::kStrided && !pin_memory.value_or(false) &&
      (format == c10::MemoryFormat::Preserve || format == c10::MemoryFormat::Contiguous) &&
      self.is_contiguous() && !self.is_conj() && !self.is_neg() &&
      self.numel() * static_cast<int64_t>(self.element_size()) >= static_cast<int64_t>(kHostCacheMin);
  if (!plain || !cache().enabled()) {
    return at::native::_to_copy(self, dtype, layout, device, pin_memory, non_blocking, memory_format);
  }
  const auto keys = c10::DispatchKeySet(c10::DispatchKey::CPU);
  // Preserve keeps the source's strides, as torch's kernel does for a dense source (a
  // contiguous tensor's size-1 dims may have any stride).
  at::Tensor r = format == c10::MemoryFormat::Preserve
      ? at::detail::empty_strided_generic(self.sizes(), self.strides(), &host_allocator(), keys, self.scalar_type())
      : at::detail::empty_generic(self.sizes(), &host_allocator(), keys, self.scalar_type(),
                                  c10::MemoryFormat::Contiguous);
  r.copy_(self, non_blocking);
  return r;
}

// Pinned host memory (tensor.pin_memory(), DataLoader(pin_memory=True)): what CUDA's
// pinned memory gives a copy to the device (no page fault and no staging copy on the way;
// with non_blocking=True the copy overlaps the host's work) is what a transport needs of
// its source too. So pinned memory is this cache's pre-faulted blocks for 1 MiB and more,
// plain CPU memory below, and either way its ranges are recorded, so that is_pinned()
// answers and an upload knows it may send from it in the background (transfer.py).
struct PinnedRanges {
  std::mutex mu;
  std::map<uintptr_t, size_t> ranges;  // start -> bytes
};

PinnedRanges& pinned_ranges() {
  static auto* r = new PinnedRanges();  // never destroyed: storages may die during exit
  return *r;
}

struct Pinned {
  c10::DataPtr memory;
};

void unpin(void* ctx) {
  auto* p = static_cast<Pinned*>(ctx);
  {
    auto& r = pinned_ranges();
    std::lock_guard<std::mutex> g(r.mu);
    r.ranges.erase(reinterpret_cast<uintptr_t>(p->memory.get()));
  }
  delete p;  // frees the memory with its own deleter
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr memory = host_allocator().allocate(n);
    void* ptr = memory.get();
    if (ptr == nullptr) {
      return memory;
    }
    {
      auto& r = pinned_ranges();
      std::lock_guard<std::mutex> g(r.mu);
      r.ranges[reinterpret_cast<uintptr_t>(ptr)] = n;
    }
    return {ptr, new Pinned{std::move(memory)}, &unpin, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

}  // namespace

c10::Allocator* pinned_allocator() {
  static PinnedAllocator instance;
  return &instance;
}

bool is_pinned_ptr(const void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  auto& r = pinned_ranges();
  std::lock_guard<std::mutex> g(r.mu);
  auto it = r.ranges.upper_bound(p);
  if (it == r.ranges.begin()) {
    return false;
  }
  --it;
  return p < it->first + it->second;
}

HostCacheStats host_cache_stats() {
  return cache().stats();
}

void host_cache_empty(std::optional<int64_t> limit) {
  TORCH_CHECK_VALUE(!limit || *limit >= 0, "remote_accel: the host cache's limit must be >= 0 bytes, got ", *limit);
  cache().trim(limit ? std::optional<size_t>(static_cast<size_t>(*limit)) : std::nullopt);
}

}  // namespace remote_accel

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_to_copy", TORCH_FN(remote_accel::to_copy));
}
