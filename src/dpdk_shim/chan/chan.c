/* SPDX-License-Identifier: BSD-3-Clause
 * The receiving half of the channel: frames in (demultiplexed by connection id and
 * peer MAC; the handshake's are hello.c's), duplicates and reordering, the in-order copy
 * into posted buffers, timers (acks, keepalive, liveness; retransmission's is conn.c's) and
 * the port's poll. Every function here runs with the port lock held, by whichever thread polls.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chan/chan.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* A message from this many bytes on is copied into its posted buffers with streaming
 * (non-temporal) stores. Such a message's destination (a tensor's storage, a .cpu()
 * result) is far larger than the caches by the time it is whole, so its lines would
 * only be fetched to be overwritten and then evicted: ordinary stores read every
 * destination line first. Smaller messages keep ordinary stores: their reader usually
 * finds them in cache. */
#define STREAM_MESSAGE_MIN (4u << 20)

/* A lone frame is acked after this long: a second frame, or a reply to piggyback on,
 * usually comes sooner, and one ack then covers both. */
#define ACK_DELAY_NS 50000ull
/* A connecting client says HELLO again this often until the server answers. */
#define HELLO_EVERY_NS 50000000ull
/* GOODBYE is sent this many times (frames may be lost; duplicates are ignored). */
#define GOODBYE_COPIES 3
/* Receive bursts per poll, to bound how long a poll holds the port lock. */
#define RX_ROUNDS 4

#if defined(__x86_64__)
/* A whole cache line a store where the CPU has AVX-512 (a line written in pieces leaves
 * its write-combining buffer partly full in between). Measured on the project's VM, 16 KiB
 * chunks from a cached frame at a 58-byte offset into a 256 MiB destination: memcpy
 * 9.6-11.3 GB/s, 16-byte streaming stores 13.6-18.6, 64-byte ones 23.5-28.0. */
__attribute__((target("avx512f"))) static void
copy_streaming_lines(uint8_t *dst, const uint8_t *src, uint64_t n)
{
	for (; n > 0 && ((uintptr_t)dst & 63) != 0; n--)
		*dst++ = *src++;
	for (; n >= 64; n -= 64, dst += 64, src += 64)
		_mm512_stream_si512((void *)dst, _mm512_loadu_si512(src));
	memcpy(dst, src, n);
}

/* Every x86-64 has SSE2's 16-byte streaming stores. */
static void
copy_streaming_sse2(uint8_t *dst, const uint8_t *src, uint64_t n)
{
	for (; n > 0 && ((uintptr_t)dst & 15) != 0; n--)
		*dst++ = *src++;
	for (; n >= 64; n -= 64, dst += 64, src += 64) {
		__m128i a = _mm_loadu_si128((const __m128i *)src);
		__m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
		__m128i d = _mm_loadu_si128((const __m128i *)(src + 32));
		__m128i e = _mm_loadu_si128((const __m128i *)(src + 48));

		_mm_stream_si128((__m128i *)dst, a);
		_mm_stream_si128((__m128i *)(dst + 16), b);
		_mm_stream_si128((__m128i *)(dst + 32), d);
		_mm_stream_si128((__m128i *)(dst + 48), e);
	}
	memcpy(dst, src, n);
}
#endif

/* memcpy whose stores bypass the caches where the CPU can; the caller fences before
 * anyone else may read the bytes. */
static void
copy_streaming(uint8_t *dst, const uint8_t *src, uint64_t n)
{
#if defined(__x86_64__)
	if (__builtin_cpu_supports("avx512f"))
		copy_streaming_lines(dst, src, n);
	else
		copy_streaming_sse2(dst, src, n);
#else
	memcpy(dst, src, n);
#endif
}

static void
streaming_fence(void)
{
#if defined(__x86_64__)
	_mm_sfence();  /* streaming stores are weakly ordered: make them visible first */
#endif
}

