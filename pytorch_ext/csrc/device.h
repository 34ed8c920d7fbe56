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
#include <string>
#include <tuple>
#include <vector>

namespace remote_accel {

// Upper bound for set_device_count: default generators live in a fixed array so that
// the references handed to PyTorch stay valid.
constexpr int kMaxDevices = 64;

// The PrivateUse1 allocator (also installed with c10::SetAllocator).
c10::Allocator* allocator();

// Storage id of the allocation starting at ptr: 0 for nullptr; throws for a pointer
// this allocator did not hand out.
uint64_t storage_id(const void* ptr);
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

} // namespace remote_accel
