// The remote_accel allocator: storage ids, session generations and memory accounting.
#include "device.h"

#include <c10/util/Exception.h>

// torch >= 2.9 asks a device for a c10::DeviceAllocator (torch.accelerator's memory_stats,
// memory_allocated, reset_peak_memory_stats, empty_cache, get_memory_info)
#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#endif
#if defined(TORCH_VERSION_MAJOR) && (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 9)
#include <c10/core/CachingDeviceAllocator.h>
#define REMOTE_ACCEL_DEVICE_ALLOCATOR 1
#endif

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace remote_accel {
namespace {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;

// ---------------------------------------------------------------------------------------
// Allocator

struct Allocation {
  uint64_t id;
  size_t nbytes;
  c10::DeviceIndex device;
  uint64_t session;  // the device's session generation when it was allocated
};

// Address ranges of freed storages, kept for the next storages of the same page count: a
// loop of out-of-place ops (`y = x + 1.0`) frees and allocates one storage per op, and an
// mmap plus an munmap (a TLB shootdown across the process's threads) per op cost more
// than the rest of the op's tracing. Ranges are PROT_NONE and NORESERVE: keeping them
// costs address space only, bounded by these limits.
constexpr size_t kPage = 4096;
constexpr size_t kMaxCachedPages = 256;  // ranges up to 1 MiB
constexpr size_t kMaxCachedRanges = 1024;

struct RangeCache {
  std::array<std::vector<void*>, kMaxCachedPages + 1> by_pages;
  size_t count = 0;
};

size_t pages_of(size_t n) {
  return (n + kPage - 1) / kPage;
}

// Per device: `session` grows whenever a session closes or dies, so storages of an older
// generation are known to name bytes that no server holds any more. Bytes are counted
// for the current generation only: they are what the server of this session holds.
struct Registry {
  std::mutex mu;
  uint64_t next_id = 1;
  std::unordered_map<void*, Allocation> live;
  std::array<std::deque<uint64_t>, kMaxDevices> freed;
  std::array<int64_t, kMaxDevices> live_count{};
  std::array<uint64_t, kMaxDevices> session{};
  std::array<int64_t, kMaxDevices> live_bytes{};
  std::array<int64_t, kMaxDevices> peak_bytes{};
  std::array<int64_t, kMaxDevices> count{}, peak_count{};  // the current session's live storages
  // cumulative since the session began (or reset_accumulated): torch's "allocated"/"freed"
  std::array<int64_t, kMaxDevices> allocated_bytes{}, freed_bytes{}, allocated_count{}, freed_count{};
  std::array<int64_t, kMaxDevices> limit{};  // 0: none
  RangeCache ranges;
};

// Leaked on purpose: tensors are still freed during interpreter shutdown, after static
// destructors would have run.
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

// Runs wherever the last reference to a storage drops, possibly in a thread without the
// GIL or during shutdown: it only records the id; Python sends the `free` to the server
// when it drains the queue.
void delete_remote(void* ptr) {
  Allocation a{};
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.live.find(ptr);
    if (it == r.live.end()) {
      return;
    }
    a = it->second;
    r.live.erase(it);
    --r.live_count[a.device];
    if (a.session == r.session[a.device]) {  // an older session's server forgot it already
      r.freed[a.device].push_back(a.id);
      r.live_bytes[a.device] -= static_cast<int64_t>(a.nbytes);
      r.freed_bytes[a.device] += static_cast<int64_t>(a.nbytes);
      ++r.freed_count[a.device];
      --r.count[a.device];
    }
    // Kept or unmapped only once the entry is gone, so that no other allocation gets the
    // same range while the map still names it.
    const auto pages = pages_of(a.nbytes);
    if (pages <= kMaxCachedPages && r.ranges.count < kMaxCachedRanges) {
      r.ranges.by_pages[pages].push_back(ptr);
      ++r.ranges.count;
      return;
    }
  }
  munmap(ptr, a.nbytes);
}

// A cached range of `n` bytes' page count, or nullptr; the caller holds the registry's lock.
void* cached_range(Registry& r, size_t n) {
  const auto pages = pages_of(n);
  if (pages > kMaxCachedPages || r.ranges.by_pages[pages].empty()) {
    return nullptr;
  }
  void* p = r.ranges.by_pages[pages].back();
  r.ranges.by_pages[pages].pop_back();
  --r.ranges.count;
  return p;
}

// The caller holds the registry's lock.
void register_allocation(Registry& r, void* p, size_t n, c10::DeviceIndex index) {
  r.live.emplace(p, Allocation{r.next_id++, n, index, r.session[index]});
  ++r.live_count[index];
  r.live_bytes[index] += static_cast<int64_t>(n);
  r.peak_bytes[index] = std::max(r.peak_bytes[index], r.live_bytes[index]);
  r.allocated_bytes[index] += static_cast<int64_t>(n);
  ++r.allocated_count[index];
  r.peak_count[index] = std::max(r.peak_count[index], ++r.count[index]);
}

#ifdef REMOTE_ACCEL_DEVICE_ALLOCATOR
using AllocatorBase = c10::DeviceAllocator;
#else
using AllocatorBase = c10::Allocator;
#endif

struct RemoteAllocator final : AllocatorBase {
  c10::DataPtr allocate(size_t n) override {
    const c10::Device device(kDevice, current_device());
    if (n == 0) {
      return {nullptr, nullptr, &delete_remote, device};
    }
    auto& r = registry();
    void* p = nullptr;
    {
      // As on CUDA, the allocating call fails (torch.OutOfMemoryError), not a later sync:
      // the session's limit is known here, and the server would refuse the same bytes.
      std::lock_guard<std::mutex> lock(r.mu);
      const auto limit = r.limit[device.index()];
      const auto used = r.live_bytes[device.index()];
      TORCH_CHECK_WITH(OutOfMemoryError, limit == 0 || static_cast<int64_t>(n) <= limit - used,
                       "remote_accel: out of memory: allocating ", n, " bytes on ", device, " would exceed the "
                       "server's memory limit for this session (", used, " of ", limit, " bytes in use)");
      p = cached_range(r, n);
      if (p != nullptr) {
        register_allocation(r, p, n, device.index());
        return {p, p, &delete_remote, device};
      }
    }
    // The bytes live on the server. The range is reserved, never readable: every storage
    // gets addresses of its own (ATen's overlap checks compare pointers), and a stray
    // dereference faults instead of scribbling on host memory. NORESERVE + PROT_NONE
    // costs no memory and no overcommit.
    p = mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    // ENOMEM here usually means vm.max_map_count: each live storage is one mapping at
    // worst (freed neighbours split merged ranges).
    TORCH_CHECK(p != MAP_FAILED, "remote_accel: cannot reserve ", n,
                " bytes of address space for a remote storage: ", std::strerror(errno),
                errno == ENOMEM ? " (too many live storages for vm.max_map_count?)" : "");
    std::lock_guard<std::mutex> lock(r.mu);
    register_allocation(r, p, n, device.index());
    return {p, p, &delete_remote, device};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &delete_remote;
  }

  void copy_data(void*, const void*, size_t) const override {
    TORCH_CHECK(false, "remote_accel: storage bytes live on the server and cannot be copied "
                       "on the client; copy tensors instead");
  }

#ifdef REMOTE_ACCEL_DEVICE_ALLOCATOR
  // The client holds no device memory: it counts what the server holds for it (every live
  // storage, from its allocation on), so torch.accelerator's figures are torch.cuda's.
  bool initialized() override {
    return true;
  }
  void emptyCache(c10::MempoolId_t) override {
    if (auto* hooks = device_hooks()) {
      hooks->empty_cache();
    }
  }
  // One stream per device, in issue order on the server: nothing to track.
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const auto c = allocation_counts(device);
    c10::CachingDeviceAllocator::DeviceStats stats;
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    for (auto* bytes : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes, &stats.requested_bytes}) {
      auto& s = (*bytes)[all];
      s.current = c.bytes;
      s.peak = c.peak_bytes;
      s.allocated = c.allocated_bytes;
      s.freed = c.freed_bytes;
    }
    for (auto* count : {&stats.allocation, &stats.active, &stats.segment}) {
      auto& s = (*count)[all];
      s.current = c.count;
      s.peak = c.peak_count;
      s.allocated = c.allocated_count;
      s.freed = c.freed_count;
    }
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    reset_accumulated(device);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    reset_peak(device);
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    auto* hooks = device_hooks();
    TORCH_CHECK(hooks != nullptr, "remote_accel: the device is not registered");
    return hooks->memory_info(device);
  }
