// The remote_accel device on the client: what lives in C++ and what Python may ask of it.
//
// A remote_accel tensor's storage is a handle: a 64-bit storage id plus a reserved (never
// readable) address range, so that ATen's pointer arithmetic and overlap checks work
// while the bytes themselves live on the server. This part gives PyTorch the pieces it
// cannot do without (an allocator, a device guard, hooks, a generator, and view kernels
// that never need the server); op_queue.h queues repeated ops; the transports and
// everything else that talks to the server are Python.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace remote_accel {

// Upper bound for set_device_count: default generators live in a fixed array so that
// the references handed to PyTorch stay valid.
constexpr int kMaxDevices = 64;

// The PrivateUse1 allocator (also installed with c10::SetAllocator).
c10::Allocator* allocator();

// Thrown for a storage of a session that was closed or lost; Python sees it as
// remote_accel's StaleTensorError (a RemoteAccelError).
struct StaleStorage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Storage id of the allocation starting at ptr: 0 for nullptr; throws for a pointer
// this allocator did not hand out, StaleStorage for one of an ended session.
uint64_t storage_id(const void* ptr);
// Device index of the storage starting at ptr; throws for any other pointer.
c10::DeviceIndex storage_device(void* ptr);
// Whether ptr is not a storage of an ended session (without throwing).
bool is_current(const void* ptr);
// The device's session closed or died: its storages become stale, its bytes uncounted.
void end_session(c10::DeviceIndex device);
// Bytes the current session may hold (0: no limit); allocations beyond it raise
// torch.OutOfMemoryError at once.
void set_memory_limit(c10::DeviceIndex device, int64_t limit);
// (bytes, peak bytes) of live storages of the device's current session.
std::tuple<int64_t, int64_t> memory_allocated(c10::DeviceIndex device);
void reset_peak(c10::DeviceIndex device);
// Give PyTorch's autograd engine a worker queue per remote_accel device index, even if
// its device threads started (at the process's first backward) before this device existed.
void ensure_autograd_queues(int count);
// Ids of storages of this device freed since the last call, oldest first.
std::vector<uint64_t> drain_freed(c10::DeviceIndex device);
// Allocations of this device still alive.
int64_t live_storages(c10::DeviceIndex device);

void set_device_count(int count);
c10::DeviceIndex device_count();
c10::DeviceIndex current_device();

const at::Generator& default_generator(c10::DeviceIndex device);
at::Generator new_generator(c10::DeviceIndex device);
// Reads and writes of a generator's state on the server, installed by Python once it has
// sessions; get/set receive (device, generator id, seed, epoch). Never freed.
struct GeneratorStateHooks {
  std::function<std::string(c10::DeviceIndex, uint64_t, uint64_t, uint64_t)> get;
  std::function<void(c10::DeviceIndex, uint64_t, uint64_t, uint64_t, const std::string&)> set;
};
void set_generator_state_hooks(GeneratorStateHooks* hooks);
// Id of a device's default generator (the server's stream 0), without taking its lock.
uint64_t default_generator_id(c10::DeviceIndex device);
// (generator id, seed, epoch) of a remote_accel generator; see device.cpp.
std::tuple<uint64_t, uint64_t, uint64_t> generator_info(const at::Generator& gen);

// What PyTorch's device-generic APIs ask of the device and only the server can answer:
// events on the server's timeline (torch.Event), waiting for the device
// (torch.accelerator.synchronize), its free and total memory (torch.accelerator's
// get_memory_info), releasing cached memory (torch.accelerator.empty_cache). Installed
// by Python when the device is registered; never freed. Each may raise (as a C++
// exception torch reports to the caller).
struct DeviceHooks {
  std::function<void(c10::DeviceIndex, uint64_t)> record_event;
  std::function<bool(c10::DeviceIndex, uint64_t)> query_event;
  std::function<void(c10::DeviceIndex, uint64_t)> synchronize_event;
  std::function<double(c10::DeviceIndex, uint64_t, uint64_t)> elapsed_ms;
  std::function<void(c10::DeviceIndex)> synchronize_device;
  std::function<std::pair<size_t, size_t>(c10::DeviceIndex)> memory_info;  // (free, total) bytes
  std::function<void()> empty_cache;
};
void set_device_hooks(DeviceHooks* hooks);
DeviceHooks* device_hooks();  // nullptr until Python installed them

// Allocation counters of a device's current session, as torch's DeviceStats counts them.
struct AllocationCounts {
  int64_t bytes, peak_bytes, allocated_bytes, freed_bytes;  // allocated/freed: cumulative
  int64_t count, peak_count, allocated_count, freed_count;
};
AllocationCounts allocation_counts(c10::DeviceIndex device);
void reset_accumulated(c10::DeviceIndex device);

// Pinned host memory for remote_accel (tensor.pin_memory(), DataLoader(pin_memory=True)):
// host_cache.cpp. is_pinned_ptr: whether ptr lies in memory that allocator handed out.
c10::Allocator* pinned_allocator();
bool is_pinned_ptr(const void* ptr);

} // namespace remote_accel
