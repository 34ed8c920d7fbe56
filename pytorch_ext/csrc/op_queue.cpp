// The op fallback: cached plans served in C++, everything else handed to Python.
// See op_queue.h for the design; fallback.py makes the plans.
#include "op_queue.h"

#include "device.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/stack.h>
#include <ATen/ops/as_strided_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace py = pybind11;

namespace remote_accel {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian, and CPU scalars are copied as they lie in memory");

constexpr c10::DispatchKey kKey = c10::DispatchKey::PrivateUse1;
// Plans kept before the cache starts over (a loop uses a few hundred).
constexpr int64_t kMaxPlans = 1 << 14;

// ---------------------------------------------------------------------------------------
// Encoding: the few codec values (dataplane/codec.py) a queued request needs.

template <class T>
void put_raw(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}

void put_int(std::string& out, int64_t v) {
  constexpr char kInt = 0x03, kSmallInt = 0x0c;
  if (v >= -128 && v < 128) {  // codec's one-byte ints
    out.push_back(kSmallInt);
    out.push_back(static_cast<char>(v + 128));
  } else {
    out.push_back(kInt);
    put_raw<int64_t>(out, v);
  }
}

void put_tuple_header(std::string& out, uint32_t n) {
  out.push_back(0x08);
  put_raw<uint32_t>(out, n);
}

void put_bytes(std::string& out, const void* data, uint32_t n) {
  out.push_back(0x06);
  put_raw<uint32_t>(out, n);
  out.append(static_cast<const char*>(data), n);
}

// ---------------------------------------------------------------------------------------
// Per-device queues

struct Queue {
  std::mutex mu;
  bool open = false;
  std::string bytes;  // encoded batch items, back to back
  int64_t requests = 0;
  int64_t ops = 0;
  std::unordered_set<uint64_t> announced;  // storage ids the server holds
};

// Leaked like the allocator's registry: storages die during interpreter shutdown too.
std::array<Queue, kMaxDevices>& queues() {
  static auto* q = new std::array<Queue, kMaxDevices>();
  return *q;
}

Queue& queue(c10::DeviceIndex device) {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "remote_accel: bad device index ",
                    static_cast<int>(device));
  return queues()[device];
}

std::atomic<int64_t> g_alloc_type{-1};
std::atomic<int64_t> g_run_planned_type{-1};
std::atomic<int64_t> g_max_items{256};

// Queues ALLOC(sid, nbytes); the caller holds q.mu and checked q.open.
void put_alloc(Queue& q, uint64_t sid, size_t nbytes) {
  put_tuple_header(q.bytes, 2);
  put_int(q.bytes, g_alloc_type.load(std::memory_order_relaxed));
  put_tuple_header(q.bytes, 2);
  put_int(q.bytes, static_cast<int64_t>(sid));
  put_int(q.bytes, static_cast<int64_t>(nbytes));
  ++q.requests;
}

uint64_t sid_of(const at::Tensor& t) {
  return storage_id(t.storage().data());
}

// ---------------------------------------------------------------------------------------
// Plans (made by fallback.py's _native_plan)

struct Result {
  // kUndefined: an absent result where the schema says Tensor (convolution_backward's
  // unasked gradients), which the stack holds as an undefined tensor, not None
  enum Kind : uint8_t { kArgument, kView, kFresh, kNone, kUndefined, kList };
  Kind kind = kNone;
  int64_t index = -1;  // kArgument, kView: the argument's schema index; kFresh: its number
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;  // kView: from the argument's own storage offset
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<Result> items;  // kList
};

struct Plan {
  // The id under which the first call's RunOp defined this plan on the server: a served
  // call sends RunPlanned(id, values), values being per tensor argument (in encoding
  // order) its storage id or, for a CPU scalar, its bytes, then per fresh result its id.
  int64_t id = 0;
  std::vector<Result> results;  // one per schema return
  size_t n_inputs = 0;
  size_t n_fresh = 0;
};

struct OpInfo {
  std::atomic<bool> never{false};  // Python said this op is never served from a plan
  // Argument indices in the order fallback.py encodes them: positional, then keyword-only
  // by name (its kwargs are encoded sorted).
  std::vector<size_t> encoding_order;
  std::unordered_map<std::string, std::shared_ptr<const Plan>> plans;
};

