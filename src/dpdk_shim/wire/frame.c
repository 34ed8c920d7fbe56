/* SPDX-License-Identifier: BSD-3-Clause
 * Frames on the wire: Ethernet / IPv4 / UDP (so a real NIC and switch carry them)
 * followed by struct frame_hdr and one chunk of a message.
 *
 * IP addresses are labels (169.254.x.y taken from the MAC), not routing: peers find
 * each other by MAC on one L2 segment (HELLO to broadcast, answers unicast). The UDP
 * checksum is 0 (allowed for IPv4); our own CRC32C covers header and chunk.
 */
#include <errno.h>
#include <string.h>

#include <rte_ip.h>
#include <rte_udp.h>

#include "wire/wire.h"

uint32_t
frame_crc(const struct frame_hdr *h, const void *chunk, uint32_t len)
{
	struct frame_hdr tmp;
	uint32_t crc;

	memcpy(&tmp, h, sizeof(tmp));
	tmp.crc = 0;
	crc = crc32c(0, &tmp, sizeof(tmp));
	return crc32c(crc, chunk, len);
}

void
frame_l2l4(uint8_t *buf, const struct rte_ether_addr *src, uint32_t src_ip,
	   const struct rte_ether_addr *dst, uint32_t dst_ip, uint32_t l4_payload)
{
	struct rte_ether_hdr *eth = (struct rte_ether_hdr *)buf;
	struct rte_ipv4_hdr *ip = (struct rte_ipv4_hdr *)(eth + 1);
	struct rte_udp_hdr *udp = (struct rte_udp_hdr *)(ip + 1);

	rte_ether_addr_copy(dst, &eth->dst_addr);
	rte_ether_addr_copy(src, &eth->src_addr);
	eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);
	ip->version_ihl = RTE_IPV4_VHL_DEF;
	ip->type_of_service = 0;
	ip->total_length = rte_cpu_to_be_16((uint16_t)(20 + 8 + l4_payload));
	ip->packet_id = 0;
	ip->fragment_offset = rte_cpu_to_be_16(RTE_IPV4_HDR_DF_FLAG);
	ip->time_to_live = 64;
	ip->next_proto_id = IPPROTO_UDP;
	ip->hdr_checksum = 0;
	ip->src_addr = src_ip;
	ip->dst_addr = dst_ip;
	ip->hdr_checksum = rte_ipv4_cksum(ip);
	udp->src_port = rte_cpu_to_be_16(SHIM_UDP_PORT);
	udp->dst_port = rte_cpu_to_be_16(SHIM_UDP_PORT);
	udp->dgram_len = rte_cpu_to_be_16((uint16_t)(8 + l4_payload));
	udp->dgram_cksum = 0;
}

/* A chained frame (a ring pair hands over the sender's header + extbuf chain, which
 * the sender still holds for retransmission) becomes a private linear copy: never
 * linearize in place what someone else may hold. */
struct rte_mbuf *
frame_linear(struct rte_mempool *pool, struct rte_mbuf *m)
{
	struct rte_mbuf *c;

	if (m->nb_segs == 1)
		return m;
	c = rte_pktmbuf_copy(m, pool, 0, UINT32_MAX);
	rte_pktmbuf_free(m);
	if (c != NULL && c->nb_segs > 1) {
		rte_pktmbuf_free(c);
		c = NULL;
	}
	return c;
}

/* 0: a frame of ours, checked; -ENOENT: not ours; -EBADMSG: ours but broken;
 * -EILSEQ: checksum mismatch; -ENOMSG: a sound header whose chunk has no checksum,
 * on a port that may have corrupted it (f is filled in). Counters are the caller's. The mbuf is single-segment. */
