// Swapping storages between the device and host memory (swap.h; server/swap.py says
// what the policy is and why).
#include "native.h"

#include "codec.h"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>

namespace remote_accel::server {
namespace {

//: Batch items looked ahead at for swapped-out inputs, beyond the one about to run.
constexpr size_t kLookahead = 16;

at::Tensor whole(const c10::Storage& storage) {
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(storage.device()))
      .set_(storage, 0, {static_cast<int64_t>(storage.nbytes())}, {1});
}

std::string text(int64_t n) { return std::to_string(n); }

}  // namespace

// -- the pool -------------------------------------------------------------------------------------
std::vector<int64_t> Pool::figures() {
  std::lock_guard<std::mutex> lock(mu_);
  return {capacity_, swap_capacity_, resident_, swapped_, peak_resident_};
}

void Pool::add(Slot& s, int64_t nbytes) {
  s.nbytes = nbytes;
  s.swapped = false;
  resident_ += nbytes;
  peak_resident_ = std::max(peak_resident_, resident_);
  s.pos = lru_.insert(lru_.end(), &s);
}

void Pool::resize(Slot& s, int64_t nbytes) {
  resident_ += nbytes - s.nbytes;
  peak_resident_ = std::max(peak_resident_, resident_);
  s.nbytes = nbytes;
  touch(s);
}

void Pool::remove(Slot& s) {
  if (s.owner == nullptr) {
    return;
  }
  if (s.swapped) {
    swapped_ -= s.nbytes;
    s.owner->stats_.swapped_out_bytes -= s.nbytes;
    s.host.reset();
  } else {
    resident_ -= s.nbytes;
    lru_.erase(s.pos);
  }
  s.owner = nullptr;
  s.swapped = s.prefetched = false;
  s.ready.reset();
  s.nbytes = 0;
}

void Pool::touch(Slot& s) {
  if (!s.swapped) {
    lru_.splice(lru_.end(), lru_, s.pos);
  }
}

bool Pool::make_room(int64_t nbytes, Guard& g, bool urgent) {
  if (resident_ + nbytes <= capacity_) {
    return true;
  }
  if (!swapping()) {
    return false;
  }
  // First what no queued op needs, least recently used first; then, rather than fail,
  // what a queued op needs (it is swapped back in before that op runs).
  for (int pass = 0; pass < (urgent ? 2 : 1) && resident_ + nbytes > capacity_; ++pass) {
    for (auto it = lru_.begin(); it != lru_.end() && resident_ + nbytes > capacity_;) {
      Slot* s = *it++;  // evict() takes s out of lru_
      if (s->pins > 0 || s->nbytes == 0 || swapped_ + s->nbytes > swap_capacity_) {
        continue;
      }
      if (pass == 0 && s->next_use >= s->owner->seq_) {
        continue;
      }
      evict(*s, g);
    }
  }
  return resident_ + nbytes <= capacity_;
}

