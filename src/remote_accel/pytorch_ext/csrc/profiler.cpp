// torch.profiler with ProfilerActivity.PrivateUse1: each server's own timeline of the ops
// and graphs it ran for this client, as the device's events beside the client's CPU events.
//
// A kineto activity profiler registered for PrivateUse1 (torch's
// PrivateUse1ProfilerRegistry, torch >= 2.10): kineto starts and stops it with every
// profiler that asks for PrivateUse1 activities. It calls back into Python
// (pytorch_ext/profiling.py), which opens and closes a window on each server and brings
// back its events in this client's Unix time; they are logged as CONCURRENT_KERNEL
// activities, which torch's profiler reports as device events of the PrivateUse1 backend
// (self_device_time_total, the trace's device rows).
#include "profiler.h"

#include <pybind11/stl.h>

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// The header declares its contents under USE_KINETO, which torch's own build defines; the
// types it names are kineto's interfaces (headers only) and a registry libtorch exports.
#ifndef USE_KINETO
#define USE_KINETO 1
#endif
#if __has_include(<torch/csrc/profiler/standalone/privateuse1_profiler.h>) && __has_include(<IActivityProfiler.h>)
#include <GenericTraceActivity.h>
#include <libkineto.h>  // CpuTraceBuffer, which getTraceBuffer()'s unique_ptr must see whole
#include <IActivityProfiler.h>
#include <TraceSpan.h>
#include <output_base.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#define RA_HAVE_KINETO_REGISTRY 1
#endif

namespace py = pybind11;

namespace remote_accel {
namespace {

// (start, stop) from Python: start() -> None; stop() -> [(name, start_ns, end_ns, device, is_kernel)]
std::mutex hooks_mu;
py::object* start_hook = nullptr;
py::object* stop_hook = nullptr;

}  // namespace

void set_profiler_hooks(py::object start, py::object stop) {
  std::lock_guard<std::mutex> lock(hooks_mu);
  // leaked on purpose: kineto may call them until the process ends, after Python's teardown began
  start_hook = new py::object(std::move(start));
  stop_hook = new py::object(std::move(stop));
}

bool profiler_available() {
#ifdef RA_HAVE_KINETO_REGISTRY
  return true;
#else
  return false;
#endif
}

#ifdef RA_HAVE_KINETO_REGISTRY
namespace {

struct ServerEvent {
  std::string name;
  int64_t start_ns, end_ns;
  int32_t device;
  bool kernel;
};

class RemoteSession final : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    call(start_hook, nullptr);
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    call(stop_hook, &events_);
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return errors_; }

  void processTrace(libkineto::ActivityLogger& logger) override {
    if (events_.empty()) {
      return;
    }
    int64_t first = events_.front().start_ns, last = events_.front().end_ns;
    for (const auto& e : events_) {
      first = std::min(first, e.start_ns);
      last = std::max(last, e.end_ns);
    }
    span_ = std::make_unique<libkineto::TraceSpan>(first, last, "remote_accel");
    int32_t id = 0;
    for (const auto& e : events_) {
      auto& a = activities_.emplace_back(*span_, libkineto::ActivityType::CONCURRENT_KERNEL,
                                         e.kernel ? e.name : "remote_accel: " + e.name);
      a.startTime = e.start_ns;
      a.endTime = e.end_ns;
      a.id = ++id;
      a.device = e.device;
      a.resource = e.kernel ? 1 : 0;  // a row for the server's ops, one for its device's kernels
      logger.handleGenericActivity(a);
    }
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override { return nullptr; }
  std::vector<libkineto::ResourceInfo> getResourceInfos() override { return {}; }
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return nullptr; }

 private:
  // Runs a hook under the GIL; a failure becomes one of errors(), never an exception
  // through kineto (the user's profiled code must not fail for want of device events).
  void call(py::object* hook, std::vector<ServerEvent>* out) {
    if (hook == nullptr || !Py_IsInitialized()) {
      return;
    }
    py::gil_scoped_acquire gil;
    try {
      py::object result = (*hook)();
      if (out == nullptr) {
        return;
      }
      for (auto item : result) {
        auto t = item.cast<py::tuple>();
        out->push_back(ServerEvent{t[0].cast<std::string>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(),
                                   t[3].cast<int32_t>(), t[4].cast<bool>()});
      }
    } catch (const std::exception& exc) {
      errors_.emplace_back(std::string("remote_accel: ") + exc.what());
    }
  }

  std::vector<ServerEvent> events_;
  std::vector<std::string> errors_;
  std::unique_ptr<libkineto::TraceSpan> span_;
  std::deque<libkineto::GenericTraceActivity> activities_;  // kineto keeps pointers to them
};

class RemoteProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<libkineto::ActivityType>& availableActivities() const override { return activities_; }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config&) override {
    if (!types.count(libkineto::ActivityType::CONCURRENT_KERNEL)) {
      return nullptr;
    }
    return std::make_unique<RemoteSession>();
  }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t, int64_t,
                                                                 const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"remote_accel"};
  std::set<libkineto::ActivityType> activities_{libkineto::ActivityType::CONCURRENT_KERNEL};
};

// kineto gets it when it starts (or at once if it already has)
REGISTER_PRIVATEUSE1_PROFILER(RemoteProfiler);

}  // namespace
#endif  // RA_HAVE_KINETO_REGISTRY

}  // namespace remote_accel
