/* SPDX-License-Identifier: BSD-3-Clause
 * Making connections: a client's connect (link first, then HELLO until ACCEPT), a
 * server's listen (the accept queues that HELLOs fill are accept.c's).
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>

#include <rte_random.h>

#include "chan.h"

#define LINK_RETRY_NS 250000000ull

extern atomic_bool shim_down;

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

/* DPDK 22.11's memif server panics in its interrupt thread (or, once the fd number is
 * reused, blocks it in a read on another client's control socket: no new client is
 * accepted) when a control connection closes before the server accepted it: the HELLO
 * it then sends fails and that error path frees the channel but leaves its fd
 * registered. A restart closes the control connection, so restart only while this
 * process holds none: a connected SOCK_SEQPACKET socket whose peer has a name (the
 * server's socket; the server's own accepted ends have unnamed peers) means the
 * handshake is queued or under way, and memif closes it itself when refused. */
static bool
memif_control_open(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	bool found = false;

	if (d == NULL)
		return false;
	while (!found && (e = readdir(d)) != NULL) {
		struct sockaddr_un peer;
		socklen_t len = sizeof(peer), tlen;
		int fd = atoi(e->d_name), type;

		tlen = sizeof(type);
		if (e->d_name[0] == '.' || fd == dirfd(d) ||
		    getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) != 0 || type != SOCK_SEQPACKET)
			continue;
		found = getpeername(fd, (struct sockaddr *)&peer, &len) == 0 && peer.sun_family == AF_UNIX &&
		       len > sizeof(sa_family_t);
	}
	closedir(d);
	return found;
}

/* -- connect / listen ---------------------------------------------------------------- */
int
shim_connect(uint16_t port, const struct shim_conn_opts *opts, int64_t timeout_ns,
	     struct shim_conn **out)
{
	struct shim_port *p = port_get(port);
	struct shim_conn_opts defaults;
	struct shim_conn *c;
	struct waiter w;
	uint64_t now = rte_rdtsc(), deadline = deadline_of(timeout_ns, now), next_restart;
	uint32_t id;
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
	/* The link first: a memif client is up once the server took its socket. A memif
	 * client does not retry by itself (server not there yet, or gone and back, or
	 * this interface id busy): stop and start it now and then. */
	next_restart = p->started ? now + ns_to_tsc(LINK_RETRY_NS) : now;
	while (shim_port_link(port) != 1) {
		struct timespec ts = { 0, 1000000 };

		now = rte_rdtsc();
		if (now >= deadline || atomic_load(&shim_down))
			return -ENOLINK;
		if (p->is_memif && now >= next_restart && !memif_control_open()) {
			pthread_mutex_lock(&p->lock);
			chan_port_down(p, "port restarted");
			port_restart(p);
			pthread_mutex_unlock(&p->lock);
			next_restart = now + ns_to_tsc(LINK_RETRY_NS);
		}
		nanosleep(&ts, NULL);
	}
	do
		id = (uint32_t)rte_rand();
	while (id == 0);
	pthread_mutex_lock(&p->lock);
	if (p->n_conns >= SHIM_MAX_CONNS || (c = conn_new(p, id, opts)) == NULL) {
		pthread_mutex_unlock(&p->lock);
		return -ENOMEM;
	}
	conn_attach(p, c);
	pthread_mutex_unlock(&p->lock);
	atomic_fetch_add(&p->app_waiters, 1);
	for (;;) {
		int work = app_poll(p);

		now = rte_rdtsc();

		if (c->state == CS_OPEN)
			break;
		rc = c->state == CS_CONNECTING ? (atomic_load(&shim_down) ? -ESHUTDOWN : 0) : conn_error(c);
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

int
shim_listen(uint16_t port, const struct shim_conn_opts *opts)
{
	struct shim_port *p = port_get(port);

	if (p == NULL)
		return -ENODEV;
	if (p->raw)
		return -EBUSY;
	if (opts != NULL && (opts->group < 0 || opts->group >= ACCEPT_GROUPS))
		return -EINVAL;
	pthread_mutex_lock(&p->lock);
	if (opts != NULL)
		p->listen_opts = *opts;
	else
		shim_conn_opts_default(&p->listen_opts);
	p->listen_group = p->listen_opts.group;
	p->listening = true;
	pthread_mutex_unlock(&p->lock);
	accept_reopen(p->listen_group);
	return 0;
}

int
shim_unlisten(uint16_t port)
{
	struct shim_port *p = port_get(port);

	if (p == NULL)
		return -ENODEV;
	pthread_mutex_lock(&p->lock);
	p->listening = false;
	pthread_mutex_unlock(&p->lock);
	return 0;
}

