/* SPDX-License-Identifier: BSD-3-Clause
 * What Python asks about ports (names, drivers, link, stats), the fault knob, and the
 * raw-frame and pool-audit hooks that tests and ra-testpmd use.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rte_ethdev.h>

#include "shim_internal.h"

int
shim_port_count(void)
{
	return shim_eal_initialized() ? (int)rte_eth_dev_count_avail() : -ENODEV;
}

int
shim_port_name(uint16_t port, char *buf, size_t cap)
{
	char name[RTE_ETH_NAME_MAX_LEN];
	int ret = rte_eth_dev_get_name_by_port(port, name);

	if (ret != 0)
		return ret;
	snprintf(buf, cap, "%s", name);
	return 0;
}

int
shim_port_driver(uint16_t port, char *buf, size_t cap)
{
	struct rte_eth_dev_info info;
	int ret;

	if (!rte_eth_dev_is_valid_port(port))
		return -ENODEV;
	ret = rte_eth_dev_info_get(port, &info);
	if (ret != 0)
		return ret;
	snprintf(buf, cap, "%s", info.driver_name);
	return 0;
}

int
shim_port_stats(uint16_t port, struct shim_port_stats *out)
{
	struct shim_port *p = port_get(port);
	struct rte_eth_stats es;

	if (p == NULL)
		return -ENODEV;
	pthread_mutex_lock(&p->lock);
	*out = p->st;
	pthread_mutex_unlock(&p->lock);
	if (rte_eth_stats_get(port, &es) == 0) {
		out->eth_ipackets = es.ipackets;
		out->eth_opackets = es.opackets;
		out->eth_ibytes = es.ibytes;
		out->eth_obytes = es.obytes;
		out->eth_imissed = es.imissed;
		out->eth_ierrors = es.ierrors;
		out->eth_oerrors = es.oerrors;
		out->eth_rx_nombuf = es.rx_nombuf;
	}
	return 0;
}

int
shim_port_stats_reset(uint16_t port)
{
	struct shim_port *p = port_get(port);

	if (p == NULL)
		return -ENODEV;
	pthread_mutex_lock(&p->lock);
	memset(&p->st, 0, sizeof(p->st));
	pthread_mutex_unlock(&p->lock);
	rte_eth_stats_reset(port);
	return 0;
}

int
shim_port_fault(uint16_t port, int dir, const struct shim_fault *fault)
{
	struct shim_port *p = port_get(port);

	if (p == NULL)
		return -ENODEV;
	if ((dir != SHIM_RX && dir != SHIM_TX) || fault == NULL ||
	    fault->drop < 0 || fault->drop > 1 || fault->corrupt < 0 || fault->corrupt > 1 ||
	    fault->duplicate < 0 || fault->duplicate > 1 || fault->reorder < 0 || fault->reorder > 1)
		return -EINVAL;
	pthread_mutex_lock(&p->lock);
	fault_configure(&p->fault[dir], fault);
	pthread_mutex_unlock(&p->lock);
	return 0;
}

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
		port_flush(p);
	for (i = 0; i < count; i++) {
		struct rte_mbuf *m = rte_pktmbuf_alloc(p->pool);

		if (m == NULL)
			break;
		memcpy(rte_pktmbuf_append(m, (uint16_t)len), frame, len);
		port_queue(p, m);
		if (p->n_txq >= SHIM_BURST)
			port_flush(p);
	}
	port_flush(p);
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

	for (int k = 0; shim_pool_at(k) != NULL; k++) {
		struct rte_mempool *mp = shim_pool_at(k);
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
