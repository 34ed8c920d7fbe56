// A worker queue per remote_accel device index in PyTorch's autograd engine.
//
// The engine starts its device threads once per process, at the first backward(), with
// one ReadyQueue per index up to the largest deviceCount() that any non-CPU device guard
// reports at that moment (engine.cpp, Engine::start_device_threads). A backward that ran
// before remote_accel registered its guard leaves it none, and a later backward on
// remote_accel:0 fails in ready_queue() ("device_ready_queues_"). Nothing public grows
// them afterwards, so this appends queues and starts their threads as the engine does.
#include "device.h"

#include <torch/csrc/autograd/engine.h>

#include <mutex>
#include <thread>

namespace remote_accel {
namespace {

using torch::autograd::Engine;
using torch::autograd::ReadyQueue;

// A pointer to a protected member, taken inside a derived class, may be applied to any
// Engine: the standard way to reach it without changing PyTorch.
struct EngineAccess : Engine {
  static std::vector<std::shared_ptr<ReadyQueue>>& queues(Engine& engine) {
    return engine.*(&EngineAccess::device_ready_queues_);
  }
};

std::mutex g_mu;

} // namespace

void ensure_autograd_queues(int count) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& engine = Engine::get_default_engine();
  auto& queues = EngineAccess::queues(engine);
  // Growing the vector is safe only while no backward runs: callers do this at import
  // or init, before any remote_accel tensor exists (the engine reads it without a lock).
  for (int index = static_cast<int>(queues.size()); index < count; ++index) {
    auto queue = std::make_shared<ReadyQueue>();
    queues.push_back(queue);
    // thread_init is virtual: PythonEngine's version sets up the thread's Python state.
    std::thread worker(&Engine::thread_init, &engine, index, queue, true);
    worker.detach();
  }
}

} // namespace remote_accel
