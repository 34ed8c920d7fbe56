// The session's receive loop in C++ (DPDK and TCP links): fast_loop.h says what it serves.
#include "fast_loop.h"

#include "codec.h"

#include <cerrno>
#include <chrono>
#include <cstring>

namespace remote_accel::server {

bool int_fields(const char* meta, size_t len, int64_t* out, uint32_t n) {
  wire::Reader r(reinterpret_cast<const uint8_t*>(meta), len);
  try {
    if (r.peek() != wire::kTuple || r.container(wire::kTuple, "fields") != n) return false;
    for (uint32_t i = 0; i < n; ++i) {
      if (!r.try_int(out[i])) return false;
    }
    return r.at_end();
  } catch (const wire::Malformed&) {
    return false;
  }
}

bool small_read(Executor& executor, int64_t sid, int64_t offset, int64_t nbytes, const char** bytes) {
  const c10::Storage* storage = executor.host_storage(sid, offset, nbytes);
  if (storage == nullptr) return false;
  *bytes = static_cast<const char*>(storage->data()) + offset;
  return true;
}

DpdkLink::DpdkLink(const Addresses& a)
    : conn_(reinterpret_cast<shim_conn*>(a.conn)),
      wire_(reinterpret_cast<const shim_wire*>(a.wire)),
      head_(reinterpret_cast<char*>(a.head)),
      head_cap_(a.head_cap),
      info_(reinterpret_cast<shim_msg_info*>(a.info)),
      recv_msg_(reinterpret_cast<RecvMsg>(a.recv_msg)),
      send_msg_(reinterpret_cast<SendMsg>(a.send_msg)) {}

int64_t DpdkLink::next(int64_t timeout_ns, const char** bytes, shim_msg_info* info) {
  const int64_t n = recv_msg_(conn_, wire_, head_, head_cap_, timeout_ns, info_);
  *bytes = head_;
  if (n >= 0) *info = *info_;
  return n;
}

int DpdkLink::send(uint8_t type, uint32_t req_id, const std::string& meta, const void* payload, size_t nbytes) {
  shim_iov iov{const_cast<void*>(payload), nbytes};
  return send_msg_(conn_, wire_, type, 0, req_id, meta.data(), static_cast<uint32_t>(meta.size()), &iov,
                   payload == nullptr ? 0 : 1);
}

FastLoop::FastLoop(Executor& executor, Link& link, const Types& t, bool cpu_device, size_t small_read,
                   std::string pong_meta)
    : executor_(executor),
      link_(link),
      types_(t),
      cpu_(cpu_device),
      small_read_(small_read),
      pong_meta_(std::move(pong_meta)) {}

FastLoop::Result FastLoop::run(int64_t timeout_ns, int64_t python_ops, bool pending) {
  Result out;
  bool served = false;
  for (;;) {
    // after serving, only look (timeout 0): Python takes over whenever nothing waits
    const char* bytes = nullptr;
    const int64_t n = link_.next(served ? 0 : timeout_ns, &bytes, &info_);
    if (n < 0) {
      if (served && n == -ETIMEDOUT) {
        out.code = kYield;
      } else {
        out.code = kFailed;
        out.value = n;
      }
      return out;
    }
    out.code = kMessage;
    out.value = n;
    const shim_msg_info& info = info_;
    // only well-formed messages that the link holds whole; with payloads, only a CPU
    // server's Batch (a training step's small uploads: its WRITEs are copied in here)
    if (info.status != 0 || static_cast<uint64_t>(n) != info.msg_len) return out;
    if (info.n_payloads != 0 && !(cpu_ && info.type == types_.batch)) return out;
    const char* meta = bytes + info.prologue_len - info.meta_len;
    int rc = 0;
    bool done = false;
    if (info.type == types_.batch) {
      done = serve_batch(meta, info.meta_len, bytes, out);
      if (!done && out.code == kStopped) {
        link_.consumed();  // the executor holds the batch now: Python resumes it, not the message
        return out;
      }
    } else if (info.type == types_.read) {
      done = serve_read(meta, info.meta_len, info.req_id, pending, rc);
    } else if (info.type == types_.sync) {
      done = serve_sync(meta, info.meta_len, info.req_id, python_ops, pending, rc);
    }
    executor_.table().unpin(0);  // its storages may be swapped out again (as session.py after each message)
    if (rc < 0) {
      out.code = kFailed;
      out.value = rc;
      return out;
    }
    if (!done) return out;  // kMessage: Python reads it from the link's buffer
    link_.consumed();
    served = true;
  }
}

bool FastLoop::serve_batch(const char* meta, size_t len, const char* message, Result& out) {
  const shim_msg_info& info = info_;
  try {
    if (info.n_payloads == 0) {
      if (!executor_.scan(std::string(meta, len))) return false;
    } else {
      // the prologue's payload lengths (big-endian, after the header; wire.py), then the
      // payloads themselves after the meta
      const auto* at = reinterpret_cast<const uint8_t*>(message) + SHIM_WIRE_HEADER;
      lengths_.assign(info.n_payloads, 0);
      for (auto& length : lengths_) {
        for (int b = 0; b < 8; ++b) length = length << 8 | *at++;
      }
      const std::string_view payloads(message + info.prologue_len, info.payload_total);
      if (!executor_.scan(std::string(meta, len), payloads, &lengths_)) return false;
    }
  } catch (const wire::Malformed&) {
    return false;  // Python decodes it and says what is wrong
  }
  const int64_t start = now_ns();
  busy_.store(true, std::memory_order_relaxed);
  Executor::Stop stop = executor_.resume(0);
  busy_.store(false, std::memory_order_relaxed);
  batch_ns_.push_back(now_ns() - start);
  ++batches_;
  if (stop.kind == Executor::Stop::kEnd) return true;
  out.code = kStopped;  // Python runs the item and resumes after it
  out.stop = std::move(stop);
  return false;
}

bool FastLoop::serve_read(const char* meta, size_t len, uint32_t req_id, bool pending, int& rc) {
  int64_t f[3];  // sid, offset, nbytes
  if (pending || !cpu_ || !int_fields(meta, len, f, 3)) return false;
  const int64_t nbytes = f[2];
  if (nbytes <= 0 || static_cast<uint64_t>(nbytes) > small_read_) return false;
  const char* bytes = nullptr;
  if (!small_read(executor_, f[0], f[1], nbytes, &bytes)) return false;  // pinned until unpin(0)
  reply_meta_.clear();
  wire::put_tuple_header(reply_meta_, 1);  // Data(nbytes)
  wire::put_int(reply_meta_, nbytes);
  rc = send(types_.data, req_id, reply_meta_, bytes, static_cast<size_t>(nbytes));
  ++reads_;
  return true;
}

bool FastLoop::serve_sync(const char* meta, size_t len, uint32_t req_id, int64_t python_ops, bool pending,
                          int& rc) {
  // a CPU device has no stream to wait for; another device's sync (and its asynchronous
  // errors) is Python's
  if (pending || !cpu_ || !int_fields(meta, len, nullptr, 0)) return false;
  reply_meta_.clear();
  wire::put_tuple_header(reply_meta_, 1);  // SyncOk(ops_done)
  wire::put_int(reply_meta_, python_ops + executor_.ops_done());
  rc = send(types_.sync_ok, req_id, reply_meta_, nullptr, 0);
  ++syncs_;
  return true;
}

int FastLoop::send(int type, uint32_t req_id, const std::string& meta, const void* payload, size_t nbytes) {
  std::lock_guard<std::mutex> lock(send_mu_);
  return link_.send(static_cast<uint8_t>(type), req_id, meta, payload, nbytes);
}

int FastLoop::send_pong() {
  return send(types_.pong, 0, pong_meta_, nullptr, 0);
}

std::vector<int64_t> FastLoop::take_batch_ns() {
  std::vector<int64_t> taken;
  taken.swap(batch_ns_);
  return taken;
}

} // namespace remote_accel::server
