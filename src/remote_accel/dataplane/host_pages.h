// Pre-faulted host memory, for the caches of large CPU buffers on both sides of the wire
// (host_blocks.cpp).
//
// Fresh anonymous memory is untouched: the first write to each 4 KiB page faults and
// the kernel zeroes it, which makes receiving into fresh memory 4-5x slower than into
// touched memory. A block mapped here was populated once, in one call.
//
// It does not ask for huge pages (MADV_HUGEPAGE): under THP's default defrag policy
// ("madvise", Debian's) a fault in such a region compacts memory synchronously when no
// free 2 MiB page is at hand. Populating 256 MiB took 30 ms on huge pages but 627 ms once
// in four tries on the VM, and a session's second 256 MiB upload ran at 0.3 GB/s against
// 2.6 for the rest; on 4 KiB pages it takes 58-70 ms every time. Where THP is "always" the
// kernel still backs the block with huge pages it has free, without stalling for them.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace remote_accel {

constexpr size_t kHugePage = 2 << 20;

// `size` bytes (a multiple of kHugePage) on a 2 MiB boundary, every page faulted in;
// nullptr when the system has no memory for it. Free with munmap(ptr, size).
inline void* map_prefaulted(size_t size) {
  // Reserve one huge page more to place the block on a 2 MiB boundary (where THP is
  // "always", the kernel backs aligned ranges with huge pages).
  void* raw = mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    return nullptr;
  }
  const auto addr = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (addr + kHugePage - 1) & ~static_cast<uintptr_t>(kHugePage - 1);
  if (start > addr) {
    munmap(raw, start - addr);
  }
  const size_t tail = (addr + size + kHugePage) - (start + size);
  if (tail) {
    munmap(reinterpret_cast<void*>(start + size), tail);
  }
  void* ptr = reinterpret_cast<void*>(start);
#ifdef MADV_POPULATE_WRITE
  if (madvise(ptr, size, MADV_POPULATE_WRITE) != 0)  // Linux < 5.14: touch every page
#endif
  {
    for (size_t off = 0; off < size; off += 4096) {
      static_cast<volatile char*>(ptr)[off] = 0;
    }
  }
  return ptr;
}

// The byte budget of a cache of such blocks: environment variable `name` in MiB (0: no
// caching), `default_mib` where it is unset.
inline size_t cache_budget_from_env(const char* name, unsigned long long default_mib) {
  const char* env = std::getenv(name);
  return static_cast<size_t>(env ? std::strtoull(env, nullptr, 10) : default_mib) << 20;
}

}  // namespace remote_accel