struct Plans {
  std::mutex mu;
  std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<OpInfo>> ops;
  int64_t count = 0;
  std::atomic<int64_t> hits{0};
};

Plans& plans() {
  static auto* p = new Plans();
  return *p;
}

OpInfo& op_info(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  auto& p = plans();
  std::lock_guard<std::mutex> lock(p.mu);
  auto& slot = p.ops[&schema];
  if (!slot) {
    slot = std::make_unique<OpInfo>();
    const auto& arguments = schema.arguments();
    std::vector<size_t> keyword;
    for (size_t i = 0; i < arguments.size(); ++i) {
      (arguments[i].kwarg_only() ? keyword : slot->encoding_order).push_back(i);
    }
    std::sort(keyword.begin(), keyword.end(),
              [&](size_t a, size_t b) { return arguments[a].name() < arguments[b].name(); });
    slot->encoding_order.insert(slot->encoding_order.end(), keyword.begin(), keyword.end());
  }
  return *slot;
}

// ---------------------------------------------------------------------------------------
// A call's key: the op's arguments, tensors by metadata and scalars by value. Two calls
// with equal keys get equal results' metadata and equal encodings but for the holes.

struct Call {
  std::string key;
  c10::DeviceIndex device = -1;  // the op's device, as fallback._device_index finds it
  c10::SmallVector<at::Tensor, 8> tensors;  // tensor arguments in encoding order
};

bool key_tensor(Call& call, const at::Tensor& t) {
  auto& key = call.key;
  if (!t.defined()) {
    key.push_back('U');
    return true;
  }
  if (t.layout() != c10::kStrided) {
    return false;
  }
  const auto device = t.device();
  if (call.device < 0 && device.type() == c10::DeviceType::PrivateUse1) {
    call.device = device.index();
  }
  const auto* impl = t.unsafeGetTensorImpl();
  key.push_back('T');
  put_raw<int8_t>(key, static_cast<int8_t>(t.scalar_type()));
  put_raw<int8_t>(key, static_cast<int8_t>(device.type()));
  put_raw<int8_t>(key, device.index());
  // wrapped numbers promote more weakly than other 0-dim tensors
  put_raw<uint8_t>(key, static_cast<uint8_t>(t.is_conj() | (t.is_neg() << 1) | (impl->is_wrapped_number() << 2)));
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  put_raw<uint32_t>(key, static_cast<uint32_t>(sizes.size()));
  key.append(reinterpret_cast<const char*>(sizes.data()), sizes.size() * sizeof(int64_t));
  key.append(reinterpret_cast<const char*>(strides.data()), strides.size() * sizeof(int64_t));
  put_raw<int64_t>(key, t.storage_offset());
  return true;
}

bool key_value(Call& call, const c10::IValue& v, bool in_list) {
  auto& key = call.key;
  if (v.isTensor()) {
    return key_tensor(call, v.toTensor());
  }
  if (v.isNone()) {
    key.push_back('N');
  } else if (v.isBool()) {
    key.push_back('b');
    key.push_back(v.toBool() ? 1 : 0);
  } else if (v.isInt()) {
    key.push_back('i');
    put_raw<int64_t>(key, v.toInt());
  } else if (v.isSymInt()) {
    const auto value = v.toSymInt().maybe_as_int();
    if (!value) {
      return false;
    }
    key.push_back('i');
    put_raw<int64_t>(key, *value);
  } else if (v.isDouble()) {
    key.push_back('d');  // by bits: -0.0 and 0.0 are sent apart
    put_raw<double>(key, v.toDouble());
  } else if (v.isComplexDouble()) {
    const auto c = v.toComplexDouble();
    key.push_back('c');
    put_raw<double>(key, c.real());
    put_raw<double>(key, c.imag());
  } else if (in_list) {
    return false;
  } else if (v.isString()) {
    const auto& s = v.toStringRef();
    key.push_back('s');
    put_raw<uint32_t>(key, static_cast<uint32_t>(s.size()));
    key += s;
  } else if (v.isDevice()) {
    const auto d = v.toDevice();
    key.push_back('V');
    put_raw<int8_t>(key, static_cast<int8_t>(d.type()));
    put_raw<int8_t>(key, d.index());
    if (call.device < 0 && d.type() == c10::DeviceType::PrivateUse1) {
      call.device = d.has_index() ? d.index() : current_device();
    }
  } else if (v.isList()) {  // int[], float[], Tensor[], Tensor?[]...
    const auto items = v.toListRef();
    key.push_back('L');
    put_raw<uint32_t>(key, static_cast<uint32_t>(items.size()));
    for (const auto& item : items) {
      if (!key_value(call, item, true)) {
        return false;
      }
    }
  } else {
    return false;  // generators, storages, streams...: always Python
  }
  return true;
}

