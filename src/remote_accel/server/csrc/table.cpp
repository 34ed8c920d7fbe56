// The storage table's C++ half: entries and accounting, as server/storage.py describes.
#include "native.h"

#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>

namespace remote_accel::server {

host_blocks::Cache& host_block_cache() {
  // REMOTE_ACCEL_HOST_CACHE_MB: bytes of free blocks kept for reuse (0 disables the cache).
  // Never destroyed: storages may die during exit.
  static auto* c = new host_blocks::Cache("REMOTE_ACCEL_HOST_CACHE_MB", 2048);
  return *c;
}

namespace {

// A CPU storage of `nbytes` over a block of this session's (`owner`), or nullopt (small,
// caching off, no memory, or no room for the block's rounding in `room`, the bytes the
// limit leaves once the storage is counted): the caller then allocates as usual, and the
// ordinary allocator reports out of memory in its own words.
std::optional<c10::Storage> host_storage(int64_t nbytes, uint64_t owner, int64_t room) {
  if (nbytes < static_cast<int64_t>(host_blocks::kMinBytes)) {
    return std::nullopt;
  }
  host_blocks::Block* b = host_block_cache().take(static_cast<size_t>(nbytes), owner,
                                                  static_cast<size_t>(std::max<int64_t>(room, 0)));
  if (b == nullptr) {
    return std::nullopt;
  }
  c10::DataPtr data(b->ptr, b, &host_blocks::Cache::release, c10::Device(c10::kCPU));
  // Resizable through the ordinary allocator: resize_ moves the bytes to a new allocation
  // and hands this block back.
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), c10::GetCPUAllocator(),
                      /*resizable=*/true);
}

}  // namespace

void fail(const char* kind, std::string message) {
  throw ErrorThrown{Error{kind, "", std::move(message)}};
}

void Table::check_fits(int64_t nbytes) const {
  // what the session's host blocks hold beyond its storages counts too: its cached free
  // blocks make room first (dataplane/host_blocks.cpp), its live blocks' rounding cannot
  fit_host(limit_ - used() - held() - nbytes);
  const int64_t held = charged();
  if (nbytes > limit_ - held) {
    fail("oom", "allocating " + std::to_string(nbytes) + " bytes would exceed this session's memory limit (" +
                    std::to_string(held) + " of " + std::to_string(limit_) + " bytes in use)");
  }
}

void Table::check_new(int64_t sid) const {
  if (entries_.count(sid)) {
    fail("bad_handle", "storage " + std::to_string(sid) + " already exists");
  }
  if (sid == 0) {
    fail("bad_handle", "storage 0 is every empty tensor's and cannot be allocated");
  }
}

void Table::account(Entry& e, int64_t nbytes) {
  // the pool's lock is held, where there is a pool
  used_ += nbytes - e.nbytes;
  e.nbytes = nbytes;
  peak_.store(std::max(peak(), used()), std::memory_order_relaxed);
  if (pool_) {
    if (e.slot.owner == nullptr) {
      e.slot.owner = this;
      e.slot.storage = &e.storage;
      pool_->add(e.slot, nbytes);
    } else {
      pool_->resize(e.slot, nbytes);
    }
  }
}

void Table::alloc(int64_t sid, int64_t nbytes) {
  check_new(sid);
  if (nbytes < 0) {
    fail("protocol", "bad allocation size " + std::to_string(nbytes));
  }
  check_fits(nbytes);
  room(nbytes);
  // uploads land in new storages: on CPU, memory that takes no page faults
  auto cached = device_.is_cpu() ? host_storage(nbytes, owner_, limit_ - used() - held() - nbytes) : std::nullopt;
  auto storage = cached ? std::move(*cached)
                        : at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device_)).storage();
  Pool::Guard g(pool_.get());
  auto& e = entries_.emplace(sid, Entry{std::move(storage), 0, {}}).first->second;
  size_ = entries_.size();
  account(e, nbytes);
  e.slot.fresh = true;
}

void Table::put(int64_t sid, c10::Storage storage, bool replace) {
  Pool::Guard g(pool_.get());
  auto it = entries_.find(sid);
  if (it == entries_.end() || !replace) {
    check_new(sid);
    it = entries_.emplace(sid, Entry{c10::Storage(), 0, {}}).first;
    size_ = entries_.size();
  }
  const auto nbytes = static_cast<int64_t>(storage.nbytes());
  auto& e = it->second;
  if (e.slot.swapped) {  // replaced whole: the swapped-out bytes are dead
    unregister(e, g);
  }
  g.bury(std::move(e.storage));
  e.storage = std::move(storage);
  account(e, nbytes);
  e.slot.fresh = false;
  if (pool_) {
    pool_->make_room(0, g);  // the result exists already: make room after the fact if need be
  }
}

bool Table::free(int64_t sid) {
  Pool::Guard g(pool_.get());
  auto it = entries_.find(sid);
  if (it == entries_.end()) {
    return false;
  }
  used_ -= it->second.nbytes;
  unregister(it->second, g);
  g.bury(std::move(it->second.storage));
  entries_.erase(it);
  size_ = entries_.size();
  return true;
}

std::pair<int64_t, int64_t> Table::clear() {
  Pool::Guard g(pool_.get());
  const auto taken = std::make_pair(static_cast<int64_t>(entries_.size()), used());
  for (auto& [sid, e] : entries_) {
    unregister(e, g);
    g.bury(std::move(e.storage));
  }
  entries_.clear();
  size_ = 0;
  pinned_.clear();
  used_ = 0;
  return taken;
}

void Table::resync(const int64_t* sids, size_t n) {
  Pool::Guard g(pool_.get());
  bool grew = false;
  for (size_t i = 0; i < n; ++i) {
    auto it = entries_.find(sids[i]);
    if (it == entries_.end() || it->second.slot.swapped) {
      continue;
    }
    const auto now = static_cast<int64_t>(it->second.storage.nbytes());
    if (now != it->second.nbytes) {
      grew |= now > it->second.nbytes;
      account(it->second, now);
    }
  }
  if (grew && used() > limit_) {
    fail("oom", "an op grew this session's storages to " + std::to_string(used()) + " bytes, over its limit of " +
                    std::to_string(limit_));
  }
}

int64_t Table::accounted(int64_t sid) const {
  auto it = entries_.find(sid);
  return it == entries_.end() ? -1 : it->second.nbytes;
}

std::vector<std::pair<int64_t, int64_t>> Table::entries() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  out.reserve(entries_.size());
  for (const auto& [sid, e] : entries_) {
    out.emplace_back(sid, e.nbytes);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace remote_accel::server
