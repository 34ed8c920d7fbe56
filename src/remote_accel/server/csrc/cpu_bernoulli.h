// bernoulli_(p) for CPU tensors with torch's numbers, faster (cpu_bernoulli.cpp says how).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace remote_accel::server {

// The kernel itself, whether or not it is installed (tests compare it with torch's).
at::Tensor& cpu_bernoulli_(at::Tensor& self, double p, std::optional<at::Generator> gen);

// Make it aten::bernoulli_.float's CPU kernel in this process; what was done ("" where
// torch's own kernel stays: Intel CPUs with MKL, where torch draws other numbers).
std::string install_cpu_bernoulli();
// Whether install_cpu_bernoulli installed it.
bool cpu_bernoulli_installed();

}  // namespace remote_accel::server
