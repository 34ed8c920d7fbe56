/* SPDX-License-Identifier: BSD-3-Clause
 * The message prologue of dataplane/wire.py, encoded and checked in C on the fast path.
 *
 * wire.py is the reference: header "!2sBBHHIIQI" (magic, version, type, flags,
 * n_payloads, req_id, meta_len, payload_total, crc32c), then n_payloads u64 lengths,
 * then meta; the CRC covers all three with the crc field zero. The constants come from
 * shim.h, and tests/unit/test_wire_facts.py holds wire.py to them. Decoding here only
 * says "valid" or "look closer": anything odd goes back to wire.py, which raises the
 * exact error. Tests check that both sides produce the same bytes.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <rte_byteorder.h>

#include "shim_internal.h"

static void
put16(uint8_t *p, uint16_t v)
{
	v = rte_cpu_to_be_16(v);
	memcpy(p, &v, 2);
}

static void
put32(uint8_t *p, uint32_t v)
{
	v = rte_cpu_to_be_32(v);
	memcpy(p, &v, 4);
}

static void
put64(uint8_t *p, uint64_t v)
{
	v = rte_cpu_to_be_64(v);
	memcpy(p, &v, 8);
}

static uint16_t
get16(const uint8_t *p)
{
	uint16_t v;

	memcpy(&v, p, 2);
	return rte_be_to_cpu_16(v);
}

static uint32_t
get32(const uint8_t *p)
{
	uint32_t v;

	memcpy(&v, p, 4);
	return rte_be_to_cpu_32(v);
}

static uint64_t
get64(const uint8_t *p)
{
	uint64_t v;

	memcpy(&v, p, 8);
	return rte_be_to_cpu_64(v);
}

int64_t
shim_wire_encode(const struct shim_wire *w, void *buf, uint64_t cap, uint8_t type,
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
	crc = shim_crc32c(0, p, need);
	put32(p + 24, crc);
	return (int64_t)need;
}

int
shim_wire_check(const struct shim_wire *w, const void *buf, uint64_t len, uint64_t msg_len,
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
	for (uint32_t i = 0; i < out->n_payloads; i++)
		total += get64(p + SHIM_WIRE_HEADER + 8 * i);
	if (total != out->payload_total)
		return 0;
	memcpy(zeroed, p, SHIM_WIRE_HEADER);
	memset(zeroed + 24, 0, 4);
	crc = shim_crc32c(shim_crc32c(0, zeroed, SHIM_WIRE_HEADER), p + SHIM_WIRE_HEADER,
			  plen - SHIM_WIRE_HEADER);
	if (crc != out->crc)
		return 0;
	out->status = 0;
	return 0;
}

#define SMALL_PROLOGUE 2048
#define SMALL_IOV 32

int
shim_conn_send_msg(struct shim_conn *c, const struct shim_wire *w, uint8_t type, uint16_t flags,
		   uint32_t req_id, const char *meta, uint32_t meta_len,
		   const struct shim_iov *payloads, int n)
{
	uint8_t small[SMALL_PROLOGUE];
	struct shim_iov small_iov[SMALL_IOV + 1], *iov = small_iov;
	uint64_t need = SHIM_WIRE_HEADER + 8ull * (uint64_t)(n < 0 ? 0 : n) + meta_len;
	uint8_t *pro = small;
	int64_t len;
	int rc;

	if (need > SMALL_PROLOGUE && (pro = malloc(need)) == NULL)
		return -ENOMEM;
	if (n > SMALL_IOV && (iov = malloc(sizeof(*iov) * ((size_t)n + 1))) == NULL) {
		rc = -ENOMEM;
		goto out;
	}
	len = shim_wire_encode(w, pro, need, type, flags, req_id, meta, meta_len, payloads, n);
	if (len < 0) {
		rc = (int)len;
		goto out;
	}
	iov[0].base = pro;
	iov[0].len = (uint64_t)len;
	if (n > 0)
		memcpy(iov + 1, payloads, sizeof(*iov) * (size_t)n);
	rc = shim_conn_send(c, iov, n + 1);
out:
	if (iov != small_iov)
		free(iov);
	if (pro != small)
		free(pro);
	return rc;
}

int
shim_conn_send_pair(struct shim_conn *c, const struct shim_wire *w, uint8_t type1, uint32_t req_id1,
		    const char *meta1, uint32_t meta_len1, uint8_t type2, uint32_t req_id2,
		    const char *meta2, uint32_t meta_len2)
{
	int rc = shim_conn_cork(c, 1);

	if (rc != 0)
		return rc;
	rc = shim_conn_send_msg(c, w, type1, 0, req_id1, meta1, meta_len1, NULL, 0);
	if (rc == 0)
		rc = shim_conn_send_msg(c, w, type2, 0, req_id2, meta2, meta_len2, NULL, 0);
	shim_conn_cork(c, 0);  /* the burst leaves here */
	return rc;
}

int64_t
shim_conn_recv_msg(struct shim_conn *c, const struct shim_wire *w, void *head, uint64_t cap,
		   int64_t timeout_ns, struct shim_msg_info *out)
{
	uint64_t msg_len = 0;
	int64_t n = conn_recv_begin(c, head, cap, timeout_ns, &msg_len);

	if (n >= 0)
		shim_wire_check(w, head, (uint64_t)n, msg_len, out);
	return n;
}