/* -- receiving ---------------------------------------------------------------------- */
static void
on_data(struct shim_conn *c, const struct frame *f)
{
	uint32_t seq = rte_be_to_cpu_32(f->h->seq);
	struct shim_port *p = c->port;
	struct rx_slot *s;

	c->st.rx_frames++;
	c->unacked++;
	if (rte_be_to_cpu_16(f->h->flags) & FF_ACK_NOW)
		c->ack_now = true;
	if (seq_lt(seq, c->rcv_nxt) || c->rx[seq & c->mask].m != NULL) {
		p->st.rx_dup++;
		c->st.rx_dup++;
		c->ack_now = true;  /* the sender missed our ack: repeat it */
		rte_pktmbuf_free(f->m);
		return;
	}
	if (seq - c->rcv_consumed >= c->window) {
		p->st.rx_out_of_window++;
		c->ack_now = true;
		rte_pktmbuf_free(f->m);
		return;
	}
	s = &c->rx[seq & c->mask];
	s->m = f->m;
	s->chunk = f->chunk;
	s->len = f->len;
	s->msg_id = rte_be_to_cpu_32(f->h->msg_id);
	s->offset = rte_be_to_cpu_64(f->h->offset);
	s->msg_len = rte_be_to_cpu_64(f->h->msg_len);
	if (seq == c->rcv_nxt) {
		c->rcv_nxt++;
		while (c->rcv_nxt - c->rcv_consumed < c->window && c->rx[c->rcv_nxt & c->mask].m) {
			c->rcv_nxt++;
			c->n_ooo--;
		}
	} else {
		c->n_ooo++;
		p->st.rx_out_of_order++;
		c->st.rx_out_of_order++;
		c->ack_now = true;  /* our sack shows the hole: the sender can fill it now */
	}
}

/* The frame that starts or continues the current message must agree with it. */
static bool
msg_check(struct shim_conn *c, const struct rx_slot *s)
{
	if (!c->in_msg) {
		if (s->offset != 0 || s->msg_id != c->in_msg_id || s->msg_len == 0 ||
		    s->len == 0 || s->len > s->msg_len)
			return false;
		c->in_msg = true;
		c->in_len = s->msg_len;
		c->in_off = 0;
		return true;
	}
	return s->msg_id == c->in_msg_id && s->offset == c->in_off && s->msg_len == c->in_len &&
	       s->len > 0 && s->len <= c->in_len - c->in_off;
}

/* Copy in-order frames into the posted buffers (or drop them for a discard). */
uint64_t
conn_deliver(struct shim_conn *c)
{
	uint64_t done = 0;
	bool streamed = false;

	while (c->post_left > 0 && c->rcv_consumed != c->rcv_nxt) {
		struct rx_slot *s = &c->rx[c->rcv_consumed & c->mask];
		uint32_t avail;

		if (c->frame_off == 0 && !msg_check(c, s)) {
			conn_kill(c, -EPROTO, "the peer broke the message framing");
			return done;
		}
		avail = s->len - c->frame_off;
		while (avail > 0 && c->post_left > 0) {
			const struct shim_iov *v = &c->post[c->post_i];
			uint64_t k = RTE_MIN((uint64_t)avail, v->len - c->post_off);

			if (k == 0) {
				c->post_i++;
				c->post_off = 0;
				continue;
			}
			if (v->base == NULL) {
				/* a discard: nothing to copy */
			} else if (c->in_len >= STREAM_MESSAGE_MIN) {
				copy_streaming((uint8_t *)v->base + c->post_off, s->chunk + c->frame_off, k);
				streamed = true;
			} else {
				memcpy((uint8_t *)v->base + c->post_off, s->chunk + c->frame_off, k);
			}
			c->post_off += k;
			c->post_left -= k;
			c->frame_off += (uint32_t)k;
			avail -= (uint32_t)k;
			done += k;
		}
		if (c->frame_off < s->len)
			break;
		c->in_off += s->len;
		c->st.rx_bytes += s->len;
		rte_pktmbuf_free(s->m);
		s->m = NULL;
		c->frame_off = 0;
		c->rcv_consumed++;
		if (c->in_off == c->in_len) {
			c->in_msg = false;
			c->in_msg_id++;
			c->st.rx_messages++;
		}
	}
	if (streamed)
		streaming_fence();
	/* Reopen the sender's window before it runs dry. */
	if (done && c->rcv_consumed + c->window - c->adv_limit >= c->window / 4)
		c->ack_now = true;
	return done;
}

