/* SPDX-License-Identifier: BSD-3-Clause
 * The sending half of the channel and a connection's life: creating, attaching and
 * freeing connections, building frames (data, acks, control), retransmission and its
 * timer, what an incoming ack means to the sender, and the port's TX queue as the channel uses it
 * (peers asleep on a doorbell are rung once their frames are out). The port lock is
 * held throughout.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chan/chan.h"

/* The retransmission timeout (RTO): from RTO_INIT_NS until the first round trip is
 * measured, then srtt + 4 rttvar within [RTO_MIN_NS, RTO_MAX_NS]; it doubles each time
 * the timer fires, up to RTO_MAX_NS. The floor is 2 ms because pollers on 2 cores may
 * nap 1 ms. */
#define RTO_MIN_NS 2000000ull
#define RTO_MAX_NS 250000000ull
#define RTO_INIT_NS 20000000ull
/* Frames resent when the timer fires: the oldest few only, as TCP; acks (and their sacks)
 * drive the rest. */
#define RTO_BURST 4
/* A hole with this many frames held above it is lost, not merely late (reordering moves a
 * frame by one or two). */
#define DUPTHRESH 3
/* A lost retransmission is resent after at least this long (or a round trip). */
#define RETX_AGAIN_NS 1000000ull
/* RESET answers to frames of unknown connections go out at most this often (per polling
 * thread): a stream of stale frames must not become a stream of resets. */
#define RESET_EVERY_NS 10000000ull

static void
retain(struct rte_mbuf *m)
{
	for (struct rte_mbuf *s = m; s != NULL; s = s->next)
		rte_mbuf_refcnt_update(s, 1);
}

/* -- the TX queue ---------------------------------------------------------------------- */
/* Ring the peers of the connections that had frames in the burst just sent. */
static void
ring_due(struct shim_port *p)
{
	for (int i = 0; i < p->n_conns; i++) {
		struct shim_conn *c = p->conns[i];

		if (c->db_due) {
			c->db_due = false;
			if (c->db_peer != NULL)
				db_ring(c->db_peer);
		}
	}
}

void
chan_queue(struct shim_port *p, struct rte_mbuf *m)
{
	if (port_queue(p, m) > 0 && p->shared_memory)
		ring_due(p);  /* a full queue was flushed to make room */
}

int
chan_flush(struct shim_port *p)
{
	int sent = port_flush(p);

	if (sent > 0 && p->shared_memory)
		ring_due(p);  /* wake the peers that sleep waiting for these frames */
	return sent;
}

struct shim_conn *
conn_new(struct shim_port *p, uint32_t id, const struct shim_conn_opts *o)
{
	struct shim_conn *c = calloc(1, sizeof(*c));
	uint32_t w = 64;
	uint32_t max_chunk = (uint32_t)RTE_MIN(p->max_frame - FRAME_OVERHEAD, (uint32_t)UINT16_MAX);

	if (c == NULL)
		return NULL;
	while (w < o->window && w < 32768)
		w <<= 1;
	c->tx = calloc(w, sizeof(*c->tx));
	c->rx = calloc(w, sizeof(*c->rx));
	if (c->tx == NULL || c->rx == NULL) {
		free(c->tx);
		free(c->rx);
		free(c);
		return NULL;
	}
	c->port = p;
	c->id = id;
	atomic_init(&c->refs, 1);
	c->state = CS_CONNECTING;
	c->o = *o;
	c->window = w;
	c->mask = w - 1;
	c->chunk = o->chunk && o->chunk < max_chunk ? o->chunk : max_chunk;
	c->peer_timeout = ns_to_tsc(o->peer_timeout_ns);
	c->ka_interval = c->peer_timeout / 4;
	c->stall = ns_to_tsc(o->stall_ns);
	c->rto = ns_to_tsc(RTO_INIT_NS);
	c->snd_limit = 64;  /* until the handshake tells the peer's window */
	c->last_rx = c->last_tx = c->last_ack_progress = port_clock(p);
	c->group = o->group;
	if (p->shared_memory && o->doorbell)  /* none is no error: waits nap as on other ports */
		c->db_own = db_create(c->db_name, sizeof(c->db_name), &c->db_token);
	return c;
}