#endif
};


} // namespace

c10::Allocator* allocator() {
  // A function-local static: device.cpp's static initialisation installs it, and the
  // order of static initialisation across files is unspecified.
  static RemoteAllocator instance;
  return &instance;
}

uint64_t storage_id(const void* ptr) {
  if (ptr == nullptr) {
    return 0;
  }
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.live.find(const_cast<void*>(ptr));
  TORCH_CHECK_VALUE(it != r.live.end(), "remote_accel: ", ptr, " is not a remote storage");
  const auto& a = it->second;
  if (a.session != r.session[a.device]) {
    throw StaleStorage("remote_accel: this tensor belongs to a remote_accel:" + std::to_string(a.device) +
                       " session that was closed (shutdown(), or its server was lost): its data is gone; "
                       "recreate the tensor in the new session");
  }
  return a.id;
}

c10::DeviceIndex storage_device(void* ptr) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.live.find(ptr);
  TORCH_CHECK(it != r.live.end(), "remote_accel: pointer ", ptr, " is not the start of a remote storage");
  return it->second.device;
}

bool is_current(const void* ptr) {
  if (ptr == nullptr) {
    return true;
  }
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.live.find(const_cast<void*>(ptr));
  return it == r.live.end() || it->second.session == r.session[it->second.device];
}

