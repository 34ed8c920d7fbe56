// torch.profiler's PrivateUse1 activities (profiler.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace remote_accel {

// start() opens a window on every server; stop() closes them and returns their events
// [(name, start_ns, end_ns, device index, is_kernel)] in this client's Unix time.
void set_profiler_hooks(pybind11::object start, pybind11::object stop);
// Whether this build registered the profiler (torch has PrivateUse1ProfilerRegistry).
bool profiler_available();

}  // namespace remote_accel
