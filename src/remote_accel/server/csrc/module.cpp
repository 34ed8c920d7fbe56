// remote_accel.server._native: the Python face of the C++ executor (server/native.py
// is the one module that imports it).
#include "native.h"

#include "codec.h"
#include "cpu_bernoulli.h"
#include "fast_loop.h"
#include "host_malloc.h"
#include "tcp_link.h"
#include "tls_link.h"

#include <ATen/ops/empty.h>

#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <optional>
#include <unordered_map>

namespace py = pybind11;

namespace remote_accel::server {
namespace {

py::object* g_error_factory = nullptr;  // native.py's to_exception(kind, type, message, op)

py::object error_tuple(const Error& e) {
  return py::make_tuple(e.kind, e.type, e.message, e.op);
}

at::Tensor bytes_of(const c10::Storage& storage) {
  // the whole storage as a uint8 tensor: Python takes its untyped_storage()
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(storage.device()))
      .set_(storage, 0, {static_cast<int64_t>(storage.nbytes())}, {1});
}

Layout layout_of(const py::tuple& spec, size_t first) {
  Layout l;
  l.dtype = spec[first].cast<at::ScalarType>();
  l.sizes = spec[first + 1].cast<std::vector<int64_t>>();
  if (spec.size() > first + 2) {
    l.strides = spec[first + 2].cast<std::vector<int64_t>>();
    l.offset = spec[first + 3].cast<int64_t>();
    l.flags = spec[first + 4].cast<int>();
    l.span = spec[first + 5].cast<int64_t>();
  }
  return l;
}

// A compiled graph's inputs: its storage references (sids and layouts from storage.ref_parts)
// as tensors, None where Python must look closer (storage 0, an unknown or failed storage,
// one too small for the view). Through StorageTable.tensor each cost about 5 us, and a graph
// call names 30 to 250 of them. Storages stay pinned until unpin(), as with get().
py::list views(Executor& s, const std::vector<int64_t>& sids, const py::sequence& layouts) {
  const size_t n = sids.size();
  if (layouts.size() != n) {
    throw std::invalid_argument("views: as many layouts as storage ids");
  }
  py::list out(n);
  for (size_t i = 0; i < n; ++i) {
    const auto sid = sids[i];
    const Layout layout = layout_of(layouts[i].cast<py::tuple>(), 0);
    const c10::Storage* storage = sid == 0 ? nullptr : s.table().resident(sid);
    if (storage == nullptr || layout.span > static_cast<int64_t>(storage->nbytes())) {
      out[i] = py::none();
    } else {
      out[i] = py::cast(s.view(*storage, layout));
    }
  }
  return out;
}

// A graph's results placed as its RunGraph's outs promise (`sids` and `layouts` from
// storage.ref_parts, None for an out the client keeps no handle of), the storages of
// `touched` (its inputs) never taken over: executor.py's _bind in C++, which cost about
// 5 us a result in Python, and a forward call has about 60.
void bind_graph(Executor& s, const py::sequence& results, const py::sequence& sids, const py::sequence& layouts,
                const std::vector<int64_t>& touched) {
  const size_t n = sids.size();
  if (layouts.size() != n) {
    throw std::invalid_argument("bind_graph: as many layouts as storage ids");
  }
  if (n > results.size()) {
    fail("op", "the op returned " + std::to_string(results.size()) + " results, the client expects " +
                   std::to_string(n));
  }
  std::vector<c10::IValue> values(n);
  std::vector<Layout> parsed;
  parsed.reserve(n);  // no reallocation: places point into it
  std::vector<Executor::Placement> places;
  for (size_t i = 0; i < n; ++i) {
    const py::object sid = sids[i];
    if (sid.is_none()) {
      continue;
    }
    const py::object value = results[i];
    if (!THPVariable_Check(value.ptr())) {
      fail("op", "result " + std::to_string(i) + " is " + std::string(Py_TYPE(value.ptr())->tp_name) +
                     ", the client expects a tensor");
    }
    values[i] = THPVariable_Unpack(value.ptr());
    parsed.push_back(layout_of(layouts[i].cast<py::tuple>(), 0));
    places.push_back({i, sid.cast<int64_t>(), &parsed.back()});
  }
  s.place(values, places, touched);
}

// A plan's template from its first RunOp, decoded by executor.py with a placeholder
// tensor in each hole: false when the op cannot be run from a template (a placeholder
// that the schema turned into something else, an op the dispatcher does not know).
bool define(Executor& self, int64_t plan, const std::string& name, const std::string& op_name,
            const std::string& overload, const py::tuple& args, const py::dict& kwargs,
            const std::vector<at::Tensor>& placeholders, const py::list& holes, size_t n_outs, bool seeded) {
  self.drop(plan);
  if (seeded && !self.has_generators()) {
    return false;
  }
  auto handle = c10::Dispatcher::singleton().findSchema({op_name, overload});
  if (!handle) {
    return false;
  }
  auto t = std::make_shared<Template>(Template{*handle, name, {}, {}, n_outs, {}, seeded});
  try {
    t->stack = torch::jit::createStackForSchema(handle->schema(), torch::jit::tuple_slice(args),
                                                py::reinterpret_borrow<py::kwargs>(kwargs), std::nullopt);
  } catch (const std::exception&) {
    return false;
  }
  // where each placeholder landed on the stack
  std::unordered_map<const c10::TensorImpl*, std::pair<int64_t, int64_t>> where;
  for (size_t i = 0; i < t->stack.size(); ++i) {
    const auto& v = t->stack[i];
    if (v.isTensor()) {
      where.emplace(v.toTensor().unsafeGetTensorImpl(), std::make_pair(static_cast<int64_t>(i), int64_t{-1}));
    } else if (v.isList()) {
      const auto items = v.toListRef();
      for (size_t j = 0; j < items.size(); ++j) {
        if (items[j].isTensor() &&
            where.emplace(items[j].toTensor().unsafeGetTensorImpl(), std::make_pair(static_cast<int64_t>(i),
                                                                                    static_cast<int64_t>(j)))
                .second) {
          if (t->list_slots.empty() || t->list_slots.back() != i) {
            t->list_slots.push_back(i);
          }
        }
      }
    }
  }
  for (const auto& h : holes) {
    const auto spec = h.cast<py::tuple>();
    const auto kind = spec[0].cast<std::string>();
    Hole hole{};
    if (kind == "o") {
      hole.kind = Hole::kOut;
      hole.out = spec[1].cast<int64_t>();
      if (hole.out < 0 || static_cast<size_t>(hole.out) >= n_outs) return false;
      hole.layout = layout_of(spec, 2);
    } else if (kind == "s") {
      hole.kind = Hole::kScalar;
      hole.slot = spec[1].cast<int64_t>();
      hole.layout.dtype = spec[2].cast<at::ScalarType>();
      const auto type = hole.layout.dtype;
      if (hole.slot < 0 || static_cast<size_t>(hole.slot) >= t->stack.size() ||
          !(type == at::kDouble || type == at::kLong || type == at::kBool || type == at::kComplexDouble)) {
        return false;
      }
      const auto& argument = handle->schema().arguments()[hole.slot];
      auto real = argument.real_type();
      if (auto optional = real->cast<c10::OptionalType>()) {
        real = optional->getElementType();
      }
      if (real->kind() != c10::TypeKind::NumberType) return false;  // only Scalar arguments take numbers
    } else {
      hole.kind = kind == "t" ? Hole::kTensor : Hole::kCpu;
      const auto index = spec[1].cast<size_t>();
      if (index >= placeholders.size()) return false;
      auto it = where.find(placeholders[index].unsafeGetTensorImpl());
      if (it == where.end()) return false;
      std::tie(hole.slot, hole.item) = it->second;
      where.erase(it);  // each placeholder fills one hole
      hole.layout = layout_of(spec, 2);
      const auto* alias = handle->schema().arguments()[hole.slot].alias_info();
      hole.written = hole.kind == Hole::kTensor && alias != nullptr && alias->isWrite();
    }
    t->holes.push_back(std::move(hole));
  }
  self.define(plan, std::move(t));
  return true;
}

// values -> the C++ form; the tuple keeps the bytes alive while they are used.
std::vector<Executor::Value> values_of(const py::tuple& values) {
  std::vector<Executor::Value> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* v = values[i].ptr();
    if (PyLong_CheckExact(v)) {
      int overflow = 0;
      out[i].sid = PyLong_AsLongLongAndOverflow(v, &overflow);
      out[i].other = overflow != 0;
    } else if (PyBytes_CheckExact(v)) {
      out[i].bytes = std::string_view(PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v));
      out[i].is_bytes = true;
    } else {
      out[i].other = true;
    }
  }
  return out;
}

}  // namespace
}  // namespace remote_accel::server

