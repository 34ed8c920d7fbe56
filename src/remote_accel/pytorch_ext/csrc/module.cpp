// Kernels that never need the server (factories and views), and the `_C` Python module.
//
// Every other aten op on a remote_accel tensor reaches the boxed fallback (op_fallback.cpp),
// which the Python side installs with its half of the work.
#include "device.h"
#include "graph_call.h"
#include "host_cache.h"
#include "op_queue.h"
#include "profiler.h"

#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/strides.h>
#include <torch/extension.h>
#include <torch/library.h>

#ifndef REMOTE_ACCEL_VERSION
#error "REMOTE_ACCEL_VERSION must be defined by the build"
#endif

namespace remote_accel {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::PrivateUse1;

void check_plain(std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(layout.value_or(c10::kStrided) == c10::kStrided,
              "remote_accel supports only strided tensors, got layout ", *layout);
  TORCH_CHECK(!pin_memory.value_or(false), "remote_accel tensors cannot be pinned (only CPU tensors can)");
}

// Factories allocate a handle only: fill_/normal_/... that follow go to the fallback.
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  check_plain(layout, pin_memory);
  // The allocator takes its device from the guard; no codegen'd guard wraps our kernels.
  const c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(size, allocator(), c10::DispatchKeySet(kKey),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  check_plain(layout, pin_memory);
  const c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, allocator(), c10::DispatchKeySet(kKey),
                                           c10::dtype_or_default(dtype));
}

// set_(storage, offset, size, stride): metadata only. CPU's kernel would grow a storage that
// is too small by copying its bytes in host memory, which for us is a reserved, unreadable
// range; growing would need the server, so it is refused here.
at::Tensor& set_storage(at::Tensor& self, at::Storage source, int64_t storage_offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  TORCH_CHECK(source.device_type() == c10::DeviceType::PrivateUse1,
              "remote_accel: set_ needs a remote_accel storage, got one on ", source.device());
  // The schema's default `stride=[]` means contiguous.
  const bool contiguous = stride.empty() && !size.empty();
  const c10::DimVector strides = contiguous ? c10::contiguous_strides(size) : c10::DimVector(stride);
  TORCH_CHECK(size.size() == strides.size(), "set_: unequal size length (", size.size(),
              ") and stride length (", strides.size(), ")");
  TORCH_CHECK(storage_offset >= 0, "set_: invalid storage offset ", storage_offset);
  // Checked before anything changes, so a refused set_ leaves self as it was.
  const size_t needed = c10::multiply_integers(size) == 0
      ? 0
      : at::detail::computeStorageNbytes(size, strides, self.dtype().itemsize(),
                                         static_cast<size_t>(storage_offset));
  TORCH_CHECK(needed <= source.nbytes(), "remote_accel: set_ would need a storage of ", needed,
              " bytes but it has ", source.nbytes(), "; growing a remote storage is not supported here");
  // Validates the rest (devices match) and installs the storage.
  at::native::checkSetStorage(self, source, storage_offset, size, c10::IntArrayRef(strides));
  self.unsafeGetTensorImpl()->set_sizes_and_strides(size, strides, storage_offset);
  return self;
}

// set_(): detach from the storage, as an empty tensor on a fresh 0-byte storage.
at::Tensor& set_empty(at::Tensor& self) {
  const c10::DeviceGuard guard(self.device());
  at::Storage empty(at::Storage::use_byte_size_t(), 0, allocator(), /*resizable=*/true);
  return set_storage(self, std::move(empty), 0, {0}, {});
}

