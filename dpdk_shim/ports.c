/* SPDX-License-Identifier: BSD-3-Clause
 * Ports coming and going, above the layers they touch: a port is set up (port.c) and
 * then served by the poll thread (engine.c); a removed port's connections die first
 * (chan.c). port.c itself calls none of them.
 */
#include <errno.h>

#include <rte_bus_vdev.h>
#include <rte_ethdev.h>

#include "chan.h"

/* Configure, start and hand the port to the poll thread; again: 0, nothing done. */
int
shim_port_setup(uint16_t port, const struct shim_port_conf *conf)
{
	int ret = port_setup(port, conf);

	return ret != 0 ? ret : engine_start();
}

int
shim_vdev_remove(uint16_t port)
{
	char name[RTE_ETH_NAME_MAX_LEN];
	struct shim_port *p;
	int ret;

	if (port >= SHIM_MAX_PORTS || rte_eth_dev_get_name_by_port(port, name) != 0)
		return -ENODEV;
	p = &shim_ports[port];
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
