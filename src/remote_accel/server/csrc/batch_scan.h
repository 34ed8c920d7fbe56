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
  static constexpr size_t kNoPayload = SIZE_MAX;
  int64_t type;
  size_t begin, end;  // the item's bytes (its (type, fields) tuple)
  size_t fields;  // where its fields' values start, after the fields tuple's header
  size_t payload = kNoPayload;  // a WRITE's: its bytes' offset in the Batch's payloads (attach_payloads)
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
    case wire::kWrite:  // sid, offset, nbytes; its payload: attach_payloads, or Python places it
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

// The payloads of a scanned Batch that arrived whole (the k-th WRITE item's payload is
// the message's k-th, as messages.batch_items and Session.write pair them): sets each
// WRITE's `payload` offset; false when the counts or a WRITE's size disagree with the
// lengths the prologue gives (Python then decodes the message and says so).
inline bool attach_payloads(std::string_view meta, std::vector<BatchItem>& items, const uint64_t* lengths,
                            size_t n) {
  size_t k = 0;
  uint64_t at = 0;
  try {
    for (auto& item : items) {
      if (item.type != wire::kWrite) continue;
      wire::Reader r(reinterpret_cast<const uint8_t*>(meta.data()), meta.size());
      r.seek(item.fields);
      int64_t sid, offset, nbytes;
      if (!r.try_int(sid) || !r.try_int(offset) || !r.try_int(nbytes)) return false;
      if (k == n || nbytes < 0 || static_cast<uint64_t>(nbytes) != lengths[k]) return false;
      item.payload = static_cast<size_t>(at);
      at += lengths[k++];
    }
  } catch (const wire::Malformed&) {
    return false;
  }
  return k == n;
}

}  // namespace remote_accel::server
