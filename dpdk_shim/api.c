/* SPDX-License-Identifier: BSD-3-Clause
 * The channel's blocking calls: connect, listen/accept, send, recv, close.
 * Each loops "poll the port, check the condition, back off" (engine.c explains
 * who polls); every loop has a deadline and watches for a local close.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <rte_random.h>

#include "chan.h"

#define MAX_GROUPS 16
#define ZC_DRAIN_NS 2000000000ull
#define LINK_RETRY_NS 250000000ull

extern atomic_bool shim_down;

static pthread_mutex_t accept_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t accept_cond;
static pthread_once_t accept_once = PTHREAD_ONCE_INIT;
static struct shim_conn *accept_head[MAX_GROUPS], *accept_tail[MAX_GROUPS];
static int accept_cancelled[MAX_GROUPS];

static void
accept_init(void)
{
	pthread_condattr_t a;

	pthread_condattr_init(&a);
	pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
	pthread_cond_init(&accept_cond, &a);
}

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
}

static uint64_t
deadline_of(int64_t timeout_ns, uint64_t now)
{
	return timeout_ns < 0 ? UINT64_MAX : now + ns_to_tsc((uint64_t)timeout_ns);
}

/* The error a call gets from a connection that can carry no more. */
static int
conn_error(const struct shim_conn *c)
{
	if (c->closed_local || atomic_load(&shim_down))
		return -ESHUTDOWN;
	switch (c->state) {
	case CS_OPEN:
	case CS_CONNECTING:
		return 0;
	case CS_PEER_CLOSED:
		return -EPIPE;
	default:
		return c->err ? c->err : -ENOTCONN;
	}
}

/* -- connect / listen / accept ------------------------------------------------------ */
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
		if (p->is_memif && now >= next_restart) {
			shim_port_restart(port);
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
	if (opts != NULL && (opts->group < 0 || opts->group >= MAX_GROUPS))
		return -EINVAL;
	pthread_once(&accept_once, accept_init);
	pthread_mutex_lock(&p->lock);
	if (opts != NULL)
		p->listen_opts = *opts;
	else
		shim_conn_opts_default(&p->listen_opts);
	p->listen_group = p->listen_opts.group;
	p->listening = true;
	pthread_mutex_unlock(&p->lock);
	pthread_mutex_lock(&accept_lock);
	accept_cancelled[p->listen_group] = 0;
	pthread_mutex_unlock(&accept_lock);
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

void
accept_push(struct shim_conn *c)
{
	int g = c->group;

	pthread_once(&accept_once, accept_init);
	pthread_mutex_lock(&accept_lock);
	c->accept_next = NULL;
	if (accept_tail[g])
		accept_tail[g]->accept_next = c;
	else
		accept_head[g] = c;
	accept_tail[g] = c;
	pthread_cond_broadcast(&accept_cond);
	pthread_mutex_unlock(&accept_lock);
}

int
shim_accept(int32_t group, int64_t timeout_ns, struct shim_conn **out)
{
	struct timespec ts;
	int rc = 0;

	if (group < 0 || group >= MAX_GROUPS)
		return -EINVAL;
	pthread_once(&accept_once, accept_init);
	clock_gettime(CLOCK_MONOTONIC, &ts);
	if (timeout_ns >= 0) {
		uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)timeout_ns;

		ts.tv_sec += (time_t)(ns / 1000000000ull);
		ts.tv_nsec = (long)(ns % 1000000000ull);
	}
	pthread_mutex_lock(&accept_lock);
	while (accept_head[group] == NULL && rc == 0) {
		if (accept_cancelled[group] || atomic_load(&shim_down))
			rc = -ESHUTDOWN;
		else if (timeout_ns < 0)
			pthread_cond_wait(&accept_cond, &accept_lock);
		else if (pthread_cond_timedwait(&accept_cond, &accept_lock, &ts) == ETIMEDOUT)
			rc = accept_head[group] ? 0 : -ETIMEDOUT;
	}
	if (rc == 0) {
		struct shim_conn *c = accept_head[group];

		accept_head[group] = c->accept_next;
		if (accept_head[group] == NULL)
			accept_tail[group] = NULL;
		c->accepted = true;
		*out = c;
	}
	pthread_mutex_unlock(&accept_lock);
	return rc;
}

void
shim_accept_cancel(int32_t group)
{
	if (group < 0 || group >= MAX_GROUPS)
		return;
	pthread_once(&accept_once, accept_init);
	pthread_mutex_lock(&accept_lock);
	accept_cancelled[group] = 1;
	pthread_cond_broadcast(&accept_cond);
	pthread_mutex_unlock(&accept_lock);
}

