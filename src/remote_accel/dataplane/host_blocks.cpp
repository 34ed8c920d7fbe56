// The host-block cache (host_blocks.h says why and for whom).
//
// Safety: a block is in the free list only after the buffer that held it died (its
// DataPtr's deleter, release(), puts it there), so two live buffers never share a block,
// and only its own owner takes it again.
#include "host_blocks.h"
#include "host_pages.h"

#include <sys/mman.h>

namespace remote_accel::host_blocks {
namespace {

// A cached block serves a request down to this fraction of its size (the rest is unused).
constexpr size_t kSlackNum = 5, kSlackDen = 4;

void unmap(Block* b) {
  munmap(b->ptr, b->size);
  delete b;
}

void unmap_all(const std::vector<Block*>& gone) {
  for (Block* b : gone) {
    unmap(b);
  }
}

}  // namespace

Cache::Cache(const char* budget_env, unsigned long long default_mib)
    : cap_(cache_budget_from_env(budget_env, default_mib)) {}

bool Cache::enabled() const {
  std::lock_guard<std::mutex> g(mu_);
  return cap_ > 0;
}

uint64_t Cache::open() {
  std::lock_guard<std::mutex> g(mu_);
  owners_.emplace(++last_owner_, Charge{});
  return last_owner_;
}

void Cache::close(uint64_t owner) {
  std::vector<Block*> gone;
  {
    std::lock_guard<std::mutex> g(mu_);
    owners_.erase(owner);
    drop_cached(owner, 0, gone);
  }
  unmap_all(gone);
}

Block* Cache::take(size_t nbytes, uint64_t owner, size_t room) {
  const size_t size = (nbytes + kHugePage - 1) & ~(kHugePage - 1);
  std::vector<Block*> gone;  // unmapped without the lock
  Block* cached = nullptr;
  bool map_new = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto owner_it = owners_.find(owner);
    if (cap_ == 0 || owner_it == owners_.end()) {
      return nullptr;
    }
    Charge& charge = owner_it->second;
    for (auto it = free_.lower_bound(size); it != free_.end() && it->first <= size * kSlackNum / kSlackDen; ++it) {
      if (it->second->owner == owner) {
        cached = it->second;
        unlist(it);
        break;
      }
    }
    const size_t block_size = cached != nullptr ? cached->size : size;
    const size_t slack = block_size - nbytes;
    drop_cached(owner, room >= slack ? room - slack : 0, gone);  // the owner's cache yields first
    if (charge.extra() + slack > room) {  // its live blocks' rounding leaves no room
      if (cached != nullptr) {
        gone.push_back(cached);
        ++released_;
        cached = nullptr;
      }
    } else {
      charge.slack += slack;  // counted now, so that no other take() overcommits the room
      live_ += block_size;
      if (cached != nullptr) {
        cached->nbytes = nbytes;
        ++hits_;
      } else {
        map_new = true;
        ++misses_;
        recycle_oldest(size, gone);
      }
    }
  }
  unmap_all(gone);
  if (!map_new) {
    return cached;
  }
  void* ptr = map_prefaulted(size);
  if (ptr == nullptr) {  // no memory: the caller's ordinary allocator tries, and reports it
    std::lock_guard<std::mutex> g(mu_);
    live_ -= size;
    auto it = owners_.find(owner);
    if (it != owners_.end()) it->second.slack -= size - nbytes;
    return nullptr;
  }
  return new Block{ptr, size, owner, nbytes, this};
}

void Cache::release(void* block) {
  auto* b = static_cast<Block*>(block);
  std::vector<Block*> gone;  // unmapped without the lock
  if (!b->cache->give(b, gone)) {
    gone.push_back(b);
  }
  unmap_all(gone);
}