void
conn_attach(struct shim_port *p, struct shim_conn *c)
{
	p->conns[p->n_conns++] = c;
	c->attached = true;
	atomic_fetch_add(&c->refs, 1);
}

void
conn_detach(struct shim_conn *c)
{
	struct shim_port *p = c->port;

	if (!c->attached)
		return;
	for (int i = 0; i < p->n_conns; i++) {
		if (p->conns[i] == c) {
			p->conns[i] = p->conns[--p->n_conns];
			break;
		}
	}
	c->attached = false;
	conn_unref(c);
}

void
free_tx(struct shim_conn *c)
{
	while (c->snd_una != c->snd_nxt) {
		struct tx_slot *s = &c->tx[c->snd_una & c->mask];

		rte_pktmbuf_free(s->m);
		s->m = NULL;
		c->snd_una++;
	}
}

void
conn_unref(struct shim_conn *c)
{
	if (atomic_fetch_sub(&c->refs, 1) != 1)
		return;
	free_tx(c);
	for (uint32_t i = 0; i < c->window; i++)
		rte_pktmbuf_free(c->rx[i].m);
	db_unlink(c->db_name);
	db_close(c->db_own);
	db_close(c->db_peer);
	free(c->tx);
	free(c->rx);
	free(c);
}

void
conn_kill(struct shim_conn *c, int err, const char *why)
{
	if (c->state == CS_DEAD || c->state == CS_CLOSED)
		return;
	c->err = err;
	snprintf(c->reason, sizeof(c->reason), "%s", why);
	c->state = CS_DEAD;
	free_tx(c);
	conn_detach(c);
}

static uint64_t
sack_bits(const struct shim_conn *c)
{
	uint64_t bits = 0;

	if (c->n_ooo == 0)
		return 0;
	for (uint32_t i = 0; i < 64; i++) {
		uint32_t seq = c->rcv_nxt + 1 + i;

		if (seq - c->rcv_consumed >= c->window)
			break;
		if (c->rx[seq & c->mask].m != NULL)
			bits |= 1ull << i;
	}
	return bits;
}

/* Our ack, limit and sack go on every frame we send, so a data frame is an ack too. */
static void
fill_ack(struct shim_conn *c, struct frame_hdr *h)
{
	uint32_t limit = c->rcv_consumed + c->window;

	h->ack = rte_cpu_to_be_32(c->rcv_nxt);
	h->limit = rte_cpu_to_be_32(limit);
	h->sack = rte_cpu_to_be_64(sack_bits(c));
	c->unacked = 0;
	c->ack_now = false;
	c->ack_due = 0;
	c->adv_limit = limit;
}

static struct frame_hdr *
start_frame(struct shim_port *p, struct rte_mbuf *m, const struct rte_ether_addr *dst,
	    uint32_t dst_ip, uint8_t type, uint32_t id, uint32_t len)
{
	/* a fresh mbuf always has room for the headers */
	uint8_t *buf = rte_pktmbuf_mtod(m, uint8_t *);
	struct frame_hdr *h = (struct frame_hdr *)(buf + L2L4_LEN);

	m->data_len = FRAME_OVERHEAD;
	m->pkt_len = FRAME_OVERHEAD;

	frame_l2l4(buf, &p->mac, p->ip, dst, dst_ip, (uint32_t)sizeof(*h) + len);
	memset(h, 0, sizeof(*h));
	h->magic = rte_cpu_to_be_16(FRAME_MAGIC);
	h->version = FRAME_VERSION;
	h->type = type;
	h->len = rte_cpu_to_be_16((uint16_t)len);
	h->conn = rte_cpu_to_be_32(id);
	return h;
}

