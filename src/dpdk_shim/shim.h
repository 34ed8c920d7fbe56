/* SPDX-License-Identifier: BSD-3-Clause
 * remote_accel DPDK shim: the whole C API that Python sees (through cffi, API mode).
 *
 * This file is fed verbatim to cffi's cdef (build_cffi.py drops the preprocessor
 * lines), so it holds only plain declarations over fixed-width types: no DPDK
 * header, no macro other than integer #defines. Every function returns a count or
 * 0 on success, or -errno on failure; none prints or exits (DPDK's own log goes
 * where shim_log_* says). Every call that may wait takes a timeout in nanoseconds
 * (a negative timeout waits for ever) and is safe to call with the GIL released.
 */
#ifndef REMOTE_ACCEL_SHIM_H
#define REMOTE_ACCEL_SHIM_H

#include <stddef.h>
#include <stdint.h>

#define SHIM_RX 0
#define SHIM_TX 1

/* -- library -------------------------------------------------------------------- */
const char *shim_version(void);
uint32_t shim_crc32c(uint32_t crc, const void *buf, size_t len);

/* -- EAL: once per process, for its lifetime ------------------------------------- */
/* -EALREADY on a second call, whatever its arguments (DPDK cannot re-init). */
int shim_eal_init(int argc, char **argv);
int shim_eal_initialized(void);
/* The arguments of the successful init, NUL-separated; returns the bytes needed. */
int shim_eal_args(char *buf, size_t cap);
/* EAL's runtime folder of this process (/var/run/dpdk/<file-prefix>); bytes copied. */
int shim_eal_runtime_dir(char *buf, size_t cap);
/* DPDK log lines since the last call (newline-separated); returns bytes copied. */
int shim_log_read(char *buf, size_t cap);
/* Stop the poll thread, say GOODBYE on every open connection, close the ports. */
void shim_shutdown(void);

/* -- ports ---------------------------------------------------------------------- */
struct shim_port_conf {
	uint32_t max_frame;  /* largest frame this port carries (memif: bsize); 0: ask the PMD */
	uint32_t min_room;   /* mbuf data room the PMD needs beyond that (af_packet: framesz) */
	uint32_t n_mbufs;    /* mbufs in the pool shared by the ports; 0: default */
	uint16_t rx_desc;    /* 0: default */
	uint16_t tx_desc;
	int32_t raw;         /* 1: the protocol leaves the port alone (tests burst by hand) */
	int32_t zero_copy;   /* -1: by driver (memif, af_packet), 0: never, 1: always */
};

struct shim_port_stats {
	uint64_t rx_frames, rx_bytes, tx_frames, tx_bytes;
	uint64_t rx_bad_crc;       /* frame checksum mismatch: dropped */
	uint64_t rx_malformed;     /* ours (UDP port) but truncated or inconsistent */
	uint64_t rx_ignored;       /* not ours: other protocols, other hosts */
	uint64_t rx_no_conn;       /* well-formed but for no connection here */
	uint64_t rx_dup;           /* already received: dropped (and re-acked) */
	uint64_t rx_out_of_order;  /* stored ahead of a hole */
	uint64_t rx_out_of_window;
	uint64_t tx_retransmits;
	uint64_t tx_acks;
	uint64_t tx_keepalives;
	uint64_t tx_full;          /* tx_burst accepted fewer frames than offered */
	uint64_t tx_nombuf;        /* mbuf allocation failed (retried later) */
	uint64_t fault_dropped, fault_corrupted, fault_duplicated, fault_reordered;
	/* rte_eth_stats of the port (memif reads 0 after its peer disconnects) */
	uint64_t eth_ipackets, eth_opackets, eth_ibytes, eth_obytes;
	uint64_t eth_imissed, eth_ierrors, eth_oerrors, eth_rx_nombuf;
	uint64_t guard_faults;     /* memif bursts cut short by the PMD's disconnect race */
};

/* Fault injection, per port and direction: each frame is independently dropped,
 * corrupted (one bit flipped anywhere in it), duplicated, or held back behind the
 * next ones, with these probabilities. A seed of 0 picks one from the clock. */
struct shim_fault {
	double drop;
	double corrupt;
	double duplicate;
	double reorder;
	uint64_t seed;
};

