/* SPDX-License-Identifier: BSD-3-Clause
 * The wire (bytes): what the layers above may use of it. The shim's bottom layer;
 * it calls nothing of the shim. Not seen by cffi.
 *
 * Layers, each calling only those before it (tests/unit/test_c_layers.py):
 *   wire/  bytes: CRC32C, the message prologue, frames          (wire/wire.h)
 *   link/  EAL, ports and their bursts, doorbell primitives      (link/link.h)
 *   chan/  the reliable channel and its handshake                (chan/chan.h)
 *   wait/  the poll thread, and how a thread waits               (wait/wait.h)
 *   api/   shim.h's functions, the only shim_* definitions       (api/api.h)
 * Each layer's header includes the one below it.
 */
#ifndef REMOTE_ACCEL_WIRE_H
#define REMOTE_ACCEL_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "shim.h"

/* -- crc.c, prologue.c ------------------------------------------------------------------
 * No DPDK in these two: the server's C++ module compiles them (with api/codec.c) for its
 * TCP sessions, and tests/unit/test_crc.py builds crc.c alone. Both define WIRE_NO_DPDK,
 * which leaves out the frames below, so a DPDK header in them cannot go unnoticed. */

/* CRC32C of buf, continuing crc (0 to start). */
uint32_t crc32c(uint32_t crc, const void *buf, size_t len);
/* shim_wire_encode and shim_wire_check (shim.h says what they do). */
int64_t prologue_encode(const struct shim_wire *w, void *buf, uint64_t cap, uint8_t type,
			uint16_t flags, uint32_t req_id, const char *meta, uint32_t meta_len,
			const struct shim_iov *payloads, int n);
int prologue_check(const struct shim_wire *w, const void *buf, uint64_t len, uint64_t msg_len,
		   struct shim_msg_info *out);

#ifndef WIRE_NO_DPDK
#include <stdbool.h>

#include <rte_byteorder.h>
#include <rte_ether.h>
#include <rte_mbuf.h>

/* -- frames: Ethernet / IPv4 / UDP / frame_hdr / chunk ---------------------------- */
#define SHIM_UDP_PORT 18516
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

/* After the hello_body, on shared-memory ports: the sender's doorbell (link/doorbell.c).
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

/* frame.c */
uint32_t frame_crc(const struct frame_hdr *h, const void *chunk, uint32_t len);
/* Ethernet, IPv4 and UDP headers from (src, src_ip) to (dst, dst_ip) into buf. */
void frame_l2l4(uint8_t *buf, const struct rte_ether_addr *src, uint32_t src_ip,
		const struct rte_ether_addr *dst, uint32_t dst_ip, uint32_t l4_payload);
/* m as one segment (a private copy from pool where it is chained); NULL: none. */
struct rte_mbuf *frame_linear(struct rte_mempool *pool, struct rte_mbuf *m);
/* A frame received on the port of this MAC; may_corrupt: its medium can corrupt a
 * frame (port_may_corrupt), so a chunk must come with its CRC. */
int frame_parse(struct rte_mbuf *m, const struct rte_ether_addr *mac, bool may_corrupt,
		struct frame *f);
/* shim_frame_build (shim.h). */
int frame_build(void *buf, uint32_t cap, uint8_t type, uint32_t conn, uint32_t seq,
		const void *chunk, uint32_t len);
#endif /* WIRE_NO_DPDK */

#endif