void
conn_send_ctrl(struct shim_conn *c, uint8_t type, uint16_t flags, const void *body,
	       uint32_t len, bool broadcast)
{
	struct shim_port *p = c->port;
	struct rte_ether_addr bcast;
	struct rte_mbuf *m = rte_pktmbuf_alloc(p->pool);
	struct frame_hdr *h;

	if (m == NULL) {
		p->st.tx_nombuf++;
		return;
	}
	memset(&bcast, 0xff, sizeof(bcast));
	h = start_frame(p, m, broadcast ? &bcast : &c->peer_mac,
			broadcast ? 0xffffffffu : c->peer_ip, type, c->id, len);
	if (port_may_corrupt(p))
		flags |= FF_WANT_CRC;  /* the peer covers the chunks it sends us */
	h->flags = rte_cpu_to_be_16(flags);
	h->seq = rte_cpu_to_be_32(c->snd_nxt);
	fill_ack(c, h);
	if (len)
		memcpy(rte_pktmbuf_append(m, (uint16_t)len), body, len);
	h->crc = rte_cpu_to_be_32(frame_crc(h, h + 1, len));
	c->last_tx = p->clock;
	c->db_due = true;
	if (type == FT_ACK)
		p->st.tx_acks++;
	else if (type == FT_KEEPALIVE)
		p->st.tx_keepalives++;
	chan_queue(p, m);
}

void
send_reset(struct shim_port *p, const struct frame *f, uint32_t id, uint64_t now)
{
	static __thread uint64_t next_reset;  /* per polling thread is close enough */
	struct rte_mbuf *m;
	struct frame_hdr *h;

	if (now < next_reset)
		return;
	next_reset = now + ns_to_tsc(RESET_EVERY_NS);
	m = rte_pktmbuf_alloc(p->pool);
	if (m == NULL)
		return;
	h = start_frame(p, m, &f->src, f->src_ip, FT_RESET, id, 0);
	h->crc = rte_cpu_to_be_32(frame_crc(h, NULL, 0));
	chan_queue(p, m);
}

/* -- sending ------------------------------------------------------------------------ */
bool
conn_can_send(const struct shim_conn *c)
{
	return seq_lt(c->snd_nxt, c->snd_una + c->window) && seq_lt(c->snd_nxt, c->snd_limit);
}

static void
zc_free_cb(void *addr, void *opaque)
{
	struct zc_ref *z = opaque;

	(void)addr;
	atomic_store(&z->done, 1);
}

void
zc_init(struct zc_ref *z)
{
	memset(z, 0, sizeof(*z));
	z->shinfo.free_cb = zc_free_cb;
	z->shinfo.fcb_opaque = z;
	rte_mbuf_ext_refcnt_set(&z->shinfo, 1);  /* the sender's own, dropped at the end */
	atomic_init(&z->done, 0);
}

/* The next DATA frame of a message, from the gather state (*iov_i, *iov_off). A chunk
 * that lies inside one long iov is attached as an external buffer (no copy) when the
 * port allows; anything else is copied into the frame's mbuf. */
struct rte_mbuf *
conn_data_frame(struct shim_conn *c, const struct shim_iov *iov, int n, int *iov_i,
		uint64_t *iov_off, uint64_t msg_off, uint64_t total, uint32_t msg_id,
		struct zc_ref *zc)
{
	struct shim_port *p = c->port;
	uint32_t len = (uint32_t)RTE_MIN((uint64_t)c->chunk, total - msg_off);
	struct rte_mbuf *m, *d = NULL;
	struct frame_hdr *h;
	uint32_t crc;
	bool cover;