/* -- send ------------------------------------------------------------------------------ */
int
shim_conn_send(struct shim_conn *c, const struct shim_iov *iov, int n)
{
	struct shim_port *p = c->port;
	struct zc_ref *zc = NULL;
	struct waiter w;
	uint64_t total = 0, msg_off = 0, iov_off = 0, now;
	uint32_t msg_id;
	uint64_t progress_at, acked_at;
	bool released = false;
	int iov_i = 0, rc;

	if ((rc = conn_error(c)) != 0)
		return rc;
	for (int i = 0; i < n; i++) {
		total += iov[i].len;
		if (p->zero_copy && c->o.zero_copy_min && iov[i].len >= c->o.zero_copy_min)
			zc = (struct zc_ref *)1;
	}
	if (total == 0)
		return -EINVAL;
	if (zc != NULL) {
		/* On the heap: if a frame could not be reclaimed it may be freed later. */
		zc = malloc(sizeof(*zc));
		if (zc == NULL)
			return -ENOMEM;
		zc_init(zc);
	}
	waiter_init(&w, &c->o);
	atomic_fetch_add(&p->app_waiters, 1);
	pthread_mutex_lock(&p->lock);
	msg_id = c->msg_id_tx++;
	acked_at = c->last_ack_progress;
	pthread_mutex_unlock(&p->lock);
	progress_at = rte_rdtsc();
	for (;;) {
		uint64_t sent_before = msg_off;
		int work;

		pthread_mutex_lock(&p->lock);
		work = chan_port_poll(p);
		now = p->clock;
		rc = conn_error(c);
		while (rc == 0 && msg_off < total && conn_can_send(c) &&
		       p->n_txq < SHIM_TXQ_CAP - SHIM_HOLD_MAX - 2) {
			uint64_t before = msg_off;
			struct rte_mbuf *m = conn_data_frame(c, iov, n, &iov_i, &iov_off, msg_off,
							     total, msg_id, zc);

			if (m == NULL) {
				p->st.tx_nombuf++;
				break;
			}
			msg_off = before + rte_pktmbuf_pkt_len(m) - FRAME_OVERHEAD;
			conn_push_data(c, m, now);
			work++;
			if (p->n_txq >= SHIM_BURST)
				port_flush(p);
		}
		work += port_flush(p);
		pthread_mutex_unlock(&p->lock);
		if (rc != 0)
			break;
		if (msg_off == total) {
			if (zc != NULL && !released) {
				released = true;
				if (rte_mbuf_ext_refcnt_update(&zc->shinfo, -1) == 0)
					atomic_store(&zc->done, 1);
			}
			if (zc == NULL || atomic_load(&zc->done))
				break;
		}
		if (msg_off != sent_before || c->last_ack_progress != acked_at) {
			progress_at = now;
			acked_at = c->last_ack_progress;
		}
		if ((int64_t)(now - progress_at) > (int64_t)c->stall) {
			char why[96];

			snprintf(why, sizeof(why), "send stalled: the peer took nothing for %.0f s",
				 (double)c->o.stall_ns / 1e9);
			pthread_mutex_lock(&p->lock);
			conn_kill(c, -ETIMEDOUT, why);
			pthread_mutex_unlock(&p->lock);
			rc = -ETIMEDOUT;
			break;
		}
		waiter_pause(&w, now, work > 0);
	}
	if (rc == 0) {
		c->st.tx_messages++;
		c->st.tx_bytes += total;
	}
	if (zc != NULL) {
		/* Never return while a frame still points into the caller's buffers. */
		uint64_t until = rte_rdtsc() + ns_to_tsc(ZC_DRAIN_NS);

		if (!released && rte_mbuf_ext_refcnt_update(&zc->shinfo, -1) == 0)
			atomic_store(&zc->done, 1);
		while (!atomic_load(&zc->done) && rte_rdtsc() < until) {
			app_poll(p);
			waiter_pause(&w, rte_rdtsc(), false);
		}
		if (atomic_load(&zc->done))
			free(zc);
		else if (rc == 0)
			rc = -EBUSY;  /* leak zc: a late free callback still writes into it */
	}
	atomic_fetch_sub(&p->app_waiters, 1);
	return rc;
}

/* -- receive ------------------------------------------------------------------------------ */
static int
recv_post(struct shim_conn *c, const struct shim_iov *iov, int n)
{
	struct shim_port *p = c->port;
	struct waiter w;
	uint64_t total = 0, now;
	int rc = 0;

	for (int i = 0; i < n; i++)
		total += iov[i].len;
	if (!c->in_msg || total > c->in_len - c->in_off)
		return -EINVAL;
	if (total == 0)
		return 0;
	waiter_init(&w, &c->o);
	pthread_mutex_lock(&p->lock);
	c->post = iov;
	c->post_n = n;
	c->post_i = 0;
	c->post_off = 0;
	c->post_left = total;
	c->last_rx_progress = port_clock(p);
	pthread_mutex_unlock(&p->lock);
	for (;;) {
		int work;

		pthread_mutex_lock(&p->lock);
		work = chan_port_poll(p);
		now = p->clock;
		if (!c->attached && conn_deliver(c) > 0)  /* pollers skip detached ones */
			work++;
		if (c->post_left == 0) {
			pthread_mutex_unlock(&p->lock);
			break;
		}
		rc = conn_error(c);
		if (rc == 0 && (int64_t)(now - c->last_rx_progress) > (int64_t)c->stall) {
			char why[96];

			snprintf(why, sizeof(why), "message stalled: no frame for %.0f s",
				 (double)c->o.stall_ns / 1e9);
			conn_kill(c, -ETIMEDOUT, why);
			rc = -ETIMEDOUT;
		}
		pthread_mutex_unlock(&p->lock);
		if (rc != 0)
			break;
		waiter_pause(&w, now, work > 0);
	}
	pthread_mutex_lock(&p->lock);
	c->post = NULL;
	c->post_left = 0;
	pthread_mutex_unlock(&p->lock);
	return rc;
}