void collect_tensors(Call& call, const c10::IValue& v) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) {
      call.tensors.push_back(v.toTensor());
    }
  } else if (v.isList()) {
    for (const auto& item : v.toListRef()) {
      if (item.isTensor() && item.toTensor().defined()) {
        call.tensors.push_back(item.toTensor());
      }
    }
  }
}

// False when some argument cannot be keyed: the call then always goes to Python.
bool describe_call(const OpInfo& info, c10::ArrayRef<c10::IValue> args, Call& call) {
  call.key.reserve(256);
  // Plans hold dtypes that factories without a dtype argument took from the default.
  put_raw<int8_t>(call.key, static_cast<int8_t>(c10::typeMetaToScalarType(c10::get_default_dtype())));
  for (const auto& v : args) {
    if (!key_value(call, v, false)) {
      return false;
    }
  }
  if (call.device < 0) {
    call.device = current_device();
  }
  put_raw<int8_t>(call.key, call.device);
  for (size_t i : info.encoding_order) {
    collect_tensors(call, args[i]);
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// Serving a call from its plan

void make_fresh(const std::vector<Result>& results, c10::SmallVector<at::Tensor, 4>& fresh) {
  for (const auto& r : results) {
    if (r.kind == Result::kFresh) {
      fresh.push_back(at::detail::empty_strided_generic(r.sizes, r.strides, allocator(), c10::DispatchKeySet(kKey),
                                                        r.dtype));
    } else if (r.kind == Result::kList) {
      make_fresh(r.items, fresh);
    }
  }
}

c10::IValue result_value(const Result& r, c10::ArrayRef<c10::IValue> args, const c10::SmallVector<at::Tensor, 4>& fresh) {
  switch (r.kind) {
    case Result::kArgument:
      return args[r.index];
    case Result::kView: {
      const auto& base = args[r.index].toTensor();
      return at::native::as_strided_tensorimpl(base, r.sizes, r.strides, base.storage_offset() + r.offset);
    }
    case Result::kFresh:
      return fresh[r.index];
    case Result::kList: {
      c10::List<at::Tensor> list;
      list.reserve(r.items.size());
      for (const auto& item : r.items) {
        auto value = result_value(item, args, fresh);
        list.push_back(value.isTensor() ? value.toTensor() : at::Tensor());
      }
      return list;
    }
    case Result::kUndefined:
      return at::Tensor();
    case Result::kNone:
      break;
  }
  return {};
}

py::function* g_slow_path = nullptr;
py::function* g_flush = nullptr;

void flush_device(c10::DeviceIndex device) {
  py::gil_scoped_acquire gil;
  (*g_flush)(static_cast<int>(device));
}

// Queues the call from its plan and replaces the arguments on the stack with the
// results; false (stack untouched) when the device's queue is closed.
bool serve(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Plan& plan, const Call& call) {
  const auto n_args = op.schema().arguments().size();
  const auto args = torch::jit::last(*stack, n_args);
  c10::SmallVector<at::Tensor, 4> fresh;
  {
    const c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, call.device));
    make_fresh(plan.results, fresh);
  }
  // Ids looked up before the queue's lock is taken: the allocator has its own.
  c10::SmallVector<uint64_t, 8> input_sids, fresh_sids;
  for (const auto& t : call.tensors) {
    input_sids.push_back(t.is_cpu() ? 0 : sid_of(t));
  }
  for (const auto& t : fresh) {
    fresh_sids.push_back(sid_of(t));
  }

  auto& q = queue(call.device);
  bool full = false;
  {
    std::lock_guard<std::mutex> lock(q.mu);
    if (!q.open) {
      return false;  // Python raises the session's error
    }
    for (size_t i = 0; i < call.tensors.size(); ++i) {
      const auto sid = input_sids[i];
      if (sid != 0 && q.announced.insert(sid).second) {
        put_alloc(q, sid, call.tensors[i].storage().nbytes());
      }
    }
    // the batch item (RUN_PLANNED, (plan id, values))
    auto& out = q.bytes;
    put_tuple_header(out, 2);
    put_int(out, g_run_planned_type.load(std::memory_order_relaxed));
    put_tuple_header(out, 2);
    put_int(out, plan.id);
    put_tuple_header(out, static_cast<uint32_t>(call.tensors.size() + fresh_sids.size()));
    for (size_t i = 0; i < call.tensors.size(); ++i) {
      const auto& t = call.tensors[i];
      if (t.is_cpu()) {  // a 0-dim CPU tensor: its value as it lies in memory
        put_bytes(out, t.const_data_ptr(), static_cast<uint32_t>(t.element_size()));
      } else {
        put_int(out, static_cast<int64_t>(input_sids[i]));
      }
    }
    for (const auto sid : fresh_sids) {
      if (sid != 0) {
        q.announced.insert(sid);
      }
      put_int(out, static_cast<int64_t>(sid));
    }
    ++q.requests;
    ++q.ops;
    full = q.requests >= g_max_items.load(std::memory_order_relaxed);
  }
  plans().hits.fetch_add(1, std::memory_order_relaxed);
  if (full) {
    flush_device(call.device);
  }
  c10::SmallVector<c10::IValue, 4> results;
  for (const auto& r : plan.results) {
    results.push_back(result_value(r, args, fresh));
  }
  torch::jit::drop(*stack, n_args);
  for (auto& value : results) {
    stack->push_back(std::move(value));
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// Python's side: what PyTorch's own Python fallback does (PythonKernelHolder), except that
// tensors go as tensors (a wrapped number stays a wrapped-number tensor), and the plan.

py::object argument_to_python(const c10::Argument& argument, const c10::IValue& v) {
  if (v.isNone()) {
    return py::none();
  }
  if (v.isTensor()) {
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(v.toTensor()));
  }
  auto type = argument.real_type();
  if (auto optional = type->cast<c10::OptionalType>()) {
    type = optional->getElementType();
  }
  switch (type->kind()) {
    case c10::TypeKind::ScalarTypeType:
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()))));
    case c10::TypeKind::LayoutType:
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(v.toInt()))));
    case c10::TypeKind::MemoryFormatType:
      return py::reinterpret_borrow<py::object>(
          torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt())));
    default:
      return torch::jit::toPyObject(v);
  }
}