int shim_port_count(void);
int shim_port_name(uint16_t port, char *buf, size_t cap);
int shim_port_driver(uint16_t port, char *buf, size_t cap);
/* Configure, start and hand the port to the poll thread; again: 0, nothing done. */
int shim_port_setup(uint16_t port, const struct shim_port_conf *conf);
int shim_port_link(uint16_t port);        /* 1 up, 0 down */
int shim_port_stats(uint16_t port, struct shim_port_stats *out);
int shim_port_stats_reset(uint16_t port);
int shim_port_fault(uint16_t port, int dir, const struct shim_fault *fault);
/* Add a virtual device at run time (e.g. "net_memif1", "role=client,socket=/x");
 * returns its port id. Remove stops it, ends its connections and detaches it. */
int shim_vdev_add(const char *name, const char *args);
int shim_vdev_remove(uint16_t port);
/* Two ports joined by crossed rte_rings (what one sends, the other receives). */
int shim_ring_pair(const char *name, uint16_t *port_a, uint16_t *port_b);
/* Raw frames, for tests: send `count` copies of one frame (through the TX fault
 * stage; count 0: flush what the fault stage holds back); receive up to `max` frames into buf (each at i*stride, length in lens). */
int shim_port_tx_raw(uint16_t port, const void *frame, uint32_t len, uint32_t count);
int shim_port_rx_raw(uint16_t port, void *buf, uint32_t stride, uint32_t *lens, uint32_t max);
/* Free mbufs found twice in the pools (a double free); 0 when sound. For tests. */
int shim_pool_audit(void);
/* Build one frame of our protocol around `chunk` (for malformed-frame tests). */
int shim_frame_build(void *buf, uint32_t cap, uint8_t type, uint32_t conn, uint32_t seq,
		     const void *chunk, uint32_t len);

/* -- pinned memory (DPDK heap: hugepages where EAL has them) --------------------- */
void *shim_mem_alloc(uint64_t size, uint32_t align);
void shim_mem_free(void *ptr);
int shim_mem_is_dpdk(const void *ptr);

/* -- reliable message channel ------------------------------------------------------ */
struct shim_conn;

struct shim_iov {
	void *base;
	uint64_t len;
};

struct shim_conn_opts {
	uint32_t window;            /* frames in flight (power of two, 64..32768) */
	uint32_t chunk;             /* payload bytes per frame; 0: the port's maximum */
	uint64_t peer_timeout_ns;   /* silent peer -> gone; keepalives at a quarter of it */
	uint64_t stall_ns;          /* a send or a started message making no progress */
	uint64_t zero_copy_min;     /* send payload iovs at least this long by extbuf */
	uint64_t spin_ns;           /* poll this long after the last traffic before sleeping */
	int32_t busy_poll;          /* 1: never sleep (benchmarks; burns a core per waiter) */
	int32_t group;              /* listen group a server connection is accepted into */
	int32_t doorbell;           /* 1: on memif/ring, sleep on a doorbell the peer rings (link/doorbell.c) */
};

struct shim_conn_info {
	uint32_t id;
	uint16_t port;
	uint8_t peer_mac[6];
	uint32_t chunk;
	uint32_t window;
	int32_t state;              /* 1 connecting, 2 open, 3 peer closed, 4 dead, 5 closed */
	int32_t error;              /* -errno once dead */
};

struct shim_conn_stats {
	uint64_t tx_messages, tx_bytes, tx_frames, tx_retransmits, tx_zero_copy_frames;
	uint64_t rx_messages, rx_bytes, rx_frames, rx_dup, rx_out_of_order;
	uint64_t rtt_ns;            /* smoothed round-trip time */
	uint64_t tx_no_crc_frames;  /* DATA frames whose chunk the CRC left out (memif, ring) */
	uint64_t doorbell;          /* 1: both ends' doorbells are mapped (waits end on the peer's frame) */
	uint64_t db_sleeps;         /* waits that slept on our doorbell */
	uint64_t db_wakeups;        /* ... and were woken by the peer (or a local close), not by time */
};

