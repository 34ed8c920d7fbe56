// The per-device request queues: the encoded batch items waiting for Python's session to
// take them into its next Batch, and the storage ids each device's server already holds
// (a storage is announced with ALLOC once per session). The op fallback appends to them
// (op_serve.cpp); Python opens, closes and drains them through op_queue.h.
#include "op_queue.h"
#include "op_queue_internal.h"

#include <algorithm>
#include <array>
#include <chrono>

namespace remote_accel {
namespace detail {
namespace {

// Leaked like the allocator's registry: storages die during interpreter shutdown too.
std::array<Queue, kMaxDevices>& queues() {
  static auto* q = new std::array<Queue, kMaxDevices>();
  return *q;
}

} // namespace

Queue& queue(c10::DeviceIndex device) {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "remote_accel: bad device index ",
                    static_cast<int>(device));
  return queues()[device];
}

std::atomic<int64_t> g_alloc_type{-1};
std::atomic<int64_t> g_run_planned_type{-1};
std::atomic<int64_t> g_first_items{256};
std::atomic<int64_t> g_max_items{256};

// Queues ALLOC(sid, nbytes); the caller holds q.mu and checked q.open.
void put_alloc(Queue& q, uint64_t sid, size_t nbytes) {
  put_tuple_header(q.bytes, 2);
  put_int(q.bytes, g_alloc_type.load(std::memory_order_relaxed));
  put_tuple_header(q.bytes, 2);
  put_int(q.bytes, static_cast<int64_t>(sid));
  put_int(q.bytes, static_cast<int64_t>(nbytes));
  ++q.requests;
}

uint64_t sid_of(const at::Tensor& t) {
  return storage_id(t.storage().data());
}

} // namespace detail

using namespace detail;

namespace {
// Empties the queue; the caller holds q.mu.
void reset(Queue& q, bool open) {
  q.open = open;
  q.bytes.clear();
  q.requests = q.ops = 0;
  q.limit = g_first_items.load(std::memory_order_relaxed);
  q.filled = false;
  q.woken = false;
}
} // namespace

void queue_open(c10::DeviceIndex device) {
  auto& q = queue(device);
  std::lock_guard<std::mutex> lock(q.mu);
  reset(q, true);
  q.announced.clear();  // a new server knows none of the old storages
}

void queue_close(c10::DeviceIndex device) {
  auto& q = queue(device);
  {
    std::lock_guard<std::mutex> lock(q.mu);
    reset(q, false);
  }
  q.work.notify_all();  // a waiting timer flush returns (the queue is closed)
  end_session(device);  // the server forgets the session's storages: they become stale
}

std::tuple<int64_t, int64_t, std::string> queue_take(c10::DeviceIndex device, int64_t free_type) {
  // freed ids first: every use of them is queued by now, and a storage freed after this
  // point may have its ALLOC in the queue taken below, so its FREE must not go with it
  auto freed = free_type >= 0 ? take_freed(device) : std::vector<uint64_t>{};
  auto& q = queue(device);
  std::string bytes;
  std::lock_guard<std::mutex> lock(q.mu);
  bytes.swap(q.bytes);
  q.bytes.reserve(bytes.capacity());
  auto requests = q.requests;
  if (!freed.empty()) {  // FreeStorage(sids) as a batch item: (type, ((sid, ...),))
    put_tuple_header(bytes, 2);
    put_int(bytes, free_type);
    put_tuple_header(bytes, 1);
    put_tuple_header(bytes, freed.size());
    for (auto sid : freed) {
      put_int(bytes, static_cast<int64_t>(sid));
    }
    ++requests;
  }
  auto taken = std::make_tuple(requests, q.ops, std::move(bytes));
  q.requests = q.ops = 0;
  q.woken = false;  // what queue_wake announced goes with this take (Python's batch)
  q.limit = q.filled ? std::min(2 * q.limit, g_max_items.load(std::memory_order_relaxed))
                     : g_first_items.load(std::memory_order_relaxed);
  q.filled = false;
  return taken;
}

bool queue_wait(c10::DeviceIndex device, double timeout_s) {
  auto& q = queue(device);
  std::unique_lock<std::mutex> lock(q.mu);
  // `woken` stays set until the next take, like the ops: a second waiter (a test, a
  // session's thread still ending) cannot swallow the flush thread's wake-up
  return q.work.wait_for(lock, std::chrono::duration<double>(timeout_s),
                         [&] { return q.ops > 0 || q.woken || !q.open; });
}

void queue_wake(c10::DeviceIndex device) {
  auto& q = queue(device);
  {
    std::lock_guard<std::mutex> lock(q.mu);
    q.woken = true;
  }
  q.work.notify_all();
}

uint64_t announce(const at::Tensor& t, c10::DeviceIndex device) {
  TORCH_CHECK_VALUE(t.device() == c10::Device(c10::DeviceType::PrivateUse1, device),
                    "remote_accel: expected a tensor on remote_accel:", static_cast<int>(device), ", got one on ",
                    t.device());
  const auto sid = sid_of(t);
  if (sid != 0) {
    auto& q = queue(device);
    std::lock_guard<std::mutex> lock(q.mu);
    if (q.open && q.announced.insert(sid).second) {
      put_alloc(q, sid, t.storage().nbytes());
    }
  }
  return sid;
}

uint64_t announce_output(const at::Tensor& t, c10::DeviceIndex device) {
  const auto sid = sid_of(t);
  if (sid != 0) {
    auto& q = queue(device);
    std::lock_guard<std::mutex> lock(q.mu);
    q.announced.insert(sid);
  }
  return sid;
}

std::vector<uint64_t> take_freed(c10::DeviceIndex device) {
  auto freed = drain_freed(device);
  auto& q = queue(device);
  std::lock_guard<std::mutex> lock(q.mu);
  std::erase_if(freed, [&](uint64_t sid) { return q.announced.erase(sid) == 0; });
  return freed;
}

} // namespace remote_accel
