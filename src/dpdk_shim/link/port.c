/* SPDX-License-Identifier: BSD-3-Clause
 * Ports: setup of any ethdev that EAL args name (vdev or PCI), the mbuf pools, the burst
 * wrappers (with the fault stage between protocol and PMD) and the TX queue.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rte_ethdev.h>

#include "link/link.h"

#define RX_DESC 1024
#define TX_DESC 1024
#define POOL_CACHE 256
#define MAX_POOLS 4
#define POOL_BYTES (128u << 20)
#define DEFAULT_MBUFS 8191  /* most mbufs of a pool sized by POOL_BYTES */
#define STANDARD_FRAME 1514  /* Ethernet without jumbo frames: 1500 bytes of MTU + the header */
#define LINK_CHECK_NS 1000000ull
/* The mbuf data room is a little larger than the biggest frame: memif's tx fast path
 * (taken when its bsize >= our data room) copies each segment of a chain into its
 * own descriptor and leaves stale "next" flags behind (22.11); with more room than
 * bsize memif gathers a header + extbuf chain into one descriptor. */
#define ROOM_SLACK 64

static pthread_mutex_t setup_lock = PTHREAD_MUTEX_INITIALIZER;
static struct rte_mempool *pools[MAX_POOLS];
static uint32_t pool_room[MAX_POOLS];

struct rte_mempool *
pool_at(int i)
{
	return i >= 0 && i < MAX_POOLS ? pools[i] : NULL;
}

struct shim_port *
port_get(uint16_t port)
{
	if (port >= SHIM_MAX_PORTS || !port_table[port].ready)
		return NULL;
	return &port_table[port];
}

/* One pool per data room size, shared by the ports that need that size. */
static struct rte_mempool *
pool_for(uint32_t max_frame, uint32_t n_mbufs)
{
	uint32_t room = max_frame + ROOM_SLACK + RTE_PKTMBUF_HEADROOM;
	char name[RTE_MEMPOOL_NAMESIZE];
	int i;

	if (room > UINT16_MAX)
		room = UINT16_MAX;
	for (i = 0; i < MAX_POOLS && pools[i] != NULL; i++)
		if (pool_room[i] >= room)
			return pools[i];
	if (i == MAX_POOLS)
		return NULL;
	snprintf(name, sizeof(name), "ra_pool_%u", room);
	if (n_mbufs == 0)  /* about POOL_BYTES whatever the frame size, within limits */
		n_mbufs = RTE_MAX(1023u, RTE_MIN((uint32_t)DEFAULT_MBUFS, POOL_BYTES / room));
	pools[i] = rte_pktmbuf_pool_create(name, n_mbufs,
					   POOL_CACHE, 0, (uint16_t)room, (int)rte_socket_id());
	pool_room[i] = room;
	return pools[i];
}

static uint32_t
default_max_frame(const struct rte_eth_dev_info *info)
{
	/* A PCI NIC's own maximum says nothing about the switch behind it: stay at a
	 * standard frame unless the caller knows better (jumbo via conf->max_frame). */
	(void)info;
	return STANDARD_FRAME;
}

int
port_link(uint16_t port)
{
	struct rte_eth_link link;
	int ret;

	if (!rte_eth_dev_is_valid_port(port))
		return -ENODEV;
	ret = rte_eth_link_get_nowait(port, &link);
	if (ret != 0)
		return ret;
	return link.link_status == RTE_ETH_LINK_UP;
}

