/* SPDX-License-Identifier: BSD-3-Clause
 * Making connections: a client's link and its new connection (which says HELLO until
 * ACCEPT: hello.c; api/connect.c waits for that), a server's listen (the accept queues
 * that HELLOs fill are accept.c's).
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

#include "chan/chan.h"

#define LINK_RETRY_NS 250000000ull

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

/* -- connect --------------------------------------------------------------------------- */
int
connect_link(struct shim_port *p, uint64_t now, uint64_t deadline)
{
	/* A memif client is up once the server took its socket. It does not retry by itself
	 * (server not there yet, or gone and back, or this interface id busy): stop and
	 * start it now and then. */
	uint64_t next_restart = p->started ? now + ns_to_tsc(LINK_RETRY_NS) : now;

	while (port_link(p->id) != 1) {
		struct timespec ts = { 0, 1000000 };

		now = rte_rdtsc();
		if (now >= deadline || atomic_load(&shutting_down))
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
	return 0;
}

int
connect_open(struct shim_port *p, const struct shim_conn_opts *o, struct shim_conn **out)
{
	struct shim_conn *c;
	uint32_t id;

	do
		id = (uint32_t)rte_rand();
	while (id == 0);
	pthread_mutex_lock(&p->lock);
	if (p->n_conns >= SHIM_MAX_CONNS || (c = conn_new(p, id, o)) == NULL) {
		pthread_mutex_unlock(&p->lock);
		return -ENOMEM;
	}
	conn_attach(p, c);
	pthread_mutex_unlock(&p->lock);
	*out = c;
	return 0;
}

/* -- listen ---------------------------------------------------------------------------- */
void
listen_start(struct shim_port *p, const struct shim_conn_opts *o)
{
	pthread_mutex_lock(&p->lock);
	p->listen_opts = *o;
	p->listen_group = p->listen_opts.group;
	p->listening = true;
	pthread_mutex_unlock(&p->lock);
	accept_reopen(p->listen_group);
}

void
listen_stop(struct shim_port *p)
{
	pthread_mutex_lock(&p->lock);
	p->listening = false;
	pthread_mutex_unlock(&p->lock);
}
