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
// disabled, or no memory, or no room): the caller then allocates as usual. `room`: the
// bytes the owner's memory limit leaves once this storage is counted; what the owner's
// blocks hold beyond their storages' bytes (its cached free blocks, and each live
// block's rounding up) stays within it (cached blocks are unmapped to make room).
std::optional<c10::Storage> host_storage(int64_t nbytes, uint64_t owner, int64_t room);

// Unmaps `owner`'s cached blocks until what its blocks hold beyond its storages' bytes
// fits in `room` (the owner's limit less the bytes it uses and is about to use).
void host_owner_fit(uint64_t owner, int64_t room);

// What `owner`'s blocks hold beyond its storages' bytes: cached free blocks plus each
// live block's rounding up. Counted against the owner's memory limit.
int64_t host_owner_extra(uint64_t owner);

}  // namespace remote_accel::server