// Keeps `b` for reuse while its owner lives and it fits the budget, which the blocks
// freed longest ago leave for it (into `gone`); false: the caller unmaps it.
bool Cache::give(Block* b, std::vector<Block*>& gone) {
  std::lock_guard<std::mutex> g(mu_);
  live_ -= b->size;
  auto it = owners_.find(b->owner);
  if (it != owners_.end()) it->second.slack -= b->size - b->nbytes;
  b->nbytes = 0;
  if (it == owners_.end() || b->size > cap_) {
    ++released_;
    return false;
  }
  make_room(b->size, gone);
  b->freed = ++frees_;
  by_age_.emplace(b->freed, free_.emplace(b->size, b));
  cached_ += b->size;
  it->second.cached += b->size;
  return true;
}

// mu_ held: unlists the blocks freed longest ago (into `gone`) until `size` more bytes
// fit the budget
void Cache::make_room(size_t size, std::vector<Block*>& gone) {
  while (!by_age_.empty() && cached_ + size > cap_) {
    push_out_oldest(gone);
  }
}

// mu_ held, on a miss of `size` bytes (counted in live_ already): while the free and live
// blocks together pass the budget, the live ones will push the blocks freed longest ago
// out once they come back. About `size` bytes of those go now, before the new block is
// mapped, so that the kernel has their pages to hand out again: pages it never handed
// out can cost far more to fault in (a VM's host backs them on first touch: 6-9 us a
// page on the project's VM, against 0.5). Only misses do this, never a hit, so a loop
// served from the cache keeps its blocks; and never for a block larger than the budget,
// which will not be kept.
void Cache::recycle_oldest(size_t size, std::vector<Block*>& gone) {
  if (size > cap_) return;
  for (size_t recycled = 0; recycled < size && !by_age_.empty() && cached_ + live_ > cap_;) {
    recycled += push_out_oldest(gone);
  }
}

// mu_ held, at least one block free: unlists the one freed longest ago (into `gone`);
// its size
size_t Cache::push_out_oldest(std::vector<Block*>& gone) {
  Block* oldest = by_age_.begin()->second->second;
  unlist(by_age_.begin()->second);
  gone.push_back(oldest);
  ++released_;
  return oldest->size;
}

// mu_ held: takes a free block out of the lists and the counts (not unmapped)
Cache::FreeList::iterator Cache::unlist(FreeList::iterator it) {
  Block* b = it->second;
  by_age_.erase(b->freed);
  cached_ -= b->size;
  auto owner_it = owners_.find(b->owner);
  if (owner_it != owners_.end()) owner_it->second.cached -= b->size;
  return free_.erase(it);
}

void Cache::fit(uint64_t owner, size_t room) {
  std::vector<Block*> gone;
  {
    std::lock_guard<std::mutex> g(mu_);
    drop_cached(owner, room, gone);
  }
  unmap_all(gone);
}

size_t Cache::extra(uint64_t owner) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = owners_.find(owner);
  return it == owners_.end() ? 0 : it->second.extra();
}

Stats Cache::stats() {
  std::lock_guard<std::mutex> g(mu_);
  return {static_cast<int64_t>(cached_), static_cast<int64_t>(live_), static_cast<int64_t>(cap_),
          hits_, misses_, released_};
}

void Cache::trim(std::optional<size_t> cap) {
  std::vector<Block*> gone;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (cap) {
      cap_ = *cap;
    }
    for (auto it = free_.begin(); it != free_.end();) {
      gone.push_back(it->second);
      it = unlist(it);
    }
    released_ += static_cast<int64_t>(gone.size());
  }
  unmap_all(gone);
}

// mu_ held: takes `owner`'s cached blocks out (largest first, into `gone`, for the caller
// to unmap without the lock) until its extra is at most `room`
void Cache::drop_cached(uint64_t owner, size_t room, std::vector<Block*>& gone) {
  auto owner_it = owners_.find(owner);
  Charge* charge = owner_it == owners_.end() ? nullptr : &owner_it->second;
  for (auto it = free_.end(); it != free_.begin();) {
    --it;
    if (charge != nullptr && charge->extra() <= room) break;
    if (it->second->owner != owner) continue;
    gone.push_back(it->second);
    ++released_;
    it = unlist(it);
  }
}

}  // namespace remote_accel::host_blocks
