/* SPDX-License-Identifier: BSD-3-Clause
 * Bursts on memif ports, guarded against the PMD's disconnect race.
 *
 * When the peer goes away, memif 22.11 handles it in EAL's interrupt thread: it
 * clears the "connected" flag and then munmaps the shared regions, without waiting
 * for a data-path thread that already passed the flag check and is copying from or
 * to those regions. That thread then takes SIGSEGV: a server would die because one
 * client was killed. We cannot change the PMD, so a burst on a memif port runs under
 * sigsetjmp, and a SIGSEGV/SIGBUS raised by *this thread while inside such a burst*
 * jumps back and reports zero frames (the port's link is already down). Anything
 * else goes to the handler that was installed before ours (faulthandler, default).
 *
 * The jump is sound because the fault is synchronous, in a copy from/to the region,
 * where the PMD holds no lock and no mempool operation is half done; the mbufs of
 * that one burst are leaked on purpose (the PMD may have freed some of them).
 */
#include <setjmp.h>
#include <signal.h>
#include <string.h>

#include <rte_ethdev.h>

#include "link/link.h"

static __thread sigjmp_buf *guard_env;
static struct sigaction old_segv, old_bus;
static pthread_once_t guard_once = PTHREAD_ONCE_INIT;

static void
guard_handler(int sig, siginfo_t *si, void *ctx)
{
	sigjmp_buf *env = guard_env;
	struct sigaction *old = sig == SIGSEGV ? &old_segv : &old_bus;

	if (env != NULL) {
		guard_env = NULL;
		siglongjmp(*env, 1);
	}
	if ((old->sa_flags & SA_SIGINFO) && old->sa_sigaction != NULL) {
		old->sa_sigaction(sig, si, ctx);
	} else if (old->sa_handler != SIG_DFL && old->sa_handler != SIG_IGN) {
		old->sa_handler(sig);
	} else {
		/* Back to the default action; returning re-executes the fault. */
		sigaction(sig, old, NULL);
	}
}

static void
guard_install(void)
{
	struct sigaction sa;

	memset(&sa, 0, sizeof(sa));
	sa.sa_sigaction = guard_handler;
	/* NODEFER: we leave the handler by siglongjmp without restoring the mask */
	sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGSEGV, &sa, &old_segv);
	sigaction(SIGBUS, &sa, &old_bus);
}

void
guard_init(void)
{
	pthread_once(&guard_once, guard_install);
}

uint16_t
guarded_rx(struct shim_port *p, struct rte_mbuf **pkts, uint16_t n)
{
	sigjmp_buf env;
	uint16_t got;

	if (!p->is_memif)
		return rte_eth_rx_burst(p->id, 0, pkts, n);
	if (sigsetjmp(env, 0) != 0) {
		p->st.guard_faults++;
		p->link_up = false;
		return 0;
	}
	guard_env = &env;
	got = rte_eth_rx_burst(p->id, 0, pkts, n);
	guard_env = NULL;
	return got;
}

/* Returns frames taken; -1 after a fault (the whole burst is then lost, not freed). */
int
guarded_tx(struct shim_port *p, struct rte_mbuf **pkts, uint16_t n)
{
	sigjmp_buf env;
	uint16_t sent;

	if (!p->is_memif)
		return rte_eth_tx_burst(p->id, 0, pkts, n);
	if (sigsetjmp(env, 0) != 0) {
		p->st.guard_faults++;
		p->link_up = false;
		return -1;
	}
	guard_env = &env;
	sent = rte_eth_tx_burst(p->id, 0, pkts, n);
	guard_env = NULL;
	return sent;
}
