/* SPDX-License-Identifier: BSD-3-Clause
 * Internal structures shared by the shim's C files. Not seen by cffi.
 */
#ifndef REMOTE_ACCEL_SHIM_INTERNAL_H
#define REMOTE_ACCEL_SHIM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <rte_byteorder.h>
#include <rte_cycles.h>
#include <rte_ether.h>
#include <rte_mbuf.h>

#include "shim.h"

#define SHIM_MAX_PORTS 32
/* Connections per port: a NIC port serves every remote client of the server
 * (--max-clients goes to 4096, plus those still in their handshake). */
#define SHIM_MAX_CONNS 4160
#define SHIM_BURST 32
#define SHIM_TXQ_CAP 512           /* frames queued for tx_burst per port */
#define SHIM_HOLD_MAX 8            /* frames a reorder fault may hold back */
#define SHIM_UDP_PORT 18516
#define SHIM_DEFAULT_MBUFS 8191
#define SHIM_MIN_FRAME 1514

/* -- frames: Ethernet / IPv4 / UDP / frame_hdr / chunk ---------------------------- */
#define FRAME_MAGIC 0x5246         /* "RF" */
#define FRAME_VERSION 1

enum frame_type {
	FT_DATA = 1,
	FT_ACK = 2,
	FT_HELLO = 3,
	FT_ACCEPT = 4,
	FT_KEEPALIVE = 5,
	FT_GOODBYE = 6,
	FT_RESET = 7,
};

#define FF_ACK_NOW 0x1             /* receiver: acknowledge at once (sender waits) */
/* DATA: the CRC covers the header only. Sent where neither end's medium can corrupt a
 * frame (memif and ring ports copy memory to memory); the header stays covered, so a
 * flipped flag still fails the check. */
#define FF_NO_DATA_CRC 0x2
/* HELLO / ACCEPT: my port can corrupt frames (a NIC, or a fault stage that corrupts):
 * cover every chunk you send me. */
#define FF_WANT_CRC 0x4

/* All fields big-endian. The CRC32C covers this header (crc = 0) and the chunk. */
struct frame_hdr {
	rte_be16_t magic;
	uint8_t version;
	uint8_t type;
	rte_be16_t flags;
	rte_be16_t len;            /* chunk bytes after this header */
	rte_be32_t conn;           /* connection id, chosen by the client */
	rte_be32_t seq;            /* DATA: frame number; others: sender's next one */
	rte_be32_t ack;            /* every frame below this one arrived */
	rte_be32_t limit;          /* the peer may send frames below this one */
	rte_be64_t sack;           /* bit i: frame ack + 1 + i arrived */
	rte_be32_t msg_id;         /* message number (DATA) */
	rte_be32_t crc;
	rte_be64_t offset;         /* of this chunk in the message */
	rte_be64_t msg_len;        /* whole message */
} __attribute__((packed));

/* HELLO / ACCEPT chunk */
struct hello_body {
	rte_be32_t max_chunk;
	rte_be32_t window;
	rte_be64_t peer_timeout_ns;
} __attribute__((packed));

/* After the hello_body, on shared-memory ports: the sender's doorbell (doorbell.c).
 * A receiver that does not know it reads only the hello_body. */
#define HELLO_DB_MAGIC 0x44424c31u  /* "DBL1" */
#define HELLO_DB_NAME 48
struct hello_doorbell {
	rte_be32_t magic;
	rte_be64_t token;
	char name[HELLO_DB_NAME];  /* NUL-terminated */
} __attribute__((packed));

#define L2L4_LEN (RTE_ETHER_HDR_LEN + 20 + 8)
#define FRAME_OVERHEAD (L2L4_LEN + (int)sizeof(struct frame_hdr))

/* A frame that passed every check, pointing into its mbuf. */
struct frame {
	struct rte_mbuf *m;
	const struct frame_hdr *h;
	const uint8_t *chunk;
	uint32_t len;
	struct rte_ether_addr src;
	uint32_t src_ip;
};

/* -- fault injection ------------------------------------------------------------- */
struct fault_stage {
	struct shim_fault cfg;
	bool active;
	uint64_t rng;
	struct rte_mbuf *held[SHIM_HOLD_MAX];
	int n_held;
	int idle_flushes;          /* TX: flushes since the last new frame */
};

/* -- ports ------------------------------------------------------------------------ */
struct shim_conn;