bool Pool::evict(Slot& s, Guard& g) {
  const auto start = now_ns();
  const bool cuda = device_.is_cuda();
  if (cuda) {
    s.owner->sync_stream();  // its last kernels may still use the bytes
    if (s.ready) {
      s.ready->synchronize();  // a prefetch not used yet may still be copying them in
    }
  }
  auto& st = s.owner->stats_;
  if (s.fresh) {
    s.host.reset();  // an output allocated ahead of its op: nothing to keep (see swap_in)
  } else {
    auto host = at::empty({s.nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(cuda));
    host.copy_(whole(*s.storage));
    s.host = std::move(host);
    st.bytes_out += s.nbytes;
    st.ns_out += now_ns() - start;
  }
  g.bury(std::move(*s.storage));
  *s.storage = c10::Storage();
  lru_.erase(s.pos);
  resident_ -= s.nbytes;
  swapped_ += s.nbytes;
  s.swapped = true;
  s.prefetched = false;
  s.ready.reset();
  st.swapped_out_bytes += s.nbytes;
  st.swap_outs += 1;
  return true;
}

c10::Stream Pool::side_stream() {
  if (!side_) {
    c10::impl::VirtualGuardImpl impl(device_.type());
    side_ = impl.getStreamFromGlobalPool(device_, false);
  }
  return *side_;
}

void Pool::swap_in(Slot& s, bool prefetch, Guard&) {
  const auto start = now_ns();
  const auto options = at::TensorOptions().dtype(at::kByte).device(device_);
  at::Tensor bytes;
  const bool copy = s.host.defined();  // else it went out fresh: its bytes were never defined
  if (!copy) {
    bytes = at::empty({s.nbytes}, options);
  } else if (prefetch && device_.is_cuda()) {
    // On a stream of its own, overlapping the session's kernels; the session's stream
    // waits for the copy before the first use (Table::resident).
    c10::impl::VirtualGuardImpl impl(device_.type());
    const auto compute = impl.getStream(device_);
    const auto side = side_stream();
    auto ready = std::make_shared<c10::Event>(device_.type());
    {
      c10::StreamGuard on_side(side);
      bytes = at::empty({s.nbytes}, options);
      bytes.copy_(s.host, /*non_blocking=*/true);
      ready->record(side);
    }
    impl.recordDataPtrOnStream(bytes.storage().data_ptr(), compute);
    s.ready = std::move(ready);
  } else {
    bytes = at::empty({s.nbytes}, options);
    bytes.copy_(s.host);
  }
  *s.storage = bytes.storage();
  s.host.reset();
  swapped_ -= s.nbytes;
  resident_ += s.nbytes;
  peak_resident_ = std::max(peak_resident_, resident_);
  s.swapped = false;
  s.prefetched = prefetch;
  s.pos = lru_.insert(lru_.end(), &s);
  auto& st = s.owner->stats_;
  st.swapped_out_bytes -= s.nbytes;
  st.swap_ins += 1;
  if (copy) {
    st.bytes_in += s.nbytes;
    st.ns_in += now_ns() - start;
  }
}

// -- a table's side ---------------------------------------------------------------------------------
void Table::unregister(Entry& e, Pool::Guard&) {
  if (!pool_ || e.slot.owner == nullptr) {
    return;
  }
  if (e.slot.pins > 0) {
    pinned_.erase(std::remove(pinned_.begin(), pinned_.end(), &e.slot), pinned_.end());
    e.slot.pins = 0;
  }
  pool_->remove(e.slot);
}

void Table::room(int64_t nbytes) {
  if (!pool_) {
    return;
  }
  Pool::Guard g(pool_.get());
  if (pool_->make_room(nbytes, g)) {
    return;
  }
  const bool swap_left = pool_->swapping() &&
                         pool_->resident() + pool_->swapped() + nbytes <= pool_->capacity() + pool_->swap_capacity();
  if (swap_left) {
    // What is resident is all in use by running ops: go over the device memory for
    // now rather than fail; later allocations swap it out again.
    stats_.overcommits += 1;
    return;
  }
  fail("oom", "allocating " + text(nbytes) + " bytes would exceed the server's device memory (" +
                  text(pool_->resident()) + " of " + text(pool_->capacity()) + " bytes in use by all clients" +
                  (pool_->swapping() ? ", " + text(pool_->swapped()) + " of " + text(pool_->swap_capacity()) +
                                           " bytes of swap space"
                                     : std::string()) +
                  ")");
}

const c10::Storage* Table::resident(int64_t sid) {
  auto it = entries_.find(sid);
  if (it == entries_.end()) {
    return nullptr;
  }
  if (!pool_) {
    return &it->second.storage;
  }
  Pool::Guard g(pool_.get());
  Slot& s = it->second.slot;
  if (s.swapped) {
    stats_.prefetch_misses += 1;
    if (!pool_->make_room(s.nbytes, g)) {
      stats_.overcommits += 1;  // everything else is pinned: this op needs more than the device has
    }
    pool_->swap_in(s, false, g);
  } else if (s.prefetched) {
    stats_.prefetch_hits += 1;
    s.prefetched = false;
  }
  if (device_.is_cuda()) {
    c10::impl::VirtualGuardImpl impl(device_.type());
    stream_ = impl.getStream(device_);
    if (s.ready) {
      s.ready->block(*stream_);
      s.ready.reset();
    }
  }
  s.fresh = false;  // the op (or a WRITE) may fill it
  s.pins += 1;
  pinned_.push_back(&s);
  pool_->touch(s);
  return &it->second.storage;
}

void Table::unpin(size_t mark) {
  if (!pool_ || pinned_.size() <= mark) {
    return;
  }
  Pool::Guard g(pool_.get());
  for (size_t i = mark; i < pinned_.size(); ++i) {
    pinned_[i]->pins -= 1;
  }
  pinned_.resize(mark);
}

void Table::upcoming(const int64_t* sids, size_t n, uint64_t seq) {
  Pool::Guard g(pool_.get());
  for (size_t i = 0; i < n; ++i) {
    auto it = entries_.find(sids[i]);
    if (it == entries_.end()) {
      continue;
    }
    Slot& s = it->second.slot;
    s.next_use = std::max(s.next_use, seq);
    if (s.swapped && pool_->make_room(s.nbytes, g, /*urgent=*/false)) {
      pool_->swap_in(s, true, g);
    }
  }
}

SwapStats Table::swap_stats() const {
  Pool::Guard g(pool_.get());
  return stats_;
}

void Table::sync_stream() {
  if (stream_) {
    stream_->synchronize();
  }
}

// -- the executor's look-ahead over a batch -------------------------------------------------------
void Executor::lookahead(size_t i) {
  const size_t end = std::min(items_.size(), i + kLookahead + 1);
  std::vector<int64_t> sids;
  for (size_t j = std::max(ahead_, i); j < end; ++j) {
    const Item& item = items_[j];
    if (item.type != wire::kRunPlanned) {
      continue;
    }
    wire::Reader r(reinterpret_cast<const uint8_t*>(meta_.data()), meta_.size());
    r.seek(item.fields);
    sids.clear();
    try {
      r.int_value("plan");
      const uint32_t n = r.container(wire::kTuple, "values");
      for (uint32_t k = 0; k < n; ++k) {
        int64_t sid;
        if (r.try_int(sid)) {
          sids.push_back(sid);
        } else if (r.peek() == wire::kBytes) {
          r.bytes_value("value");
        } else {
          break;  // Python runs (and reports) it
        }
      }
    } catch (const wire::Malformed&) {
      continue;
    }
    try {
      table_.upcoming(sids.data(), sids.size(), base_ + j);
    } catch (...) {
      // a prefetch is only a head start: the op swaps in (and reports) what it needs
    }
  }
  ahead_ = std::max(ahead_, end);
}

}  // namespace remote_accel::server
