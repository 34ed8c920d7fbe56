// Checking a Batch's meta whole, before any item runs: as messages.decode and
// batch_items would, without torch, so that fuzz/batch_scan_fuzz.cpp can reach the very
// code the receive loop runs on a peer's bytes (Executor::scan in batch.cpp calls it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "codec.h"

namespace remote_accel::server {

// One item of a checked Batch: where its bytes are in the meta.
struct BatchItem {
  int64_t type;
  size_t begin, end;  // the item's bytes (its (type, fields) tuple)
  size_t fields;  // where its fields' values start, after the fields tuple's header
};

namespace batch_detail {

// Checks one item's fields as messages.from_fields would; false when Python must judge
// (and report) them.
inline bool check_fields(wire::Reader& r, int64_t type, uint32_t n) {
  constexpr int kDepth = 4;  // Batch fields tuple -> items tuple -> item -> fields -> values
  int64_t v;
  switch (type) {
    case wire::kAlloc:
      return n == 2 && r.try_int(v) && r.try_int(v);
    case wire::kWrite:  // sid, offset, nbytes; Python places the payload and runs it
      return n == 3 && r.try_int(v) && r.try_int(v) && r.try_int(v);
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
    case wire::kRunGraph:  // graph_id, nodes, inputs, outputs, outs[, stream]: Python runs it
      if (n < 5 || n > 6 || !r.try_int(v)) return false;
      for (uint32_t i = 1; i < n; ++i) {
        if (i < 5 && r.peek() != wire::kTuple) return false;
        r.skip(kDepth);
      }
      return true;
    default:
      return false;  // anything not allowed in a Batch
  }
}

}  // namespace batch_detail

// A Batch's meta checked whole; false (items then partly filled) when Python must decode
// it again and say what is wrong, or run it itself.
inline bool scan_batch(std::string_view meta, std::vector<BatchItem>& items) {
  items.clear();
  wire::Reader r(reinterpret_cast<const uint8_t*>(meta.data()), meta.size());
  try {
    if (r.container(wire::kTuple, "fields") != 1) return false;
    const uint32_t n = r.container(wire::kTuple, "items");
    items.reserve(n);  // bounded: container() checked n against the bytes left
    for (uint32_t i = 0; i < n; ++i) {
      BatchItem item{};
      item.begin = r.pos();
      if (r.peek() != wire::kTuple || r.container(wire::kTuple, "item") != 2 || !r.try_int(item.type) ||
          r.peek() != wire::kTuple) {
        return false;
      }
      const uint32_t fields = r.container(wire::kTuple, "fields");
      item.fields = r.pos();
      if (!batch_detail::check_fields(r, item.type, fields)) return false;
      item.end = r.pos();
      items.push_back(item);
    }
    return r.at_end();
  } catch (const wire::Malformed&) {
    return false;  // Python decodes it again and says what is wrong
  }
}

}  // namespace remote_accel::server