int64_t
shim_conn_recv_begin(struct shim_conn *c, void *head, uint64_t cap, int64_t timeout_ns,
		     uint64_t *msg_len)
{
	struct shim_port *p = c->port;
	struct shim_iov v;
	struct waiter w;
	uint64_t now = rte_rdtsc(), deadline = deadline_of(timeout_ns, now);
	int rc = 0;

	if (c->in_msg)
		return -EBUSY;  /* the previous message was not read to its end */
	waiter_init(&w, &c->o);
	atomic_fetch_add(&p->app_waiters, 1);
	for (;;) {
		int work;

		pthread_mutex_lock(&p->lock);
		work = chan_port_poll(p);
		now = rte_rdtsc();
		if (c->closed_local || atomic_load(&shim_down)) {
			rc = -ESHUTDOWN;
		} else if (c->rcv_consumed != c->rcv_nxt) {
			struct rx_slot *s = &c->rx[c->rcv_consumed & c->mask];

			/* Validate and start the message here, to know its length. */
			if (s->offset != 0 || s->msg_id != c->in_msg_id || s->msg_len == 0 ||
			    s->len == 0 || s->len > s->msg_len) {
				conn_kill(c, -EPROTO, "the peer broke the message framing");
				rc = -EPROTO;
			} else {
				c->in_msg = true;
				c->in_len = s->msg_len;
				c->in_off = 0;
				pthread_mutex_unlock(&p->lock);
				break;
			}
		} else {
			rc = conn_error(c);
		}
		pthread_mutex_unlock(&p->lock);
		if (rc == 0 && now >= deadline)
			rc = -ETIMEDOUT;
		if (rc != 0) {
			atomic_fetch_sub(&p->app_waiters, 1);
			return rc;
		}
		waiter_pause(&w, now, work > 0);
	}
	*msg_len = c->in_len;
	v.base = head;
	v.len = RTE_MIN(cap, c->in_len);
	rc = recv_post(c, &v, 1);
	atomic_fetch_sub(&p->app_waiters, 1);
	return rc < 0 ? rc : (int64_t)v.len;
}

int
shim_conn_recv_into(struct shim_conn *c, const struct shim_iov *iov, int n)
{
	int rc;

	if (c->closed_local || atomic_load(&shim_down))
		return -ESHUTDOWN;
	atomic_fetch_add(&c->port->app_waiters, 1);
	rc = recv_post(c, iov, n);
	atomic_fetch_sub(&c->port->app_waiters, 1);
	return rc;
}

int
shim_conn_recv_discard(struct shim_conn *c)
{
	struct shim_iov v = { NULL, 0 };

	if (!c->in_msg)
		return 0;
	v.len = c->in_len - c->in_off;
	return shim_conn_recv_into(c, &v, 1);
}

/* -- close, info ------------------------------------------------------------------------ */
void
shim_conn_close(struct shim_conn *c, int64_t linger_ns)
{
	struct shim_port *p = c->port;

	pthread_mutex_lock(&p->lock);
	if (!c->closed_local)
		conn_begin_close(c, rte_rdtsc(), linger_ns < 0 ? 0 : (uint64_t)linger_ns);
	pthread_mutex_unlock(&p->lock);
}

void
shim_conn_free(struct shim_conn *c)
{
	if (c == NULL)
		return;
	if (!c->closed_local)
		shim_conn_close(c, 0);
	conn_unref(c);
}

int
shim_conn_info(struct shim_conn *c, struct shim_conn_info *out)
{
	struct shim_port *p = c->port;

	pthread_mutex_lock(&p->lock);
	out->id = c->id;
	out->port = p->id;
	memcpy(out->peer_mac, c->peer_mac.addr_bytes, 6);
	out->chunk = c->chunk;
	out->window = c->window;
	out->state = c->state;
	out->error = c->err;
	pthread_mutex_unlock(&p->lock);
	return 0;
}

int
shim_conn_stats(struct shim_conn *c, struct shim_conn_stats *out)
{
	struct shim_port *p = c->port;

	pthread_mutex_lock(&p->lock);
	*out = c->st;
	out->rtt_ns = tsc_to_ns(c->srtt);
	pthread_mutex_unlock(&p->lock);
	return 0;
}

int
shim_conn_reason(struct shim_conn *c, char *buf, size_t cap)
{
	struct shim_port *p = c->port;

	pthread_mutex_lock(&p->lock);
	snprintf(buf, cap, "%s", c->state == CS_DEAD || c->state == CS_PEER_CLOSED ? c->reason : "");
	pthread_mutex_unlock(&p->lock);
	return 0;
}
