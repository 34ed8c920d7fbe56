// libFuzzer target: the receive loop's check of a Batch (server/csrc/batch_scan.h), the
// C++ that reads every Batch a client sends before any item of it runs. batch.cpp's
// Executor::scan is this function over the message's meta; batch_scan.h needs no torch,
// so it links here alone.
//
// What must hold for a meta scan_batch accepts: the items lie in order inside the meta,
// each from its (type, fields) header to its end, of the types a Batch may hold, and
// executor-side reads of them (batch.cpp's resume: the RunPlanned plan id and values, a
// FREE's sids, an ALLOC's and a WRITE's ints) stay inside the item; they throw Malformed at worst.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "batch_scan.h"

using remote_accel::server::BatchItem;
using remote_accel::server::scan_batch;
namespace wire = remote_accel::wire;

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

// Reads an item's fields as Executor::resume does (without running them).
void read_item(const std::string& meta, const BatchItem& item) {
  wire::Reader r(reinterpret_cast<const uint8_t*>(meta.data()), meta.size());
  r.seek(item.fields);
  int64_t v;
  try {
    if (item.type == wire::kRunPlanned) {
      r.int_value("plan");
      const uint32_t n = r.container(wire::kTuple, "values");
      for (uint32_t i = 0; i < n; ++i) {
        if (r.try_int(v)) continue;
        if (r.peek() != wire::kBytes) return;
        r.bytes_value("value");
      }
    } else if (item.type == wire::kAlloc) {
      r.int_value("sid");
      r.int_value("nbytes");
    } else if (item.type == wire::kWrite) {  // Python places and runs it; its ints are read first
      r.int_value("sid");
      r.int_value("offset");
      r.int_value("nbytes");
    } else if (item.type == wire::kFree) {
      const uint32_t n = r.container(wire::kTuple, "sids");
      for (uint32_t i = 0; i < n && r.try_int(v); ++i) {
      }
    } else {
      return;  // RUN, RUN_GRAPH: Python's
    }
  } catch (const wire::Malformed&) {
    std::abort();  // scan_batch checked these bytes: a read of them cannot fail
  }
  check(r.pos() <= item.end);
}

// attach_payloads (the C++ loop's Batches with uploads): lengths equal to the sizes the
// WRITEs name are taken, each WRITE's payload starting where the one before it ended;
// one payload more, or one size changed, is refused.
void check_payloads(const std::string& meta, std::vector<BatchItem> items) {
  std::vector<uint64_t> lengths;
  for (const auto& item : items) {
    if (item.type != wire::kWrite) continue;
    wire::Reader r(reinterpret_cast<const uint8_t*>(meta.data()), meta.size());
    r.seek(item.fields);
    int64_t sid, offset, nbytes;
    check(r.try_int(sid) && r.try_int(offset) && r.try_int(nbytes));
    if (nbytes < 0) {  // no payload has that length: refused whatever the lengths say
      check(!remote_accel::server::attach_payloads(meta, items, lengths.data(), lengths.size()));
      return;
    }
    lengths.push_back(static_cast<uint64_t>(nbytes));
  }
  check(remote_accel::server::attach_payloads(meta, items, lengths.data(), lengths.size()));
  uint64_t at = 0;
  size_t k = 0;
  for (const auto& item : items) {
    if (item.type != wire::kWrite) {
      check(item.payload == BatchItem::kNoPayload);
      continue;
    }
    check(item.payload == at);
    at += lengths[k++];
  }
  lengths.push_back(0);
  check(!remote_accel::server::attach_payloads(meta, items, lengths.data(), lengths.size()));
  lengths.pop_back();
  if (!lengths.empty()) {
    lengths.back() += 1;
    check(!remote_accel::server::attach_payloads(meta, items, lengths.data(), lengths.size()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // a std::string of exactly the input's bytes (its capacity beyond them is not ASan's to
  // see, but no read goes through its data() past size(): Reader checks each against it)
  const std::string meta(reinterpret_cast<const char*>(data), size);
  std::vector<BatchItem> items;
  if (!scan_batch(meta, items)) return 0;
  size_t last_end = 0;
  for (const auto& item : items) {
    check(item.begin >= last_end && item.begin < item.fields && item.fields <= item.end && item.end <= size);
    check(item.type == wire::kAlloc || item.type == wire::kFree || item.type == wire::kWrite ||
          item.type == wire::kRun || item.type == wire::kRunGraph || item.type == wire::kRunPlanned);
    read_item(meta, item);
    last_end = item.end;
  }
  check(items.empty() || last_end == size);  // after the last item: nothing (scan_batch checked at_end)
  check_payloads(meta, items);
  return 0;
}