/* -- control frames ------------------------------------------------------------------ */
static struct shim_conn *
find_conn(struct shim_port *p, uint32_t id, const struct rte_ether_addr *src)
{
	for (int i = 0; i < p->n_conns; i++) {
		struct shim_conn *c = p->conns[i];

		if (c->id == id && (c->state == CS_CONNECTING || rte_is_same_ether_addr(&c->peer_mac, src)))
			return c;
	}
	return NULL;
}

/* The peer sent a chunk without its CRC to a port that has begun to corrupt frames: an
 * ACK (it carries FF_WANT_CRC) tells it to cover them, its retransmissions included. */
static void
ask_cover(struct shim_port *p, const struct frame *f)
{
	struct shim_conn *c = find_conn(p, rte_be_to_cpu_32(f->h->conn), &f->src);

	if (c != NULL && c->state == CS_OPEN)
		conn_send_ctrl(c, FT_ACK, 0, NULL, 0, false);
}

static void
on_frame(struct shim_port *p, struct frame *f, uint64_t now)
{
	const struct frame_hdr *h = f->h;
	uint32_t id = rte_be_to_cpu_32(h->conn);
	struct shim_conn *c = find_conn(p, id, &f->src);

	switch (h->type) {
	case FT_HELLO:
		on_hello(p, f, c, now);
		goto done;
	case FT_ACCEPT:
		if (c != NULL && c->state == CS_CONNECTING)
			on_accept(c, f, now);
		goto done;
	case FT_RESET:
		if (c != NULL && c->state != CS_CONNECTING)
			conn_kill(c, -ECONNRESET, "the peer reset the connection (it no longer knows it)");
		goto done;
	default:
		break;
	}
	if (c == NULL || c->state == CS_CONNECTING) {
		p->st.rx_no_conn++;
		if (h->type != FT_GOODBYE)
			send_reset(p, f, id, now);
		goto done;
	}
	c->last_rx = now;
	if (unlikely(c->db_name[0] != '\0'))
		db_unlink(c->db_name);  /* the client sends only once it mapped our ACCEPT's */
	if (h->flags & rte_cpu_to_be_16(FF_WANT_CRC))
		c->data_crc = true;  /* sticky: the peer's port can corrupt what we send */
	on_ack(c, h, now);
	if (h->type == FT_DATA) {
		on_data(c, f);
		return;  /* the frame is stored or freed */
	}
	if (h->type == FT_GOODBYE && c->state == CS_OPEN) {
		c->goodbye_seq = rte_be_to_cpu_32(h->seq);
		snprintf(c->reason, sizeof(c->reason), "the peer closed the connection");
		c->err = -EPIPE;
		c->state = CS_PEER_CLOSED;
		free_tx(c);
		conn_detach(c);
	}
done:
	rte_pktmbuf_free(f->m);
}

static void
conn_timers(struct shim_conn *c, uint64_t now)
{
	if (c->state == CS_CONNECTING) {
		if (now >= c->hello_next) {
			hello_send(c, FT_HELLO, true);
			c->hello_next = now + ns_to_tsc(HELLO_EVERY_NS);
		}
		return;
	}
	if (c->state != CS_OPEN)
		return;
	if (now - c->last_rx > c->peer_timeout) {
		char why[96];

		snprintf(why, sizeof(why), "no frame from the peer for %.1f s",
			 (double)tsc_to_ns(now - c->last_rx) / 1e9);
		conn_kill(c, -EHOSTDOWN, why);
		return;
	}
	if (c->closed_local && (c->snd_una == c->snd_nxt || now > c->linger_deadline)) {
		for (int i = 0; i < GOODBYE_COPIES; i++)
			conn_send_ctrl(c, FT_GOODBYE, 0, NULL, 0, false);
		c->state = CS_CLOSED;
		free_tx(c);
		conn_detach(c);
		return;
	}
	conn_retransmit_due(c, now);
	if (c->unacked > 0) {
		if (c->ack_now || c->unacked >= RTE_MAX(8u, c->window / 16))
			conn_send_ctrl(c, FT_ACK, 0, NULL, 0, false);
		else if (c->ack_due == 0)
			c->ack_due = now + ns_to_tsc(ACK_DELAY_NS);
		else if (now >= c->ack_due)
			conn_send_ctrl(c, FT_ACK, 0, NULL, 0, false);
	} else if (c->ack_now) {
		conn_send_ctrl(c, FT_ACK, 0, NULL, 0, false);  /* a window update */
	}
	if (now - c->last_tx > c->ka_interval)
		conn_send_ctrl(c, FT_KEEPALIVE, 0, NULL, 0, false);
}

