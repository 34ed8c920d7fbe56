// Cached host memory for large `.cpu()` results (host_cache.cpp says why).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

namespace remote_accel {

// Results of at least this many bytes come from the cache.
constexpr size_t kHostCacheMin = 1 << 20;

struct HostCacheStats {
  int64_t cached_bytes;  // free blocks kept for the next result
  int64_t live_bytes;    // blocks held by live tensors
  int64_t limit_bytes;   // most bytes of free blocks kept (0: no caching)
  int64_t hits, misses, released;  // results served from the cache, blocks mapped, blocks unmapped
};
HostCacheStats host_cache_stats();
// Unmap every cached block; with `limit`, keep at most that many bytes from now on.
void host_cache_empty(std::optional<int64_t> limit);

}  // namespace remote_accel
