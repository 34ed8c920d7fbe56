// A Batch message read in C++: checked whole first (as messages.decode and batch_items
// would), then run item by item, handing Python only the items it must run itself.
#include "native.h"

#include "codec.h"

namespace remote_accel::server {
namespace {

using wire::Malformed;
using wire::Reader;

// Checks one item's fields as messages.from_fields would; false when Python must judge
// (and report) them.
bool check_fields(Reader& r, int64_t type, uint32_t n) {
  constexpr int kDepth = 4;  // Batch fields tuple -> items tuple -> item -> fields -> values
  int64_t v;
  switch (type) {
    case wire::kAlloc:
      return n == 2 && r.try_int(v) && r.try_int(v);
    case wire::kRunPlanned:
      if (n != 2 || !r.try_int(v) || r.peek() != wire::kTuple) return false;
      r.skip(kDepth);
      return true;
    case wire::kFree:
      if (n != 1 || r.peek() != wire::kTuple) return false;
      r.skip(kDepth);
      return true;
    case wire::kRun: {
      if (n < 4 || n > 7) return false;
      const uint8_t expect[] = {wire::kStr, wire::kTuple, wire::kDict, wire::kTuple};
      for (uint32_t i = 0; i < n; ++i) {
        const uint8_t tag = r.peek();
        if (i < 4 && tag != expect[i]) return false;
        if (i == 4 && tag != wire::kFalse && tag != wire::kTrue) return false;
        r.skip(kDepth);
      }
      return true;
    }
    default:
      return false;  // WRITE (its payloads are Python's to place) and anything not allowed here
  }
}

}  // namespace

bool Executor::scan(std::string meta) {
  meta_ = std::move(meta);
  items_.clear();
  base_ = table_.seq() + 1;
  ahead_ = 0;
  Reader r(reinterpret_cast<const uint8_t*>(meta_.data()), meta_.size());
  try {
    if (r.container(wire::kTuple, "fields") != 1) return false;
    const uint32_t n = r.container(wire::kTuple, "items");
    items_.reserve(n);
    for (uint32_t i = 0; i < n; ++i) {
      Item item{};
      item.begin = r.pos();
      if (r.peek() != wire::kTuple || r.container(wire::kTuple, "item") != 2 || !r.try_int(item.type) ||
          r.peek() != wire::kTuple) {
        return false;
      }
      const uint32_t fields = r.container(wire::kTuple, "fields");
      item.fields = r.pos();
      if (!check_fields(r, item.type, fields)) return false;
      item.end = r.pos();
      items_.push_back(item);
    }
    return r.at_end();
  } catch (const Malformed&) {
    return false;  // Python decodes it again and says what is wrong
  }
}

Executor::Stop Executor::resume(size_t first) {
  for (size_t i = first; i < items_.size(); ++i) {
    const Item& item = items_[i];
    Reader r(reinterpret_cast<const uint8_t*>(meta_.data()), meta_.size());
    r.seek(item.fields);
    Stop slow{i, Stop::kSlow, item.begin, item.end, {}};
    if (table_.swapping()) {
      table_.set_seq(base_ + i);
      lookahead(i);  // swap in what the next ops need while this one runs
    }
    try {
      if (item.type == wire::kRunPlanned) {
        const int64_t plan = r.int_value("plan");
        if (!planned(plan)) return slow;
        const uint32_t n = r.container(wire::kTuple, "values");
        std::vector<Value> values(n);
        for (auto& value : values) {
          if (r.try_int(value.sid)) continue;
          if (r.peek() != wire::kBytes) return slow;  // Python reports what is wrong with it
          value.bytes = r.bytes_value("value");
          value.is_bytes = true;
        }
        run(plan, values);
      } else if (item.type == wire::kAlloc) {
        const int64_t sid = r.int_value("sid");
        table_.alloc(sid, r.int_value("nbytes"));
        forget(sid);
        alloc_requests_.store(alloc_requests() + 1, std::memory_order_relaxed);
      } else if (item.type == wire::kFree) {
        const uint32_t n = r.container(wire::kTuple, "sids");
        std::vector<int64_t> sids(n);
        for (auto& sid : sids) {
          if (!r.try_int(sid)) return slow;
        }
        for (const auto sid : sids) {
          table_.free(sid);
          forget(sid);
        }
      } else {
        return slow;
      }
    } catch (ErrorThrown& e) {
      return Stop{i, Stop::kError, 0, 0, std::move(e.error)};
    } catch (const Malformed&) {
      return slow;  // checked by scan(): cannot happen, but Python would say why
    }
  }
  return Stop{items_.size(), Stop::kEnd, 0, 0, {}};
}

}  // namespace remote_accel::server
