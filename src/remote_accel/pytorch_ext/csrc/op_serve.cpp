// Serving a call from its cached plan, in C++ and without the GIL: the results made as the
// plan says (arguments, views of them, fresh tensors), and the RUN_PLANNED batch item
// (plan id, then per tensor or Scalar argument its storage id or bytes, then per fresh
// result its id) appended to the device's queue, with an ALLOC first for each storage the
// server has not seen, unless the op writes it whole (the server then makes it). The plans
// themselves are made in Python (fallback.py).
#include "op_queue_internal.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/as_strided_native.h>
#include <c10/core/DeviceGuard.h>

namespace remote_accel::detail {
namespace {

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

// Whether `t` reaches exactly the whole of its storage. A storage the server has not seen
// that an op writes first (an out= result, a factory's fill_) is made by the server from
// the plan's layout of `t`, so it needs no ALLOC only when that layout spans all of it.
bool spans_storage(const at::Tensor& t) {
  int64_t span = 0;
  if (t.numel() != 0) {
    span = t.storage_offset() + 1;
    for (int64_t d = 0; d < t.dim(); ++d) {
      span += (t.size(d) - 1) * t.stride(d);
    }
    span *= static_cast<int64_t>(t.element_size());
  }
  return span == static_cast<int64_t>(t.storage().nbytes());
}

// A Scalar argument's value, as torch_wire/values.py's scalar_value packs it.
void put_scalar(std::string& out, const c10::Scalar& s) {
  if (s.isComplex()) {
    const auto c = s.toComplexDouble();
    const double parts[2] = {c.real(), c.imag()};
    put_bytes(out, parts, sizeof parts);
  } else if (s.isFloatingPoint()) {
    const double v = s.toDouble();
    put_bytes(out, &v, sizeof v);
  } else if (s.isBoolean()) {
    const uint8_t v = s.toBool() ? 1 : 0;
    put_bytes(out, &v, 1);
  } else {
    const int64_t v = s.toLong();
    put_bytes(out, &v, sizeof v);
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
} // namespace


// Queues the call from its plan and replaces the arguments on the stack with the
// results; false (stack untouched) when the device's queue is closed.
bool serve(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Plan& plan, const Call& call) {
  for (const auto& t : call.tensors) {
    if (!t.is_cpu() && !is_current(t.storage().data())) {
      return false;  // a tensor of an ended session: Python raises StaleTensorError
    }
  }
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
  bool first = false;  // the first op since the last take: wakes the timer flush
  {
    std::lock_guard<std::mutex> lock(q.mu);
    if (!q.open) {
      return false;  // Python raises the session's error
    }
    first = q.ops == 0;
    for (size_t i = 0; i < call.tensors.size(); ++i) {
      const auto sid = input_sids[i];
      if (sid != 0 && q.announced.insert(sid).second && !(call.written[i] && spans_storage(call.tensors[i]))) {
        put_alloc(q, sid, call.tensors[i].storage().nbytes());
      }
    }
    // the batch item (RUN_PLANNED, (plan id, values))
    auto& out = q.bytes;
    put_tuple_header(out, 2);
    put_int(out, g_run_planned_type.load(std::memory_order_relaxed));
    put_tuple_header(out, 2);
    put_int(out, plan.id);
    put_tuple_header(out, static_cast<uint32_t>(call.holes() + fresh_sids.size()));
    size_t scalar = 0;  // scalars go where they were met among the tensors
    for (size_t i = 0; i <= call.tensors.size(); ++i) {
      for (; scalar < call.scalars.size() && call.scalars[scalar].first == i + scalar; ++scalar) {
        put_scalar(out, call.scalars[scalar].second);
      }
      if (i == call.tensors.size()) {
        break;
      }
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
    full = q.requests >= q.limit;
    q.filled = q.filled || full;
  }
  if (first) {
    q.work.notify_one();
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

} // namespace remote_accel::detail
