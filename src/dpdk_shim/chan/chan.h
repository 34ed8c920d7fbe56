/* SPDX-License-Identifier: BSD-3-Clause
 * The channel: the reliable message channel and its handshake. What the layers above
 * may use of it (the poll thread and waiters in wait/, the blocking calls Python makes in
 * api/); it calls only the link and the wire below (wire/wire.h names the layers). All
 * of it runs with the port lock held, by whichever thread polls, unless it says otherwise.
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

#include <errno.h>

#include "link/link.h"

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
	/* doorbells (link/doorbell.c; shared-memory ports): ours, which the peer rings when it
	 * sends to us while we sleep, and the peer's, which we ring */
	struct doorbell *db_own, *db_peer;
	uint64_t db_token;
	char db_name[HELLO_DB_NAME];  /* ours, while it still has a name (unlinked once mapped) */
	bool db_due;                  /* frames queued for the peer since the last flush */
	bool corked;                  /* shim_conn_cork: a send queues its frames, no burst */
	uint64_t db_sleeps, db_wakeups;  /* atomics: waiters (wait/waiter.c) count them without the lock */
	/* accept queue */
	struct shim_conn *accept_next;
	int32_t group;
	struct shim_conn_stats st;
};

/* The protocol's timings and thresholds live in the one file that uses each: the
 * retransmission timer's and the sender's in conn.c, the receiver's and the poll's in
 * chan.c. */

static inline bool seq_lt(uint32_t a, uint32_t b) { return (int32_t)(a - b) < 0; }
static inline bool seq_le(uint32_t a, uint32_t b) { return (int32_t)(a - b) <= 0; }

static inline uint64_t
deadline_of(int64_t timeout_ns, uint64_t now)
{
	return timeout_ns < 0 ? UINT64_MAX : now + ns_to_tsc((uint64_t)timeout_ns);
}

/* The error a call gets from a connection that can carry no more. */
static inline int
conn_error(const struct shim_conn *c)
{
	if (c->closed_local || atomic_load(&shutting_down))
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

/* conn.c: a connection's life, its frames out, and its retransmission timer. Inside chan/
 * calls run one way: conn.c and accept.c call no other file of the channel; hello.c calls
 * them; chan.c calls those three; connect.c calls any of them. */
struct shim_conn *conn_new(struct shim_port *p, uint32_t id, const struct shim_conn_opts *o);  /* not attached */
void conn_attach(struct shim_port *p, struct shim_conn *c);
void conn_detach(struct shim_conn *c);
void conn_unref(struct shim_conn *c);  /* the last reference frees it (lock held or not) */
void conn_kill(struct shim_conn *c, int err, const char *why);
void free_tx(struct shim_conn *c);
void send_reset(struct shim_port *p, const struct frame *f, uint32_t id, uint64_t now);
void conn_send_ctrl(struct shim_conn *c, uint8_t type, uint16_t flags, const void *body,
		    uint32_t len, bool broadcast);
bool conn_can_send(const struct shim_conn *c);
void zc_init(struct zc_ref *z);  /* no lock */
struct rte_mbuf *conn_data_frame(struct shim_conn *c, const struct shim_iov *iov, int n,
				 int *iov_i, uint64_t *iov_off, uint64_t msg_off, uint64_t total,
				 uint32_t msg_id, struct zc_ref *zc);
void conn_push_data(struct shim_conn *c, struct rte_mbuf *m, uint64_t now);
void retransmit(struct shim_conn *c, struct tx_slot *s, uint64_t now);
/* The retransmission timer (now: tsc): frames unacknowledged past the timeout are sent
 * again, the oldest few, and the timeout backs off. */
void conn_retransmit_due(struct shim_conn *c, uint64_t now);
void on_ack(struct shim_conn *c, const struct frame_hdr *h, uint64_t now);
/* The port's TX queue, as the channel uses it: after frames went out, the peers asleep
 * on a doorbell for them are rung (port_queue and port_flush wake nobody). */
void chan_queue(struct shim_port *p, struct rte_mbuf *m);
int chan_flush(struct shim_port *p);  /* frames gone */

/* hello.c: the handshake */
void hello_send(struct shim_conn *c, uint8_t type, bool broadcast);
void on_hello(struct shim_port *p, const struct frame *f, struct shim_conn *c, uint64_t now);
void on_accept(struct shim_conn *c, const struct frame *f, uint64_t now);

/* chan.c: frames in, timers, the port's poll */
uint64_t conn_deliver(struct shim_conn *c);  /* into the posted buffers; bytes copied */
void conn_begin_close(struct shim_conn *c, uint64_t now, uint64_t linger_ns);
int chan_port_poll(struct shim_port *p);  /* frames handled */
void chan_port_down(struct shim_port *p, const char *why);
void chan_port_goodbye(struct shim_port *p);  /* shutdown: GOODBYE on every open connection */
/* A connection closed with a linger still owes its peer unacknowledged frames, and its
 * linger has not ended: the shutdown lets it finish first (now: tsc). Port lock held. */
bool chan_port_lingering(struct shim_port *p, uint64_t now);
/* The process exits: its open connections close as its sockets would, each lingering
 * up to linger_ns for what the peer has not acknowledged yet. Port lock held. */
void chan_port_close_all(struct shim_port *p, uint64_t now, uint64_t linger_ns);

/* connect.c: making connections (no lock held: each takes it) */
/* Wait (sleeping, not polling) for the port's link from now until deadline (tsc); a
 * memif client is restarted now and then. 0, or -ENOLINK. */
int connect_link(struct shim_port *p, uint64_t now, uint64_t deadline);
/* A new client connection, attached, saying HELLO from the next poll on. */
int connect_open(struct shim_port *p, const struct shim_conn_opts *o, struct shim_conn **out);
void listen_start(struct shim_port *p, const struct shim_conn_opts *o);
void listen_stop(struct shim_port *p);

/* accept.c: the accept queues (their own lock, not the port's) */
#define ACCEPT_GROUPS 16  /* listen groups, each with its accept queue */
void accept_push(struct shim_conn *c);
void accept_reopen(int group);  /* a listen again takes connections */
/* Wait up to timeout for a connection of the group; 0, -ETIMEDOUT, -ESHUTDOWN. */
int accept_take(int32_t group, int64_t timeout_ns, struct shim_conn **out);
void accept_cancel(int32_t group);

#endif
