/* SPDX-License-Identifier: BSD-3-Clause
 * The pages of this process's memif regions, mapped at once instead of on first touch.
 *
 * memif's shared memory is a memfd of 4 KiB pages that each process maps; a page gets into
 * a process's page tables on its first touch. A new connection's first laps through the
 * rings touch fresh buffers: measured on a 2-core VM, the first ~500 round trips of a new
 * memif connection took ~5 minor faults each on each side, and 38 us instead of 17 us
 * (benchmarks/sync_after_idle.py's first round). Mapping every page when the connection
 * opens moves that cost (a few ms per 32 MiB region) to connect/accept time.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "link/link.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  /* Linux 5.14 */
#endif

void
memif_regions_prefault(void)
{
	FILE *maps = fopen("/proc/self/maps", "r");
	char line[512];

	if (maps == NULL)
		return;  /* only an optimisation */
	while (fgets(line, sizeof(line), maps) != NULL) {
		unsigned long lo, hi;
		char perms[8];

		if (strstr(line, "memif_region") == NULL ||
		    sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3 || perms[0] != 'r' || perms[1] != 'w')
			continue;
		/* Only the kernel may touch the range: the mapping can go (a client that left, unmapped
		 * by memif's interrupt thread) between reading the maps and here, and another take its
		 * place; then madvise fails or maps that one's pages, where a store of ours would fault
		 * or write into it. Kernels before 5.14 (EINVAL) keep faulting on first touch. */
		(void)madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
	}
	fclose(maps);
}