// Module._apply (`model.to(...)`, `.cpu()`, `.remote_accel()`) keeps each Parameter and
// its .grad the same object (`param.data = moved`) only where this says yes; otherwise it
// makes new Parameters, which silently unties shared weights (GPT-2's lm_head and wte)
// and strands optimizers made before the move. c10 says yes for dense tensors of its
// built-in backends and leaves PrivateUse1 to its backend (TensorImpl.h): our tensors
// are plain strided TensorImpls, as exchangeable with CPU or CUDA ones as those are with
// each other. Reached whenever one argument is ours (PrivateUse1 outranks CPU and CUDA).
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    constexpr auto backends = c10::DispatchKeySet(
        {c10::BackendComponent::CPUBit, c10::BackendComponent::CUDABit, c10::BackendComponent::MPSBit,
         c10::BackendComponent::HIPBit, c10::BackendComponent::XPUBit, c10::BackendComponent::HPUBit,
         c10::BackendComponent::MTIABit, c10::BackendComponent::PrivateUse1Bit});
    const auto keys = t.key_set();
    return keys.has_any(c10::DispatchKeySet(c10::DispatchKey::Dense)) && keys.has_any(backends);
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) ||
      (dense(self) && dense(from));
}

uint64_t id_of(const at::Storage& storage) {
  TORCH_CHECK_VALUE(storage.device_type() == c10::DeviceType::PrivateUse1,
                    "remote_accel: storage_id needs a remote_accel storage, got one on ", storage.device());
  return storage_id(storage.data());
}

} // namespace
} // namespace remote_accel

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace remote_accel;
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  // The views with a kernel per backend (native_functions.yaml). The rest (transpose,
  // permute, select, slice, expand, squeeze, diagonal, alias, _neg_view, _conj...) are
  // CompositeExplicitAutograd and end up in these. All are device-generic metadata code.
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
  m.impl("set_.source_Storage", TORCH_FN(at::native::set_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage));
  m.impl("set_.source_Tensor", TORCH_FN(at::native::set_tensor_));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
  // resize_ is left to the Python fallback: growing a storage must copy its bytes on the
  // server.
}

// A conjugate or negative view reaching `_copy_from` (every copy_ from or to this device)
// would otherwise meet the Conjugate/Negative fallback first, which materialises the view
// with clone() -> copy_ -> _copy_from -> the same fallback, forever. The Python copy sends
// the conj/neg bits with the tensor, so the lazy bits are resolved where the data is.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

// Autocast: the same policy lists CUDA uses (ATen's autocast_mode.h), so that under
// torch.autocast("remote_accel", dtype=...) matmuls and convolutions run in the lower
// precision on the server, reductions in fp32, and mixed inputs are promoted. The casts
// themselves are ordinary ops on remote tensors: they queue like any other.
namespace remote_accel {
namespace {
at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                       int64_t) {
  TORCH_CHECK(false, "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
                     "(as on CUDA): use binary_cross_entropy_with_logits or BCEWithLogitsLoss instead");
}
} // namespace
} // namespace remote_accel

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  using namespace at;  // the op lists name Tensor, Scalar, ScalarType unqualified
#define RA_KERNEL_LOW_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(RA_KERNEL_LOW_PRECISION_FP)
#define RA_KERNEL_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(RA_KERNEL_FP32)
#define RA_KERNEL_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(RA_KERNEL_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#define RA_KERNEL_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(RA_KERNEL_PROMOTE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"),
         TORCH_FN(remote_accel::binary_cross_entropy_banned));
}

// Every other op passes autocast untouched (torch registers no fallback for this key).
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

