/* SPDX-License-Identifier: BSD-3-Clause
 * Making connections: a client's connect (link first, then HELLO until ACCEPT), a
 * server's listen and accept (chan/connect.c, chan/accept.c and chan/hello.c do the work).
 */
#include <errno.h>
#include <string.h>

#include "api/api.h"

void
shim_conn_opts_default(struct shim_conn_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->window = 256;
	o->chunk = 0;
	o->peer_timeout_ns = 8000000000ull;
	o->stall_ns = 30000000000ull;
	o->zero_copy_min = 256 * 1024;
	o->spin_ns = 200000;
	o->busy_poll = 0;
	o->group = 0;
	o->doorbell = 1;
}

/* -- connect ------------------------------------------------------------------------- */
int
shim_connect(uint16_t port, const struct shim_conn_opts *opts, int64_t timeout_ns,
	     struct shim_conn **out)
{
	struct shim_port *p = port_get(port);
	struct shim_conn_opts defaults;
	struct shim_conn *c;
	struct waiter w;
	uint64_t now = rte_rdtsc(), deadline = deadline_of(timeout_ns, now);
	int rc = 0;

	if (p == NULL)
		return -ENODEV;
	if (p->raw)
		return -EBUSY;
	if (opts == NULL) {
		shim_conn_opts_default(&defaults);
		opts = &defaults;
	}
	waiter_init(&w, opts);
	/* The link first: a memif client is up once the server took its socket. */
	rc = connect_link(p, now, deadline);
	if (rc != 0)
		return rc;
	rc = connect_open(p, opts, &c);
	if (rc != 0)
		return rc;
	atomic_fetch_add(&p->app_waiters, 1);
	for (;;) {
		int work = app_poll(p);

		now = rte_rdtsc();

		if (c->state == CS_OPEN)
			break;
		rc = c->state == CS_CONNECTING ? (atomic_load(&shutting_down) ? -ESHUTDOWN : 0) : conn_error(c);
		if (rc == 0 && now >= deadline)
			rc = -ETIMEDOUT;
		if (rc != 0)
			break;
		waiter_pause(&w, now, work > 0);
	}
	atomic_fetch_sub(&p->app_waiters, 1);
	if (rc != 0) {
		pthread_mutex_lock(&p->lock);
		conn_begin_close(c, rte_rdtsc(), 0);
		pthread_mutex_unlock(&p->lock);
		conn_unref(c);
		return rc;
	}
	if (p->is_memif)
		memif_regions_prefault();  /* before the first message, not during the first hundreds */
	*out = c;
	return 0;
}

/* -- listen, accept ------------------------------------------------------------------- */
int
shim_listen(uint16_t port, const struct shim_conn_opts *opts)
{
	struct shim_port *p = port_get(port);
	struct shim_conn_opts defaults;

	if (p == NULL)
		return -ENODEV;
	if (p->raw)
		return -EBUSY;
	if (opts != NULL && (opts->group < 0 || opts->group >= ACCEPT_GROUPS))
		return -EINVAL;
	if (opts == NULL) {
		shim_conn_opts_default(&defaults);
		opts = &defaults;
	}
	listen_start(p, opts);
	return 0;
}

int
shim_unlisten(uint16_t port)
{
	struct shim_port *p = port_get(port);

	if (p == NULL)
		return -ENODEV;
	listen_stop(p);
	return 0;
}

int
shim_accept(int32_t group, int64_t timeout_ns, struct shim_conn **out)
{
	int rc;

	if (group < 0 || group >= ACCEPT_GROUPS)
		return -EINVAL;
	rc = accept_take(group, timeout_ns, out);
	if (rc == 0 && (*out)->port->is_memif)
		memif_regions_prefault();  /* the new client's region: before its first message */
	return rc;
}

void
shim_accept_cancel(int32_t group)
{
	if (group < 0 || group >= ACCEPT_GROUPS)
		return;
	accept_cancel(group);
}
