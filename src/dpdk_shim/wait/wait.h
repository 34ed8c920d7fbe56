/* SPDX-License-Identifier: BSD-3-Clause
 * Waiting: the poll thread (engine.c) and how an application thread waits (waiter.c:
 * spin, yield, nap, or sleep on its connection's doorbell). What the api above may use
 * of it; it calls only the channel and the layers below (wire/wire.h names the layers).
 */
#ifndef REMOTE_ACCEL_WAIT_H
#define REMOTE_ACCEL_WAIT_H

#include "chan/chan.h"

/* waiter.c: waiting with backoff */
struct waiter {
	uint64_t idle_since;
	uint64_t spin;
	bool busy;
	struct shim_port *port;    /* with db: naps become sleeps on the doorbell */
	struct doorbell *db, *peer;
	struct shim_conn *conn;
	uint64_t seen;             /* port->rx_count at the last pause */
};
void waiter_init(struct waiter *w, const struct shim_conn_opts *o);
void waiter_init_conn(struct waiter *w, struct shim_conn *c);
void waiter_pause(struct waiter *w, uint64_t now, bool progress);
/* One poll of the port by an application thread; returns frames handled. */
int app_poll(struct shim_port *p);
void nap(uint64_t ns);
void tight_timers(void);  /* this thread's timer slack, for naps of microseconds */

/* engine.c: the poll thread, for ports no application thread polls */
int engine_start(void);
void engine_stop(void);

#endif
