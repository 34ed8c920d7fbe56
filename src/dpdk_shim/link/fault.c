/* SPDX-License-Identifier: BSD-3-Clause
 * Fault injection between the protocol and the PMD, per port and direction, so tests
 * exercise the reliability code on links that lose nothing (memif, rings).
 *
 * A frame may be shared (a ring pair hands the sender's mbuf to the receiver, and the
 * sender keeps a reference for retransmission), so corruption always works on a
 * private copy: flipping a bit in place would also corrupt every retransmission.
 */
#include <string.h>
#include <time.h>

#include <rte_mbuf.h>

#include "link/link.h"

static uint64_t
next_rand(uint64_t *s)
{
	/* xorshift64*: plenty for rates; deterministic for a given seed */
	uint64_t x = *s;

	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	*s = x;
	return x * 0x2545f4914f6cdd1dull;
}

static double
next_unit(uint64_t *s)
{
	return (double)(next_rand(s) >> 11) * (1.0 / 9007199254740992.0);
}

void
fault_configure(struct fault_stage *f, const struct shim_fault *cfg)
{
	uint64_t seed = cfg->seed;

	if (seed == 0) {
		struct timespec ts;

		clock_gettime(CLOCK_MONOTONIC, &ts);
		seed = (uint64_t)ts.tv_nsec * 2654435761u + (uint64_t)ts.tv_sec;
	}
	f->cfg = *cfg;
	f->rng = seed | 1;
	f->active = cfg->drop > 0 || cfg->corrupt > 0 || cfg->duplicate > 0 || cfg->reorder > 0;
}

static struct rte_mbuf *
corrupt(struct fault_stage *f, struct shim_port *p, struct rte_mbuf *m)
{
	struct rte_mbuf *c = m;
	uint32_t off;

	if (RTE_MBUF_HAS_EXTBUF(m) || m->nb_segs > 1 || rte_mbuf_refcnt_read(m) > 1) {
		c = rte_pktmbuf_copy(m, p->pool, 0, UINT32_MAX);
		rte_pktmbuf_free(m);
		if (c == NULL)
			return NULL;  /* counts as a drop */
		if (c->nb_segs > 1 && rte_pktmbuf_linearize(c) != 0) {
			rte_pktmbuf_free(c);
			return NULL;
		}
	}
	off = (uint32_t)(next_rand(&f->rng) % rte_pktmbuf_data_len(c));
	rte_pktmbuf_mtod(c, uint8_t *)[off] ^= (uint8_t)(1u << (next_rand(&f->rng) & 7));
	return c;
}

static void
retain(struct rte_mbuf *m)
{
	for (struct rte_mbuf *s = m; s != NULL; s = s->next)
		rte_mbuf_refcnt_update(s, 1);
}

#define FAULT_MAX_IN (2 * SHIM_BURST)

/* Filter pkts[0..n) into pkts; frames held back earlier come out after the new ones.
 * Returns the new count (at most cap). */
uint16_t
fault_apply(struct fault_stage *f, struct shim_port *p, struct rte_mbuf **pkts,
	    uint16_t n, uint16_t cap)
{
	struct rte_mbuf *prev[SHIM_HOLD_MAX];
	struct rte_mbuf *in[FAULT_MAX_IN];
	int n_prev = f->n_held;
	uint16_t out = 0;

	if (!f->active && n_prev == 0)
		return n;
	/* Duplicates make the output longer than the input read so far: read from a copy. */
	if (n > FAULT_MAX_IN)
		n = FAULT_MAX_IN;  /* callers pass at most a burst */
	memcpy(in, pkts, sizeof(in[0]) * n);
	memcpy(prev, f->held, sizeof(prev[0]) * (size_t)n_prev);
	f->n_held = 0;
	if (n > 0)
		f->idle_flushes = 0;
	for (uint16_t i = 0; i < n; i++) {
		struct rte_mbuf *m = in[i];

		if (f->cfg.drop > 0 && next_unit(&f->rng) < f->cfg.drop) {
			rte_pktmbuf_free(m);
			p->st.fault_dropped++;
			continue;
		}
		if (f->cfg.corrupt > 0 && next_unit(&f->rng) < f->cfg.corrupt) {
			m = corrupt(f, p, m);
			p->st.fault_corrupted++;
			if (m == NULL)
				continue;
		}
		if (f->cfg.reorder > 0 && f->n_held < SHIM_HOLD_MAX &&
		    next_unit(&f->rng) < f->cfg.reorder) {
			f->held[f->n_held++] = m;
			p->st.fault_reordered++;
			continue;
		}
		pkts[out++] = m;
		if (f->cfg.duplicate > 0 && out < cap && next_unit(&f->rng) < f->cfg.duplicate) {
			retain(m);
			pkts[out++] = m;
			p->st.fault_duplicated++;
		}
	}
	for (int i = 0; i < n_prev; i++) {
		if (out < cap)
			pkts[out++] = prev[i];
		else if (f->n_held < SHIM_HOLD_MAX)
			f->held[f->n_held++] = prev[i];
		else
			rte_pktmbuf_free(prev[i]);
	}
	return out;
}
