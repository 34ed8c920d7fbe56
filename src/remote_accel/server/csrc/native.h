// The server's per-session hot path in C++: the storage table, plan templates, and
// batches of planned ops run with the GIL released. Python (server/executor.py,
// server/storage.py, server/session.py) drives it and keeps the rare paths.
#pragma once

#include "batch_scan.h"
#include "host_blocks.h"  // dataplane/: the host-block cache, shared with the client
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include "swap.h"

#include <ATen/core/Generator.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace remote_accel::server {

// The steady clock in nanoseconds (timings, deadlines).
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A failure of one request, reported at the client's next sync. `kind` is an ErrorReply
// kind (server/failure.py) or "exception" for an op's own error, then `type` names the
// Python exception class to raise it as.
struct Error {
  std::string kind;
  std::string type;
  std::string message;
  std::string op;  // the op that failed, when one did
};

struct ErrorThrown {
  Error error;
};

[[noreturn]] void fail(const char* kind, std::string message);

// Client storage ids -> device storages, with the session's memory accounting (the C++
// half of server/storage.py's StorageTable). Only the session's thread changes it; the
// figures (used, peak, size) are atomics because metrics and stats read them from other
// threads while a batch runs with the GIL released.
// The server's host-block cache (dataplane/host_blocks.h): large CPU storages come from
// pre-faulted blocks, one owner per session's table (table.cpp).
host_blocks::Cache& host_block_cache();

