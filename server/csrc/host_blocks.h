// Pre-faulted, cached host memory for large CPU storages (host_blocks.cpp says why).
#pragma once

#include <c10/core/Storage.h>

#include <cstdint>
#include <optional>

namespace remote_accel::server {

// Blocks are reused only by the owner (a session's table) that freed them: a new
// storage must never show another client's bytes. Closing an owner unmaps its blocks.
uint64_t host_owner_open();
void host_owner_close(uint64_t owner);

// A CPU storage of `nbytes` over a cached block of `owner`, or nullopt (small, cache
// disabled, or no memory): the caller then allocates as usual.
std::optional<c10::Storage> host_storage(int64_t nbytes, uint64_t owner);

}  // namespace remote_accel::server
