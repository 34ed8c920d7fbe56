// The boxed op fallback every aten op on a remote_accel tensor without a kernel of its own
// reaches, and Python's side of it: a call whose key has a cached plan is served in C++
// (op_serve.cpp); any other goes to Python's slow path (fallback.py) with its arguments
// as PyTorch's own Python fallback passes them, and the plan Python makes for it, checked,
// is cached for the calls after. See op_queue.h for the design.
#include "op_queue.h"
#include "op_queue_internal.h"

#include <ATen/Dispatch.h>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include <vector>

namespace py = pybind11;

namespace remote_accel {
namespace detail {
namespace {

// Plans kept before the cache starts over (a loop uses a few hundred).
constexpr int64_t kMaxPlans = 1 << 14;


py::function* g_slow_path = nullptr;
py::function* g_flush = nullptr;
} // namespace


void flush_device(c10::DeviceIndex device) {
  py::gil_scoped_acquire gil;
  (*g_flush)(static_cast<int>(device));
}
namespace {

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
  const auto passed = passed_arguments(schema, values);
  size_t positional_end = 0;
  while (positional_end < values.size() && !arguments[positional_end].kwarg_only() && passed[positional_end]) {
    ++positional_end;
  }
  py::tuple args(positional_end);
  for (size_t i = 0; i < positional_end; ++i) {
    args[i] = argument_to_python(arguments[i], values[i]);
  }
  py::dict kwargs;
  for (size_t i = positional_end; i < values.size(); ++i) {
    if (passed[i] && arguments[i].kwarg_only()) {
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
  if (plan->results.size() != schema.returns().size() || plan->n_inputs != call.holes()) {
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
      !info.never && describe_call(info, op.schema(), torch::jit::last(*stack, op.schema().arguments().size()), call);
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

// A structured op's functional and in-place variants (add.Tensor, add_.Tensor) have a
// CompositeExplicitAutogradNonFunctional kernel that a backend without its own kernel
// gets: it infers the result's meta, allocates it (empty) and calls the out= variant.
// Here that would be three queued messages per op (an ALLOC, the add.out, later a FREE)
// and a server that runs add.out into a tensor it was sent, where the op itself gives
// one planned message and lets the server allocate as its device likes. So every aten
// op with such a kernel and none of ours goes to the fallback as it is. In-place view
// ops (as_strided_) stay with theirs: they only change the tensor's metadata here.
void route_structured_ops_to_fallback(torch::Library& library) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    const auto op = dispatcher.findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) || op->hasTag(at::Tag::inplace_view)) {
      continue;
    }
    auto qualified = name.name.substr(6);
    if (!name.overload_name.empty()) {
      qualified += "." + name.overload_name;
    }
    library.impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&op_fallback>());
  }
}

// `.item()` (_local_scalar_dense): every training step's loss.item() and every generated
// token's stop check. The element's bytes come from Python's read_scalar (one READ; None
// where it cannot say), unpacked here as the CPU kernel does; anything else (a sparse or
// conjugate view, a dtype not listed) takes the fallback's general path. Through the
// boxed fallback the call cost about 4 us of argument conversion and dispatch in Python.
py::function* g_read_scalar = nullptr;

at::Scalar local_scalar_dense(const at::Tensor& self) {
  if (self.numel() == 1 && self.layout() == at::kStrided && !self.is_conj() && !self.is_neg()) {
    const auto dtype = self.scalar_type();
    std::optional<at::Scalar> value;
    {
      py::gil_scoped_acquire gil;
      const py::object data = (*g_read_scalar)(self);
      if (!data.is_none()) {
        const py::buffer_info bytes = py::buffer(data).request();
        TORCH_CHECK(bytes.size * bytes.itemsize == static_cast<py::ssize_t>(self.element_size()),
                    "remote_accel: a scalar read returned ", bytes.size * bytes.itemsize, " bytes, not ",
                    self.element_size());
        AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(at::kHalf, at::kBool, at::kBFloat16, dtype, "item", [&] {
          scalar_t element;
          std::memcpy(&element, bytes.ptr, sizeof(element));
          value = at::Scalar(element);
        });
      }
    }
    if (value) return *value;
  }
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::_local_scalar_dense", "");
  torch::jit::Stack stack{self};
  op_fallback(op, &stack);
  return stack.back().toScalar();
}

} // namespace

} // namespace detail

using namespace detail;

namespace {

// A registration for the process's life: its Library is never destroyed (that would take
// the kernels away while the dispatcher may still call them). Kept where a leak check
// sees it held, not dropped: ./quickstart.sh sanitize reported each dropped one as a leak.
torch::Library* registered(torch::Library* library) {
  static auto* kept = new std::vector<torch::Library*>();  // never destroyed either
  kept->push_back(library);
  return library;
}

} // namespace

void install_scalar_read(py::function read_scalar) {
  TORCH_CHECK(g_read_scalar == nullptr, "remote_accel: the scalar read is already installed");
  g_read_scalar = new py::function(std::move(read_scalar));  // leaked, as the fallback's
  auto* library = registered(new torch::Library(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__));
  library->impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
}

// ---------------------------------------------------------------------------------------

void install_op_fallback(py::function slow_path, py::function flush, int64_t alloc_type, int64_t run_planned_type,
                         int64_t first_items, int64_t max_items) {
  TORCH_CHECK(g_slow_path == nullptr, "remote_accel: the op fallback is already installed");
  TORCH_CHECK(first_items > 0 && first_items <= max_items,
              "remote_accel: need 0 < first_items <= max_items");
  // Leaked, with the registrations below: the fallback may run until interpreter exit.
  g_slow_path = new py::function(std::move(slow_path));
  g_flush = new py::function(std::move(flush));
  g_alloc_type = alloc_type;
  g_run_planned_type = run_planned_type;
  g_first_items = first_items;
  g_max_items = max_items;
  auto* every_op = registered(new torch::Library(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__));
  every_op->fallback(torch::CppFunction::makeFromBoxedFunction<&op_fallback>());
  // These have a throwing default kernel, so the fallback never sees them unless named;
  // the server runs them as convolution(_backward). The norms have a generic
  // decomposition (CompositeExplicitAutograd) that would otherwise run here op by op, in
  // the input's precision: named, the server runs the fused kernel that CPU and CUDA run,
  // which accumulates float16/bfloat16 in float32.
  auto* named = registered(new torch::Library(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__));
  for (const char* name : {"convolution_overrideable", "convolution_backward_overrideable", "native_layer_norm",
                           "native_group_norm", "arange", "arange.start", "arange.start_step"}) {
    named->impl(name, torch::CppFunction::makeFromBoxedFunction<&op_fallback>());
  }
  route_structured_ops_to_fallback(*named);
}

} // namespace remote_accel
