/* SPDX-License-Identifier: BSD-3-Clause
 * The message prologue of dataplane/wire.py in C: encoded and checked on the fast paths.
 *
 * wire.py is the reference: header "!2sBBHHIIQI" (magic, version, type, flags,
 * n_payloads, req_id, meta_len, payload_total, crc32c), then n_payloads u64 lengths,
 * then meta; the CRC covers all three with the crc field zero. The constants come from
 * shim.h, and tests/unit/test_wire_facts.py holds wire.py to them. Checking here only
 * says "valid" or "look closer": anything odd goes back to wire.py, which raises the
 * exact error. Tests check that both sides produce the same bytes.
 *
 * No DPDK header here (nor in crc.c): the server's C++ module compiles these two files as
 * well (with api/codec.c, where shim_wire_encode and shim_wire_check call these), for its
 * TCP sessions' receive loop (server/csrc/tcp_link.cpp), and links nothing else of the shim.
 */
#include <errno.h>
#include <string.h>

#define WIRE_NO_DPDK
#include "wire/wire.h"

/* Network byte order, written out (compilers turn these into a load and a bswap). */
static void
put16(uint8_t *p, uint16_t v)
{
	p[0] = (uint8_t)(v >> 8);
	p[1] = (uint8_t)v;
}

static void
put32(uint8_t *p, uint32_t v)
{
	for (int i = 3; i >= 0; i--, v >>= 8)
		p[i] = (uint8_t)v;
}

static void
put64(uint8_t *p, uint64_t v)
{
	put32(p, (uint32_t)(v >> 32));
	put32(p + 4, (uint32_t)v);
}

static uint16_t
get16(const uint8_t *p)
{
	return (uint16_t)(p[0] << 8 | p[1]);
}

static uint32_t
get32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint64_t
get64(const uint8_t *p)
{
	return (uint64_t)get32(p) << 32 | get32(p + 4);
}

int64_t
prologue_encode(const struct shim_wire *w, void *buf, uint64_t cap, uint8_t type,
		uint16_t flags, uint32_t req_id, const char *meta, uint32_t meta_len,
		const struct shim_iov *payloads, int n)
{
	uint8_t *p = buf;
	uint64_t need = SHIM_WIRE_HEADER + 8ull * (uint64_t)n + meta_len, total = 0;
	uint32_t crc;

	if (n < 0 || n > UINT16_MAX)
		return -EINVAL;
	if (need > cap)
		return -ENOSPC;
	for (int i = 0; i < n; i++) {
		put64(p + SHIM_WIRE_HEADER + 8 * i, payloads[i].len);
		total += payloads[i].len;
	}
	p[0] = w->magic0;
	p[1] = w->magic1;
	p[2] = w->version;
	p[3] = type;
	put16(p + 4, flags);
	put16(p + 6, (uint16_t)n);
	put32(p + 8, req_id);
	put32(p + 12, meta_len);
	put64(p + 16, total);
	put32(p + 24, 0);
	if (meta_len)
		memcpy(p + SHIM_WIRE_HEADER + 8 * n, meta, meta_len);
	crc = crc32c(0, p, need);
	put32(p + 24, crc);
	return (int64_t)need;
}

int
prologue_check(const struct shim_wire *w, const void *buf, uint64_t len, uint64_t msg_len,
	       struct shim_msg_info *out)
{
	const uint8_t *p = buf;
	uint8_t zeroed[SHIM_WIRE_HEADER];
	uint64_t total = 0, plen;
	uint32_t crc;

	memset(out, 0, sizeof(*out));
	out->status = 1;  /* not (yet) known good */
	out->msg_len = msg_len;
	if (len < SHIM_WIRE_HEADER || p[0] != w->magic0 || p[1] != w->magic1 || p[2] != w->version)
		return 0;
	out->type = p[3];
	out->flags = get16(p + 4);
	out->n_payloads = get16(p + 6);
	out->req_id = get32(p + 8);
	out->meta_len = get32(p + 12);
	out->payload_total = get64(p + 16);
	out->crc = get32(p + 24);
	if (out->meta_len > w->max_meta || out->n_payloads > w->max_payloads ||
	    out->payload_total > w->max_payload_total)
		return 0;
	plen = SHIM_WIRE_HEADER + 8ull * out->n_payloads + out->meta_len;
	out->prologue_len = (uint32_t)plen;
	if (plen > len || plen + out->payload_total != msg_len)
		return 0;  /* prologue beyond what we hold, or lengths that disagree */
	/* each length within the total, which the limit keeps far below 2^64 / 65536: the u64
	 * sum of at most 65535 of them cannot wrap round to the total then (wire.py's sum,
	 * in Python's ints, never wraps; fuzz/prologue_fuzz.c found lengths that did here) */
	for (uint32_t i = 0; i < out->n_payloads; i++) {
		uint64_t one = get64(p + SHIM_WIRE_HEADER + 8 * i);

		if (one > out->payload_total)
			return 0;
		total += one;
	}
	if (total != out->payload_total)
		return 0;
	memcpy(zeroed, p, SHIM_WIRE_HEADER);
	memset(zeroed + 24, 0, 4);
	crc = crc32c(crc32c(0, zeroed, SHIM_WIRE_HEADER), p + SHIM_WIRE_HEADER,
		     plen - SHIM_WIRE_HEADER);
	if (crc != out->crc)
		return 0;
	out->status = 0;
	return 0;
}
