/* SPDX-License-Identifier: BSD-3-Clause
 * The link: EAL, ports (set-up, bursts through guard and fault stage, the TX queue),
 * and doorbell primitives. What the layers above may use of it; it calls only the
 * wire below (wire/wire.h names the layers). Not seen by cffi.
 */
#ifndef REMOTE_ACCEL_LINK_H
#define REMOTE_ACCEL_LINK_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <rte_byteorder.h>
#include <rte_cycles.h>
#include <rte_ether.h>
#include <rte_mbuf.h>

#include "wire/wire.h"

#define SHIM_MAX_PORTS 32
/* Connections per port: a NIC port serves every remote client of the server
 * (--max-clients goes to 4096, plus those still in their handshake). */
#define SHIM_MAX_CONNS 4160
#define SHIM_BURST 32
#define SHIM_TXQ_CAP 512           /* frames queued for tx_burst per port */
#define SHIM_HOLD_MAX 8            /* frames a reorder fault may hold back */

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
struct shim_conn;  /* the channel's (chan/chan.h): a port only lists them */

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
	uint64_t rx_count;         /* frames taken off the port, by any thread (wait/waiter.c) */
	struct rte_mbuf *txq[SHIM_TXQ_CAP];
	int n_txq;
	struct fault_stage fault[2];
	struct shim_conn *conns[SHIM_MAX_CONNS];
	int n_conns;
	struct shim_port_stats st;
};

/* eal.c: the process's DPDK state */
extern struct shim_port port_table[SHIM_MAX_PORTS];  /* by port id; locks made at EAL init */
extern uint64_t tsc_hz;
extern atomic_bool shutting_down;  /* shim_shutdown began: calls end with -ESHUTDOWN */
int eal_init(int argc, char **argv);  /* shim_eal_init */
bool eal_initialized(void);
int eal_args(char *buf, size_t cap);   /* shim_eal_args */
int log_read(char *buf, size_t cap);   /* shim_log_read */

static inline uint64_t ns_to_tsc(uint64_t ns) { return ns * (tsc_hz / 1000000) / 1000; }
static inline uint64_t tsc_to_ns(uint64_t t) { return t * 1000 / (tsc_hz / 1000000); }

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
int port_link(uint16_t port);  /* shim_port_link */
int port_restart(struct shim_port *p);  /* port lock held: stop and start (a memif client does not reconnect by itself) */
/* Port lock held. Queue a frame for the next flush (through the TX fault stage); returns
 * the frames a flush it had to make sent (the queue was full), else 0. */
int port_queue(struct shim_port *p, struct rte_mbuf *m);
/* Port lock held. Burst the queue out; returns the frames gone. Wakes nobody: the
 * channel rings the peers that wait for them (chan_flush). */
int port_flush(struct shim_port *p);
uint16_t port_rx(struct shim_port *p, struct rte_mbuf **pkts, uint16_t n);
bool port_check_link(struct shim_port *p, uint64_t now);  /* true: the link just went down */
struct rte_mempool *pool_at(int i);  /* NULL past the last pool */

/* guard.c: bursts that survive memif unmapping its regions under them */
void guard_init(void);
uint16_t guarded_rx(struct shim_port *p, struct rte_mbuf **pkts, uint16_t n);
int guarded_tx(struct shim_port *p, struct rte_mbuf **pkts, uint16_t n);

/* fault.c */
void fault_configure(struct fault_stage *f, const struct shim_fault *cfg);
uint16_t fault_apply(struct fault_stage *f, struct shim_port *p, struct rte_mbuf **pkts,
		     uint16_t n, uint16_t cap);

/* prefault.c */
void memif_regions_prefault(void);

/* doorbell.c: a page of shared memory with a futex word, one per connection end on
 * shared-memory ports. The peer rings ours; the waiting side (wait/waiter.c) sleeps on
 * it between db_sleep_begin and db_sleep_end. */
struct doorbell;
struct doorbell *db_create(char *name, size_t cap, uint64_t *token);
struct doorbell *db_open(const char *name, uint64_t token);
void db_close(struct doorbell *d);
void db_unlink(char *name);
void db_ring(struct doorbell *d);
/* Announce a sleeper (then look for work once more); returns the word to sleep on. */
unsigned int db_sleep_begin(struct doorbell *d);
/* Sleep while the word is seq, at most ns; true: rung (before or during the sleep). */
bool db_wait(struct doorbell *d, unsigned int seq, uint64_t ns);
void db_sleep_end(struct doorbell *d);
/* One turn of a spin waiting for the peer (own: ours, peer: the peer's). */
void db_spin(struct doorbell *own, struct doorbell *peer);

#endif