int
port_setup(uint16_t port, const struct shim_port_conf *conf)
{
	struct rte_eth_conf ec;
	struct rte_eth_dev_info info;
	struct shim_port *p;
	uint16_t nb_rxd, nb_txd;
	int ret, socket;

	if (!eal_initialized())
		return -ENODEV;
	if (port >= SHIM_MAX_PORTS || !rte_eth_dev_is_valid_port(port))
		return -ENODEV;
	p = &port_table[port];
	pthread_mutex_lock(&setup_lock);
	if (p->ready) {
		pthread_mutex_unlock(&setup_lock);
		return 0;
	}
	/* The lock outlives set-ups of the same port id (a removed vdev's id is reused). */
	{
		pthread_mutex_t keep = p->lock;

		memset(p, 0, sizeof(*p));
		p->lock = keep;
	}
	p->id = port;
	socket = rte_eth_dev_socket_id(port);
	if (socket < 0)
		socket = (int)rte_socket_id();

	/* Device capabilities */
	ret = rte_eth_dev_info_get(port, &info);
	if (ret != 0)
		goto out;
	p->max_frame = conf && conf->max_frame ? conf->max_frame : default_max_frame(&info);
	if (p->max_frame > UINT16_MAX - ROOM_SLACK - RTE_PKTMBUF_HEADROOM)
		p->max_frame = UINT16_MAX - ROOM_SLACK - RTE_PKTMBUF_HEADROOM;
	if (p->max_frame < FRAME_OVERHEAD + 64) {
		ret = -EINVAL;
		goto out;
	}
	/* Mbuf pool */
	p->pool = pool_for(RTE_MAX(p->max_frame, conf ? conf->min_room : 0),
			  conf ? conf->n_mbufs : 0);
	if (p->pool == NULL) {
		ret = rte_errno ? -rte_errno : -ENOMEM;
		goto out;
	}
	/* Configure one RX and one TX queue; chains (header + extbuf) need MULTI_SEGS */
	memset(&ec, 0, sizeof(ec));
	if (info.tx_offload_capa & RTE_ETH_TX_OFFLOAD_MULTI_SEGS)
		ec.txmode.offloads |= RTE_ETH_TX_OFFLOAD_MULTI_SEGS;
	ret = rte_eth_dev_configure(port, 1, 1, &ec);
	if (ret != 0)
		goto out;
	if (p->max_frame > STANDARD_FRAME && info.max_mtu > RTE_ETHER_MTU &&
	    rte_eth_dev_set_mtu(port, (uint16_t)(p->max_frame - RTE_ETHER_HDR_LEN)) != 0 &&
	    strncmp(info.driver_name, "net_", 4) != 0)
		p->max_frame = STANDARD_FRAME;  /* a NIC that refuses jumbo frames */
	/* Descriptor counts the device accepts */
	nb_rxd = conf && conf->rx_desc ? conf->rx_desc : RX_DESC;
	nb_txd = conf && conf->tx_desc ? conf->tx_desc : TX_DESC;
	ret = rte_eth_dev_adjust_nb_rx_tx_desc(port, &nb_rxd, &nb_txd);
	if (ret != 0)
		goto out;
	/* Queues */
	ret = rte_eth_rx_queue_setup(port, 0, nb_rxd, (unsigned)socket, NULL, p->pool);
	if (ret != 0)
		goto out;
	ret = rte_eth_tx_queue_setup(port, 0, nb_txd, (unsigned)socket, NULL);
	if (ret != 0)
		goto out;
	/* Start. A memif client whose server is not there yet fails here; it stays set
	 * up, and shim_connect restarts it until the server answers. */
	p->is_memif = strcmp(info.driver_name, "net_memif") == 0;
	p->shared_memory = p->is_memif || strcmp(info.driver_name, "net_ring") == 0;
	ret = rte_eth_dev_start(port);
	if (ret != 0 && !p->is_memif)
		goto out;
	p->started = ret == 0;
	ret = 0;
	/* Addresses: a port without a MAC of its own gets a random local one */
	rte_eth_macaddr_get(port, &p->mac);
	if (rte_is_zero_ether_addr(&p->mac)) {
		rte_eth_random_addr(p->mac.addr_bytes);
		rte_eth_dev_default_mac_addr_set(port, &p->mac);
	}
	p->ip = rte_cpu_to_be_32((169u << 24) | (254u << 16) |
				 ((uint32_t)p->mac.addr_bytes[4] << 8) | p->mac.addr_bytes[5]);
	if (conf == NULL || conf->zero_copy < 0)
		p->zero_copy = p->is_memif || strcmp(info.driver_name, "net_af_packet") == 0;
	else
		p->zero_copy = conf->zero_copy != 0;
	p->raw = conf && conf->raw;
	if (p->is_memif)
		guard_init();
	p->link_up = port_link(port) == 1;
	p->ready = true;
out:
	pthread_mutex_unlock(&setup_lock);
	return ret;
}

