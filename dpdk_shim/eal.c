/* SPDX-License-Identifier: BSD-3-Clause
 * EAL start-up (once per process), DPDK log capture, pinned memory.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_log.h>
#include <rte_malloc.h>
#include <rte_memory.h>

#include "shim_internal.h"

#ifndef SHIM_VERSION
#define SHIM_VERSION "unknown"
#endif

#define LOG_CAP (64 * 1024)

uint64_t shim_tsc_hz;

static pthread_mutex_t eal_lock = PTHREAD_MUTEX_INITIALIZER;
static bool eal_done;
static char *eal_argv_copy;   /* NUL-separated, as given */
static size_t eal_argv_len;

/* DPDK logs into this ring instead of stderr: a library must not print, and Python
 * forwards the lines to `logging` (shim_log_read). Oldest bytes go on overflow. */
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char log_ring[LOG_CAP];
static size_t log_head;       /* bytes written, ever */
static size_t log_tail;       /* bytes read, ever */

const char *
shim_version(void)
{
	return SHIM_VERSION;
}

static ssize_t
log_write(void *cookie, const char *buf, size_t size)
{
	(void)cookie;
	pthread_mutex_lock(&log_lock);
	for (size_t i = 0; i < size; i++)
		log_ring[(log_head + i) % LOG_CAP] = buf[i];
	log_head += size;
	if (log_head - log_tail > LOG_CAP)
		log_tail = log_head - LOG_CAP;
	pthread_mutex_unlock(&log_lock);
	return (ssize_t)size;
}

void
eal_capture_log(void)
{
	static FILE *stream;
	cookie_io_functions_t io = { .write = log_write };

	if (stream != NULL)
		return;
	stream = fopencookie(NULL, "w", io);
	if (stream == NULL)
		return;
	setvbuf(stream, NULL, _IOLBF, 0);
	rte_openlog_stream(stream);
}

int
shim_log_read(char *buf, size_t cap)
{
	size_t n;

	pthread_mutex_lock(&log_lock);
	n = log_head - log_tail;
	if (n > cap)
		n = cap;
	for (size_t i = 0; i < n; i++)
		buf[i] = log_ring[(log_tail + i) % LOG_CAP];
	log_tail += n;
	pthread_mutex_unlock(&log_lock);
	return (int)n;
}

int
shim_eal_init(int argc, char **argv)
{
	char **copy;
	size_t len = 0;
	int ret;

	if (argc < 1 || argv == NULL)
		return -EINVAL;
	pthread_mutex_lock(&eal_lock);
	if (eal_done) {
		pthread_mutex_unlock(&eal_lock);
		return -EALREADY;
	}
	/* rte_eal_init permutes argv; keep what the caller gave for shim_eal_args. */
	for (int i = 0; i < argc; i++)
		len += strlen(argv[i]) + 1;
	eal_argv_copy = malloc(len);
	copy = calloc((size_t)argc + 1, sizeof(*copy));
	if (eal_argv_copy == NULL || copy == NULL) {
		free(eal_argv_copy);
		free(copy);
		eal_argv_copy = NULL;
		pthread_mutex_unlock(&eal_lock);
		return -ENOMEM;
	}
	eal_argv_len = 0;
	for (int i = 0; i < argc; i++) {
		size_t n = strlen(argv[i]) + 1;

		memcpy(eal_argv_copy + eal_argv_len, argv[i], n);
		eal_argv_len += n;
		copy[i] = argv[i];
	}
	eal_capture_log();
	ret = rte_eal_init(argc, copy);
	free(copy);
	if (ret < 0) {
		ret = rte_errno ? -rte_errno : -EINVAL;
		/* DPDK refuses any second rte_eal_init, failed or not: remember that. */
		eal_done = ret == -EALREADY;
		pthread_mutex_unlock(&eal_lock);
		return ret;
	}
	shim_tsc_hz = rte_get_tsc_hz();
	for (int i = 0; i < SHIM_MAX_PORTS; i++)
		pthread_mutex_init(&shim_ports[i].lock, NULL);
	eal_done = true;
	pthread_mutex_unlock(&eal_lock);
	return 0;
}

int
shim_eal_initialized(void)
{
	return eal_done && shim_tsc_hz != 0;
}

int
shim_eal_args(char *buf, size_t cap)
{
	if (!shim_eal_initialized())
		return -ENODEV;
	if (buf != NULL && cap >= eal_argv_len)
		memcpy(buf, eal_argv_copy, eal_argv_len);
	return (int)eal_argv_len;
}

int
shim_eal_runtime_dir(char *buf, size_t cap)
{
	const char *dir;
	size_t n;

	if (!shim_eal_initialized())
		return -ENODEV;
	dir = rte_eal_get_runtime_dir();
	n = strlen(dir) + 1;
	if (buf == NULL || cap < n)
		return -ENOSPC;
	memcpy(buf, dir, n);
	return (int)n - 1;
}

void *
shim_mem_alloc(uint64_t size, uint32_t align)
{
	if (!shim_eal_initialized() || size == 0)
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
	if (!shim_eal_initialized())
		return 0;
	return rte_mem_virt2memseg(ptr, NULL) != NULL;
}
