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

/* At exit, what each connection still owes its peer (a client's last work and its
 * GOODBYE, in frames not yet acknowledged) goes out before the ports close, as a TCP
 * socket's kernel keeps sending after the process is gone: without this a script that
 * ended right after queuing work lost its tail and its GOODBYE over memif. Connections
 * the application did not close close here. A live peer acknowledges within
 * milliseconds; one that has not within EXIT_LINGER_NS is taken for gone, and each
 * connection's own linger may end its wait sooner. This thread polls every port no
 * application thread polls (the engine naps up to 16 ms when idle). */
#define EXIT_LINGER_NS 2000000000ull

static void
finish_lingering(void)
{
	uint64_t deadline = rte_rdtsc() + ns_to_tsc(EXIT_LINGER_NS);

	for (;;) {
		bool lingering = false;
		int work = 0;

		for (int i = 0; i < SHIM_MAX_PORTS; i++) {
			struct shim_port *p = &port_table[i];

			if (!p->ready || p->raw)
				continue;
			pthread_mutex_lock(&p->lock);
			chan_port_close_all(p, rte_rdtsc(), EXIT_LINGER_NS);
			if (atomic_load(&p->app_waiters) == 0)
				work += chan_port_poll(p);
			lingering |= chan_port_lingering(p, rte_rdtsc());
			pthread_mutex_unlock(&p->lock);
		}
		if (!lingering || rte_rdtsc() > deadline)
			return;
		nap(work ? 20000 : 200000);
	}
}

void
shim_shutdown(void)
{
	uint64_t deadline;

	if (eal_initialized())
		finish_lingering();
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