class Table {
 public:
  Table(c10::Device device, int64_t limit, std::shared_ptr<Pool> pool = nullptr)
      : device_(device), limit_(limit), owner_(host_block_cache().open()), pool_(std::move(pool)) {}
  // storages first: their cached host blocks go back to the owner, which then unmaps them
  ~Table() {
    clear();
    host_block_cache().close(owner_);
  }
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  c10::Device device() const { return device_; }
  int64_t limit() const { return limit_; }
  // host_blocks.h: what this session's host blocks hold beyond its storages' bytes (its
  // cached free blocks and its live blocks' rounding), charged to its limit; fit_host
  // unmaps its cached blocks until that fits in `room`
  int64_t host_extra() const { return static_cast<int64_t>(host_block_cache().extra(owner_)); }
  void fit_host(int64_t room) const { host_block_cache().fit(owner_, static_cast<size_t>(std::max<int64_t>(room, 0))); }
  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  // Bytes the server holds for this session outside its storages (an echo's payload while
  // it is sent back, kept plans and graphs: StorageTable.hold), charged as storages are.
  int64_t held() const { return held_.load(std::memory_order_relaxed); }
  void hold(int64_t delta) { held_.fetch_add(delta, std::memory_order_relaxed); }
  // Everything charged to the limit: storages, held bytes, host blocks' extra.
  int64_t charged() const { return used() + held() + host_extra(); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  size_t size() const { return size_.load(std::memory_order_relaxed); }
  bool contains(int64_t sid) const { return entries_.count(sid) != 0; }
  // An entry's storage; only for one pinned by resident() (or with no pool): another
  // session may swap an unpinned one out at any time (swap.cpp).
  const c10::Storage* find(int64_t sid) const {
    auto it = entries_.find(sid);
    return it == entries_.end() ? nullptr : &it->second.storage;
  }

  // -- swapping (swap.cpp) -------------------------------------------------------------------
  // The storage of `sid` on the device (swapped in first if need be), pinned there until
  // unpin(mark) with a mark taken before; nullptr if there is no such entry.
  const c10::Storage* resident(int64_t sid);
  size_t pin_mark() const { return pinned_.size(); }
  void unpin(size_t mark);
  // Refuses (Failure oom) `nbytes` more that the server's device memory cannot take.
  void room(int64_t nbytes);
  // Queued ops: `sids` are used by the op numbered `seq`; swapped-out ones are fetched.
  void upcoming(const int64_t* sids, size_t n, uint64_t seq);
  bool swapping() const { return pool_ && pool_->swapping(); }
  uint64_t seq() const { return seq_; }
  void set_seq(uint64_t seq) { seq_ = seq; }
  SwapStats swap_stats() const;
  void sync_stream();  // CUDA: waits for the work this session queued

  void check_fits(int64_t nbytes) const;
  void check_new(int64_t sid) const;
  void alloc(int64_t sid, int64_t nbytes);
  // Keeps `storage` under `sid` (replacing what it held if `replace`); the caller has
  // checked the limit.
  void put(int64_t sid, c10::Storage storage, bool replace);
  bool free(int64_t sid);
  std::pair<int64_t, int64_t> clear();
  // Re-counts storages an op may have resized; Failure(oom) past the limit.
  void resync(const int64_t* sids, size_t n);
  int64_t accounted(int64_t sid) const;
  // (sid, bytes) of every entry, in sid order: what a client's recovery snapshot reads.
  std::vector<std::pair<int64_t, int64_t>> entries() const;

 private:
  struct Entry {
    c10::Storage storage;
    int64_t nbytes;
    Slot slot;  // its residency, under the pool's lock
  };
  void account(Entry& e, int64_t nbytes);
  void unregister(Entry& e, Pool::Guard& g);
  friend class Pool;

  c10::Device device_;
  int64_t limit_;
  std::atomic<int64_t> used_{0};
  std::atomic<int64_t> held_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<size_t> size_{0};  // entries_.size(), readable from any thread
  std::unordered_map<int64_t, Entry> entries_;
  uint64_t owner_;  // host_blocks: this session's cached memory is reused by it alone
  // swapping: all under the pool's lock
  std::shared_ptr<Pool> pool_;
  std::vector<Slot*> pinned_;
  uint64_t seq_ = 1;  // the op running (batch items are numbered on from here)
  SwapStats stats_;
  std::optional<c10::Stream> stream_;  // the session's compute stream (CUDA)
};

// A view's layout as a tensor reference gives it (storage id aside).
struct Layout {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  int flags = 0;  // torch_wire/values.py FLAG_CONJ | FLAG_NEG
  int64_t span = 0;  // bytes of storage it reaches
};

// Where one RunPlanned value goes.
struct Hole {
  // kScalar: a Scalar argument sent as a value (float64, int64, bool or complex128 bytes)
  enum Kind : uint8_t { kTensor, kCpu, kOut, kScalar } kind;
  Layout layout;  // kTensor, kOut; kCpu: dtype and sizes; kScalar: dtype
  int64_t slot = -1;  // kTensor, kCpu, kScalar: index into the stack
  int64_t item = -1;  // inside the list at that slot, or -1
  int64_t out = -1;  // kOut: result index
  // kTensor: the op writes this argument, so a storage id the session has not seen is
  // made here from the layout (the client sends no ALLOC for it: out= results, factories)
  bool written = false;
  // kCpu: the tensor the last run filled, filled again by the next one when nothing else
  // kept it (an at::empty per scalar argument was 9% of a batch); the session's thread alone
  // runs its templates
  mutable at::Tensor scratch;
};

struct Template {
  c10::OperatorHandle op;
  std::string name;
  std::vector<c10::IValue> stack;  // the arguments, holes holding placeholders
  std::vector<Hole> holes;  // in wire order
  size_t n_outs = 0;  // RunOp.outs' length (None outs have no hole)
  std::vector<size_t> list_slots;  // stack slots holding lists with holes: copied per call
  // Draws from the device's default generator (native_dropout): run with it holding the
  // session's default generator's state (server/rng.py's as_device_default)
  bool seeded = false;
};

// The lock around swaps of the device's process-wide default generator's state (one per
// process, shared with server/rng.py's as_device_default).
std::mutex& default_generator_mutex();

class Executor {
 public:
  Executor(c10::Device device, int64_t limit, std::shared_ptr<Pool> pool = nullptr)
      : table_(device, limit, std::move(pool)) {}

  Table& table() { return table_; }
  // The storage of `sid` when bytes [offset, offset + nbytes) of it lie in host memory
  // (a CPU server), swapped in and pinned until the table's unpin(); nullptr for
  // anything else (a device storage, no such storage, a bad range, a swap-in that
  // failed): Python's path then says what is wrong. Small reads and a Batch's WRITEs.
  const c10::Storage* host_storage(int64_t sid, int64_t offset, int64_t nbytes);
  // read by metrics from other threads while a batch runs: atomic
  int64_t ops_done() const { return ops_done_.load(std::memory_order_relaxed); }
  // ALLOC requests run, and storages made for ops that write them instead (Hole::written)
  int64_t alloc_requests() const { return alloc_requests_.load(std::memory_order_relaxed); }
  int64_t storages_made() const { return storages_made_.load(std::memory_order_relaxed); }

