/* SPDX-License-Identifier: BSD-3-Clause
 * Ports: set-up (then the poll thread serves them), virtual devices coming and going
 * (a removed port's connections die first), and what Python asks about ports (names,
 * drivers, link, stats) and the fault knob.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <rte_bus_vdev.h>
#include <rte_errno.h>
#include <rte_eth_ring.h>
#include <rte_ethdev.h>
#include <rte_ring.h>

#include "api/api.h"

/* Configure, start and hand the port to the poll thread; again: 0, nothing done. */
int
shim_port_setup(uint16_t port, const struct shim_port_conf *conf)
{
	int ret = port_setup(port, conf);

	return ret != 0 ? ret : engine_start();
}

int
shim_port_link(uint16_t port)
{
	return port_link(port);
}

int
shim_vdev_add(const char *name, const char *args)
{
	uint16_t port;
	int ret;

	if (!eal_initialized())
		return -ENODEV;
	ret = rte_eal_hotplug_add("vdev", name, args ? args : "");
	if (ret != 0)
		return ret < 0 ? ret : -EINVAL;
	ret = rte_eth_dev_get_port_by_name(name, &port);
	return ret != 0 ? ret : port;
}

int
shim_vdev_remove(uint16_t port)
{
	char name[RTE_ETH_NAME_MAX_LEN];
	struct shim_port *p;
	int ret;

	if (port >= SHIM_MAX_PORTS || rte_eth_dev_get_name_by_port(port, name) != 0)
		return -ENODEV;
	p = &port_table[port];
	pthread_mutex_lock(&p->lock);
	if (p->ready) {
		chan_port_down(p, "port removed");
		p->ready = false;
		if (p->started)
			rte_eth_dev_stop(port);
	}
	ret = rte_eal_hotplug_remove("vdev", name);
	pthread_mutex_unlock(&p->lock);
	return ret;
}

int
shim_ring_pair(const char *name, uint16_t *port_a, uint16_t *port_b)
{
	struct rte_ring *ab, *ba;
	char rname[RTE_RING_NAMESIZE];
	char pname[64];
	int a, b;

	if (!eal_initialized())
		return -ENODEV;
	/* Each ring has one producer and one consumer port, each under its port lock. */
	snprintf(rname, sizeof(rname), "%s_ab", name);
	ab = rte_ring_create(rname, 2048, rte_socket_id(), RING_F_SP_ENQ | RING_F_SC_DEQ);
	snprintf(rname, sizeof(rname), "%s_ba", name);
	ba = rte_ring_create(rname, 2048, rte_socket_id(), RING_F_SP_ENQ | RING_F_SC_DEQ);
	if (ab == NULL || ba == NULL)
		return rte_errno ? -rte_errno : -ENOMEM;
	snprintf(pname, sizeof(pname), "%s_a", name);
	a = rte_eth_from_rings(pname, &ba, 1, &ab, 1, rte_socket_id());
	snprintf(pname, sizeof(pname), "%s_b", name);
	b = rte_eth_from_rings(pname, &ab, 1, &ba, 1, rte_socket_id());
	if (a < 0 || b < 0)
		return rte_errno ? -rte_errno : -EINVAL;
	*port_a = (uint16_t)a;
	*port_b = (uint16_t)b;
	return 0;
}

/* -- what Python asks ---------------------------------------------------------------- */

int
shim_port_count(void)
{
	return eal_initialized() ? (int)rte_eth_dev_count_avail() : -ENODEV;
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
