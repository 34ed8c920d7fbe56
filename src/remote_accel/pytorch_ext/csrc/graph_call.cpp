// The client's half of a compiled graph call (pytorch_ext/compile.py): the RunGraph
// fields that change from call to call, encoded in one C++ call each instead of a few
// Python calls per tensor. A training step's three graphs pass about 220 input tensors
// and make about 90 result handles; in Python that cost the tracing thread about 0.9 ms
// a step, time the server waited for the forward and, on 2 shared cores, lost outright.
//
// The bytes are those codec.encode writes for the same values: a remote tensor as
// Ext(TENSOR, (sid, dtype name, shape, stride, storage offset, conj/neg flags)), which
// torch_wire/values.py's encoded_tensor_ref also writes (a test compares the two).
// Anything else (CPU tensors, plain numbers, tensors of another device, dtypes the
// table below lacks) is encoded by Python's `other`, which also raises its errors.
#include "graph_call.h"

#include "codec.h"
#include "device.h"
#include "op_queue.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <string>
#include <utility>

namespace remote_accel {
namespace {

namespace py = pybind11;

// torch_wire/values.py's DTYPES, the names a reference carries.
constexpr std::array<std::pair<c10::ScalarType, std::string_view>, 18> kDtypeNames{{
    {c10::ScalarType::Float, "float32"}, {c10::ScalarType::Double, "float64"},
    {c10::ScalarType::Half, "float16"}, {c10::ScalarType::BFloat16, "bfloat16"},
    {c10::ScalarType::ComplexFloat, "complex64"}, {c10::ScalarType::ComplexDouble, "complex128"},
    {c10::ScalarType::ComplexHalf, "complex32"}, {c10::ScalarType::Byte, "uint8"},
    {c10::ScalarType::Char, "int8"}, {c10::ScalarType::Short, "int16"}, {c10::ScalarType::Int, "int32"},
    {c10::ScalarType::Long, "int64"}, {c10::ScalarType::Bool, "bool"}, {c10::ScalarType::UInt16, "uint16"},
    {c10::ScalarType::UInt32, "uint32"}, {c10::ScalarType::UInt64, "uint64"},
    {c10::ScalarType::Float8_e4m3fn, "float8_e4m3fn"}, {c10::ScalarType::Float8_e5m2, "float8_e5m2"},
}};

const std::string_view* dtype_name(c10::ScalarType dtype) {
  for (const auto& [type, name] : kDtypeNames) {
    if (type == dtype) return &name;
  }
  return nullptr;
}

c10::ScalarType dtype_from_name(const std::string& name) {
  for (const auto& [type, known] : kDtypeNames) {
    if (known == name) return type;
  }
  throw py::value_error("remote_accel: a graph result of unknown dtype " + name);
}

void put_ints(std::string& out, c10::IntArrayRef values) {
  wire::put_tuple_header(out, static_cast<uint32_t>(values.size()));
  for (const auto v : values) wire::put_int(out, v);
}

void put_ref(std::string& out, uint64_t sid, std::string_view dtype, const at::Tensor& t, int64_t flags) {
  out.push_back(static_cast<char>(wire::kExt));
  out.push_back(static_cast<char>(wire::kExtTensor));
  wire::put_tuple_header(out, 6);
  wire::put_int(out, static_cast<int64_t>(sid));
  wire::put_container_header(out, wire::kStr, static_cast<uint32_t>(dtype.size()));
  out.append(dtype);
  put_ints(out, t.sizes());
  put_ints(out, t.strides());
  wire::put_int(out, t.storage_offset());
  wire::put_int(out, flags);
}

constexpr int64_t kFlagConj = 1, kFlagNeg = 2;  // torch_wire/values.py FLAG_CONJ, FLAG_NEG

} // namespace

py::bytes graph_inputs(const py::sequence& inputs, int device, const py::function& other) {
  const c10::Device where(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
  std::string out;
  out.reserve(64 * inputs.size() + 8);
  wire::put_tuple_header(out, static_cast<uint32_t>(inputs.size()));
  for (const auto item : inputs) {
    PyObject* obj = item.ptr();
    if (THPVariable_Check(obj)) {
      const at::Tensor& t = THPVariable_Unpack(obj);
      const auto* name = t.device() == where && t.layout() == c10::kStrided ? dtype_name(t.scalar_type()) : nullptr;
      if (name != nullptr) {
        const uint64_t sid = announce(t, where.index());  // ALLOC queued first if the server lacks it
        put_ref(out, sid, *name, t, (t.is_conj() ? kFlagConj : 0) | (t.is_neg() ? kFlagNeg : 0));
        continue;
      }
    }
    const py::object encoded = other(item);
    if (!PyBytes_Check(encoded.ptr())) throw py::type_error("remote_accel: graph_inputs' `other` must return bytes");
    out.append(PyBytes_AS_STRING(encoded.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(encoded.ptr())));
  }
  return py::bytes(out);
}

GraphResults::GraphResults(const py::sequence& specs) {
  for (const auto spec : specs) {
    Spec s;
    if (!spec.is_none()) {
      const auto fields = spec.cast<py::tuple>();
      if (fields.size() != 3) throw py::value_error("remote_accel: a result spec is (shape, stride, dtype name)");
      s.sizes = fields[0].cast<std::vector<int64_t>>();
      s.strides = fields[1].cast<std::vector<int64_t>>();
      if (s.sizes.size() != s.strides.size()) throw py::value_error("remote_accel: a result's shape and stride differ in length");
      s.dtype = dtype_from_name(fields[2].cast<std::string>());
      s.present = true;
    }
    specs_.push_back(std::move(s));
  }
}

py::tuple GraphResults::make(int device) const {
  const c10::Device where(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
  std::vector<at::Tensor> made(specs_.size());
  std::string out;
  out.reserve(48 * specs_.size() + 8);
  wire::put_tuple_header(out, static_cast<uint32_t>(specs_.size()));
  try {
    const c10::DeviceGuard guard(where);  // the allocator takes its device from the guard
    for (size_t k = 0; k < specs_.size(); ++k) {
      const auto& s = specs_[k];
      if (!s.present) {
        out.push_back(static_cast<char>(wire::kNone));
        continue;
      }
      made[k] = at::detail::empty_strided_generic(s.sizes, s.strides, allocator(),
                                                  c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), s.dtype);
      // no ALLOC: the server makes the storage when it binds the result to this id
      put_ref(out, announce_output(made[k], where.index()), *dtype_name(s.dtype), made[k], 0);
    }
  } catch (const c10::OutOfMemoryError& e) {
    // over the session's memory limit: torch.OutOfMemoryError, as torch.empty_strided raises
    PyErr_SetString(py::module_::import("torch").attr("OutOfMemoryError").ptr(), e.what_without_backtrace());
    throw py::error_already_set();
  }
  py::list results(specs_.size());
  for (size_t k = 0; k < specs_.size(); ++k) {
    if (!made[k].defined()) {
      results[k] = py::none();
      continue;
    }
    PyObject* wrapped = THPVariable_Wrap(std::move(made[k]));
    if (wrapped == nullptr) throw py::error_already_set();
    results[k] = py::reinterpret_steal<py::object>(wrapped);
  }
  return py::make_tuple(std::move(results), py::bytes(out));
}

} // namespace remote_accel
