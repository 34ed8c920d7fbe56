/* SPDX-License-Identifier: BSD-3-Clause
 * The reliable message channel: one connection's state, shared by chan.c (frames in
 * and out, acks, timers) and api.c (the blocking calls Python makes).
 *
 * Sequence space: every DATA frame takes one number. The sender keeps each frame
 * (an mbuf reference) until the receiver's cumulative ack passes it, retransmits
 * on timeout or when selective acks show a hole, and never runs past the receiver's
 * limit (its credit: frames it has room for). The receiver stores frames by number
 * in a ring of `window` slots, drops duplicates, acks, and copies frames in order
 * into the buffers that the current recv call posted.
 */
#ifndef REMOTE_ACCEL_CHAN_H
#define REMOTE_ACCEL_CHAN_H

#include "shim_internal.h"

enum conn_state {
	CS_CONNECTING = 1,
	CS_OPEN = 2,
	CS_PEER_CLOSED = 3,
	CS_DEAD = 4,
	CS_CLOSED = 5,
};

struct tx_slot {
	struct rte_mbuf *m;        /* our reference, for retransmission */
	uint64_t sent;             /* tsc of the last transmission */
	uint16_t n_tx;
	bool sacked;
};

struct rx_slot {
	struct rte_mbuf *m;        /* NULL: empty */
	const uint8_t *chunk;
	uint32_t len;
	uint32_t msg_id;
	uint64_t offset;
	uint64_t msg_len;
};

/* Free callback state of one zero-copy send: the frames point into the caller's
 * buffers until the last mbuf referring to them is freed. */
struct zc_ref {
	struct rte_mbuf_ext_shared_info shinfo;
	atomic_int done;
};

struct shim_conn {
	struct shim_port *port;
	uint32_t id;
	atomic_int refs;           /* Python's handle + the port's table */
	volatile int state;
	volatile bool closed_local;
	bool attached;             /* in port->conns */
	bool accepted;             /* server side: handed to shim_accept */
	int err;                   /* -errno once dead */
	char reason[160];
	struct shim_conn_opts o;
	bool data_crc;             /* the peer's port may corrupt: cover every chunk */
	uint32_t window, mask, chunk;
	struct rte_ether_addr peer_mac;
	uint32_t peer_ip;
	uint64_t peer_timeout, ka_interval, stall, linger_deadline;
	uint64_t hello_next;
	/* sender */
	uint32_t snd_una, snd_nxt, snd_limit, msg_id_tx;
	struct tx_slot *tx;
	uint64_t srtt, rttvar, rto; /* tsc */
	uint64_t last_tx;
	uint64_t last_ack_progress;
	/* receiver */
	uint32_t rcv_nxt, rcv_consumed, adv_limit, unacked, n_ooo;
	uint32_t frame_off;        /* bytes of frame rcv_consumed already consumed */
	bool ack_now;
	uint64_t ack_due;
	uint64_t last_rx;
	uint32_t goodbye_seq;
	struct rx_slot *rx;
	bool in_msg;
	uint32_t in_msg_id;
	uint64_t in_len, in_off;
	/* the buffers of the recv call in progress (NULL base: discard) */
	const struct shim_iov *post;
	int post_n, post_i;
	uint64_t post_off, post_left;
	uint64_t last_rx_progress;
	/* doorbells (doorbell.c; shared-memory ports): ours, which the peer rings when it
	 * sends to us while we sleep, and the peer's, which we ring */
	struct doorbell *db_own, *db_peer;
	uint64_t db_token;
	char db_name[HELLO_DB_NAME];  /* ours, while it still has a name (unlinked once mapped) */
	bool db_due;                  /* frames queued for the peer since the last flush */
	bool corked;                  /* shim_conn_cork: a send queues its frames, no burst */
	uint64_t db_sleeps, db_wakeups;  /* atomics: waiters count them without the lock */
	/* accept queue */
	struct shim_conn *accept_next;
	int32_t group;
	struct shim_conn_stats st;
};

