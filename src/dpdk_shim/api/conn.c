/* SPDX-License-Identifier: BSD-3-Clause
 * The channel's blocking calls on a connection: send, recv, close, and what Python
 * reads about it. Each loops "poll the port, check the condition, back off" (wait/engine.c
 * explains who polls); every loop has a deadline and watches for a local close.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

#define ZC_DRAIN_NS 2000000000ull

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
	waiter_init_conn(&w, c);
	atomic_fetch_add(&p->app_waiters, 1);
	progress_at = rte_rdtsc();
	for (int pass = 0;; pass++) {
		uint64_t sent_before = msg_off;
		int work = 0;

		pthread_mutex_lock(&p->lock);
		if (pass == 0) {
			/* The first pass only sends (a small message costs one lock, one burst);
			 * acks and anything else wait for the next pass or the next poll. */
			msg_id = c->msg_id_tx++;
			acked_at = c->last_ack_progress;
			now = port_clock(p);
		} else {
			work = chan_port_poll(p);
			now = p->clock;
		}
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
				chan_flush(p);
		}
		if (!c->corked || msg_off != total || zc != NULL)
			work += chan_flush(p);
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
	waiter_init_conn(&w, c);
	pthread_mutex_lock(&p->lock);
	c->post = iov;
	c->post_n = n;
	c->post_i = 0;
	c->post_off = 0;
	c->post_left = total;
	c->last_rx_progress = port_clock(p);
	conn_deliver(c);  /* what already arrived needs no poll (a small message: all of it) */
	if (c->post_left == 0) {
		c->post = NULL;
		pthread_mutex_unlock(&p->lock);
		return 0;
	}
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
conn_recv_begin(struct shim_conn *c, void *head, uint64_t cap, int64_t timeout_ns,
		uint64_t *msg_len)
{
	struct shim_port *p = c->port;
	struct shim_iov v;
	struct waiter w;
	uint64_t now = rte_rdtsc(), deadline = deadline_of(timeout_ns, now);
	int rc = 0;

	if (c->in_msg)
		return -EBUSY;  /* the previous message was not read to its end */
	waiter_init_conn(&w, c);
	atomic_fetch_add(&p->app_waiters, 1);
	for (;;) {
		int work;

		pthread_mutex_lock(&p->lock);
		work = chan_port_poll(p);
		now = rte_rdtsc();
		if (c->closed_local || atomic_load(&shutting_down)) {
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

	if (c->closed_local || atomic_load(&shutting_down))
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

int
shim_conn_cork(struct shim_conn *c, int on)
{
	struct shim_port *p = c->port;

	if (atomic_load(&shutting_down))
		return -ESHUTDOWN;
	pthread_mutex_lock(&p->lock);
	c->corked = on != 0;
	if (!c->corked)
		chan_flush(p);
	pthread_mutex_unlock(&p->lock);
	return 0;
}

/* -- close, info ------------------------------------------------------------------------ */
void
shim_conn_close(struct shim_conn *c, int64_t linger_ns)
{
	struct shim_port *p = c->port;

	if (atomic_load(&shutting_down)) {  /* ports are closed: nothing may touch them */
		c->closed_local = true;
		return;
	}
	pthread_mutex_lock(&p->lock);
	if (!c->closed_local)
		conn_begin_close(c, rte_rdtsc(), linger_ns < 0 ? 0 : (uint64_t)linger_ns);
	pthread_mutex_unlock(&p->lock);
	if (c->db_own != NULL)
		db_ring(c->db_own);  /* a thread asleep in recv sees the close now */
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
	out->doorbell = c->db_own != NULL && c->db_peer != NULL;
	out->db_sleeps = __atomic_load_n(&c->db_sleeps, __ATOMIC_RELAXED);
	out->db_wakeups = __atomic_load_n(&c->db_wakeups, __ATOMIC_RELAXED);
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
