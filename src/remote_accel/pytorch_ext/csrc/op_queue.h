// The op fallback and the per-device request queue it feeds.
//
// Every aten op on a remote_accel tensor without a kernel of its own reaches
// `op_fallback`. A training loop runs the same ops on the same argument layouts again
// and again, so the first call of each (op, argument metadata, scalar values) goes to
// Python (fallback.py), which infers the results on `meta`, queues the op as a RunOp
// that also defines a plan on the server, and hands C++ the plan: its id and how to make
// the results. Later calls with the same key are served in C++ without the GIL: results
// made from the plan, and a RunPlanned(id, storage ids and CPU scalar bytes) appended to
// the device's queue.
// Python's session drains that queue (`take`) into each Batch it sends, before anything
// it queues itself, so requests leave in the order they were made.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Device.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace remote_accel {

// Python's side of the fallback, installed once by fallback.register():
// slow_path(op, args, kwargs, want_plan) -> (results, plan or None or False),
// flush(device index); alloc_type, run_planned_type: the wire numbers of ALLOC and
// RUN_PLANNED requests; a batch leaves at first_items requests after one that left
// before it was full (a sync point), then at twice as many each time, up to max_items.
void install_op_fallback(pybind11::function slow_path, pybind11::function flush, int64_t alloc_type,
                         int64_t run_planned_type, int64_t first_items, int64_t max_items);

// `.item()` of a remote tensor: read_scalar(tensor) -> the element's bytes (one READ), or
// None for the fallback's general path. Registers the _local_scalar_dense kernel.
void install_scalar_read(pybind11::function read_scalar);

// A device's queue accepts requests between open (a session started: also forgets every
// storage the previous server knew) and close (the session ended or died).
void queue_open(c10::DeviceIndex device);
void queue_close(c10::DeviceIndex device);
// (requests, of which ops, their concatenated encodings) queued since the last take;
// with free_type >= 0 (the wire number of FREE) also one FreeStorage item of the ids
// take_freed() would return, after the rest: one call per batch instead of two.
std::tuple<int64_t, int64_t, std::string> queue_take(c10::DeviceIndex device, int64_t free_type = -1);

// The timer flush's wait, called without the GIL: true once an op is queued or
// queue_wake was called since the last take, or the queue is closed; false after
// timeout_s. Waiting takes nothing: only queue_take clears what it waits for.
bool queue_wait(c10::DeviceIndex device, double timeout_s);
// Wakes queue_wait until the next take: a request waits in Python's batch, or the
// session stops.
void queue_wake(c10::DeviceIndex device);

// The storage id of a remote argument, queueing ALLOC first if the server has not seen it.
uint64_t announce(const at::Tensor& t, c10::DeviceIndex device);
// The storage id of a fresh result: the server creates the storage when it binds it.
uint64_t announce_output(const at::Tensor& t, c10::DeviceIndex device);
// Ids of this device's storages freed since the last call that the server knows about.
std::vector<uint64_t> take_freed(c10::DeviceIndex device);
// (plans cached, calls served from them) since the last clear; clear_plans() forgets all.
std::tuple<int64_t, int64_t> plan_stats();
void clear_plans();

} // namespace remote_accel
