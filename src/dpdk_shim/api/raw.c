/* SPDX-License-Identifier: BSD-3-Clause
 * The hooks that tests and ra-testpmd use: raw frames in and out of a port, our own
 * frame built around a chunk, and an audit of the mbuf pools.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

int
shim_port_tx_raw(uint16_t port, const void *frame, uint32_t len, uint32_t count)
{
	struct shim_port *p = port_get(port);
	uint32_t i;

	if (p == NULL)
		return -ENODEV;
	if (count > 0 && (len == 0 || len > p->max_frame))
		return -EMSGSIZE;
	pthread_mutex_lock(&p->lock);
	if (count == 0)  /* only flush, twice: frames a reorder fault held go out too */
		chan_flush(p);
	for (i = 0; i < count; i++) {
		struct rte_mbuf *m = rte_pktmbuf_alloc(p->pool);

		if (m == NULL)
			break;
		memcpy(rte_pktmbuf_append(m, (uint16_t)len), frame, len);
		chan_queue(p, m);
		if (p->n_txq >= SHIM_BURST)
			chan_flush(p);
	}
	chan_flush(p);
	pthread_mutex_unlock(&p->lock);
	return i == count ? (int)i : -ENOBUFS;
}

int
shim_port_rx_raw(uint16_t port, void *buf, uint32_t stride, uint32_t *lens, uint32_t max)
{
	struct shim_port *p = port_get(port);
	struct rte_mbuf *pkts[2 * SHIM_BURST + SHIM_HOLD_MAX];
	uint32_t got = 0;
	uint16_t n;

	if (p == NULL)
		return -ENODEV;
	if (!p->raw)
		return -EBUSY;  /* the protocol owns this port's RX */
	pthread_mutex_lock(&p->lock);
	n = port_rx(p, pkts, (uint16_t)RTE_DIM(pkts));
	for (uint16_t i = 0; i < n; i++) {
		struct rte_mbuf *m = pkts[i];

		if (got < max) {
			uint32_t len = RTE_MIN(rte_pktmbuf_pkt_len(m), stride);

			uint8_t *dst = (uint8_t *)buf + (size_t)got * stride;
			const void *src = rte_pktmbuf_read(m, 0, len, dst);

			if (src != NULL && src != dst)
				memcpy(dst, src, len);
			lens[got++] = len;
			p->st.rx_frames++;
			p->st.rx_bytes += len;
		}
		rte_pktmbuf_free(m);
	}
	pthread_mutex_unlock(&p->lock);
	return (int)got;
}

static int
cmp_ptr(const void *a, const void *b)
{
	uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;

	return x < y ? -1 : x > y;
}

/* Take every free mbuf out of the pools, count those found twice (a double free
 * would put one there twice), put each back once. For tests. */
int
shim_pool_audit(void)
{
	int dups = 0;

	for (int k = 0; pool_at(k) != NULL; k++) {
		struct rte_mempool *mp = pool_at(k);
		unsigned int n = rte_mempool_avail_count(mp), got = 0;
		struct rte_mbuf **all = calloc(n + 64, sizeof(*all));

		if (all == NULL)
			return -ENOMEM;
		while (got < n + 64 && (all[got] = rte_pktmbuf_alloc(mp)) != NULL)
			got++;
		qsort(all, got, sizeof(*all), cmp_ptr);
		for (unsigned int i = 1; i < got; i++)
			if (all[i] == all[i - 1])
				dups++;
		for (unsigned int i = 0; i < got; i++)
			if (i == 0 || all[i] != all[i - 1])
				rte_pktmbuf_free(all[i]);
		free(all);
	}
	return dups;
}

int
shim_frame_build(void *buf, uint32_t cap, uint8_t type, uint32_t conn, uint32_t seq,
		 const void *chunk, uint32_t len)
{
	return frame_build(buf, cap, type, conn, seq, chunk, len);
}