int
frame_parse(struct rte_mbuf *m, const struct rte_ether_addr *mac, bool may_corrupt, struct frame *f)
{
	const struct rte_ether_hdr *eth;
	const struct rte_ipv4_hdr *ip;
	const struct rte_udp_hdr *udp;
	const struct frame_hdr *h;
	uint32_t len, ip_len, udp_len, chunk_len, covered;

	len = rte_pktmbuf_data_len(m);
	if (len < L2L4_LEN)
		return -ENOENT;
	eth = rte_pktmbuf_mtod(m, const struct rte_ether_hdr *);
	if (eth->ether_type != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4))
		return -ENOENT;
	ip = (const struct rte_ipv4_hdr *)(eth + 1);
	if (ip->version_ihl != RTE_IPV4_VHL_DEF || ip->next_proto_id != IPPROTO_UDP)
		return -ENOENT;
	udp = (const struct rte_udp_hdr *)(ip + 1);
	if (udp->dst_port != rte_cpu_to_be_16(SHIM_UDP_PORT))
		return -ENOENT;
	if (!rte_is_broadcast_ether_addr(&eth->dst_addr) &&
	    !rte_is_same_ether_addr(&eth->dst_addr, mac))
		return -ENOENT;
	/* From here on the frame claims to be ours: anything wrong is malformed. */
	ip_len = rte_be_to_cpu_16(ip->total_length);
	udp_len = rte_be_to_cpu_16(udp->dgram_len);
	if (ip_len > len - RTE_ETHER_HDR_LEN || udp_len != ip_len - 20 ||
	    udp_len < 8 + sizeof(struct frame_hdr))
		return -EBADMSG;
	h = (const struct frame_hdr *)(udp + 1);
	if (h->magic != rte_cpu_to_be_16(FRAME_MAGIC) || h->version != FRAME_VERSION)
		return -EBADMSG;
	chunk_len = rte_be_to_cpu_16(h->len);
	if (chunk_len != udp_len - 8 - sizeof(struct frame_hdr))
		return -EBADMSG;
	if (h->type < FT_DATA || h->type > FT_RESET)
		return -EBADMSG;
	f->m = m;
	f->h = h;
	f->chunk = (const uint8_t *)(h + 1);
	f->len = chunk_len;
	covered = chunk_len;
	if (h->type == FT_DATA && (h->flags & rte_cpu_to_be_16(FF_NO_DATA_CRC)))
		covered = 0;
	if (frame_crc(h, f->chunk, covered) != rte_be_to_cpu_32(h->crc))
		return -EILSEQ;
	rte_ether_addr_copy(&eth->src_addr, &f->src);
	f->src_ip = ip->src_addr;
	/* an uncovered chunk is only taken where this port cannot have corrupted it */
	if (covered != chunk_len && may_corrupt)
		return -ENOMSG;
	return 0;
}

int
frame_build(void *buf, uint32_t cap, uint8_t type, uint32_t conn, uint32_t seq,
	    const void *chunk, uint32_t len)
{
	static const struct rte_ether_addr zero;  /* a test frame: from MAC and IP zero */
	struct rte_ether_addr bcast;
	struct frame_hdr *h;

	if (cap < FRAME_OVERHEAD + len || len > UINT16_MAX)
		return -ENOSPC;
	memset(&bcast, 0xff, sizeof(bcast));
	frame_l2l4(buf, &zero, 0, &bcast, 0xffffffff, sizeof(*h) + len);
	h = (struct frame_hdr *)((uint8_t *)buf + L2L4_LEN);
	memset(h, 0, sizeof(*h));
	h->magic = rte_cpu_to_be_16(FRAME_MAGIC);
	h->version = FRAME_VERSION;
	h->type = type;
	h->len = rte_cpu_to_be_16((uint16_t)len);
	h->conn = rte_cpu_to_be_32(conn);
	h->seq = rte_cpu_to_be_32(seq);
	if (len)
		memcpy(h + 1, chunk, len);
	h->crc = rte_cpu_to_be_32(frame_crc(h, h + 1, len));
	return FRAME_OVERHEAD + (int)len;
}