// (args, kwargs) as PyTorch passes them: keyword-only arguments by name, arguments equal
// to their defaults left out at the end.
std::pair<py::tuple, py::dict> arguments_to_python(const c10::FunctionSchema& schema,
                                                   const std::vector<c10::IValue>& values) {
  const auto& arguments = schema.arguments();
  auto is_default = [&](size_t i) {
    const auto& fallback = arguments[i].default_value();
    return fallback.has_value() && *fallback == values[i];
  };
  size_t keyword_start = values.size();
  while (keyword_start > 0 && arguments[keyword_start - 1].kwarg_only()) {
    --keyword_start;
  }
  size_t positional_end = keyword_start;
  while (positional_end > 0 && is_default(positional_end - 1)) {
    --positional_end;
  }
  py::tuple args(positional_end);
  for (size_t i = 0; i < positional_end; ++i) {
    args[i] = argument_to_python(arguments[i], values[i]);
  }
  py::dict kwargs;
  for (size_t i = keyword_start; i < values.size(); ++i) {
    if (!is_default(i)) {
      kwargs[py::str(arguments[i].name())] = argument_to_python(arguments[i], values[i]);
    }
  }
  return {std::move(args), std::move(kwargs)};
}

Result parse_result(py::handle spec, size_t n_args, size_t& n_fresh) {
  const auto fields = spec.cast<py::tuple>();
  const auto kind = fields[0].cast<std::string>();
  Result r;
  if (kind == "arg" || kind == "view") {
    r.kind = kind == "arg" ? Result::kArgument : Result::kView;
    r.index = fields[1].cast<int64_t>();
    TORCH_CHECK(r.index >= 0 && static_cast<size_t>(r.index) < n_args, "remote_accel: plan names argument ", r.index);
    if (r.kind == Result::kView) {
      r.sizes = fields[2].cast<std::vector<int64_t>>();
      r.strides = fields[3].cast<std::vector<int64_t>>();
      r.offset = fields[4].cast<int64_t>();
    }
  } else if (kind == "tensor") {
    r.kind = Result::kFresh;
    r.index = static_cast<int64_t>(n_fresh++);
    r.sizes = fields[1].cast<std::vector<int64_t>>();
    r.strides = fields[2].cast<std::vector<int64_t>>();
    r.dtype = fields[3].cast<at::ScalarType>();
  } else if (kind == "list") {
    r.kind = Result::kList;
    for (auto item : fields[1].cast<py::tuple>()) {
      r.items.push_back(parse_result(item, n_args, n_fresh));
    }
  } else {
    TORCH_CHECK(kind == "none", "remote_accel: unknown plan result kind ", kind);
  }
  return r;
}

