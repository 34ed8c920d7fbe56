// A Batch message read in C++: checked whole first (as messages.decode and batch_items
// would), then run item by item, handing Python only the items it must run itself.
#include "native.h"

#include "batch_scan.h"
#include "codec.h"

#include <cstring>

namespace remote_accel::server {

using wire::Malformed;
using wire::Reader;

bool Executor::scan(std::string meta, std::string_view payloads, const std::vector<uint64_t>* lengths) {
  meta_ = std::move(meta);
  payloads_.clear();
  base_ = table_.seq() + 1;
  ahead_ = 0;
  if (!scan_batch(meta_, items_)) return false;
  if (lengths == nullptr) return true;
  if (!attach_payloads(meta_, items_, lengths->data(), lengths->size())) return false;
  // a copy: a run that stops for Python outlives the link's buffer (small: it held them)
  payloads_.assign(payloads.data(), payloads.size());
  return true;
}

std::optional<std::string_view> Executor::held_payload(size_t i) const {
  if (i >= items_.size() || items_[i].type != wire::kWrite || items_[i].payload == Item::kNoPayload) {
    return std::nullopt;
  }
  const size_t next = [&] {  // where the next WRITE's payload begins: this one's end
    for (size_t j = i + 1; j < items_.size(); ++j) {
      if (items_[j].type == wire::kWrite) return items_[j].payload;
    }
    return payloads_.size();
  }();
  return std::string_view(payloads_).substr(items_[i].payload, next - items_[i].payload);
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
      } else if (item.type == wire::kWrite && item.payload != Item::kNoPayload) {
        const int64_t sid = r.int_value("sid");
        const int64_t offset = r.int_value("offset");
        const int64_t nbytes = r.int_value("nbytes");
        const c10::Storage* storage = host_storage(sid, offset, nbytes);
        if (storage == nullptr) return slow;  // Python runs it from held_payload and says why
        if (nbytes > 0) {
          std::memcpy(static_cast<char*>(storage->mutable_data()) + offset, payloads_.data() + item.payload, nbytes);
        }
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
