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
 * long computation is late by at most ~6% (waiter.c). On memif and ring ports a waiter
 * sleeps on its connection's doorbell instead (link/doorbell.c): the same sleep, ended at
 * once by the peer's next frame, and its spin yields only while the peer shares its core.
 * `busy_poll` spins without end (benchmarks).
 * The caps are for many idle clients on few cores: a server's session threads each
 * wait on their own memif port, and with 1 ms caps 16 idle clients and their server
 * cost about 17% of a core on a 2-core VM (TCP: 1%). A message after 16 ms of silence
 * waits at most 1 ms more, after 256 ms at most 16 ms; traffic resets the back-off.
 */
#define _GNU_SOURCE
#include <pthread.h>

#include "wait/wait.h"

#define ENGINE_NAP_NS 20000ull
#define ENGINE_IDLE_NS 16000000ull

static pthread_mutex_t engine_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_t engine_thread;
static bool engine_running;
static atomic_bool engine_stop_flag;

static void *
engine_main(void *arg)
{
	uint64_t sleep_ns = ENGINE_NAP_NS;

	(void)arg;
	tight_timers();
	while (!atomic_load(&engine_stop_flag)) {
		int work = 0;

		for (int i = 0; i < SHIM_MAX_PORTS; i++) {
			struct shim_port *p = &port_table[i];

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
	if (!engine_running && !atomic_load(&shutting_down)) {
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
