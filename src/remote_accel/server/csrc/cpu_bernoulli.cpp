// bernoulli_(p) for CPU tensors with the numbers torch's own kernel gives, about 6x faster
// (benchmarks/bench_cpu_bernoulli.py).
//
// Why: dropout's mask is torch.bernoulli_ with a float p, and on CPUs that are not Intel's
// (and on builds without MKL) torch draws it one element at a time: a call into the
// generator for two MT19937 words, a double, a compare (templates::cpu::bernoulli_kernel,
// about 6 ns an element on this VM). The tiny Transformer's training step spends 1.2 ms
// of its 6 ms there, on the server as in a local process. Compiled graphs keep dropout
// as this eager kernel (Inductor's fallback_random) so that remote numbers equal local.
//
// How the numbers stay the same: each element takes the generator's next two 32-bit
// MT19937 words hi, lo (CPUGeneratorImpl::random64), u = (hi:lo & (2^53 - 1)) * 2^-53
// (uniform_real_distribution<double>), and is u < p (transformation::bernoulli). Here
// the words come in blocks straight from a copy of the engine's state, and u < p is
// the integer compare m < ceil(p * 2^53) (m is exact in a double and the scale is a
// power of two). The engine's state is written back, so the next draw continues where
// torch's kernel would have left it; tests compare both, element by element and state.
//
// Where torch takes another path the server keeps torch's kernel: Intel CPUs with MKL
// (torch's VSL kernel, other numbers, already parallel), non-contiguous or overlapping
// tensors (TensorIterator's element order), and every case torch rejects (its errors).
#include "cpu_bernoulli.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/ops/bernoulli_native.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#if defined(__x86_64__)
#define RA_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define RA_VECTOR_CLONES
#endif

namespace remote_accel::server {
namespace {

constexpr int kStateWords = at::MERSENNE_STATE_N;  // 624
constexpr int kShift = at::MERSENNE_STATE_M;       // 397

inline uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

inline uint32_t temper(uint32_t y) {
  y ^= (y >> 11);
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= (y >> 18);
  return y;
}

// at::mt19937's next_state, on the state's plain data.
RA_VECTOR_CLONES void regenerate(at::mt19937_data_pod& d) {
  uint32_t* s = d.state_.data();
  int k = 0;
  for (; k < kStateWords - kShift; ++k) s[k] = s[k + kShift] ^ twist(s[k], s[k + 1]);
  for (; k < kStateWords - 1; ++k) s[k] = s[k + kShift - kStateWords] ^ twist(s[k], s[k + 1]);
  s[kStateWords - 1] = s[kShift - 1] ^ twist(s[kStateWords - 1], s[0]);
  d.left_ = kStateWords;
  d.next_ = 0;
}

// The next n words that n calls of at::mt19937::operator() would return. That operator
// decrements left_ first and regenerates when it reaches 0, so left_ - 1 words are ready.
RA_VECTOR_CLONES void next_words(at::mt19937_data_pod& d, uint32_t* out, int64_t n) {
  while (n > 0) {
    if (d.left_ == 1) {
      regenerate(d);
      *out++ = temper(d.state_[d.next_++]);
      --n;
      continue;
    }
    const int64_t k = std::min<int64_t>(n, d.left_ - 1);
    const uint32_t* s = d.state_.data() + d.next_;
    for (int64_t i = 0; i < k; ++i) out[i] = temper(s[i]);
    d.next_ += static_cast<uint32_t>(k);
    d.left_ -= static_cast<int>(k);
    out += k;
    n -= k;
  }
}

// bits[i] = u_i < p, from the word pairs (hi, lo) of each element
RA_VECTOR_CLONES void below(const uint32_t* words, int64_t len, uint64_t threshold, uint8_t* bits) {
  for (int64_t i = 0; i < len; ++i) {
    const uint64_t m = (static_cast<uint64_t>(words[2 * i] & 0x1fffffu) << 32) | words[2 * i + 1];
    bits[i] = m < threshold;
  }
}

bool takes(const at::Tensor& self, double p) {
  if (!(0 <= p && p <= 1) || self.numel() == 0 || !self.is_contiguous()) return false;
  switch (self.scalar_type()) {  // the dtypes torch's kernel dispatches
    case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong:
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16: case at::kBool:
      return true;
    default:
      return false;
  }
}

// Swallows the dispatcher's "Overriding a previously registered kernel" warning: the
// server says what it did in its own log line.
struct QuietWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

torch::Library* g_library = nullptr;  // the registration, kept for the process's life

}  // namespace

at::Tensor& cpu_bernoulli_(at::Tensor& self, double p, std::optional<at::Generator> gen) {
  if (!takes(self, p)) return at::native::bernoulli_(self, p, std::move(gen));
  auto* generator = at::get_generator_or_default<at::CPUGeneratorImpl>(gen, at::detail::getDefaultCPUGenerator());
  const uint64_t threshold = static_cast<uint64_t>(std::ceil(std::ldexp(p, 53)));
  constexpr int64_t kChunk = 512;
  uint32_t words[2 * kChunk];
  uint8_t bits[kChunk];
  const int64_t n = self.numel();
  // See torch's Note [Acquire lock when using random generators]
  std::lock_guard<std::mutex> lock(generator->mutex_);
  at::mt19937 engine = generator->engine();
  at::mt19937_data_pod state = engine.data();
  AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kBFloat16, at::kHalf, self.scalar_type(), "bernoulli_scalar_cpu_", [&] {
    scalar_t* out = self.data_ptr<scalar_t>();
    for (int64_t base = 0; base < n; base += kChunk) {
      const int64_t len = std::min(kChunk, n - base);
      next_words(state, words, 2 * len);
      below(words, len, threshold, bits);
      for (int64_t i = 0; i < len; ++i) out[base + i] = static_cast<scalar_t>(static_cast<int>(bits[i]));
    }
  });
  engine.set_data(state);
  generator->set_engine(engine);
  return self;
}

bool cpu_bernoulli_installed() {
  return g_library != nullptr;
}

std::string install_cpu_bernoulli() {
#if defined(__x86_64__)
  if (at::hasMKL() && __builtin_cpu_is("intel")) return "";  // torch's MKL kernel: other numbers, already fast
#endif
  if (g_library == nullptr) {
    QuietWarnings quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    auto* library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__);
    library->impl("bernoulli_.float", TORCH_FN(cpu_bernoulli_));
    g_library = library;
  }
  return "bernoulli_(p) on CPU tensors: the server's block-wise kernel, torch's numbers";
}

}  // namespace remote_accel::server