/* Timing and thresholds of the protocol (see conn.c and chan.c for their why). */
#define ACK_DELAY_NS 50000ull          /* a lone frame is acked after this long */
#define RTO_MIN_NS 2000000ull          /* 2 ms: pollers on 2 cores may nap 1 ms */
#define RTO_MAX_NS 250000000ull
#define RTO_INIT_NS 20000000ull
#define RTO_BURST 4                    /* frames resent when the timer fires */
#define DUPTHRESH 3                    /* a hole with this many frames held above it is lost */
#define RETX_AGAIN_NS 1000000ull       /* a lost retransmission is resent after >= this */
#define HELLO_EVERY_NS 50000000ull
#define RESET_EVERY_NS 10000000ull
#define GOODBYE_COPIES 3
#define RX_ROUNDS 4                    /* bursts per poll, to bound lock hold time */

static inline bool seq_lt(uint32_t a, uint32_t b) { return (int32_t)(a - b) < 0; }
static inline bool seq_le(uint32_t a, uint32_t b) { return (int32_t)(a - b) <= 0; }

/* conn.c and chan.c: all with the port lock held */
void conn_detach(struct shim_conn *c);
void free_tx(struct shim_conn *c);
void send_reset(struct shim_port *p, const struct frame *f, uint32_t id, uint64_t now);
void hello_body_fill(const struct shim_conn *c, struct hello_body *b);
void retransmit(struct shim_conn *c, struct tx_slot *s, uint64_t now);
void on_ack(struct shim_conn *c, const struct frame_hdr *h, uint64_t now);
struct shim_conn *conn_new(struct shim_port *p, uint32_t id, const struct shim_conn_opts *o);
void conn_attach(struct shim_port *p, struct shim_conn *c);
void conn_unref(struct shim_conn *c);
void conn_kill(struct shim_conn *c, int err, const char *why);
void conn_send_ctrl(struct shim_conn *c, uint8_t type, uint16_t flags, const void *body,
		    uint32_t len, bool broadcast);
uint64_t conn_deliver(struct shim_conn *c);
bool conn_can_send(const struct shim_conn *c);
struct rte_mbuf *conn_data_frame(struct shim_conn *c, const struct shim_iov *iov, int n,
				 int *iov_i, uint64_t *iov_off, uint64_t msg_off, uint64_t total,
				 uint32_t msg_id, struct zc_ref *zc);
void conn_push_data(struct shim_conn *c, struct rte_mbuf *m, uint64_t now);
void conn_begin_close(struct shim_conn *c, uint64_t now, uint64_t linger_ns);
void zc_init(struct zc_ref *z);

extern atomic_bool shim_down;

static inline uint64_t
deadline_of(int64_t timeout_ns, uint64_t now)
{
	return timeout_ns < 0 ? UINT64_MAX : now + ns_to_tsc((uint64_t)timeout_ns);
}

/* The error a call gets from a connection that can carry no more. */
static inline int
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

/* accept.c */
#define ACCEPT_GROUPS 16  /* listen groups, each with its accept queue */
void accept_push(struct shim_conn *c);
void accept_reopen(int group);  /* a listen again takes connections */

/* engine.c: waiting with backoff */
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

/* doorbell.c */
struct doorbell *db_create(char *name, size_t cap, uint64_t *token);
struct doorbell *db_open(const char *name, uint64_t token);
void db_close(struct doorbell *d);
void db_unlink(char *name);
void db_ring(struct doorbell *d);
void db_sleep(struct waiter *w, uint64_t ns);
void db_spin(struct waiter *w);
void hello_send(struct shim_conn *c, uint8_t type, bool broadcast);
void hello_doorbell_read(struct shim_conn *c, const struct frame *f);

/* prefault.c */
void memif_regions_prefault(void);

#endif
