"""The server process's malloc: memory its session threads free stays for their next
allocations, instead of going back to the kernel and faulting in again a batch later.

A CPU server's kernels allocate and free an eager step's tensors through malloc
(storages from 1 MiB on come from the host-block cache, dataplane/host_blocks.cpp). glibc
gives the free top of a heap back to the kernel once it exceeds its trim threshold:
128 KiB, until the process frees a chunk it had mmapped, which raises it. A step of small
tensors never raises it, so the heap is trimmed whenever the frees at a batch's end leave
more than that free, and the pages are faulted in again by the next batch. On the tiny
Transformer step (server `--threads 1`) that was 465,000 page faults in 4 s and a third
more server time a step, depending only on where the client's batches happened to end.

keep_freed_memory() sets both thresholds where glibc would itself end up after the
process freed one mmapped chunk of 32 MiB (the most it adapts to): chunks below 32 MiB
come from the heaps, and up to 64 MiB stays free at the top of each before it is trimmed.
glibc's own variables (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_ or a GLIBC_TUNABLES
malloc setting) win: where the environment sets one, malloc stays as the operator chose.
"""

from __future__ import annotations

import os

#: Below this many bytes malloc serves requests from its heaps (glibc's upper bound for
#: its own adjustment, DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)...
MMAP_BELOW = 32 << 20
#: ...and keeps this many free at the top of a heap (twice that: glibc's own rule).
KEEP_FREE = 2 * MMAP_BELOW

#: glibc's environment variables for the same two settings.
GLIBC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
GLIBC_TUNABLES = "GLIBC_TUNABLES"


def operator_choice(environ=os.environ) -> str | None:
    """The variable by which the environment already sets malloc's thresholds, if any."""
    for name in GLIBC_VARIABLES:
        if name in environ:
            return name
    tunables = environ.get(GLIBC_TUNABLES, "")
    if "glibc.malloc.trim_threshold" in tunables or "glibc.malloc.mmap_threshold" in tunables:
        return GLIBC_TUNABLES
    return None


def keep_freed_memory() -> str:
    """Set the thresholds for this process (once, at the server's start); says what was done."""
    chosen = operator_choice()
    if chosen is not None:
        return f"malloc's thresholds as {chosen} sets them"
    from . import native

    if not native.keep_freed_heap(MMAP_BELOW, KEEP_FREE):
        return "malloc as the C library has it (no glibc thresholds to set)"
    return (f"malloc keeps up to {KEEP_FREE >> 20} MiB free a heap and maps chunks from "
            f"{MMAP_BELOW >> 20} MiB on by themselves (freed pages are not faulted in again)")