struct shim_port {
	bool ready;
	bool raw;
	bool listening;
	bool zero_copy;            /* extbuf TX allowed (the PMD copies and frees in tx_burst) */
	bool is_memif;
	bool shared_memory;        /* memif, ring: frames cross as memory copies, uncorrupted */
	bool started;
	bool link_up;
	uint16_t id;
	uint32_t max_frame;
	int32_t listen_group;
	struct shim_conn_opts listen_opts;
	struct rte_mempool *pool;
	struct rte_ether_addr mac;
	uint32_t ip;               /* 169.254.x.y from the MAC: a label, we do not route */
	pthread_mutex_t lock;      /* rx/tx queues, the connections and their frames */
	atomic_int app_waiters;    /* threads polling this port themselves */
	uint64_t next_link_check;
	uint64_t clock;            /* tsc, never going back (threads' rdtsc may differ) */
	uint64_t rx_count;         /* frames taken off the port, by any thread (doorbell.c) */
	struct rte_mbuf *txq[SHIM_TXQ_CAP];
	int n_txq;
	struct fault_stage fault[2];
	struct shim_conn *conns[SHIM_MAX_CONNS];
	int n_conns;
	struct shim_port_stats st;
};

extern struct shim_port shim_ports[SHIM_MAX_PORTS];
extern uint64_t shim_tsc_hz;

static inline uint64_t ns_to_tsc(uint64_t ns) { return ns * (shim_tsc_hz / 1000000) / 1000; }
static inline uint64_t tsc_to_ns(uint64_t t) { return t * 1000 / (shim_tsc_hz / 1000000); }

/* The port's time: rdtsc made monotonic under the port lock, so "now - then" is never
 * negative between values taken by different threads. */
static inline uint64_t
port_clock(struct shim_port *p)
{
	uint64_t t = rte_rdtsc();

	if ((int64_t)(t - p->clock) > 0)
		p->clock = t;
	return p->clock;
}

/* Whether frames on this port may arrive corrupted, so that chunks need their CRC:
 * any NIC-like port (af_packet, PCI, ...), and a shared-memory one while a fault stage
 * corrupts frames (it stands for a medium that does). */
static inline bool
port_may_corrupt(const struct shim_port *p)
{
	return !p->shared_memory || p->fault[0].cfg.corrupt > 0 || p->fault[1].cfg.corrupt > 0;
}

/* port.c */
struct shim_port *port_get(uint16_t port);   /* NULL unless set up */
int port_setup(uint16_t port, const struct shim_port_conf *conf);  /* shim_port_setup, less the poll thread */
int port_restart(struct shim_port *p);  /* port lock held: stop and start (a memif client does not reconnect by itself) */
void port_queue(struct shim_port *p, struct rte_mbuf *m);
int port_flush(struct shim_port *p);
uint16_t port_rx(struct shim_port *p, struct rte_mbuf **pkts, uint16_t n);
bool port_check_link(struct shim_port *p, uint64_t now);  /* true: the link just went down */
struct rte_mempool *shim_pool_for(uint32_t max_frame, uint32_t n_mbufs);
struct rte_mempool *shim_pool_at(int i);  /* NULL past the last pool */

/* doorbell.c: port lock held, after a burst went out: wake the peers asleep for it */
void db_ring_due(struct shim_port *p);

/* guard.c: bursts that survive memif unmapping its regions under them */
void guard_init(void);
uint16_t guarded_rx(struct shim_port *p, struct rte_mbuf **pkts, uint16_t n);
int guarded_tx(struct shim_port *p, struct rte_mbuf **pkts, uint16_t n);

/* fault.c */
void fault_configure(struct fault_stage *f, const struct shim_fault *cfg);
uint16_t fault_apply(struct fault_stage *f, struct shim_port *p, struct rte_mbuf **pkts,
		     uint16_t n, uint16_t cap);

/* frame.c */
uint32_t frame_crc(const struct frame_hdr *h, const void *chunk, uint32_t len);
void frame_l2l4(struct shim_port *p, uint8_t *buf, const struct rte_ether_addr *dst,
		uint32_t dst_ip, uint32_t l4_payload);
struct rte_mbuf *frame_linear(struct shim_port *p, struct rte_mbuf *m);
int frame_parse(struct shim_port *p, struct rte_mbuf *m, struct frame *f);

/* chan.c / engine.c */
int chan_port_poll(struct shim_port *p);  /* port lock held; frames handled */
void chan_port_down(struct shim_port *p, const char *why);  /* port lock held */
int engine_start(void);
/* api.c: wait up to timeout for the next message to start; copy its first
 * min(cap, length) bytes into head. Returns the bytes copied, *msg_len the whole length. */
int64_t conn_recv_begin(struct shim_conn *c, void *head, uint64_t cap, int64_t timeout_ns,
			uint64_t *msg_len);
void engine_stop(void);
void eal_capture_log(void);

#endif