	while (*iov_i < n && *iov_off == iov[*iov_i].len) {
		(*iov_i)++;
		*iov_off = 0;
	}
	m = rte_pktmbuf_alloc(p->pool);
	if (m == NULL)
		return NULL;
	h = start_frame(p, m, &c->peer_mac, c->peer_ip, FT_DATA, c->id, len);
	h->seq = rte_cpu_to_be_32(c->snd_nxt);
	h->msg_id = rte_cpu_to_be_32(msg_id);
	h->offset = rte_cpu_to_be_64(msg_off);
	h->msg_len = rte_cpu_to_be_64(total);
	if (msg_off + len == total || c->snd_nxt + 1 == c->snd_limit)
		h->flags = rte_cpu_to_be_16(FF_ACK_NOW);  /* the sender is about to wait */
	fill_ack(c, h);
	/* CRC32C of a chunk costs about what a copy of it does: skip it where no medium on
	 * the way can corrupt (memif, ring), keep it wherever one can (port_may_corrupt) */
	cover = c->data_crc || port_may_corrupt(p);
	if (port_may_corrupt(p))
		h->flags |= rte_cpu_to_be_16(FF_WANT_CRC);
	if (!cover) {
		h->flags |= rte_cpu_to_be_16(FF_NO_DATA_CRC);
		c->st.tx_no_crc_frames++;
	}
	if (zc != NULL && iov[*iov_i].len >= c->o.zero_copy_min &&
	    iov[*iov_i].len - *iov_off >= len) {
		uint8_t *addr = (uint8_t *)iov[*iov_i].base + *iov_off;

		d = rte_pktmbuf_alloc(p->pool);
		if (d == NULL) {
			rte_pktmbuf_free(m);
			return NULL;
		}
		rte_mbuf_ext_refcnt_update(&zc->shinfo, 1);
		rte_pktmbuf_attach_extbuf(d, addr, RTE_BAD_IOVA, (uint16_t)len, &zc->shinfo);
		d->data_len = (uint16_t)len;
		d->pkt_len = len;
		crc = frame_crc(h, addr, cover ? len : 0);
		rte_pktmbuf_chain(m, d);
		*iov_off += len;
		c->st.tx_zero_copy_frames++;
	} else {
		uint8_t *dst = (uint8_t *)rte_pktmbuf_append(m, (uint16_t)len);
		uint32_t left = len;

		while (left) {
			const struct shim_iov *v = &iov[*iov_i];
			uint64_t k = RTE_MIN((uint64_t)left, v->len - *iov_off);

			if (k == 0) {
				(*iov_i)++;
				*iov_off = 0;
				continue;
			}
			memcpy(dst, (const uint8_t *)v->base + *iov_off, k);
			dst += k;
			left -= (uint32_t)k;
			*iov_off += k;
		}
		crc = frame_crc(h, h + 1, cover ? len : 0);
	}
	h->crc = rte_cpu_to_be_32(crc);
	return m;
}

void
conn_push_data(struct shim_conn *c, struct rte_mbuf *m, uint64_t now)
{
	struct tx_slot *s = &c->tx[c->snd_nxt & c->mask];

	retain(m);
	s->m = m;
	s->sent = now;
	s->n_tx = 1;
	s->sacked = false;
	if (c->snd_una == c->snd_nxt)
		c->last_ack_progress = now;  /* the stall clock starts with the first frame out */
	c->snd_nxt++;
	c->last_tx = now;
	c->db_due = true;
	c->st.tx_frames++;
	chan_queue(c->port, m);
}

/* A frame sent without its chunk's CRC to a peer that since asked for it (its port
 * began to corrupt, so it drops uncovered chunks): cover it before sending it again. */
static void
cover_chunk(struct rte_mbuf *m)
{
	struct frame_hdr *h = rte_pktmbuf_mtod_offset(m, struct frame_hdr *, L2L4_LEN);
	const void *chunk = m->next != NULL ? rte_pktmbuf_mtod(m->next, const void *) : (const void *)(h + 1);

	h->flags &= ~rte_cpu_to_be_16(FF_NO_DATA_CRC);
	h->crc = rte_cpu_to_be_32(frame_crc(h, chunk, rte_be_to_cpu_16(h->len)));
}