// The plan Python made for this call, if it fits the call (checked, not trusted: a plan
// that does not fit is not kept).
std::shared_ptr<const Plan> parse_plan(py::handle value, const c10::FunctionSchema& schema, const Call& call) {
  const auto fields = value.cast<py::tuple>();
  auto plan = std::make_shared<Plan>();
  plan->id = fields[0].cast<int64_t>();
  plan->n_inputs = fields[1].cast<size_t>();
  for (auto spec : fields[2].cast<py::tuple>()) {
    auto result = parse_result(spec, schema.arguments().size(), plan->n_fresh);
    const auto i = plan->results.size();
    if (result.kind == Result::kNone && i < schema.returns().size() &&
        schema.returns()[i].real_type()->kind() == c10::TypeKind::TensorType) {
      result.kind = Result::kUndefined;
    }
    plan->results.push_back(std::move(result));
  }
  if (plan->results.size() != schema.returns().size() || plan->n_inputs != call.tensors.size()) {
    return nullptr;
  }
  for (const auto& t : call.tensors) {
    const bool scalar = t.is_cpu() && t.dim() == 0 && !t.is_conj() && !t.is_neg();
    const bool remote = t.device() == c10::Device(c10::DeviceType::PrivateUse1, call.device);
    if (!scalar && !remote) {
      return nullptr;
    }
  }
  return plan;
}

// Runs the op in Python; returns the plan it made for later calls with this key, if any.
std::shared_ptr<const Plan> run_in_python(const c10::OperatorHandle& op, torch::jit::Stack* stack, OpInfo& info,
                                          const Call* call) {
  const auto& schema = op.schema();
  const auto values = torch::jit::pop(*stack, schema.arguments().size());
  py::gil_scoped_acquire gil;
  TORCH_CHECK(g_slow_path != nullptr, "remote_accel: the op fallback is not installed; call remote_accel.init() first");
  auto [args, kwargs] = arguments_to_python(schema, values);
  const py::tuple answer = (*g_slow_path)(torch::detail::getTorchApiFunction(op), args, kwargs, call != nullptr);
  const py::object results = answer[0];
  const auto& returns = schema.returns();
  if (returns.size() == 1) {
    torch::jit::push(stack, torch::jit::toIValue(results, returns[0].real_type()));
  } else if (returns.size() > 1) {
    const auto sequence = results.cast<py::sequence>();
    for (size_t i = 0; i < returns.size(); ++i) {
      torch::jit::push(stack, torch::jit::toIValue(sequence[i], returns[i].real_type()));
    }
  }
  const py::object plan = answer[1];
  if (plan.is(py::bool_(false))) {
    info.never = true;
    return nullptr;
  }
  if (plan.is_none() || call == nullptr) {
    return nullptr;
  }
  return parse_plan(plan, schema, *call);
}

void op_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto& info = op_info(op);
  auto& p = plans();
  Call call;
  const bool keyed =
      !info.never && describe_call(info, torch::jit::last(*stack, op.schema().arguments().size()), call);
  if (keyed) {
    std::shared_ptr<const Plan> plan;
    {
      std::lock_guard<std::mutex> lock(p.mu);
      auto it = info.plans.find(call.key);
      if (it != info.plans.end()) {
        plan = it->second;
      }
    }
    if (plan && serve(op, stack, *plan, call)) {
      return;
    }
  }
  auto plan = run_in_python(op, stack, info, keyed ? &call : nullptr);
  if (plan) {
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.count >= kMaxPlans) {
      for (auto& [schema, other] : p.ops) {
        other->plans.clear();
      }
      p.count = 0;
    }
    if (info.plans.emplace(std::move(call.key), std::move(plan)).second) {
      ++p.count;
    }
  }
}

} // namespace