void end_session(c10::DeviceIndex device) {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "remote_accel: bad device index ",
                    static_cast<int>(device));
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  ++r.session[device];
  r.freed[device].clear();
  r.live_bytes[device] = r.peak_bytes[device] = r.count[device] = r.peak_count[device] = 0;
  r.allocated_bytes[device] = r.freed_bytes[device] = r.allocated_count[device] = r.freed_count[device] = 0;
  r.limit[device] = 0;
}

void set_memory_limit(c10::DeviceIndex device, int64_t limit) {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "remote_accel: bad device index ",
                    static_cast<int>(device));
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.limit[device] = limit;
}

std::tuple<int64_t, int64_t> memory_allocated(c10::DeviceIndex device) {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "remote_accel: bad device index ",
                    static_cast<int>(device));
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return {r.live_bytes[device], r.peak_bytes[device]};
}

void reset_peak(c10::DeviceIndex device) {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "remote_accel: bad device index ",
                    static_cast<int>(device));
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.peak_bytes[device] = r.live_bytes[device];
  r.peak_count[device] = r.count[device];
}

AllocationCounts allocation_counts(c10::DeviceIndex device) {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "remote_accel: bad device index ",
                    static_cast<int>(device));
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return {r.live_bytes[device], r.peak_bytes[device], r.allocated_bytes[device], r.freed_bytes[device],
          r.count[device], r.peak_count[device], r.allocated_count[device], r.freed_count[device]};
}

void reset_accumulated(c10::DeviceIndex device) {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "remote_accel: bad device index ",
                    static_cast<int>(device));
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.allocated_bytes[device] = r.freed_bytes[device] = r.allocated_count[device] = r.freed_count[device] = 0;
}

std::vector<uint64_t> drain_freed(c10::DeviceIndex device) {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "remote_accel: bad device index ",
                    static_cast<int>(device));
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto& q = r.freed[device];
  std::vector<uint64_t> ids(q.begin(), q.end());
  q.clear();
  return ids;
}

int64_t live_storages(c10::DeviceIndex device) {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "remote_accel: bad device index ",
                    static_cast<int>(device));
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.live_count[device];
}

} // namespace remote_accel
