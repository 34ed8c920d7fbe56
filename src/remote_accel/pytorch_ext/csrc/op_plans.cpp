// The plan cache and the keys it is looked up by. A call's key holds the op's arguments,
// tensors by metadata and scalars by value (and the default dtype and the op's device),
// so that two calls with equal keys get results of equal metadata and encodings equal but
// for the storage ids and CPU scalars: the plan fallback.py made for the first serves the
// rest. Also the cache's statistics and its clearing for Python (op_queue.h).
#include "op_queue.h"
#include "op_queue_internal.h"

#include <c10/core/DefaultDtype.h>

#include <algorithm>

namespace remote_accel {
namespace detail {
namespace {

// ---------------------------------------------------------------------------------------
// Encoding: the few codec values (dataplane/codec.py) a queued request needs; keys.

template <class T>
void put_raw(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}

} // namespace

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
    // arange and range take their results' length from Scalar values: those stay keyed
    // (fallback.py's _scalar_arguments says the same)
    slot->seeded = op.hasTag(at::Tag::nondeterministic_seeded) &&
                   std::none_of(arguments.begin(), arguments.end(), [](const c10::Argument& a) {
                     auto type = a.real_type();
                     if (auto optional = type->cast<c10::OptionalType>()) {
                       type = optional->getElementType();
                     }
                     return type->kind() == c10::TypeKind::GeneratorType;
                   });
    for (size_t i = 0; i < arguments.size(); ++i) {
      const auto* alias = arguments[i].alias_info();
      slot->written.push_back((alias != nullptr && alias->isWrite()) ||
                              (i == 1 && schema.name() == "aten::_copy_from"));  // (self, dst): the server's copy_
    }
    const bool shape_from_scalars = schema.name() == "aten::arange" || schema.name() == "aten::range";
    for (const auto& argument : arguments) {
      if (shape_from_scalars) {
        slot->scalar.push_back(false);
        continue;
      }
      auto type = argument.real_type();
      if (auto optional = type->cast<c10::OptionalType>()) {
        type = optional->getElementType();
      }
      slot->scalar.push_back(type->kind() == c10::TypeKind::NumberType);
    }
  }
  return *slot;
}

namespace {

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

void collect_tensors(Call& call, const c10::IValue& v, bool written) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) {
      call.tensors.push_back(v.toTensor());
      call.written.push_back(written);
    }
  } else if (v.isList()) {
    for (const auto& item : v.toListRef()) {
      if (item.isTensor() && item.toTensor().defined()) {
        call.tensors.push_back(item.toTensor());
        call.written.push_back(written);
      }
    }
  }
}

} // namespace

std::vector<bool> passed_arguments(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> values) {
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
  std::vector<bool> passed(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    passed[i] = i < positional_end || (i >= keyword_start && !is_default(i));
  }
  return passed;
}

// False when some argument cannot be keyed: the call then always goes to Python.
bool describe_call(const OpInfo& info, const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                   Call& call) {
  call.key.reserve(256);
  // Plans hold dtypes that factories without a dtype argument took from the default.
  put_raw<int8_t>(call.key, static_cast<int8_t>(c10::typeMetaToScalarType(c10::get_default_dtype())));
  // Scalar arguments that Python is passed travel as values: only their kind is keyed
  // (it can change the results' dtype; the value cannot change their metadata).
  c10::SmallVector<bool, 8> hole(args.size(), false);
  std::vector<bool> passed;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& v = args[i];
    if (info.scalar[i] && (v.isDouble() || v.isInt() || v.isBool() || v.isComplexDouble())) {
      if (passed.empty()) {
        passed = passed_arguments(schema, args);
      }
      if (passed[i]) {
        hole[i] = true;
        call.key.push_back('S');
        call.key.push_back(v.isDouble() ? 'd' : v.isInt() ? 'i' : v.isBool() ? 'b' : 'c');
        continue;
      }
    }
    if (!key_value(call, v, false)) {
      return false;
    }
  }
  if (call.device < 0) {
    call.device = current_device();
  }
  put_raw<int8_t>(call.key, call.device);
  if (info.seeded) {
    const auto [id, seed, epoch] = generator_info(default_generator(call.device));
    put_raw<uint64_t>(call.key, seed);
    put_raw<uint64_t>(call.key, epoch);
  }
  for (size_t i : info.encoding_order) {
    if (hole[i]) {
      call.scalars.emplace_back(call.holes(), args[i].toScalar());
    } else {
      collect_tensors(call, args[i], info.written[i]);
    }
  }
  return true;
}

} // namespace detail

using namespace detail;

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
