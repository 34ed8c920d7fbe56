// Host memory for large CPU storages: pre-faulted, huge-page-backed blocks, kept for
// reuse when their storage goes (as CUDA's pinned-memory allocator caches blocks).
//
// Why: a client uploading batches allocates a new storage per batch. Fresh memory from
// malloc is mmap'd and untouched, so the receive path takes a page fault (and the kernel
// zeroes a page) every 4 KiB while it copies frames in, which makes a copy into fresh
// memory 4-5x slower than into touched memory. A block taken from the cache was faulted
// in once (MAP_POPULATE, on 2 MiB pages where THP allows) and is simply written again.
#include "host_blocks.h"
#include "host_pages.h"

#include <sys/mman.h>

#include <c10/core/CPUAllocator.h>

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
    live_.insert(++last_owner_);
    return last_owner_;
  }

  void close(uint64_t owner) {
    std::vector<Block*> gone;
    {
      std::lock_guard<std::mutex> g(mu_);
      live_.erase(owner);
      for (auto it = free_.begin(); it != free_.end();) {
        if (it->second->owner == owner) {
          cached_ -= it->second->size;
          gone.push_back(it->second);
          it = free_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (Block* b : gone) {
      unmap(b);
    }
  }

  Block* take(size_t size, uint64_t owner) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = free_.lower_bound(size); it != free_.end() && it->first <= size * kSlackNum / kSlackDen; ++it) {
      if (it->second->owner == owner) {
        Block* b = it->second;
        free_.erase(it);
        cached_ -= b->size;
        return b;
      }
    }
    return nullptr;
  }

  // Keeps `b` for reuse while its owner lives and the cache has room; false: the
  // caller unmaps it.
  bool give(Block* b) {
    std::lock_guard<std::mutex> g(mu_);
    if (cached_ + b->size > cap_ || !live_.count(b->owner)) {
      return false;
    }
    free_.emplace(b->size, b);
    cached_ += b->size;
    return true;
  }

 private:
  std::mutex mu_;
  std::multimap<size_t, Block*> free_;
  std::set<uint64_t> live_;
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

Block* map_block(size_t size, uint64_t owner) {
  void* ptr = map_prefaulted(size);
  return ptr == nullptr ? nullptr : new Block{ptr, size, owner};
}

}  // namespace

uint64_t host_owner_open() { return cache().open(); }

void host_owner_close(uint64_t owner) { cache().close(owner); }

std::optional<c10::Storage> host_storage(int64_t nbytes, uint64_t owner) {
  if (nbytes < static_cast<int64_t>(kMinBytes) || !cache().enabled()) {
    return std::nullopt;
  }
  size_t size = (static_cast<size_t>(nbytes) + kGranule - 1) & ~(kGranule - 1);
  Block* b = cache().take(size, owner);
  if (b == nullptr) {
    b = map_block(size, owner);
    if (b == nullptr) {
      return std::nullopt;  // let the ordinary allocator try (and report out of memory)
    }
  }
  c10::DataPtr data(b->ptr, b, &release, c10::Device(c10::kCPU));
  // Resizable through the ordinary allocator: resize_ moves the bytes to a new
  // allocation and hands this block back (release).
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), c10::GetCPUAllocator(),
                      /*resizable=*/true);
}

}  // namespace remote_accel::server