PYBIND11_MODULE(_C, m) {
  namespace ra = remote_accel;
  namespace py = pybind11;
  m.doc() = "remote_accel device: allocator, device guard, generator and view kernels";

  m.def("version", [] { return std::string(REMOTE_ACCEL_VERSION); },
        "Version of the package this extension was built for.");

  m.def("storage_id", [](const at::Tensor& t) { return ra::id_of(t.storage()); }, py::arg("tensor"));
  m.def("storage_id", [](const at::Storage& s) { return ra::id_of(s); }, py::arg("storage"),
        "Storage id of a remote_accel tensor or storage: 0 for a storage without bytes.");
  m.def("drain_freed", [](int device) { return ra::drain_freed(static_cast<c10::DeviceIndex>(device)); },
        py::arg("device_index"), "Ids of this device's storages freed since the last call, oldest first.");
  // A tensor of an ended session is a RemoteAccelError, like every failure of the device.
  py::register_exception<ra::StaleStorage>(m, "StaleTensorError",
                                           py::module_::import("remote_accel.errors").attr("RemoteAccelError"));
  m.def("set_memory_limit", [](int device, int64_t limit) {
          ra::set_memory_limit(static_cast<c10::DeviceIndex>(device), limit);
        }, py::arg("device_index"), py::arg("limit"),
        "Bytes this device's session may hold (0: no limit); larger allocations raise torch.OutOfMemoryError.");
  m.def("memory_allocated", [](int device) { return ra::memory_allocated(static_cast<c10::DeviceIndex>(device)); },
        py::arg("device_index"), "(bytes, peak bytes) of the live storages of this device's current session.");
  m.def("reset_peak_memory", [](int device) { ra::reset_peak(static_cast<c10::DeviceIndex>(device)); },
        py::arg("device_index"));
  m.def("ensure_autograd_queues", &ra::ensure_autograd_queues, py::arg("count"),
        "Give the autograd engine a worker queue for device indices 0..count-1 (its device threads "
        "must have started: run any backward first).");
  m.def("live_storages", [](int device) { return ra::live_storages(static_cast<c10::DeviceIndex>(device)); },
        py::arg("device_index"), "Number of this device's storages still alive.");

  m.def("install_scalar_read", &ra::install_scalar_read, py::arg("read_scalar"),
        "Serve .item() through read_scalar(tensor) -> the element's bytes or None (once per process).");
  m.def("install_op_fallback", &ra::install_op_fallback, py::arg("slow_path"), py::arg("flush"),
        py::arg("alloc_type"), py::arg("run_planned_type"), py::arg("first_items"), py::arg("max_items"),
        "Install the fallback for every op at PrivateUse1 (once): calls without a cached plan run "
        "slow_path(op, args, kwargs, want_plan) -> (results, plan, or None, or False: never for this op); "
        "flush(device index) sends a queue that reached its length: first_items after a batch that left "
        "before it was full, twice the last length after a full one, at most max_items.");
  m.def("queue_open", [](int device) { ra::queue_open(static_cast<c10::DeviceIndex>(device)); },
        py::arg("device_index"), "Accept requests for this device (a new session: no storage announced).");
  m.def("queue_close", [](int device) { ra::queue_close(static_cast<c10::DeviceIndex>(device)); },
        py::arg("device_index"), "Refuse requests for this device and drop what is queued.");
  m.def("queue_wait", [](int device, double timeout_s) {
          return ra::queue_wait(static_cast<c10::DeviceIndex>(device), timeout_s);
        }, py::arg("device_index"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
        "Wait without the GIL until an op is queued in C++ or queue_wake is called since the last take, "
        "or the queue closes (True), or timeout_s passes (False).");
  m.def("queue_wake", [](int device) { ra::queue_wake(static_cast<c10::DeviceIndex>(device)); },
        py::arg("device_index"), py::call_guard<py::gil_scoped_release>(), "Wake queue_wait.");
  m.def("queue_take", [](int device, int64_t free_type) {
          auto [requests, ops, bytes] = ra::queue_take(static_cast<c10::DeviceIndex>(device), free_type);
          return py::make_tuple(requests, ops, py::bytes(bytes));
        }, py::arg("device_index"), py::arg("free_type") = -1,
        "(requests, of which ops, their encodings back to back) queued in C++ since the last take; "
        "with free_type (FREE's wire number) also a FreeStorage item of the freed ids, last.");
  m.def("announce", [](const at::Tensor& t, int device) {
          return ra::announce(t, static_cast<c10::DeviceIndex>(device));
        }, py::arg("tensor"), py::arg("device_index"),
        "Storage id of a remote argument; queues ALLOC first if the server has not seen it.");
  m.def("announce_output", [](const at::Tensor& t, int device) {
          return ra::announce_output(t, static_cast<c10::DeviceIndex>(device));
        }, py::arg("tensor"), py::arg("device_index"),
        "Storage id of a fresh result, which the server creates when it binds it.");

  // compiled graph calls (graph_call.h)
  m.def("graph_inputs", &ra::graph_inputs, py::arg("inputs"), py::arg("device_index"), py::arg("other"),
        "The encoded tuple of a graph call's input references: remote tensors of the device in C++, "
        "anything else as the bytes other(value) returns.");
  py::class_<ra::GraphResults>(m, "GraphResults")
      .def(py::init<const py::sequence&>(), py::arg("specs"),
           "specs: per result None or (shape, stride, dtype name), fixed when the graph was compiled.")
      .def("make", &ra::GraphResults::make, py::arg("device_index"),
           "([fresh tensor or None per result], their encoded references).");
  m.def("plan_stats", &ra::plan_stats, "(plans cached, calls served from them) since the last clear_plans().");
  m.def("clear_plans", &ra::clear_plans, "Forget every cached plan (their server may have changed).");

  m.def("host_cache_stats", [] {
          const auto s = ra::host_cache_stats();
          py::dict d;
          d["cached_bytes"] = s.cached_bytes;
          d["live_bytes"] = s.live_bytes;
          d["limit_bytes"] = s.limit_bytes;
          d["hits"] = s.hits;
          d["misses"] = s.misses;
          d["released"] = s.released;
          return d;
        }, "The host cache of large .cpu() results: cached_bytes, live_bytes, limit_bytes, hits, misses, released.");
  m.def("host_cache_empty", &ra::host_cache_empty, py::arg("limit") = py::none(),
        "Unmap the host cache's free blocks; with `limit`, keep at most that many bytes from now on (0: off).");

  m.attr("MAX_DEVICES") = ra::kMaxDevices;
  m.def("set_device_count", &ra::set_device_count, py::arg("count"));
  m.def("device_count", [] { return static_cast<int>(ra::device_count()); });
  m.def("current_device", [] { return static_cast<int>(ra::current_device()); },
        "This thread's current remote_accel device index.");
  m.def("set_device", [](int device) {
          c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)
              ->setDevice({c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)});
        }, py::arg("device_index"));
  m.def("exchange_device", [](int device) {
          const auto old = ra::current_device();
          c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)
              ->setDevice({c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)});
          return static_cast<int>(old);
        }, py::arg("device_index"), "Set the current device; return the previous one.");

  m.def("default_generator", [](int device) { return ra::default_generator(static_cast<c10::DeviceIndex>(device)); },
        py::arg("device_index") = -1, "The default torch.Generator of a device (-1: current).");
  m.def("default_generator_id", [](int device) { return ra::default_generator_id(static_cast<c10::DeviceIndex>(device)); },
        py::arg("device_index"), "Id of a device's default generator (safe while its lock is held).");
  m.def("set_generator_state_hooks", [](py::function get, py::function set) {
          // Leaked like the generators that call them: they may run until interpreter exit.
          auto* get_fn = new py::function(std::move(get));
          auto* set_fn = new py::function(std::move(set));
          ra::set_generator_state_hooks(new ra::GeneratorStateHooks{
              [get_fn](c10::DeviceIndex device, uint64_t id, uint64_t seed, uint64_t epoch) {
                py::gil_scoped_acquire gil;
                return (*get_fn)(static_cast<int>(device), id, seed, epoch).cast<std::string>();
              },
              [set_fn](c10::DeviceIndex device, uint64_t id, uint64_t seed, uint64_t epoch, const std::string& state) {
                py::gil_scoped_acquire gil;
                (*set_fn)(static_cast<int>(device), id, seed, epoch, py::bytes(state));
              }});
        }, py::arg("get"), py::arg("set"),
        "Make Generator.get_state()/set_state() read and write the server's generator: "
        "get(device, id, seed, epoch) -> bytes, set(device, id, seed, epoch, state).");
  m.def("set_profiler_hooks", &ra::set_profiler_hooks, py::arg("start"), py::arg("stop"),
        "torch.profiler's PrivateUse1 window: start() on every server, stop() -> their events.");
  m.def("profiler_available", &ra::profiler_available);
  m.def("set_device_hooks", [](py::object impl) {
          // Leaked like the guard that calls them: events may be destroyed until interpreter exit.
          auto* obj = new py::object(std::move(impl));
          // Each call takes the GIL for the call and for the conversion of its result.
          auto* hooks = new ra::DeviceHooks;
          hooks->record_event = [obj](c10::DeviceIndex d, uint64_t id) {
            py::gil_scoped_acquire gil;
            obj->attr("record_event")(static_cast<int>(d), id);
          };
          hooks->query_event = [obj](c10::DeviceIndex d, uint64_t id) {
            py::gil_scoped_acquire gil;
            return obj->attr("query_event")(static_cast<int>(d), id).cast<bool>();
          };
          hooks->synchronize_event = [obj](c10::DeviceIndex d, uint64_t id) {
            py::gil_scoped_acquire gil;
            obj->attr("synchronize_event")(static_cast<int>(d), id);
          };
          hooks->elapsed_ms = [obj](c10::DeviceIndex d, uint64_t start, uint64_t end) {
            py::gil_scoped_acquire gil;
            return obj->attr("elapsed_ms")(static_cast<int>(d), start, end).cast<double>();
          };
          hooks->synchronize_device = [obj](c10::DeviceIndex d) {
            py::gil_scoped_acquire gil;
            obj->attr("synchronize_device")(static_cast<int>(d));
          };
          hooks->memory_info = [obj](c10::DeviceIndex d) {
            py::gil_scoped_acquire gil;
            return obj->attr("memory_info")(static_cast<int>(d)).cast<std::pair<size_t, size_t>>();
          };
          hooks->empty_cache = [obj] {
            py::gil_scoped_acquire gil;
            obj->attr("empty_cache")();
          };
          ra::set_device_hooks(hooks);
        }, py::arg("hooks"),
        "Install the object whose methods answer what only the server knows: record_event(device, id), "
        "query_event(device, id) -> bool, synchronize_event(device, id), elapsed_ms(device, start, end) -> "
        "float, synchronize_device(device), memory_info(device) -> (free, total), empty_cache().");
  m.def("is_pinned_ptr", [](uintptr_t ptr) { return ra::is_pinned_ptr(reinterpret_cast<const void*>(ptr)); },
        py::arg("ptr"), "Whether the address lies in remote_accel's pinned host memory.");
  m.def("allocation_counts", [](int device) {
          const auto c = ra::allocation_counts(static_cast<c10::DeviceIndex>(device));
          py::dict d;
          d["bytes"] = c.bytes; d["peak_bytes"] = c.peak_bytes;
          d["allocated_bytes"] = c.allocated_bytes; d["freed_bytes"] = c.freed_bytes;
          d["count"] = c.count; d["peak_count"] = c.peak_count;
          d["allocated_count"] = c.allocated_count; d["freed_count"] = c.freed_count;
          return d;
        }, py::arg("device"), "The device's allocation counters (current, peak, cumulative).");
  m.def("reset_accumulated", [](int device) { ra::reset_accumulated(static_cast<c10::DeviceIndex>(device)); },
        py::arg("device"), "Zero the cumulative allocation counters.");
  m.def("generator_info", &ra::generator_info, py::arg("generator"),
        "(generator id, seed, epoch) of a remote_accel torch.Generator. The server reseeds its "
        "generator whenever this triple changes; the offset is Generator.get_offset().");
}
