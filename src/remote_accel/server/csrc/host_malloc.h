// How much freed memory the server process's malloc keeps for its next allocations.
#pragma once

#include <cstddef>

namespace remote_accel::server {

// Have malloc serve requests below `mmap_below` bytes from its heaps, and keep up to
// `keep_free` bytes free at the top of each heap before it hands pages back to the
// kernel. False where the C library has no such settings (not glibc) or refused them.
bool keep_freed_heap(size_t mmap_below, size_t keep_free);

}  // namespace remote_accel::server
