/* SPDX-License-Identifier: BSD-3-Clause
 * The handshake: a client says HELLO to the whole segment until a server answers ACCEPT.
 * Each carries the sender's chunk size, window and peer timeout (struct hello_body) and,
 * on shared-memory ports, the name of the sender's doorbell (link/doorbell.c), which the
 * receiver maps. A HELLO makes a server connection and queues it for shim_accept.
 */
#include <stdio.h>
#include <string.h>

#include "chan/chan.h"

static void
hello_body_fill(const struct shim_conn *c, struct hello_body *b)
{
	b->max_chunk = rte_cpu_to_be_32(c->chunk);
	b->window = rte_cpu_to_be_32(c->window);
	b->peer_timeout_ns = rte_cpu_to_be_64(c->o.peer_timeout_ns);
}

static bool
hello_read(const struct frame *f, struct hello_body *b)
{
	if (f->len < sizeof(*b))
		return false;
	memcpy(b, f->chunk, sizeof(*b));
	return rte_be_to_cpu_32(b->max_chunk) >= 64 && rte_be_to_cpu_32(b->window) >= 64;
}

void
hello_send(struct shim_conn *c, uint8_t type, bool broadcast)
{
	struct {
		struct hello_body b;
		struct hello_doorbell d;
	} __attribute__((packed)) h;
	uint32_t len = sizeof(h.b);

	hello_body_fill(c, &h.b);
	if (c->db_own != NULL && c->db_name[0] != '\0') {
		memset(&h.d, 0, sizeof(h.d));
		h.d.magic = rte_cpu_to_be_32(HELLO_DB_MAGIC);
		h.d.token = rte_cpu_to_be_64(c->db_token);
		snprintf(h.d.name, sizeof(h.d.name), "%s", c->db_name);
		len = sizeof(h);
	}
	conn_send_ctrl(c, type, 0, &h, len, broadcast);
}

/* The peer's doorbell, from its HELLO (server) or ACCEPT (client). */
static void
hello_doorbell_read(struct shim_conn *c, const struct frame *f)
{
	struct hello_doorbell d;

	if (c->db_peer != NULL || !c->port->shared_memory ||
	    f->len < sizeof(struct hello_body) + sizeof(d))
		return;
	memcpy(&d, f->chunk + sizeof(struct hello_body), sizeof(d));
	if (rte_be_to_cpu_32(d.magic) != HELLO_DB_MAGIC || memchr(d.name, '\0', sizeof(d.name)) == NULL)
		return;
	c->db_peer = db_open(d.name, rte_be_to_cpu_64(d.token));
}

/* A HELLO; c: the connection of its id and source, if any. */
void
on_hello(struct shim_port *p, const struct frame *f, struct shim_conn *c, uint64_t now)
{
	uint32_t id = rte_be_to_cpu_32(f->h->conn);
	struct hello_body b;

	if (c != NULL) {
		if (c->state == CS_CONNECTING)
			return;  /* our own broadcast, looped back by the link */
		if (c->state == CS_OPEN)  /* our ACCEPT was lost */
			hello_send(c, FT_ACCEPT, false);
		return;
	}
	if (!p->listening) {
		p->st.rx_no_conn++;
		return;
	}
	if (!hello_read(f, &b)) {
		p->st.rx_malformed++;
		return;
	}
	if (p->n_conns >= SHIM_MAX_CONNS || (c = conn_new(p, id, &p->listen_opts)) == NULL) {
		send_reset(p, f, id, now);
		return;
	}
	rte_ether_addr_copy(&f->src, &c->peer_mac);
	c->peer_ip = f->src_ip;
	c->chunk = RTE_MIN(c->chunk, rte_be_to_cpu_32(b.max_chunk));
	c->snd_limit = rte_be_to_cpu_32(b.window);
	c->state = CS_OPEN;
	c->group = p->listen_group;
	c->last_rx = now;
	c->data_crc = (f->h->flags & rte_cpu_to_be_16(FF_WANT_CRC)) != 0;
	hello_doorbell_read(c, f);
	conn_attach(p, c);
	hello_send(c, FT_ACCEPT, false);
	accept_push(c);  /* the queue holds the reference conn_new gave */
}

/* An ACCEPT for our connection c, still connecting: it opens. */
void
on_accept(struct shim_conn *c, const struct frame *f, uint64_t now)
{
	struct hello_body b;

	if (!hello_read(f, &b))
		return;
	rte_ether_addr_copy(&f->src, &c->peer_mac);
	c->peer_ip = f->src_ip;
	c->chunk = RTE_MIN(c->chunk, rte_be_to_cpu_32(b.max_chunk));
	c->snd_limit = rte_be_to_cpu_32(b.window);
	c->data_crc = (f->h->flags & rte_cpu_to_be_16(FF_WANT_CRC)) != 0;
	c->state = CS_OPEN;
	c->last_rx = now;
	hello_doorbell_read(c, f);
	db_unlink(c->db_name);  /* the server mapped it when our HELLO came */
}
