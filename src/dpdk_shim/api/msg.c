/* SPDX-License-Identifier: BSD-3-Clause
 * Whole messages on a connection: the prologue (wire/prologue.c) and the payloads sent as
 * one message, a message received with its prologue checked.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

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
	len = prologue_encode(w, pro, need, type, flags, req_id, meta, meta_len, payloads, n);
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
		prologue_check(w, head, (uint64_t)n, msg_len, out);
	return n;
}