// ---------------------------------------------------------------------------------------

void install_op_fallback(py::function slow_path, py::function flush, int64_t alloc_type, int64_t run_planned_type,
                         int64_t max_items) {
  TORCH_CHECK(g_slow_path == nullptr, "remote_accel: the op fallback is already installed");
  TORCH_CHECK(max_items > 0, "remote_accel: max_items must be positive");
  // Leaked, with the registrations below: the fallback may run until interpreter exit.
  g_slow_path = new py::function(std::move(slow_path));
  g_flush = new py::function(std::move(flush));
  g_alloc_type = alloc_type;
  g_run_planned_type = run_planned_type;
  g_max_items = max_items;
  auto* every_op = new torch::Library(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
  every_op->fallback(torch::CppFunction::makeFromBoxedFunction<&op_fallback>());
  // These have a throwing default kernel, so the fallback never sees them unless named;
  // the server runs them as convolution(_backward). The norms have a generic
  // decomposition (CompositeExplicitAutograd) that would otherwise run here op by op, in
  // the input's precision: named, the server runs the fused kernel that CPU and CUDA run,
  // which accumulates float16/bfloat16 in float32.
  auto* named = new torch::Library(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__);
  for (const char* name : {"convolution_overrideable", "convolution_backward_overrideable", "native_layer_norm",
                           "native_group_norm"}) {
    named->impl(name, torch::CppFunction::makeFromBoxedFunction<&op_fallback>());
  }
}

namespace {
// Empties the queue; the caller holds q.mu.
void reset(Queue& q, bool open) {
  q.open = open;
  q.bytes.clear();
  q.requests = q.ops = 0;
}
} // namespace

void queue_open(c10::DeviceIndex device) {
  auto& q = queue(device);
  std::lock_guard<std::mutex> lock(q.mu);
  reset(q, true);
  q.announced.clear();  // a new server knows none of the old storages
}

void queue_close(c10::DeviceIndex device) {
  auto& q = queue(device);
  std::lock_guard<std::mutex> lock(q.mu);
  reset(q, false);
}

std::tuple<int64_t, int64_t, std::string> queue_take(c10::DeviceIndex device) {
  auto& q = queue(device);
  std::string bytes;
  std::lock_guard<std::mutex> lock(q.mu);
  bytes.swap(q.bytes);
  q.bytes.reserve(bytes.capacity());
  auto taken = std::make_tuple(q.requests, q.ops, std::move(bytes));
  q.requests = q.ops = 0;
  return taken;
}

uint64_t announce(const at::Tensor& t, c10::DeviceIndex device) {
  TORCH_CHECK_VALUE(t.device() == c10::Device(c10::DeviceType::PrivateUse1, device),
                    "remote_accel: expected a tensor on remote_accel:", static_cast<int>(device), ", got one on ",
                    t.device());
  const auto sid = sid_of(t);
  if (sid != 0) {
    auto& q = queue(device);
    std::lock_guard<std::mutex> lock(q.mu);
    if (q.open && q.announced.insert(sid).second) {
      put_alloc(q, sid, t.storage().nbytes());
    }
  }
  return sid;
}

uint64_t announce_output(const at::Tensor& t, c10::DeviceIndex device) {
  const auto sid = sid_of(t);
  if (sid != 0) {
    auto& q = queue(device);
    std::lock_guard<std::mutex> lock(q.mu);
    q.announced.insert(sid);
  }
  return sid;
}

std::vector<uint64_t> take_freed(c10::DeviceIndex device) {
  auto freed = drain_freed(device);
  auto& q = queue(device);
  std::lock_guard<std::mutex> lock(q.mu);
  std::erase_if(freed, [&](uint64_t sid) { return q.announced.erase(sid) == 0; });
  return freed;
}

std::tuple<int64_t, int64_t> plan_stats() {
  auto& p = plans();
  std::lock_guard<std::mutex> lock(p.mu);
  return {p.count, p.hits.load()};
}

void clear_plans() {
  auto& p = plans();
  std::lock_guard<std::mutex> lock(p.mu);
  for (auto& [schema, info] : p.ops) {
    info->plans.clear();
  }
  p.count = 0;
  p.hits = 0;
}

} // namespace remote_accel
