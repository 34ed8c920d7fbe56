// keep_freed_heap (host_malloc.h): why a server keeps its freed heap memory, and the
// values it uses, are in server/heap.py.
#include "host_malloc.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace remote_accel::server {

bool keep_freed_heap(size_t mmap_below, size_t keep_free) {
#if defined(__GLIBC__)
  // Setting either one turns glibc's own adjustment of both off, so both are set.
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_below)) == 1 &&
         mallopt(M_TRIM_THRESHOLD, static_cast<int>(keep_free)) == 1;
#else
  (void)mmap_below;
  (void)keep_free;
  return false;
#endif
}

}  // namespace remote_accel::server
