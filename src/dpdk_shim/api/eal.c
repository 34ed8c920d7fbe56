/* SPDX-License-Identifier: BSD-3-Clause
 * The process: EAL start-up and what Python reads of it (link/eal.c holds the state),
 * DPDK's log lines, pinned memory, and the shutdown.
 */
#include <errno.h>
#include <string.h>

#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_malloc.h>
#include <rte_memory.h>

#include "api/api.h"

#ifndef SHIM_VERSION
#define SHIM_VERSION "unknown"
#endif

const char *
shim_version(void)
{
	return SHIM_VERSION;
}

int
shim_eal_init(int argc, char **argv)
{
	return eal_init(argc, argv);
}

int
shim_eal_initialized(void)
{
	return eal_initialized();
}

int
shim_eal_args(char *buf, size_t cap)
{
	return eal_args(buf, cap);
}

int
shim_eal_runtime_dir(char *buf, size_t cap)
{
	const char *dir;
	size_t n;

	if (!eal_initialized())
		return -ENODEV;
	dir = rte_eal_get_runtime_dir();
	n = strlen(dir) + 1;
	if (buf == NULL || cap < n)
		return -ENOSPC;
	memcpy(buf, dir, n);
	return (int)n - 1;
}

int
shim_log_read(char *buf, size_t cap)
{
	return log_read(buf, cap);
}

void *
shim_mem_alloc(uint64_t size, uint32_t align)
{
	if (!eal_initialized() || size == 0)
		return NULL;
	return rte_malloc("remote_accel", size, align ? align : 64);
}

void
shim_mem_free(void *ptr)
{
	rte_free(ptr);
}

int
shim_mem_is_dpdk(const void *ptr)
{
	if (!eal_initialized())
		return 0;
	return rte_mem_virt2memseg(ptr, NULL) != NULL;
}

void
shim_shutdown(void)
{
	uint64_t deadline;

	atomic_store(&shutting_down, true);
	engine_stop();
	if (!eal_initialized())
		return;
	/* Blocked callers see shutting_down within one pause; give them a moment to leave. */
	deadline = rte_rdtsc() + ns_to_tsc(200000000ull);
	for (int i = 0; i < SHIM_MAX_PORTS; i++) {
		struct shim_port *p = &port_table[i];

		if (!p->ready)
			continue;
		while (atomic_load(&p->app_waiters) > 0 && rte_rdtsc() < deadline)
			nap(1000000);
		pthread_mutex_lock(&p->lock);
		chan_port_goodbye(p);
		if (atomic_load(&p->app_waiters) == 0 && !p->raw) {
			/* closing a memif server port removes its socket file */
			p->ready = false;
			rte_eth_dev_stop(p->id);
			rte_eth_dev_close(p->id);
		}
		pthread_mutex_unlock(&p->lock);
	}
}