void shim_conn_opts_default(struct shim_conn_opts *opts);
/* Client: wait for the link, say HELLO to the whole segment, take the first answer. */
int shim_connect(uint16_t port, const struct shim_conn_opts *opts, int64_t timeout_ns,
		 struct shim_conn **out);
/* Server: answer HELLOs on this port; new connections queue for shim_accept(group). */
int shim_listen(uint16_t port, const struct shim_conn_opts *opts);
int shim_unlisten(uint16_t port);
int shim_accept(int32_t group, int64_t timeout_ns, struct shim_conn **out);
/* Wake every shim_accept(group) waiter with -ESHUTDOWN. */
void shim_accept_cancel(int32_t group);

/* One message: the iovs back to back. Returns once every byte is handed to the
 * channel (copies in flight) and no frame still points into the caller's buffers. */
int shim_conn_send(struct shim_conn *c, const struct shim_iov *iov, int n);
/* The next bytes of the current message, into these buffers. */
int shim_conn_recv_into(struct shim_conn *c, const struct shim_iov *iov, int n);
/* Drop the rest of the current message (after a limit or parse error). */
int shim_conn_recv_discard(struct shim_conn *c);
/* Closed here: later calls and blocked callers get -ESHUTDOWN; unacknowledged data
 * keeps being retransmitted in the background for up to linger_ns, then GOODBYE. */
void shim_conn_close(struct shim_conn *c, int64_t linger_ns);
/* 1: sends queue a small message's frames without sending the burst, so several
 * messages leave in one burst and wake the peer once; 0: send what is queued. */
int shim_conn_cork(struct shim_conn *c, int on);
/* Drop the caller's reference (after close); memory goes when the poll thread is done. */
void shim_conn_free(struct shim_conn *c);
int shim_conn_info(struct shim_conn *c, struct shim_conn_info *out);
int shim_conn_stats(struct shim_conn *c, struct shim_conn_stats *out);
/* Why the connection died, as text ("" while it is alive). */
int shim_conn_reason(struct shim_conn *c, char *buf, size_t cap);

/* -- the message prologue of dataplane/wire.py, for the fast path ------------------ */
#define SHIM_WIRE_HEADER 28

/* What wire.py says: its magic, version and the receiver's limits. */
struct shim_wire {
	uint8_t magic0, magic1, version;
	uint32_t max_meta;
	uint32_t max_payloads;
	uint64_t max_payload_total;
};

/* A checked prologue; status 0: valid (lengths follow the header in the head buffer,
 * meta after them), 1: let wire.py look (an error, or a prologue beyond the head). */
struct shim_msg_info {
	uint8_t type;
	uint16_t flags;
	uint16_t n_payloads;
	uint32_t req_id;
	uint32_t meta_len;
	uint64_t payload_total;
	uint32_t crc;
	uint32_t prologue_len;
	uint64_t msg_len;
	int32_t status;
};

/* Header + lengths (of the payload iovs) + meta into buf; returns its length. */
int64_t shim_wire_encode(const struct shim_wire *w, void *buf, uint64_t cap, uint8_t type,
			 uint16_t flags, uint32_t req_id, const char *meta, uint32_t meta_len,
			 const struct shim_iov *payloads, int n);
int shim_wire_check(const struct shim_wire *w, const void *buf, uint64_t len, uint64_t msg_len,
		    struct shim_msg_info *out);
/* send: the prologue built here, then the payloads; recv: recv_begin + wire check. */
int shim_conn_send_msg(struct shim_conn *c, const struct shim_wire *w, uint8_t type, uint16_t flags,
		       uint32_t req_id, const char *meta, uint32_t meta_len,
		       const struct shim_iov *payloads, int n);
int64_t shim_conn_recv_msg(struct shim_conn *c, const struct shim_wire *w, void *head, uint64_t cap,
			   int64_t timeout_ns, struct shim_msg_info *out);
/* Two payload-free messages (flags 0) in one corked burst: a sync point's Batch and its
 * request, which wake the peer once. Stops at the first failure. */
int shim_conn_send_pair(struct shim_conn *c, const struct shim_wire *w, uint8_t type1, uint32_t req_id1,
			const char *meta1, uint32_t meta_len1, uint8_t type2, uint32_t req_id2,
			const char *meta2, uint32_t meta_len2);

#endif
