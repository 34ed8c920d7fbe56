// Cached host memory for large `.cpu()` results (host_cache.cpp says why).
#pragma once

#include "host_blocks.h"

#include <cstddef>
#include <cstdint>
#include <optional>

namespace remote_accel {

// Results of at least this many bytes come from the cache.
constexpr size_t kHostCacheMin = host_blocks::kMinBytes;

using HostCacheStats = host_blocks::Stats;
HostCacheStats host_cache_stats();
// Unmap every cached block; with `limit`, keep at most that many bytes from now on.
void host_cache_empty(std::optional<int64_t> limit);

}  // namespace remote_accel
