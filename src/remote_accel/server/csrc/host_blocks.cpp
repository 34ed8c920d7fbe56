// Host memory for large CPU storages: pre-faulted, huge-page-backed blocks, kept for
// reuse when their storage goes (as CUDA's pinned-memory allocator caches blocks).
//
// Why: a client uploading batches allocates a new storage per batch. Fresh memory from
// malloc is mmap'd and untouched, so the receive path takes a page fault (and the kernel
// zeroes a page) every 4 KiB while it copies frames in, which makes a copy into fresh
// memory 4-5x slower than into touched memory. A block taken from the cache was faulted
// in once (MAP_POPULATE, on 2 MiB pages where THP allows) and is simply written again.
//
// What a session's blocks hold beyond its storages' bytes (its cached free blocks, and
// the rounding of each live block up to 2 MiB pages) is charged to that session: it may
// use only what its memory limit leaves (Table passes that `room` in), and its cached
// blocks are unmapped first when it needs the room itself.
#include "host_blocks.h"
#include "host_pages.h"

#include <sys/mman.h>

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <vector>

namespace remote_accel::server {
namespace {

constexpr size_t kMinBytes = 1 << 20;   // smaller storages: malloc is fine (its own free lists)
constexpr size_t kGranule = kHugePage;
// A cached block serves a request down to this fraction of its size (the rest is unused).
constexpr size_t kSlackNum = 5, kSlackDen = 4;

struct Block {
  void* ptr;
  size_t size;
  uint64_t owner;
  size_t nbytes;  // of the storage it backs (0 while cached)
};

// An owner's charge: bytes its blocks hold beyond its storages' bytes.
struct Charge {
  size_t cached = 0;  // its free blocks, kept for reuse
  size_t slack = 0;   // its live blocks' size less their storages' bytes
  size_t extra() const { return cached + slack; }
};

void unmap(Block* b) {
  munmap(b->ptr, b->size);
  delete b;
}

class Cache {
 public:
  Cache() {
    // REMOTE_ACCEL_HOST_CACHE_MB: bytes of free blocks kept for reuse (0 disables the cache)
    cap_ = cache_budget_from_env("REMOTE_ACCEL_HOST_CACHE_MB", 2048);
  }

  bool enabled() const { return cap_ > 0; }

  uint64_t open() {
    std::lock_guard<std::mutex> g(mu_);
    live_.emplace(++last_owner_, Charge{});
    return last_owner_;
  }

  void close(uint64_t owner) {
    std::vector<Block*> gone;
    {
      std::lock_guard<std::mutex> g(mu_);
      live_.erase(owner);
      drop_cached(owner, 0, gone);
    }
    for (Block* b : gone) {
      unmap(b);
    }
  }

  // For a storage of `nbytes` of `owner` in a block of at least `size` bytes: a cached
  // block, or map_new (the caller maps one; its rounding is counted already), or
  // neither when the block's rounding does not fit in `room` even after the owner's
  // cached blocks are dropped. Dropped blocks go to `gone`, for the caller to unmap
  // without the lock.
  struct Taken {
    Block* block = nullptr;
    bool map_new = false;
  };
  Taken take(size_t size, size_t nbytes, uint64_t owner, size_t room, std::vector<Block*>& gone) {
    std::lock_guard<std::mutex> g(mu_);
    auto owner_it = live_.find(owner);
    if (owner_it == live_.end()) return {};
    Charge& charge = owner_it->second;
    Block* b = nullptr;
    for (auto it = free_.lower_bound(size); it != free_.end() && it->first <= size * kSlackNum / kSlackDen; ++it) {
      if (it->second->owner == owner) {
        b = it->second;
        free_.erase(it);
        cached_ -= b->size;
        charge.cached -= b->size;
        break;
      }
    }
    const size_t slack = (b != nullptr ? b->size : size) - nbytes;
    drop_cached(owner, room >= slack ? room - slack : 0, gone);  // the owner's cache yields first
    if (charge.extra() + slack > room) {  // its live blocks' rounding leaves no room
      if (b != nullptr) gone.push_back(b);
      return {};
    }
    charge.slack += slack;
    if (b == nullptr) return {nullptr, true};
    b->nbytes = nbytes;
    return {b, false};
  }

