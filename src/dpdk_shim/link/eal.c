/* SPDX-License-Identifier: BSD-3-Clause
 * The process's DPDK state: EAL start-up (once per process), DPDK log capture, the TSC
 * clock, the port table (its locks made with the EAL) and the shutdown flag.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_log.h>

#include "link/link.h"

#define LOG_CAP (64 * 1024)

struct shim_port port_table[SHIM_MAX_PORTS];
uint64_t tsc_hz;
atomic_bool shutting_down;

static pthread_mutex_t eal_lock = PTHREAD_MUTEX_INITIALIZER;
static bool eal_done;
static char *eal_argv_copy;   /* NUL-separated, as given */
static size_t eal_argv_len;

/* DPDK logs into this ring instead of stderr: a library must not print, and Python
 * forwards the lines to `logging` (shim_log_read). Oldest bytes go on overflow.
 * CRIT and worse also go to stderr at once: DPDK writes them just before rte_exit or
 * rte_panic ends the process, when nobody will read the ring again. */
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char log_ring[LOG_CAP];
static size_t log_head;       /* bytes written, ever */
static size_t log_tail;       /* bytes read, ever */

static ssize_t
log_write(void *cookie, const char *buf, size_t size)
{
	int level = rte_log_cur_msg_loglevel();

	(void)cookie;
	if (level >= (int)RTE_LOG_EMERG && level <= (int)RTE_LOG_CRIT && write(2, buf, size) < 0) {
		/* nothing better to do: the ring below still has the line */
	}
	pthread_mutex_lock(&log_lock);
	for (size_t i = 0; i < size; i++)
		log_ring[(log_head + i) % LOG_CAP] = buf[i];
	log_head += size;
	if (log_head - log_tail > LOG_CAP)
		log_tail = log_head - LOG_CAP;
	pthread_mutex_unlock(&log_lock);
	return (ssize_t)size;
}

static void
capture_log(void)
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
log_read(char *buf, size_t cap)
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
eal_init(int argc, char **argv)
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
	/* rte_eal_init permutes argv; keep what the caller gave for eal_args. */
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
	capture_log();
	ret = rte_eal_init(argc, copy);
	free(copy);
	if (ret < 0) {
		ret = rte_errno ? -rte_errno : -EINVAL;
		/* DPDK refuses any second rte_eal_init, failed or not: remember that. */
		eal_done = ret == -EALREADY;
		pthread_mutex_unlock(&eal_lock);
		return ret;
	}
	tsc_hz = rte_get_tsc_hz();
	for (int i = 0; i < SHIM_MAX_PORTS; i++)
		pthread_mutex_init(&port_table[i].lock, NULL);
	eal_done = true;
	pthread_mutex_unlock(&eal_lock);
	return 0;
}

bool
eal_initialized(void)
{
	return eal_done && tsc_hz != 0;
}

int
eal_args(char *buf, size_t cap)
{
	if (!eal_initialized())
		return -ENODEV;
	if (buf != NULL && cap >= eal_argv_len)
		memcpy(buf, eal_argv_copy, eal_argv_len);
	return (int)eal_argv_len;
}
