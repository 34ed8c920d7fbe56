// Running one planned op: fill the plan's argument stack from the RunPlanned values,
// call the op boxed, bind its results (server/executor.py's run_op and _bind, in C++).
#include "native.h"

#include <ATen/ops/_neg_view.h>
#include <ATen/ops/empty.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <new>
#include <unordered_set>

namespace remote_accel::server {
namespace {

constexpr int kFlagConj = 1, kFlagNeg = 2;
constexpr size_t kMaxFailed = size_t{1} << 16;

std::string shape_text(c10::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    s += std::to_string(sizes[i]);
    s += sizes.size() == 1 ? "," : (i + 1 < sizes.size() ? ", " : "");
  }
  return s + ")";
}

// An op's own exception, as the Python class PyTorch would raise it as.
Error op_error(const std::string& op) {
  auto make = [&](const char* type, const std::string& what) { return Error{"exception", type, what}; };
  try {
    throw;
  } catch (const ErrorThrown& e) {
    return e.error;
  } catch (const c10::OutOfMemoryError& e) {
    return make("OutOfMemoryError", e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    return make("IndexError", e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    return make("ValueError", e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    return make("TypeError", e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    return make("NotImplementedError", e.what_without_backtrace());
  } catch (const c10::LinAlgError& e) {
    return make("LinAlgError", e.what_without_backtrace());
  } catch (const c10::Error& e) {
    return make("RuntimeError", e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return make("MemoryError", "out of memory running " + op);
  } catch (const std::exception& e) {
    return make("RuntimeError", e.what());
  }
}

// A Scalar argument from its bytes (torch_wire/values.py scalar_value).
c10::IValue scalar_value(c10::ScalarType dtype, std::string_view bytes) {
  const auto need = dtype == at::kBool ? 1u : dtype == at::kComplexDouble ? 16u : 8u;
  if (bytes.size() != need) {
    fail("protocol", "a " + std::string(c10::toString(dtype)) + " scalar has " + std::to_string(need) +
                         " bytes, RunPlanned gave " + std::to_string(bytes.size()));
  }
  switch (dtype) {
    case at::kDouble: {
      double v;
      std::memcpy(&v, bytes.data(), 8);
      return v;
    }
    case at::kLong: {
      int64_t v;
      std::memcpy(&v, bytes.data(), 8);
      return v;
    }
    case at::kBool:
      return bytes[0] != 0;
    default: {
      double v[2];
      std::memcpy(v, bytes.data(), 16);
      return c10::complex<double>(v[0], v[1]);
    }
  }
}

}  // namespace

at::Tensor Executor::view(const c10::Storage& storage, const Layout& layout) const {
  // What StorageTable.tensor does with empty(0).set_(...), without the dispatcher round trips.
  const auto keys = c10::DispatchKeySet(c10::computeDispatchKey(layout.dtype, c10::kStrided, storage.device()));
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), keys,
                                                    c10::scalarTypeToTypeMeta(layout.dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(layout.sizes, layout.strides, layout.offset);
  if (layout.flags & kFlagConj) {
    t = t.conj();
  }
  if (layout.flags & kFlagNeg) {
    t = at::_neg_view(t);
  }
  return t;
}

const c10::Storage& Executor::input(int64_t sid, const Layout& layout, c10::Storage& scratch) {
  const c10::Storage* storage;
  if (sid == 0) {
    // a fresh one each time: an op that resizes its output must not grow a shared one
    scratch = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(table_.device())).storage();
    storage = &scratch;
  } else {
    storage = table_.resident(sid);  // pinned until the op is done (run)
    if (storage == nullptr) {
      fail("bad_handle", failed(sid) ? "storage " + std::to_string(sid) + " does not exist: the op that made it failed"
                                     : "unknown storage " + std::to_string(sid));
    }
  }
  if (layout.span > static_cast<int64_t>(storage->nbytes())) {
    fail("bad_handle", "view " + shape_text(layout.sizes) + "/" + shape_text(layout.strides) + "+" +
                           std::to_string(layout.offset) + " of " + c10::toString(layout.dtype) + " needs " +
                           std::to_string(layout.span) + " bytes, storage " + std::to_string(sid) + " has " +
                           std::to_string(storage->nbytes()));
  }
  return *storage;
}

void Executor::mark_failed(int64_t sid) {
  if (failed_.size() > kMaxFailed) {
    failed_.clear();
  }
  if (sid != 0) {  // storage 0 is every empty tensor's: it never fails
    failed_.insert(sid);
  }
}

void Executor::run(int64_t plan, const std::vector<Value>& values) {
  const auto found = plans_.find(plan);
  if (found == plans_.end()) {
    fail("protocol", "plan " + std::to_string(plan) + " was never defined by a RunOp of this session");
  }
  const auto keep = found->second;  // the plan may be dropped while it runs (it is not, but cheaply safe)
  const Template& t = *keep;
  if (values.size() != t.holes.size()) {
    fail("protocol", "plan " + std::to_string(plan) + " has " + std::to_string(t.holes.size()) +
                         " holes, RunPlanned gave " + std::to_string(values.size()) + " values");
  }
  std::vector<int64_t> out_sids;
  for (size_t i = 0; i < values.size(); ++i) {
    const bool bytes = t.holes[i].kind == Hole::kCpu || t.holes[i].kind == Hole::kScalar;
    if (values[i].other || values[i].is_bytes != bytes) {
      fail("protocol", t.holes[i].kind == Hole::kScalar ? "a RunPlanned value for a scalar must be bytes"
                       : bytes                           ? "a RunPlanned value for a CPU tensor must be bytes"
                                                         : "a RunPlanned value for a tensor reference must be a storage id");
    }
    if (t.holes[i].kind == Hole::kOut) {
      out_sids.push_back(values[i].sid);
    }
  }

  std::vector<int64_t> touched;
  struct Unpin {  // the op's storages may be swapped out again once it is done
    Table& table;
    size_t mark;
    ~Unpin() { table.unpin(mark); }
  } unpin{table_, table_.pin_mark()};
  try {
    std::vector<c10::IValue> stack = t.stack;
    for (const auto slot : t.list_slots) {
      stack[slot] = c10::IValue(stack[slot].toList().copy());
    }
    int64_t need = 0;
    c10::Storage scratch;
    for (size_t i = 0; i < values.size(); ++i) {
      const Hole& hole = t.holes[i];
      at::Tensor tensor;
      if (hole.kind == Hole::kTensor) {
        const auto sid = values[i].sid;
        if (hole.written && sid != 0 && !table_.contains(sid) && !failed(sid)) {
          table_.alloc(sid, hole.layout.span);  // a storage the op makes (Hole::written)
          storages_made_.store(storages_made() + 1, std::memory_order_relaxed);
        }
        touched.push_back(values[i].sid);
        tensor = view(input(values[i].sid, hole.layout, scratch), hole.layout);
      } else if (hole.kind == Hole::kScalar) {
        stack[hole.slot] = scalar_value(hole.layout.dtype, values[i].bytes);
        continue;
      } else if (hole.kind == Hole::kCpu) {
        const auto& bytes = values[i].bytes;
        if (hole.scratch.defined() && hole.scratch.use_count() == 1 && hole.scratch.storage().use_count() == 1) {
          tensor = hole.scratch;
        } else {
          tensor = at::empty(hole.layout.sizes, at::TensorOptions().dtype(hole.layout.dtype));
          hole.scratch = tensor;
        }
        if (bytes.size() != tensor.nbytes()) {
          fail("protocol", "inline tensor has " + std::to_string(bytes.size()) + " bytes, shape " +
                               shape_text(hole.layout.sizes) + " needs " + std::to_string(tensor.nbytes()));
        }
        if (!bytes.empty()) {
          std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
        }
      } else {
        if (!table_.contains(values[i].sid)) {
          need += hole.layout.span;
        } else {
          table_.resident(values[i].sid);  // written into: on the device, pinned
        }
        continue;
      }
      if (hole.item < 0) {
        stack[hole.slot] = std::move(tensor);
      } else {
        stack[hole.slot].toList().set(hole.item, std::move(tensor));
      }
    }
    table_.check_fits(need);  // refuse, before running, outputs over the limit
    table_.room(need);
    if (t.seeded) {
      call_seeded(t, stack);
    } else {
      t.op.callBoxed(stack);
    }
    ops_done_.store(ops_done_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);  // one writer
    bind(t, stack, out_sids, touched);
  } catch (...) {
    auto error = op_error(t.name);
    error.op = t.name;
    for (const auto sid : out_sids) {
      mark_failed(sid);
    }
    try {
      table_.resync(touched.data(), touched.size());
    } catch (const ErrorThrown&) {
      // the op's own error is the one to report
    }
    throw ErrorThrown{std::move(error)};
  }
  table_.resync(touched.data(), touched.size());
}

std::mutex& default_generator_mutex() {
  static auto* mu = new std::mutex();  // leaked: sessions may run during interpreter exit
  return *mu;
}

namespace {
c10::intrusive_ptr<c10::TensorImpl> state_of(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state().getIntrusivePtr();
}
void set_state_of(at::Generator& gen, const c10::intrusive_ptr<c10::TensorImpl>& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(at::Tensor(state));
}
}  // namespace

void Executor::call_seeded(const Template& t, std::vector<c10::IValue>& stack) {
  if (!has_generators()) {
    fail("protocol", t.name + " draws random numbers, and this session has no generator for it");
  }
  std::lock_guard<std::mutex> lock(default_generator_mutex());
  const auto saved = state_of(shared_generator_);
  set_state_of(shared_generator_, state_of(own_generator_));
  struct Restore {  // also when the op throws, as as_device_default's finally does
    Executor& self;
    const c10::intrusive_ptr<c10::TensorImpl>& saved;
    ~Restore() {
      set_state_of(self.own_generator_, state_of(self.shared_generator_));
      set_state_of(self.shared_generator_, saved);
    }
  } restore{*this, saved};
  t.op.callBoxed(stack);
}

void Executor::bind(const Template& t, std::vector<c10::IValue>& results, const std::vector<int64_t>& out_sids,
                    const std::vector<int64_t>& touched) {
  // Results numbered as RunOp.outs: Tensor[] returns expanded in place.
  std::vector<c10::IValue> flat;
  for (auto& r : results) {
    if (r.isList()) {
      for (const auto& item : r.toListRef()) {
        flat.push_back(item);
      }
    } else {
      flat.push_back(std::move(r));
    }
  }
  if (t.n_outs > flat.size()) {
    fail("op", "the op returned " + std::to_string(flat.size()) + " results, the client expects " +
                   std::to_string(t.n_outs));
  }
  std::vector<Placement> places;
  size_t k = 0;
  for (const auto& hole : t.holes) {
    if (hole.kind == Hole::kOut) {
      places.push_back({static_cast<size_t>(hole.out), out_sids[k++], &hole.layout});
    }
  }
  place(flat, places, touched);
}

void Executor::place(const std::vector<c10::IValue>& results, const std::vector<Placement>& places,
                     const std::vector<int64_t>& touched) {
  std::unordered_set<const void*> inputs, taken;
  for (const auto sid : touched) {
    if (const auto* s = table_.find(sid)) {
      inputs.insert(s->data());
    }
  }
  for (const auto& p : places) {
    const auto sid = p.sid;
    const auto& ref = *p.layout;
    const auto& value = results[p.result];
    if (!value.isTensor() || !value.toTensor().defined()) {
      fail("op", "result " + std::to_string(p.result) + " is " +
                     (value.isNone() || value.isTensor() ? "NoneType" : value.tagKind()) + ", the client expects a tensor");
    }
    const auto& result = value.toTensor();
    if (result.sizes() != c10::IntArrayRef(ref.sizes)) {
      fail("op", "result " + std::to_string(p.result) + " has shape " + shape_text(result.sizes()) +
                     ", the client expects " + shape_text(ref.sizes));
    }
    if (sid == 0 && ref.span == 0) {
      continue;  // an empty tensor: no bytes to keep
    }
    const auto& storage = result.storage();
    const void* ptr = storage.data();
    const bool exact = result.device() == table_.device() && result.scalar_type() == ref.dtype &&
                       result.strides() == c10::IntArrayRef(ref.strides) && result.storage_offset() == ref.offset &&
                       ref.flags == 0 && !result.is_conj() && !result.is_neg();
    const auto* existing = table_.find(sid);
    if (existing != nullptr && exact && existing->data() == ptr) {
      continue;  // the result already is that view (out= variants)
    }
    const auto nbytes = static_cast<int64_t>(storage.nbytes());
    // Swap the kernel's fresh storage in rather than copy (see executor.py's _bind).
    if (exact && !taken.count(ptr) && !inputs.count(ptr) && nbytes > 0 &&
        nbytes == (existing == nullptr ? ref.span : static_cast<int64_t>(existing->nbytes())) &&
        (existing == nullptr || !inputs.count(existing->data()))) {
      taken.insert(ptr);
      table_.put(sid, storage, true);
      continue;
    }
    if (existing == nullptr) {
      table_.alloc(sid, ref.span);
    }
    c10::Storage unused;
    view(input(sid, ref, unused), ref).copy_(result);
  }
}

const c10::Storage* Executor::host_storage(int64_t sid, int64_t offset, int64_t nbytes) {
  if (table_.device().type() != c10::DeviceType::CPU || sid == 0 || offset < 0 || nbytes < 0) return nullptr;
  const c10::Storage* storage = nullptr;
  try {
    storage = table_.resident(sid);
  } catch (...) {
    return nullptr;  // e.g. a swap-in that failed: Python's path raises it again
  }
  if (storage == nullptr || offset > static_cast<int64_t>(storage->nbytes()) - nbytes) return nullptr;
  return storage;
}

}  // namespace remote_accel::server
