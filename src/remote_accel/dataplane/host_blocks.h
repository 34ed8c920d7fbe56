// The cache of pre-faulted host blocks for large CPU buffers, one for both sides of the
// wire: the client's large `.cpu()` results and pinned memory (pytorch_ext/csrc/
// host_cache.cpp) and the server's large CPU storages (server/csrc/host_blocks.cpp).
//
// Why: fresh memory from malloc is untouched, so every 4 KiB page faults (and the kernel
// zeroes it) as received bytes land in it, which makes a copy into fresh memory 4-5x
// slower than into touched memory, and it is unmapped again when its tensor dies. A
// block freed by its tensor goes back to this cache and is simply written again, as
// CUDA's pinned-memory host allocator caches its blocks.
//
// Owners: a block is reused only by the owner that freed it (the server opens one per
// session, so a new storage never shows another client's bytes; the client has one).
// What an owner's blocks hold beyond the bytes asked of them (its cached free blocks,
// and each live block's rounding up to 2 MiB) is its `extra`: the server charges it to
// the session's memory limit, by passing the `room` that limit leaves; the client
// passes no limit.
//
// No torch here: the callers wrap a block in their DataPtr, with release() as deleter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

namespace remote_accel::host_blocks {

// Smaller buffers come from malloc as usual (its own free lists serve them well).
constexpr size_t kMinBytes = 1 << 20;
constexpr size_t kNoLimit = std::numeric_limits<size_t>::max();

class Cache;

struct Block {
  void* ptr;
  size_t size;   // mapped: the bytes asked, rounded up to 2 MiB pages
  uint64_t owner;
  size_t nbytes;  // asked by the buffer it backs (0 while cached)
  Cache* cache;
  uint64_t freed = 0;  // while cached: when it was freed (the cache's count of frees)
};

struct Stats {
  int64_t cached_bytes;  // free blocks kept for reuse
  int64_t live_bytes;    // blocks backing live buffers
  int64_t limit_bytes;   // most bytes of free blocks kept (0: no caching)
  int64_t hits, misses, released;  // buffers served from the cache, blocks mapped, blocks unmapped
};

class Cache {
 public:
  // `budget_env`: the environment variable of the free blocks' budget in MiB (0: no
  // caching), `default_mib` where it is unset.
  Cache(const char* budget_env, unsigned long long default_mib);

  bool enabled() const;
  uint64_t open();
  // Unmaps the owner's cached blocks; its live ones are unmapped when their buffers go.
  void close(uint64_t owner);

  // A block for `nbytes` (>= kMinBytes) of `owner`: a cached one of its own, or a newly
  // mapped one; nullptr when caching is off, the system has no memory, or the block's
  // rounding does not fit in `room` (the bytes the owner's limit leaves once `nbytes`
  // are counted) even after its cached blocks are unmapped to make room.
  Block* take(size_t nbytes, uint64_t owner, size_t room = kNoLimit);
  // A DataPtr deleter: `block` goes back to its cache, or is unmapped. Where the budget
  // is full, the blocks freed longest ago make room for it: a loop's next buffer is the
  // size it just freed, whatever sizes an earlier phase left behind.
  static void release(void* block);

  // Unmaps `owner`'s cached blocks until its extra fits in `room`.
  void fit(uint64_t owner, size_t room);
  size_t extra(uint64_t owner);
  Stats stats();
  // Unmaps every cached block; with `cap`, keeps at most that many bytes from now on.
  void trim(std::optional<size_t> cap);

 private:
  struct Charge {
    size_t cached = 0;  // its free blocks
    size_t slack = 0;   // its live blocks' size less the bytes asked of them
    size_t extra() const { return cached + slack; }
  };
  using FreeList = std::multimap<size_t, Block*>;  // by size

  bool give(Block* b, std::vector<Block*>& gone);
  void drop_cached(uint64_t owner, size_t room, std::vector<Block*>& gone);  // mu_ held
  void make_room(size_t size, std::vector<Block*>& gone);                    // mu_ held
  void recycle_oldest(size_t size, std::vector<Block*>& gone);               // mu_ held
  size_t push_out_oldest(std::vector<Block*>& gone);                         // mu_ held
  FreeList::iterator unlist(FreeList::iterator it);                          // mu_ held

  mutable std::mutex mu_;
  FreeList free_;
  std::map<uint64_t, FreeList::iterator> by_age_;  // the free blocks by Block::freed
  uint64_t frees_ = 0;
  std::map<uint64_t, Charge> owners_;
  uint64_t last_owner_ = 0;
  size_t cap_;
  size_t cached_ = 0, live_ = 0;
  int64_t hits_ = 0, misses_ = 0, released_ = 0;
};

}  // namespace remote_accel::host_blocks
