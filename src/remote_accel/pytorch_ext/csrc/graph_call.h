// A compiled graph call's per-call RunGraph fields, encoded in C++ (graph_call.cpp).
#pragma once

#include <c10/core/ScalarType.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

namespace remote_accel {

// The encoded tuple of a call's input references: remote tensors of `device` in C++
// (ALLOC queued first for a storage the server has not seen), any other value as the
// bytes `other(value)` returns.
pybind11::bytes graph_inputs(const pybind11::sequence& inputs, int device, const pybind11::function& other);

// A graph's results, whose layouts are fixed when it is compiled: each call makes fresh
// handles for them and the encoded tuple of their references (RunGraph.outs).
class GraphResults {
 public:
  // specs: per result None, or (shape, stride, dtype name as torch_wire.values names it)
  explicit GraphResults(const pybind11::sequence& specs);
  // ([tensor or None per result], encoded outs)
  pybind11::tuple make(int device) const;

 private:
  struct Spec {
    bool present = false;
    std::vector<int64_t> sizes, strides;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
  };
  std::vector<Spec> specs_;
};

} // namespace remote_accel