void
retransmit(struct shim_conn *c, struct tx_slot *s, uint64_t now)
{
	if (c->data_crc && (rte_pktmbuf_mtod_offset(s->m, struct frame_hdr *, L2L4_LEN)->flags &
			    rte_cpu_to_be_16(FF_NO_DATA_CRC)))
		cover_chunk(s->m);
	retain(s->m);
	chan_queue(c->port, s->m);
	s->sent = now;
	s->n_tx++;
	c->last_tx = now;
	c->db_due = true;
	c->port->st.tx_retransmits++;
	c->st.tx_retransmits++;
}

void
conn_retransmit_due(struct shim_conn *c, uint64_t now)
{
	struct tx_slot *s;
	int budget = RTO_BURST;

	if (c->snd_una == c->snd_nxt)
		return;
	s = &c->tx[c->snd_una & c->mask];
	if (now - s->sent <= c->rto)
		return;
	for (uint32_t seq = c->snd_una; seq != c->snd_nxt && budget > 0; seq++) {
		struct tx_slot *t = &c->tx[seq & c->mask];

		if (!t->sacked && now - t->sent > c->rto) {
			retransmit(c, t, now);
			budget--;
		}
	}
	c->rto = RTE_MIN(c->rto * 2, ns_to_tsc(RTO_MAX_NS));
}

static void
rtt_sample(struct shim_conn *c, uint64_t r)
{
	uint64_t lo = ns_to_tsc(RTO_MIN_NS), hi = ns_to_tsc(RTO_MAX_NS);

	if (c->srtt == 0) {
		c->srtt = r;
		c->rttvar = r / 2;
	} else {
		uint64_t d = c->srtt > r ? c->srtt - r : r - c->srtt;

		c->rttvar = (3 * c->rttvar + d) / 4;
		c->srtt = (7 * c->srtt + r) / 8;
	}
	c->rto = RTE_MAX(lo, RTE_MIN(hi, c->srtt + 4 * c->rttvar));
}

void
on_ack(struct shim_conn *c, const struct frame_hdr *h, uint64_t now)
{
	uint32_t ack = rte_be_to_cpu_32(h->ack);
	uint32_t limit = rte_be_to_cpu_32(h->limit);
	uint64_t sack = rte_be_to_cpu_64(h->sack);

	if (seq_lt(c->snd_una, ack) && seq_le(ack, c->snd_nxt)) {
		struct tx_slot *last = &c->tx[(ack - 1) & c->mask];

		if (last->n_tx == 1)
			rtt_sample(c, now - last->sent);
		while (c->snd_una != ack) {
			struct tx_slot *s = &c->tx[c->snd_una & c->mask];

			rte_pktmbuf_free(s->m);
			s->m = NULL;
			c->snd_una++;
		}
		c->last_ack_progress = now;
	}
	if (seq_lt(c->snd_limit, limit) && seq_le(limit, ack + c->window * 2 + 65536))
		c->snd_limit = limit;
	if (sack != 0 && seq_le(c->snd_una, ack)) {
		uint32_t hi = c->snd_una, above = 0;
		uint64_t again = RTE_MAX(ns_to_tsc(RETX_AGAIN_NS), c->srtt);

		for (uint32_t i = 0; i < 64; i++) {
			uint32_t seq = ack + 1 + i;

			if (!seq_lt(seq, c->snd_nxt))
				break;
			if (sack & (1ull << i)) {
				c->tx[seq & c->mask].sacked = true;
				hi = seq;
			}
		}
		/* A frame not held by the peer below DUPTHRESH frames it holds is lost, not
		 * merely late (reordering moves a frame by one or two): resend it now, and
		 * again only after a round trip if that copy was lost too. */
		for (uint32_t k = 0; k <= hi - c->snd_una; k++) {
			struct tx_slot *s = &c->tx[(hi - k) & c->mask];

			if (s->sacked)
				above++;
			else if (above >= DUPTHRESH && (s->n_tx == 1 || now - s->sent > again))
				retransmit(c, s, now);
		}
	}
}