  void define(int64_t plan, std::shared_ptr<const Template> t) { plans_[plan] = std::move(t); }
  // The session's default generator and the device's shared one, for seeded templates.
  void set_generators(at::Generator own, at::Generator shared) {
    own_generator_ = std::move(own);
    shared_generator_ = std::move(shared);
  }
  bool has_generators() const { return own_generator_.defined() && shared_generator_.defined(); }
  void drop(int64_t plan) { plans_.erase(plan); }
  bool planned(int64_t plan) const { return plans_.count(plan) != 0; }
  void clear_plans() { plans_.clear(); }

  void mark_failed(int64_t sid);
  bool failed(int64_t sid) const { return failed_.count(sid) != 0; }
  void forget(int64_t sid) { failed_.erase(sid); }
  void clear_failed() { failed_.clear(); }

  // One planned op from its values (storage ids, CPU tensor bytes); throws ErrorThrown.
  struct Value {
    int64_t sid = 0;
    std::string_view bytes;
    bool is_bytes = false;
    bool other = false;  // neither an int nor bytes
  };
  void run(int64_t plan, const std::vector<Value>& values);

  // -- batches (batch.cpp) --------------------------------------------------------------
  // Checks a whole Batch's meta as messages.decode + batch_items would; false when
  // Python must decode it. With `lengths` (the message came whole, its `payloads` after
  // the meta: the C++ loop's), its WRITEs run here too, from a copy of those bytes;
  // without, each WRITE stops the run for Python, which has placed its payload.
  bool scan(std::string meta, std::string_view payloads = {}, const std::vector<uint64_t>* lengths = nullptr);
  // The payload scan() kept for WRITE item `i`, when it kept one.
  std::optional<std::string_view> held_payload(size_t i) const;
  // Runs items from `first` on until one Python must run, an error, or the end.
  struct Stop {
    // initialized: a Stop is copied whole (FastLoop::Result) even when no batch set it,
    // and an indeterminate enum is undefined behaviour (UBSan: "not a valid value for type Kind")
    size_t item = 0;  // the item Python runs (kSlow) or that failed (kError); == count at the end
    enum Kind { kEnd, kSlow, kError } kind = kEnd;
    size_t begin = 0, end = 0;  // kSlow: the item's bytes in the meta
    Error error;
  };
  Stop resume(size_t first);
  size_t batch_size() const { return items_.size(); }
  const std::vector<BatchItem>& batch_items() const { return items_; }
  const std::string& batch_meta() const { return meta_; }

  at::Tensor view(const c10::Storage& storage, const Layout& layout) const;

  // Where a result goes: flat result `result` into storage `sid`, with `layout`.
  struct Placement {
    size_t result;
    int64_t sid;
    const Layout* layout;
  };
  // Places `results` as the client's references promise (executor.py's _bind): a fresh
  // storage is swapped in under its id, anything else is copied into it. The storages
  // of `touched` (the op's inputs) are never taken over.
  void place(const std::vector<c10::IValue>& results, const std::vector<Placement>& places,
             const std::vector<int64_t>& touched);

 private:
  const c10::Storage& input(int64_t sid, const Layout& layout, c10::Storage& scratch);
  void bind(const Template& t, std::vector<c10::IValue>& results, const std::vector<int64_t>& out_sids,
            const std::vector<int64_t>& touched);
  void run_item(size_t i);
  void lookahead(size_t i);  // swap.cpp

  void call_seeded(const Template& t, std::vector<c10::IValue>& stack);

  Table table_;
  at::Generator own_generator_, shared_generator_;
  std::atomic<int64_t> ops_done_{0};
  std::atomic<int64_t> alloc_requests_{0}, storages_made_{0};  // one writer: the session's thread
  std::unordered_map<int64_t, std::shared_ptr<const Template>> plans_;
  std::unordered_set<int64_t> failed_;

  // the batch being run
  using Item = BatchItem;  // batch_scan.h: where each item's bytes are
  std::string meta_;
  std::string payloads_;  // its WRITEs' payloads, when it came whole (scan)
  std::vector<Item> items_;
  uint64_t base_ = 0;  // the op sequence number of item 0
  size_t ahead_ = 0;  // items before this one have been looked ahead at
};

}  // namespace remote_accel::server
