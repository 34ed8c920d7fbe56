// Declarations shared by the op fallback's parts, internal to the extension:
// op_queue.cpp holds the per-device queues, op_plans.cpp the plan cache and the call keys
// it is looked up by, op_serve.cpp the serving of a call from its plan (the RUN_PLANNED
// batch item it writes), and op_fallback.cpp the boxed fallback itself with Python's
// side. Nothing else includes this header; op_queue.h is the interface and says the design.
#pragma once

#include "codec.h"
#include "device.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <bit>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace remote_accel::detail {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian, and CPU scalars are copied as they lie in memory");

constexpr c10::DispatchKey kKey = c10::DispatchKey::PrivateUse1;

// Codec values (one definition for the client's writer and the server's reader).
using wire::put_bytes;
using wire::put_int;
using wire::put_tuple_header;

// ---------------------------------------------------------------------------------------
// Per-device queues

struct Queue {
  std::mutex mu;
  bool open = false;
  std::string bytes;  // encoded batch items, back to back
  int64_t requests = 0;
  int64_t ops = 0;
  // The batch leaves at `limit` requests. It starts small after a batch that left before
  // it was full (a sync point, the timer flush: the server has likely run out of work),
  // so that the server starts at once, and doubles with each full batch up to
  // g_max_items while the client keeps queueing (slow start: queue_take).
  int64_t limit = 1;  // set by reset() when the queue opens
  bool filled = false;  // this batch reached its limit
  std::unordered_set<uint64_t> announced;  // storage ids the server holds
  // The session's timer flush waits on `work` without the GIL (queue_wait) until an op is
  // queued here or `woken` is set (queue_wake: a request in Python's own batch, or the
  // session stopping; cleared by the next take): an idle session's flush thread sleeps
  // instead of waking every flush interval.
  std::condition_variable work;
  bool woken = false;
};

// The queue of a device index (checked).
Queue& queue(c10::DeviceIndex device);

// Wire numbers and the batch length, set once by install_op_fallback.
extern std::atomic<int64_t> g_alloc_type;
extern std::atomic<int64_t> g_run_planned_type;
extern std::atomic<int64_t> g_first_items;
extern std::atomic<int64_t> g_max_items;

// Queues ALLOC(sid, nbytes); the caller holds q.mu and checked q.open.
void put_alloc(Queue& q, uint64_t sid, size_t nbytes);
uint64_t sid_of(const at::Tensor& t);

// ---------------------------------------------------------------------------------------
// Plans (made by fallback.py's _native_plan)

struct Result {
  // kUndefined: an absent result where the schema says Tensor (convolution_backward's
  // unasked gradients), which the stack holds as an undefined tensor, not None
  enum Kind : uint8_t { kArgument, kView, kFresh, kNone, kUndefined, kList };
  Kind kind = kNone;
  int64_t index = -1;  // kArgument, kView: the argument's schema index; kFresh: its number
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;  // kView: from the argument's own storage offset
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<Result> items;  // kList
};

struct Plan {
  // The id under which the first call's RunOp defined this plan on the server: a served
  // call sends RunPlanned(id, values), values being per tensor argument (in encoding
  // order) its storage id or, for a CPU scalar, its bytes, then per fresh result its id.
  int64_t id = 0;
  std::vector<Result> results;  // one per schema return
  size_t n_inputs = 0;
  size_t n_fresh = 0;
};

struct OpInfo {
  std::atomic<bool> never{false};  // Python said this op is never served from a plan
  // Argument indices in the order fallback.py encodes them: positional, then keyword-only
  // by name (its kwargs are encoded sorted).
  std::vector<size_t> encoding_order;
  // By schema index: a Scalar (or Scalar?) argument, sent as a value (a hole of the plan,
  // not part of its key) whenever Python's slow path is passed it: a changing step size
  // then does not make a new plan every step.
  std::vector<bool> scalar;
  // By schema index: an argument the op writes (out=, in-place self; _copy_from's dst).
  // A storage the server has not seen that an op only writes needs no ALLOC: the server
  // makes it from the plan's layout (op_serve.cpp, server/csrc/executor.cpp).
  std::vector<bool> written;
  // Draws random numbers from the default stream without a generator argument
  // (native_dropout): the default generator's (seed, epoch) is keyed, so that a plan made
  // before a manual_seed never serves a call after it (the server reseeds at the RunOp
  // that makes the next plan, and each plan's calls draw on from there).
  bool seeded = false;
  std::unordered_map<std::string, std::shared_ptr<const Plan>> plans;
};

struct Plans {
  std::mutex mu;
  std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<OpInfo>> ops;
  int64_t count = 0;
  std::atomic<int64_t> hits{0};
};

// The plan cache (leaked, like the queues) and an op's entry in it, made on first use.
Plans& plans();
OpInfo& op_info(const c10::OperatorHandle& op);

// ---------------------------------------------------------------------------------------
// A call's key: the op's arguments, tensors by metadata and scalars by value. Two calls
// with equal keys get equal results' metadata and equal encodings but for the holes.

struct Call {
  std::string key;
  c10::DeviceIndex device = -1;  // the op's device, as fallback._device_index finds it
  c10::SmallVector<at::Tensor, 8> tensors;  // tensor arguments in encoding order
  c10::SmallVector<bool, 8> written;  // per tensor: its argument is written by the op
  // Scalar arguments sent as values: (the number of holes before it, its value)
  c10::SmallVector<std::pair<size_t, c10::Scalar>, 2> scalars;
  size_t holes() const { return tensors.size() + scalars.size(); }
};

// Which arguments Python's slow path is passed (fallback.py sees no others): all up to
// the trailing positional ones equal to their defaults, and keyword-only ones that are
// not equal to their defaults.
std::vector<bool> passed_arguments(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> values);

// False when some argument cannot be keyed: the call then always goes to Python.
bool describe_call(const OpInfo& info, const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                   Call& call);

// Queues the call from its plan and replaces the arguments on the stack with the
// results; false (stack untouched) when the device's queue is closed.
bool serve(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Plan& plan, const Call& call);

// Has Python send the device's queue (it reached max_items requests); takes the GIL.
void flush_device(c10::DeviceIndex device);

} // namespace remote_accel::detail