PYBIND11_MODULE(_native, m) {
  using namespace remote_accel::server;
  m.attr("VERSION") = REMOTE_ACCEL_VERSION;
  // server/rng.py's as_device_default takes the lock the C++ executor takes (waiting
  // without the GIL, which a session's thread may need meanwhile)
  m.def("lock_default_generator", [] {
    py::gil_scoped_release no_gil;
    default_generator_mutex().lock();
  });
  m.def("unlock_default_generator", [] { default_generator_mutex().unlock(); });
  m.def("install_cpu_bernoulli", &install_cpu_bernoulli);
  m.def("cpu_bernoulli_installed", &cpu_bernoulli_installed);
  m.def("cpu_bernoulli_", [](at::Tensor self, double p, std::optional<at::Generator> generator) {
    py::gil_scoped_release no_gil;
    return cpu_bernoulli_(self, p, std::move(generator));
  }, py::arg("self"), py::arg("p"), py::arg("generator") = py::none());
  m.def("keep_freed_heap", &keep_freed_heap, py::arg("mmap_below"), py::arg("keep_free"),
        "Set malloc's mmap and trim thresholds (csrc/host_malloc.h); False where it has none.");
  m.def("set_error_factory", [](py::object factory) {
    delete g_error_factory;
    g_error_factory = new py::object(std::move(factory));
  });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ErrorThrown& e) {
      if (g_error_factory == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, e.error.message.c_str());
        return;
      }
      py::object exc = (*g_error_factory)(e.error.kind, e.error.type, e.error.message, e.error.op);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::class_<Pool, std::shared_ptr<Pool>>(m, "Pool")
      .def(py::init([](const std::string& device, int64_t capacity, int64_t swap_capacity) {
        return std::make_shared<Pool>(c10::Device(device), capacity, swap_capacity);
      }))
      // (capacity, swap_capacity, resident, swapped, peak_resident) bytes, all sessions
      .def("figures", &Pool::figures);

  py::class_<Executor>(m, "Executor")
      .def(py::init([](const std::string& device, int64_t limit, std::shared_ptr<Pool> pool) {
             return std::make_unique<Executor>(c10::Device(device), limit, std::move(pool));
           }),
           py::arg("device"), py::arg("limit"), py::arg("pool") = nullptr)
      // -- the storage table
      .def("contains", [](Executor& s, int64_t sid) { return s.table().contains(sid); })
      .def("size", [](Executor& s) { return s.table().size(); })
      .def("used", [](Executor& s) { return s.table().used(); })
      // host blocks (dataplane/host_blocks.cpp): what they hold beyond the storages, charged to the
      // session; fit_host(room) drops cached blocks until that fits in `room`
      .def("host_extra", [](Executor& s) { return s.table().host_extra(); })
      .def("fit_host", [](Executor& s, int64_t room) { s.table().fit_host(room); })
      // bytes held outside the storages (an echo's payload, kept plans and graphs),
      // charged to the limit too
      .def("hold", [](Executor& s, int64_t delta) { s.table().hold(delta); })
      .def("peak", [](Executor& s) { return s.table().peak(); })
      .def("limit", [](Executor& s) { return s.table().limit(); })
      .def("accounted", [](Executor& s, int64_t sid) { return s.table().accounted(sid); })
      .def("entries", [](Executor& s) { return s.table().entries(); })
      // Failure (oom) where `n` more bytes would take the session past its limit
      .def("check_fits", [](Executor& s, int64_t n) { s.table().check_fits(n); })
      .def("alloc", [](Executor& s, int64_t sid, int64_t n) { s.table().alloc(sid, n); })
      .def("put", [](Executor& s, int64_t sid, const at::Tensor& bytes, bool replace) {
        s.table().put(sid, bytes.storage(), replace);
      })
      .def("get", [](Executor& s, int64_t sid) -> std::optional<at::Tensor> {
        const auto* storage = s.table().resident(sid);  // pinned until unpin()
        if (storage == nullptr) return std::nullopt;
        return bytes_of(*storage);
      })
      .def("views", &views, py::arg("sids"), py::arg("layouts"))
      .def("bind_graph", &bind_graph, py::arg("results"), py::arg("sids"), py::arg("layouts"), py::arg("touched"))
      .def("free", [](Executor& s, int64_t sid) { return s.table().free(sid); })
      .def("clear", [](Executor& s) { return s.table().clear(); })
      .def("resync", [](Executor& s, const std::vector<int64_t>& sids) { s.table().resync(sids.data(), sids.size()); })
      // -- swapping (swap.cpp)
      .def("pin_mark", [](Executor& s) { return s.table().pin_mark(); })
      .def("unpin", [](Executor& s, size_t mark) { s.table().unpin(mark); })
      .def("swap_stats", [](Executor& s) {
        const auto st = s.table().swap_stats();
        py::dict d;
        d["swapped_out_bytes"] = st.swapped_out_bytes;
        d["swap_ins"] = st.swap_ins;
        d["swap_outs"] = st.swap_outs;
        d["prefetch_hits"] = st.prefetch_hits;
        d["prefetch_misses"] = st.prefetch_misses;
        d["swap_in_bytes"] = st.bytes_in;
        d["swap_out_bytes"] = st.bytes_out;
        d["swap_in_ns"] = st.ns_in;
        d["swap_out_ns"] = st.ns_out;
        d["swap_overcommits"] = st.overcommits;
        return d;
      })
      // -- failed storages
      .def("mark_failed", &Executor::mark_failed)
      .def("failed", &Executor::failed)
      .def("forget", &Executor::forget)
      .def("clear_failed", &Executor::clear_failed)
      // -- plans
      .def("define", &define)
      .def("set_generators", &Executor::set_generators)
      .def("drop", &Executor::drop)
      .def("planned", &Executor::planned)
      .def("clear_plans", &Executor::clear_plans)
      .def("ops_done", &Executor::ops_done)
      .def("alloc_requests", &Executor::alloc_requests)
      .def("storages_made", &Executor::storages_made)
      .def("run_planned", [](Executor& s, int64_t plan, const py::tuple& values) {
        const auto converted = values_of(values);
        py::gil_scoped_release no_gil;
        s.run(plan, converted);
      })
      // -- batches
      .def("scan", [](Executor& s, const py::bytes& meta) { return s.scan(std::string(meta)); })
      .def("held_payload", [](const Executor& s, size_t item) -> py::object {  // the C++ loop's copy, or None
        const auto held = s.held_payload(item);
        if (!held) return py::none();
        return py::bytes(held->data(), held->size());
      })
      .def("scanned_items", [](const Executor& s) {  // (type, start in the meta) of each item of the scanned Batch
        py::list out;
        for (const auto& item : s.batch_items()) out.append(py::make_tuple(item.type, item.begin));
        return out;
      })
      .def("resume", [](Executor& s, size_t first) {
        Executor::Stop stop;
        {
          py::gil_scoped_release no_gil;  // a heartbeat may be sent meanwhile
          stop = s.resume(first);
        }
        return py::make_tuple(stop.item, static_cast<int>(stop.kind), stop.begin, stop.end,
                              stop.kind == Executor::Stop::kError ? error_tuple(stop.error) : py::none());
      });

  // -- a session's receive loop in C++ (fast_loop.h) and its connection (a Link)
  py::class_<Link>(m, "Link");
  py::class_<DpdkLink, Link>(m, "DpdkLink")
      .def(py::init([](const py::tuple& a) {
             return new DpdkLink(DpdkLink::Addresses{a[0].cast<uintptr_t>(), a[1].cast<uintptr_t>(),
                                                     a[2].cast<uintptr_t>(), a[3].cast<uintptr_t>(),
                                                     a[4].cast<uintptr_t>(), a[5].cast<uintptr_t>(),
                                                     a[6].cast<uintptr_t>()});
           }),
           py::arg("addresses"),
           "addresses: (conn, wire, head, head_cap, info, recv_msg, send_msg), DpdkTransport.native_addresses().");
  // (magic0, magic1, version, max_meta, max_payloads, max_payload_total): wire.py's, as Python gives them
  const auto wire_params = [](const py::tuple& w) {
    shim_wire wire{};
    wire.magic0 = w[0].cast<uint8_t>();
    wire.magic1 = w[1].cast<uint8_t>();
    wire.version = w[2].cast<uint8_t>();
    wire.max_meta = w[3].cast<uint32_t>();
    wire.max_payloads = w[4].cast<uint32_t>();
    wire.max_payload_total = w[5].cast<uint64_t>();
    return wire;
  };
  py::class_<TcpLink, Link>(m, "TcpLink")
      .def(py::init([wire_params](int fd, uintptr_t buffer, size_t capacity, const py::tuple& w, int64_t poll_ns,
                                  int64_t stall_ns) {
             return new TcpLink(fd, buffer, capacity, wire_params(w), poll_ns, stall_ns);
           }),
           py::arg("fd"), py::arg("buffer"), py::arg("capacity"), py::arg("wire"), py::arg("poll_ns"),
           py::arg("stall_ns"),
           "TcpTransport.native_socket()'s socket and read-ahead buffer; wire: (magic0, magic1, version, "
           "max_meta, max_payloads, max_payload_total).")
      .def("set_read_ahead", &TcpLink::set_read_ahead, py::arg("head"), py::arg("tail"))
      .def("read_ahead", &TcpLink::read_ahead)
      .def("take_counts", &TcpLink::take_counts,
           "(rx messages, rx bytes, tx messages, tx bytes) since the last call, for the transport's counters.")
      .def("close", &TcpLink::close, "Closes the link's socket (a dup of the transport's).");
  py::class_<TlsLink, TcpLink>(m, "TlsLink")
      .def(py::init([wire_params](int fd, uintptr_t buffer, size_t capacity, const py::tuple& w, int64_t poll_ns,
                                  int64_t stall_ns, uintptr_t ssl, const py::tuple& f) {
             constexpr size_t kBatching = sizeof(ra_ssl_batching) / sizeof(void*);
             if (f.size() != 6 + kBatching) throw py::value_error("OpenSSL function addresses: tls.py's _SSL_FUNCTIONS");
             SslFunctions fns{};
             fns.read = reinterpret_cast<decltype(fns.read)>(f[0].cast<uintptr_t>());
             fns.write = reinterpret_cast<decltype(fns.write)>(f[1].cast<uintptr_t>());
             fns.get_error = reinterpret_cast<decltype(fns.get_error)>(f[2].cast<uintptr_t>());
             fns.set_fd = reinterpret_cast<decltype(fns.set_fd)>(f[3].cast<uintptr_t>());
             fns.clear_error = reinterpret_cast<decltype(fns.clear_error)>(f[4].cast<uintptr_t>());
             fns.peek_error = reinterpret_cast<decltype(fns.peek_error)>(f[5].cast<uintptr_t>());
             void* batching[kBatching];  // struct ra_ssl_batching: function pointers in tls.py's order
             for (size_t i = 0; i < kBatching; ++i) {
               batching[i] = reinterpret_cast<void*>(f[6 + i].cast<uintptr_t>());
               if (batching[i] == nullptr) throw py::value_error("an OpenSSL function's address is 0");
             }
             std::memcpy(&fns.batching, batching, sizeof(fns.batching));
             return new TlsLink(fd, buffer, capacity, wire_params(w), poll_ns, stall_ns, ssl, fns);
           }),
           py::arg("fd"), py::arg("buffer"), py::arg("capacity"), py::arg("wire"), py::arg("poll_ns"),
           py::arg("stall_ns"), py::arg("ssl"), py::arg("functions"),
           "TlsTransport.native_link()'s: TcpLink's arguments, then the SSL object's address and the addresses of "
           "(SSL_read, SSL_write, SSL_get_error, SSL_set_fd, ERR_clear_error, ERR_peek_error) and of struct "
           "ra_ssl_batching's functions (dataplane/tls.py: _SSL_FUNCTIONS).");
  m.def("wire_encode", [wire_params](const py::tuple& w, int type, uint32_t req_id, const py::bytes& meta,
                                     std::optional<uint64_t> payload_len) {
    const shim_wire wire = wire_params(w);
    const std::string m = meta;
    std::string out(SHIM_WIRE_HEADER + 8 + m.size(), '\0');
    const shim_iov payload{nullptr, payload_len.value_or(0)};
    const int64_t n = shim_wire_encode(&wire, out.data(), out.size(), static_cast<uint8_t>(type), 0, req_id, m.data(),
                                       static_cast<uint32_t>(m.size()), &payload, payload_len ? 1 : 0);
    if (n < 0) throw std::invalid_argument("shim_wire_encode refused the message");
    out.resize(static_cast<size_t>(n));
    return py::bytes(out);
  }, "A prologue as the TCP loop sends it (dpdk_shim/wire/prologue.c; tests compare it with wire.encode_prologue).");
  m.def("wire_check", [wire_params](const py::tuple& w, const py::bytes& data) {
    const shim_wire wire = wire_params(w);
    const std::string d = data;
    shim_msg_info info;
    prologue_check(wire, reinterpret_cast<const uint8_t*>(d.data()), d.size(), &info);
    return py::make_tuple(info.status, info.type, info.req_id, info.meta_len, info.msg_len);
  }, "(status, type, req_id, meta_len, msg_len) of a prologue as the TCP loop checks it (0: valid).");
  py::class_<FastLoop>(m, "FastLoop")
      .def(py::init([](Executor& executor, Link& link, const py::tuple& t, bool cpu_device, size_t small_read,
                       const py::bytes& pong_meta) {
             const FastLoop::Types types{t[0].cast<int>(), t[1].cast<int>(), t[2].cast<int>(),
                                         t[3].cast<int>(), t[4].cast<int>(), t[5].cast<int>()};
             return new FastLoop(executor, link, types, cpu_device, small_read, std::string(pong_meta));
           }),
           py::arg("executor"), py::arg("link"), py::arg("types"), py::arg("cpu_device"), py::arg("small_read"),
           py::arg("pong_meta"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>(),
           "link: a DpdkLink or TcpLink; types: the wire numbers of (BATCH, READ, SYNC, DATA, SYNC_OK, PONG).")
      .def("run", [](FastLoop& f, int64_t timeout_ns, int64_t python_ops, bool pending) -> py::tuple {
             FastLoop::Result r;
             {
               py::gil_scoped_release no_gil;
               r = f.run(timeout_ns, python_ops, pending);
             }
             if (r.code != FastLoop::kStopped) return py::make_tuple(static_cast<int>(r.code), r.value);
             const auto& s = r.stop;
             // as Executor.resume returns it, and the batch's meta (Python decodes the item)
             return py::make_tuple(static_cast<int>(r.code),
                                   py::make_tuple(s.item, static_cast<int>(s.kind), s.begin, s.end,
                                                  s.kind == Executor::Stop::kError ? error_tuple(s.error) : py::none()),
                                   py::bytes(f.batch_meta()));
           },
           py::arg("timeout_ns"), py::arg("python_ops"), py::arg("pending"),
           "(code, value[, batch meta]): 0 yield (served some, none waits), 1 a message for Python "
           "(value: its bytes the link holds), 2 a -errno (value), 3 a Batch stopped "
           "(value: as Executor.resume).")
      .def("send_pong", [](FastLoop& f) {
             py::gil_scoped_release no_gil;
             return f.send_pong();
           })
      .def("busy", &FastLoop::busy)
      .def("take_batch_ns", &FastLoop::take_batch_ns)
      .def("served", &FastLoop::served, "Messages served in C++: (batches, reads, syncs).");

  // -- a session's per-message fast path (session.py): a READ's fields and its bytes
  // without the Python decoder, a tensor view or ctypes (together about 10 us of a sync's
  // server time). None wherever Python must look: it decodes, checks and reports as before.
  m.def("parse_read", [](const py::bytes& meta) -> py::object {
    char* data = nullptr;
    Py_ssize_t n = 0;
    if (PyBytes_AsStringAndSize(meta.ptr(), &data, &n) != 0) throw py::error_already_set();
    int64_t fields[3];  // sid, offset, nbytes
    if (!int_fields(data, static_cast<size_t>(n), fields, 3)) return py::none();
    return py::make_tuple(fields[0], fields[1], fields[2]);
  });
  // A copy of bytes [offset, offset + nbytes) of a CPU server's storage (a scalar for
  // `.item()`), pinned until unpin() as with get(); None for anything else (no such
  // storage, a bad range, a device storage): Python's path says what is wrong.
  m.def("read_small", [](Executor& s, int64_t sid, int64_t offset, int64_t nbytes) -> py::object {
    const char* bytes = nullptr;
    if (!small_read(s, sid, offset, nbytes, &bytes)) return py::none();
    return nbytes == 0 ? py::bytes() : py::bytes(bytes, static_cast<size_t>(nbytes));
  });
}
