/* SPDX-License-Identifier: BSD-3-Clause
 * Doorbells: a thread waiting on a shared-memory port (memif, ring) sleeps in the
 * kernel, and the peer that sends to it wakes it at once.
 *
 * Why: polling with naps trades CPU for latency (a reply after a long wait was late by
 * up to a sixteenth of the wait, 16 ms at most), busy polling burns a core per waiter.
 * memif's own Rx interrupts are not reachable through ethdev in DPDK 22.11 (the PMD has
 * no rx_queue_intr_enable), so each connection end owns a small page of shared memory
 * (a POSIX shm object, named in the HELLO / ACCEPT it sends) holding a futex word and
 * the number of threads asleep on it. The peer maps it and, after every burst that
 * carried frames to us, rings it (bumps the word, FUTEX_WAKE) only while someone
 * sleeps, so a round trip between two polling threads makes no system call.
 *
 * No lost wake-up: the sleeper announces itself (sleepers++, a full barrier), polls the
 * port once more, and sleeps only if that poll found nothing and no other thread took
 * frames off the port meanwhile; the sender stores the frame into the ring, then a full
 * barrier, then reads `sleepers` (Dekker: one of the two sees the other). A sleep still
 * ends at the waiter's nap time, so timers (keepalives, retransmissions) run as before.
 *
 * Here the page and its primitives; the waiting side (when to sleep, the last poll) is
 * wait/waiter.c's, the naming of doorbells in the handshake chan/hello.c's, and the
 * channel rings the peers after each burst (chan_flush).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <rte_pause.h>
#include <rte_random.h>

#include "link/link.h"

#define DB_MAGIC 0x52414442u  /* "RADB" */
#define DB_PREFIX "remote_accel-db-"
#define DB_SIZE 4096

struct doorbell {
	atomic_uint seq;        /* the futex word: every ring bumps it */
	atomic_uint sleepers;   /* threads asleep on it, or about to be */
	atomic_int cpu;         /* where the owner's thread last waited (-1: asleep, unknown) */
	uint32_t magic;
	uint32_t pad;
	uint64_t token;         /* proves to the peer that it mapped the page we named */
};

static atomic_uint db_counter;
static atomic_bool db_swept;

static long
futex(atomic_uint *word, int op, unsigned int val, const struct timespec *ts)
{
	/* not FUTEX_PRIVATE: the word lives in memory shared with another process */
	return syscall(SYS_futex, (unsigned int *)word, op, val, ts, NULL, 0);
}

/* Pages of processes that died before they could unlink theirs (a crash during a
 * handshake): removed by the next process that makes one. */
static void
sweep_dead(void)
{
	DIR *d;
	struct dirent *e;

	if (atomic_exchange(&db_swept, true))
		return;
	d = opendir("/dev/shm");
	if (d == NULL)
		return;
	while ((e = readdir(d)) != NULL) {
		char path[300];
		long pid;

		if (strncmp(e->d_name, DB_PREFIX, strlen(DB_PREFIX)) != 0)
			continue;
		pid = strtol(e->d_name + strlen(DB_PREFIX), NULL, 10);
		if (pid <= 0 || (kill((pid_t)pid, 0) != 0 && errno == ESRCH)) {
			snprintf(path, sizeof(path), "/%s", e->d_name);
			shm_unlink(path);
		}
	}
	closedir(d);
}