void
conn_begin_close(struct shim_conn *c, uint64_t now, uint64_t linger_ns)
{
	c->closed_local = true;
	switch (c->state) {
	case CS_OPEN:
		/* Timers send GOODBYE once the peer has everything, or the linger ends. */
		c->linger_deadline = now + ns_to_tsc(linger_ns);
		conn_timers(c, now);
		break;
	case CS_CONNECTING:
	case CS_PEER_CLOSED:
	case CS_DEAD:
		c->state = CS_CLOSED;
		free_tx(c);
		conn_detach(c);
		break;
	default:
		break;
	}
}

void
chan_port_down(struct shim_port *p, const char *why)
{
	for (int i = p->n_conns - 1; i >= 0; i--)
		if (p->conns[i]->state != CS_CONNECTING)
			conn_kill(p->conns[i], -ENOLINK, why);
	for (int i = 0; i < p->n_txq; i++)
		rte_pktmbuf_free(p->txq[i]);
	p->n_txq = 0;
}

void
chan_port_close_all(struct shim_port *p, uint64_t now, uint64_t linger_ns)
{
	for (int k = p->n_conns - 1; k >= 0; k--) {  /* a close may detach it */
		struct shim_conn *c = p->conns[k];

		if (c->state == CS_OPEN && !c->closed_local)
			conn_begin_close(c, now, linger_ns);
	}
}

bool
chan_port_lingering(struct shim_port *p, uint64_t now)
{
	for (int k = 0; k < p->n_conns; k++) {
		struct shim_conn *c = p->conns[k];

		if (c->state == CS_OPEN && c->closed_local && now <= c->linger_deadline)
			return true;
	}
	return false;
}

void
chan_port_goodbye(struct shim_port *p)
{
	for (int k = p->n_conns - 1; k >= 0; k--) {
		struct shim_conn *c = p->conns[k];

		if (c->state == CS_OPEN)
			for (int j = 0; j < GOODBYE_COPIES; j++)
				conn_send_ctrl(c, FT_GOODBYE, 0, NULL, 0, false);
	}
	chan_flush(p);
}

int
chan_port_poll(struct shim_port *p)
{
	struct rte_mbuf *pkts[2 * SHIM_BURST + SHIM_HOLD_MAX];
	uint64_t now;
	int work = 0;

	if (!p->ready)
		return 0;  /* removed or shut down: its connections are dead already */
	now = port_clock(p);
	if (port_check_link(p, now))
		chan_port_down(p, "link down: the peer's port went away");
	for (int round = 0; round < RX_ROUNDS; round++) {
		uint16_t n = port_rx(p, pkts, (uint16_t)RTE_DIM(pkts));

		for (uint16_t i = 0; i < n; i++) {
			struct frame f;
			int ret;

			pkts[i] = frame_linear(p->pool, pkts[i]);
			if (pkts[i] == NULL) {
				p->st.rx_malformed++;
				continue;
			}
			ret = frame_parse(pkts[i], &p->mac, port_may_corrupt(p), &f);

			if (ret == 0) {
				p->st.rx_frames++;
				p->st.rx_bytes += rte_pktmbuf_pkt_len(pkts[i]);
				on_frame(p, &f, now);
				continue;
			}
			if (ret == -ENOENT)
				p->st.rx_ignored++;
			else if (ret == -EILSEQ)
				p->st.rx_bad_crc++;
			else if (ret == -ENOMSG) {
				p->st.rx_bad_crc++;
				ask_cover(p, &f);
			}
			else
				p->st.rx_malformed++;
			rte_pktmbuf_free(pkts[i]);
		}
		work += n;
		__atomic_store_n(&p->rx_count, p->rx_count + n, __ATOMIC_RELEASE);
		if (n < SHIM_BURST)
			break;
	}
	for (int i = p->n_conns - 1; i >= 0; i--) {
		struct shim_conn *c = p->conns[i];

		if (c->post_left > 0 && conn_deliver(c) > 0)
			c->last_rx_progress = now;
		if (i < p->n_conns && p->conns[i] == c)
			conn_timers(c, now);
	}
	work += chan_flush(p);
	return work;
}