int
port_restart(struct shim_port *p)
{
	int ret = p->started ? rte_eth_dev_stop(p->id) : 0;

	if (ret == 0)
		ret = rte_eth_dev_start(p->id);
	p->started = ret == 0;
	p->link_up = false;
	p->next_link_check = 0;
	return ret;
}

uint16_t
port_rx(struct shim_port *p, struct rte_mbuf **pkts, uint16_t cap)
{
	uint16_t n;

	/* A stopped port (a memif client whose restart found no server) has ethdev's
	 * dummy burst functions, which dump a backtrace to stderr on every call. */
	if (unlikely(!p->started))
		return 0;
	n = guarded_rx(p, pkts, SHIM_BURST);

	return fault_apply(&p->fault[SHIM_RX], p, pkts, n, cap);
}

/* Returns the frames a flush sent to make room. */
static int
txq_append(struct shim_port *p, struct rte_mbuf *m)
{
	int sent = 0;

	if (p->n_txq == SHIM_TXQ_CAP)
		sent = port_flush(p);
	if (p->n_txq == SHIM_TXQ_CAP) {
		/* The PMD takes nothing (peer gone, ring full): drop, retransmission covers. */
		rte_pktmbuf_free(m);
		p->st.tx_full++;
		return sent;
	}
	p->txq[p->n_txq++] = m;
	return sent;
}

int
port_queue(struct shim_port *p, struct rte_mbuf *m)
{
	struct rte_mbuf *tmp[2 + SHIM_HOLD_MAX];
	uint16_t n;
	int sent = 0;

	tmp[0] = m;
	n = fault_apply(&p->fault[SHIM_TX], p, tmp, 1, RTE_DIM(tmp));
	for (uint16_t i = 0; i < n; i++)
		sent += txq_append(p, tmp[i]);
	return sent;
}

int
port_flush(struct shim_port *p)
{
	int off = 0;

	if (unlikely(!p->started))
		return 0;  /* frames wait in txq until the port runs (see port_rx) */
	/* Held frames go out behind the next new frame; without traffic, after a flush. */
	if (p->fault[SHIM_TX].n_held && ++p->fault[SHIM_TX].idle_flushes >= 2 &&
	    p->n_txq < SHIM_TXQ_CAP - SHIM_HOLD_MAX) {
		struct rte_mbuf *tmp[SHIM_HOLD_MAX];
		uint16_t n = fault_apply(&p->fault[SHIM_TX], p, tmp, 0, RTE_DIM(tmp));

		for (uint16_t i = 0; i < n; i++)
			p->txq[p->n_txq++] = tmp[i];
	}
	while (off < p->n_txq) {
		uint16_t want = (uint16_t)RTE_MIN(p->n_txq - off, SHIM_BURST);
		int k = guarded_tx(p, p->txq + off, want);

		if (k < 0) {  /* the PMD faulted mid-burst: those mbufs are lost, not ours */
			off += want;
			break;
		}
		for (int i = 0; i < k; i++)
			p->st.tx_bytes += rte_pktmbuf_pkt_len(p->txq[off + i]);
		p->st.tx_frames += k;
		off += k;
		if (k < (int)want) {
			p->st.tx_full++;
			break;
		}
	}
	if (off > 0 && off < p->n_txq)
		memmove(p->txq, p->txq + off, sizeof(p->txq[0]) * (size_t)(p->n_txq - off));
	p->n_txq -= off;
	return off;
}

bool
port_check_link(struct shim_port *p, uint64_t now)
{
	struct rte_eth_link link;
	bool up, went_down;

	if (now < p->next_link_check)
		return false;
	p->next_link_check = now + ns_to_tsc(LINK_CHECK_NS);
	if (rte_eth_link_get_nowait(p->id, &link) != 0)
		return false;
	up = link.link_status == RTE_ETH_LINK_UP;
	went_down = p->link_up && !up;
	p->link_up = up;
	return went_down;
}