  // A block the caller failed to map after take() counted it.
  void untake(uint64_t owner, size_t slack) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(owner);
    if (it != live_.end()) it->second.slack -= slack;
  }

  // Keeps `b` for reuse while its owner lives and the cache has room; false: the
  // caller unmaps it.
  bool give(Block* b) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(b->owner);
    if (it != live_.end()) it->second.slack -= b->size - b->nbytes;  // no longer live
    b->nbytes = 0;
    if (cached_ + b->size > cap_ || it == live_.end()) {
      return false;
    }
    give_locked(b);
    return true;
  }

  void fit(uint64_t owner, size_t room) {
    std::vector<Block*> gone;
    {
      std::lock_guard<std::mutex> g(mu_);
      drop_cached(owner, room, gone);
    }
    for (Block* b : gone) {
      unmap(b);
    }
  }

  size_t extra(uint64_t owner) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = live_.find(owner);
    return it == live_.end() ? 0 : it->second.extra();
  }

 private:
  // mu_ held; `b` is cached, its charge already moved off the live slack
  void give_locked(Block* b) {
    free_.emplace(b->size, b);
    cached_ += b->size;
    auto it = live_.find(b->owner);
    if (it != live_.end()) it->second.cached += b->size;
  }

  // mu_ held: takes `owner`'s cached blocks out (largest first, into `gone`, for the
  // caller to unmap without the lock) until its charge is at most `room`
  void drop_cached(uint64_t owner, size_t room, std::vector<Block*>& gone) {
    auto owner_it = live_.find(owner);
    Charge* charge = owner_it == live_.end() ? nullptr : &owner_it->second;
    for (auto it = free_.end(); it != free_.begin();) {
      --it;
      if (charge != nullptr && charge->extra() <= room) break;
      if (it->second->owner != owner) continue;
      cached_ -= it->second->size;
      if (charge != nullptr) charge->cached -= it->second->size;
      gone.push_back(it->second);
      it = free_.erase(it);
    }
  }

  std::mutex mu_;
  std::multimap<size_t, Block*> free_;
  std::map<uint64_t, Charge> live_;
  uint64_t last_owner_ = 0;
  size_t cached_ = 0;
  size_t cap_;
};

Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: storages may die during exit
  return *c;
}

void release(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  if (!cache().give(b)) {
    unmap(b);
  }
}

Block* map_block(size_t size, uint64_t owner, size_t nbytes) {
  void* ptr = map_prefaulted(size);
  return ptr == nullptr ? nullptr : new Block{ptr, size, owner, nbytes};
}

}  // namespace

uint64_t host_owner_open() { return cache().open(); }

void host_owner_close(uint64_t owner) { cache().close(owner); }

void host_owner_fit(uint64_t owner, int64_t room) { cache().fit(owner, static_cast<size_t>(std::max<int64_t>(room, 0))); }

int64_t host_owner_extra(uint64_t owner) { return static_cast<int64_t>(cache().extra(owner)); }

std::optional<c10::Storage> host_storage(int64_t nbytes, uint64_t owner, int64_t room) {
  if (nbytes < static_cast<int64_t>(kMinBytes) || !cache().enabled()) {
    return std::nullopt;
  }
  size_t size = (static_cast<size_t>(nbytes) + kGranule - 1) & ~(kGranule - 1);
  const size_t n = static_cast<size_t>(nbytes);
  const size_t fits = static_cast<size_t>(std::max<int64_t>(room, 0));
  std::vector<Block*> gone;
  auto taken = cache().take(size, n, owner, fits, gone);
  for (Block* g : gone) {
    unmap(g);
  }
  Block* b = taken.block;
  if (taken.map_new) {
    b = map_block(size, owner, n);
    if (b == nullptr) {
      cache().untake(owner, size - n);
      return std::nullopt;  // let the ordinary allocator try (and report out of memory)
    }
  }
  if (b == nullptr) {
    return std::nullopt;  // no room for a block's rounding: the ordinary allocator has none
  }
  c10::DataPtr data(b->ptr, b, &release, c10::Device(c10::kCPU));
  // Resizable through the ordinary allocator: resize_ moves the bytes to a new
  // allocation and hands this block back (release).
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), c10::GetCPUAllocator(),
                      /*resizable=*/true);
}

}  // namespace remote_accel::server