static struct doorbell *
db_map(int fd)
{
	void *a = mmap(NULL, DB_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

	close(fd);
	return a == MAP_FAILED ? NULL : a;
}

struct doorbell *
db_create(char *name, size_t cap, uint64_t *token)
{
	struct doorbell *d;
	int fd;

	sweep_dead();
	for (int tries = 0; tries < 4; tries++) {
		snprintf(name, cap, "/" DB_PREFIX "%d-%u-%08x", (int)getpid(),
			 atomic_fetch_add(&db_counter, 1), (unsigned int)rte_rand());
		fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
		if (fd >= 0)
			break;
		if (errno != EEXIST)
			break;
	}
	if (fd < 0 || ftruncate(fd, DB_SIZE) != 0) {
		if (fd >= 0) {
			close(fd);
			shm_unlink(name);
		}
		name[0] = '\0';
		return NULL;
	}
	d = db_map(fd);
	if (d == NULL) {
		shm_unlink(name);
		name[0] = '\0';
		return NULL;
	}
	*token = rte_rand();
	atomic_init(&d->seq, 0);
	atomic_init(&d->sleepers, 0);
	atomic_init(&d->cpu, -1);
	d->token = *token;
	d->magic = DB_MAGIC;
	return d;
}

struct doorbell *
db_open(const char *name, uint64_t token)
{
	struct doorbell *d;
	int fd;

	if (strncmp(name, "/" DB_PREFIX, strlen(DB_PREFIX) + 1) != 0 || strchr(name + 1, '/') != NULL)
		return NULL;  /* only our own kind of name: never open what a peer points at */
	fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
	if (fd < 0)
		return NULL;  /* another host, another /dev/shm: no doorbell, naps as before */
	d = db_map(fd);
	if (d != NULL && (d->magic != DB_MAGIC || d->token != token)) {
		munmap(d, DB_SIZE);
		return NULL;  /* a page of the same name that is not the peer's */
	}
	return d;
}

void
db_close(struct doorbell *d)
{
	if (d != NULL)
		munmap(d, DB_SIZE);
}

void
db_unlink(char *name)
{
	if (name[0] != '\0') {
		shm_unlink(name);
		name[0] = '\0';
	}
}

void
db_ring(struct doorbell *d)
{
	/* the frames are in the ring (tx_burst stored its head); now look for sleepers */
	atomic_thread_fence(memory_order_seq_cst);
	if (atomic_load_explicit(&d->sleepers, memory_order_relaxed) == 0)
		return;
	atomic_fetch_add(&d->seq, 1);
	futex(&d->seq, FUTEX_WAKE, INT_MAX, NULL);
}

/* The sleeper's side: sleepers++, a full barrier, then the caller polls once more and
 * sleeps only if that found nothing (see above). Returns the word as it was before. */
unsigned int
db_sleep_begin(struct doorbell *d)
{
	unsigned int seq = atomic_load(&d->seq);

	atomic_store_explicit(&d->cpu, -1, memory_order_relaxed);  /* a peer spinning here need not yield */
	atomic_fetch_add(&d->sleepers, 1);  /* a locked RMW: a full barrier on x86 */
	atomic_thread_fence(memory_order_seq_cst);
	return seq;
}

bool
db_wait(struct doorbell *d, unsigned int seq, uint64_t ns)
{
	struct timespec ts = { .tv_sec = (time_t)(ns / 1000000000ull),
			       .tv_nsec = (long)(ns % 1000000000ull) };
	long rc = futex(&d->seq, FUTEX_WAIT, seq, &ts);

	return rc == 0 || errno == EAGAIN;  /* rung (before or during the sleep), not timed out */
}

void
db_sleep_end(struct doorbell *d)
{
	atomic_fetch_sub(&d->sleepers, 1);
	atomic_store_explicit(&d->cpu, sched_getcpu(), memory_order_relaxed);  /* awake, here */
}

/* One turn of a waiter's spin. Two threads spinning for each other on one core (2-core
 * machines; the scheduler often puts both ends there) would each hold the core for its
 * whole slice: each end says in its page where it runs, and a waiter spins on pause only
 * while the peer runs on another core; otherwise (the same core, or the peer asleep: its
 * wake-up may land here) it yields (a system call: ~1 us per turn). */
void
db_spin(struct doorbell *own, struct doorbell *peer)
{
	int cpu = sched_getcpu();
	int peer_cpu = atomic_load_explicit(&peer->cpu, memory_order_relaxed);

	if (atomic_load_explicit(&own->cpu, memory_order_relaxed) != cpu)
		atomic_store_explicit(&own->cpu, cpu, memory_order_relaxed);
	if (peer_cpu >= 0 && peer_cpu != cpu)
		rte_pause();
	else
		sched_yield();
}
