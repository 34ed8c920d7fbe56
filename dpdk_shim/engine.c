/* SPDX-License-Identifier: BSD-3-Clause
 * Who polls the ports, and how threads wait.
 *
 * Design: the thread that waits drives the port itself ("caller runs"): a recv or
 * send call polls its port under the port lock, so a round trip never pays for a
 * hand-off between threads (on memif that is the difference between ~10 us and
 * ~50+ us). But a peer must be answered also while the application computes for
 * seconds without calling us: acks (or the sender retransmits and stalls),
 * keepalives (or the peer declares us dead), HELLOs (a server between accepts).
 * So ONE background thread per process (not per port: two cores) polls every port
 * that no application thread is polling right now, with backoff: it naps 20 us
 * after traffic, doubling up to 16 ms when idle. Waiting application threads spin
 * for `spin_ns` after the last traffic, then yield, then sleep a sixteenth of the
 * idle time (10 us .. 16 ms), so a long wait costs little CPU and a reply after a
 * long computation is late by at most ~6%. On memif and ring ports a waiter sleeps on
 * its connection's doorbell instead (doorbell.c): the same sleep, ended at once by the
 * peer's next frame, and its spin yields only while the peer shares its core.
 * `busy_poll` spins without end (benchmarks).
 * The caps are for many idle clients on few cores: a server's session threads each
 * wait on their own memif port, and with 1 ms caps 16 idle clients and their server
 * cost about 17% of a core on a 2-core VM (TCP: 1%). A message after 16 ms of silence
 * waits at most 1 ms more, after 256 ms at most 16 ms; traffic resets the back-off.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <sys/prctl.h>
#include <time.h>

#include <rte_ethdev.h>
#include <rte_pause.h>

#include "chan.h"

#define ENGINE_NAP_NS 20000ull
#define ENGINE_IDLE_NS 16000000ull
#define SLEEP_MIN_NS 10000ull
#define SLEEP_MAX_NS 16000000ull

atomic_bool shim_down;

static pthread_mutex_t engine_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_t engine_thread;
static bool engine_running;
static atomic_bool engine_stop_flag;

static void
nap(uint64_t ns)
{
	struct timespec ts = { .tv_sec = (time_t)(ns / 1000000000ull),
			       .tv_nsec = (long)(ns % 1000000000ull) };

	nanosleep(&ts, NULL);
}

/* Sleeps of tens of microseconds are useless with the default 50 us timer slack. */
static void
tight_timers(void)
{
	static __thread bool done;

	if (!done) {
		prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
		done = true;
	}
}

static void *
engine_main(void *arg)
{
	uint64_t sleep_ns = ENGINE_NAP_NS;

	(void)arg;
	tight_timers();
	while (!atomic_load(&engine_stop_flag)) {
		int work = 0;

		for (int i = 0; i < SHIM_MAX_PORTS; i++) {
			struct shim_port *p = &shim_ports[i];

			if (!p->ready || p->raw || atomic_load(&p->app_waiters) > 0)
				continue;
			if (pthread_mutex_trylock(&p->lock) != 0)
				continue;
			work += chan_port_poll(p);
			pthread_mutex_unlock(&p->lock);
		}
		sleep_ns = work ? ENGINE_NAP_NS : RTE_MIN(sleep_ns * 2, ENGINE_IDLE_NS);
		nap(sleep_ns);
	}
	return NULL;
}

int
engine_start(void)
{
	int ret = 0;

	pthread_mutex_lock(&engine_lock);
	if (!engine_running && !atomic_load(&shim_down)) {
		atomic_store(&engine_stop_flag, false);
		ret = -pthread_create(&engine_thread, NULL, engine_main, NULL);
		if (ret == 0) {
			pthread_setname_np(engine_thread, "ra-dpdk-poll");
			engine_running = true;
		}
	}
	pthread_mutex_unlock(&engine_lock);
	return ret;
}

void
engine_stop(void)
{
	pthread_mutex_lock(&engine_lock);
	if (engine_running) {
		atomic_store(&engine_stop_flag, true);
		pthread_join(engine_thread, NULL);
		engine_running = false;
	}
	pthread_mutex_unlock(&engine_lock);
}

void
waiter_init(struct waiter *w, const struct shim_conn_opts *o)
{
	tight_timers();
	w->idle_since = rte_rdtsc();
	w->spin = ns_to_tsc(o->spin_ns);
	w->busy = o->busy_poll != 0;
	w->port = NULL;
	w->db = w->peer = NULL;
	w->seen = UINT64_MAX;  /* the first pause only looks */
}

/* A waiter for this connection: its naps sleep on the connection's doorbell, so the
 * peer's next frame ends them. */
void
waiter_init_conn(struct waiter *w, struct shim_conn *c)
{
	waiter_init(w, &c->o);
	if (c->db_own != NULL) {
		w->port = c->port;
		w->db = c->db_own;
		w->peer = c->db_peer;
		w->conn = c;
	}
}

void
waiter_pause(struct waiter *w, uint64_t now, bool progress)
{
	int64_t idle;

	if (progress) {
		w->idle_since = now;
		return;
	}
	if (w->busy) {
		rte_pause();
		return;
	}
	idle = (int64_t)(now - w->idle_since);  /* now may come from another core's tsc */
	if (w->peer != NULL && idle < (int64_t)w->spin) {
		db_spin(w);  /* pause, or yield to the peer where it runs on this core */
	} else if (idle < (int64_t)w->spin / 4) {
		rte_pause();
	} else if (idle < (int64_t)w->spin) {
		sched_yield();  /* let the peer's thread have this core if it wants it */
	} else {
		uint64_t ns = tsc_to_ns((uint64_t)idle) / 16;

		ns = RTE_MAX(SLEEP_MIN_NS, RTE_MIN(SLEEP_MAX_NS, ns));
		if (w->db != NULL)
			db_sleep(w, ns);  /* the same nap, cut short by the peer's next frame */
		else
			nap(ns);
	}
}

int
app_poll(struct shim_port *p)
{
	int work;

	pthread_mutex_lock(&p->lock);
	work = chan_port_poll(p);
	pthread_mutex_unlock(&p->lock);
	return work;
}

void
shim_shutdown(void)
{
	uint64_t deadline;

	atomic_store(&shim_down, true);
	engine_stop();
	if (!shim_eal_initialized())
		return;
	/* Blocked callers see shim_down within one pause; give them a moment to leave. */
	deadline = rte_rdtsc() + ns_to_tsc(200000000ull);
	for (int i = 0; i < SHIM_MAX_PORTS; i++) {
		struct shim_port *p = &shim_ports[i];

		if (!p->ready)
			continue;
		while (atomic_load(&p->app_waiters) > 0 && rte_rdtsc() < deadline)
			nap(1000000);
		pthread_mutex_lock(&p->lock);
		for (int k = p->n_conns - 1; k >= 0; k--) {
			struct shim_conn *c = p->conns[k];

			if (c->state == CS_OPEN)
				for (int j = 0; j < GOODBYE_COPIES; j++)
					conn_send_ctrl(c, FT_GOODBYE, 0, NULL, 0, false);
		}
		port_flush(p);
		if (atomic_load(&p->app_waiters) == 0 && !p->raw) {
			/* closing a memif server port removes its socket file */
			p->ready = false;
			rte_eth_dev_stop(p->id);
			rte_eth_dev_close(p->id);
		}
		pthread_mutex_unlock(&p->lock);
	}
}
