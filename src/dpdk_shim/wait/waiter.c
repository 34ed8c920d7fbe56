/* SPDX-License-Identifier: BSD-3-Clause
 * How an application thread waits for its port (engine.c says who polls, and why these
 * numbers): spin for `spin_ns` after the last traffic, then yield, then sleep a sixteenth
 * of the idle time (10 us .. 16 ms); on memif and ring ports the sleep is on the
 * connection's doorbell (link/doorbell.c), ended at once by the peer's next frame.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <sys/prctl.h>
#include <time.h>

#include <rte_pause.h>

#include "wait/wait.h"

#define SLEEP_MIN_NS 10000ull
#define SLEEP_MAX_NS 16000000ull

void
nap(uint64_t ns)
{
	struct timespec ts = { .tv_sec = (time_t)(ns / 1000000000ull),
			       .tv_nsec = (long)(ns % 1000000000ull) };

	nanosleep(&ts, NULL);
}

/* Sleeps of tens of microseconds are useless with the default 50 us timer slack. */
void
tight_timers(void)
{
	static __thread bool done;

	if (!done) {
		prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
		done = true;
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

/* A nap on the connection's doorbell, taken only if one more poll, after announcing the
 * sleeper, finds nothing and no other thread took frames off the port meanwhile (the
 * protocol against a lost wake-up: link/doorbell.c). */
static void
waiter_sleep(struct waiter *w, uint64_t ns)
{
	struct doorbell *d = w->db;
	struct shim_port *p = w->port;
	unsigned int seq = db_sleep_begin(d);
	uint64_t seen;
	int work;

	work = app_poll(p);
	seen = __atomic_load_n(&p->rx_count, __ATOMIC_ACQUIRE);  /* frames other threads took count too */
	if (work == 0 && seen == w->seen) {
		bool rung = db_wait(d, seq, ns);

		__atomic_fetch_add(&w->conn->db_sleeps, 1, __ATOMIC_RELAXED);
		if (rung)
			__atomic_fetch_add(&w->conn->db_wakeups, 1, __ATOMIC_RELAXED);
	}
	db_sleep_end(d);
	w->seen = seen;
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
		db_spin(w->db, w->peer);  /* pause, or yield to the peer where it runs on this core */
	} else if (idle < (int64_t)w->spin / 4) {
		rte_pause();
	} else if (idle < (int64_t)w->spin) {
		sched_yield();  /* let the peer's thread have this core if it wants it */
	} else {
		uint64_t ns = tsc_to_ns((uint64_t)idle) / 16;

		ns = RTE_MAX(SLEEP_MIN_NS, RTE_MIN(SLEEP_MAX_NS, ns));
		if (w->db != NULL)
			waiter_sleep(w, ns);  /* the same nap, cut short by the peer's next frame */
		else
			nap(ns);
	}
}
