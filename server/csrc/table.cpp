// The storage table's C++ half: entries and accounting, as server/storage.py describes.
#include "native.h"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace remote_accel::server {

void fail(const char* kind, std::string message) {
  throw ErrorThrown{Error{kind, "", std::move(message)}};
}

void Table::check_fits(int64_t nbytes) const {
  if (nbytes > limit_ - used()) {
    fail("oom", "allocating " + std::to_string(nbytes) + " bytes would exceed this session's memory limit (" +
                    std::to_string(used()) + " of " + std::to_string(limit_) + " bytes in use)");
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
  used_ += nbytes - e.nbytes;
  e.nbytes = nbytes;
  peak_.store(std::max(peak(), used()), std::memory_order_relaxed);
}

void Table::alloc(int64_t sid, int64_t nbytes) {
  check_new(sid);
  if (nbytes < 0) {
    fail("protocol", "bad allocation size " + std::to_string(nbytes));
  }
  check_fits(nbytes);
  auto storage = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device_)).storage();
  auto& e = entries_.emplace(sid, Entry{std::move(storage), 0}).first->second;
  size_ = entries_.size();
  account(e, nbytes);
}

void Table::put(int64_t sid, c10::Storage storage, bool replace) {
  auto it = entries_.find(sid);
  if (it == entries_.end() || !replace) {
    check_new(sid);
    it = entries_.emplace(sid, Entry{c10::Storage(), 0}).first;
    size_ = entries_.size();
  }
  const auto nbytes = static_cast<int64_t>(storage.nbytes());
  it->second.storage = std::move(storage);
  account(it->second, nbytes);
}

bool Table::free(int64_t sid) {
  auto it = entries_.find(sid);
  if (it == entries_.end()) {
    return false;
  }
  used_ -= it->second.nbytes;
  entries_.erase(it);
  size_ = entries_.size();
  return true;
}

std::pair<int64_t, int64_t> Table::clear() {
  const auto taken = std::make_pair(static_cast<int64_t>(entries_.size()), used());
  entries_.clear();
  size_ = 0;
  used_ = 0;
  return taken;
}

void Table::resync(const int64_t* sids, size_t n) {
  bool grew = false;
  for (size_t i = 0; i < n; ++i) {
    auto it = entries_.find(sids[i]);
    if (it == entries_.end()) {
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

}  // namespace remote_accel::server
