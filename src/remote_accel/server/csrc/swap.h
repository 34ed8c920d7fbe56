// Device memory shared by every session of a server, with swapping of storages to host
// memory (server/swap.py says what for). One Pool per server; each Table entry carries a
// Slot, its residency. Every field here is guarded by Pool::mu: another session's
// thread may swap an unpinned storage out at any time, so a table reads an entry's
// bytes only after pinning it (Table::resident).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace remote_accel::server {

class Table;

// Per-session swap counters (memory_stats keys of the same names).
struct SwapStats {
  int64_t swapped_out_bytes = 0;
  int64_t swap_ins = 0, swap_outs = 0;
  int64_t prefetch_hits = 0, prefetch_misses = 0;
  int64_t bytes_in = 0, bytes_out = 0;  // bytes copied each way
  int64_t ns_in = 0, ns_out = 0;  // time spent copying each way (swap GB/s)
  int64_t overcommits = 0;  // ops whose own storages alone exceeded the device memory
};

// The residency of one table entry.
struct Slot {
  Table* owner = nullptr;
  c10::Storage* storage = nullptr;  // the entry's, empty while swapped out
  at::Tensor host;  // the bytes while swapped out (pinned on CUDA)
  int64_t nbytes = 0;  // counted as resident (or swapped when `swapped`)
  bool swapped = false;
  bool prefetched = false;  // swapped in ahead of use, not yet used
  bool fresh = false;  // allocated and not used since: no bytes worth copying either way
  int pins = 0;  // uses in progress: never swapped out while > 0
  uint64_t next_use = 0;  // the owner's op sequence number of its next known use
  std::shared_ptr<c10::Event> ready;  // CUDA: the prefetch copy, waited on before use
  std::list<Slot*>::iterator pos;  // in Pool::lru while resident
};

class Pool {
 public:
  Pool(c10::Device device, int64_t capacity, int64_t swap_capacity)
      : device_(device), capacity_(capacity), swap_capacity_(swap_capacity) {}

  // Holds the pool's lock; storages dropped meanwhile are released after unlocking
  // (a storage that Python once saw may need the GIL to die).
  class Guard {
   public:
    explicit Guard(Pool* pool) : pool_(pool) {
      if (pool_) lock_ = std::unique_lock<std::mutex>(pool_->mu_);
    }
    ~Guard() {
      if (lock_.owns_lock()) lock_.unlock();
      dead_.clear();
    }
    void bury(c10::Storage s) { dead_.push_back(std::move(s)); }

   private:
    Pool* pool_;
    std::unique_lock<std::mutex> lock_;
    std::vector<c10::Storage> dead_;
  };

  int64_t capacity() const { return capacity_; }
  int64_t swap_capacity() const { return swap_capacity_; }
  bool swapping() const { return swap_capacity_ > 0; }
  c10::Device device() const { return device_; }
  // Figures of the whole server (under the lock).
  std::vector<int64_t> figures();

  // -- with the Guard held --------------------------------------------------------------------
  void add(Slot& s, int64_t nbytes);  // a new resident entry
  void resize(Slot& s, int64_t nbytes);  // a resident entry's bytes changed
  void remove(Slot& s);  // an entry leaves (freed)
  void touch(Slot& s);  // most recently used
  // Swap out least recently used storages until `nbytes` more fit; false when they
  // cannot (nothing left to swap out, or no swap space). Not `urgent` (a prefetch):
  // only storages that no queued op needs.
  bool make_room(int64_t nbytes, Guard& g, bool urgent = true);
  void swap_in(Slot& s, bool prefetch, Guard& g);
  int64_t resident() const { return resident_; }
  int64_t swapped() const { return swapped_; }

 private:
  bool evict(Slot& s, Guard& g);
  c10::Stream side_stream();

  std::mutex mu_;
  c10::Device device_;
  int64_t capacity_, swap_capacity_;
  int64_t resident_ = 0, swapped_ = 0, peak_resident_ = 0;
  std::list<Slot*> lru_;  // resident slots, least recently used first
  std::optional<c10::Stream> side_;  // CUDA: where prefetches copy
};

}  // namespace remote_accel::server
