/* SPDX-License-Identifier: BSD-3-Clause
 * The accept queues, one per listen group: the handshake (hello.c) pushes each new server
 * connection here when its HELLO arrives, and shim_accept takes them. A leaf of the
 * channel: it calls nothing of the shim.
 */
#include <errno.h>
#include <time.h>

#include "chan/chan.h"

static pthread_mutex_t accept_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t accept_cond;
static pthread_once_t accept_once = PTHREAD_ONCE_INIT;
static struct shim_conn *accept_head[ACCEPT_GROUPS], *accept_tail[ACCEPT_GROUPS];
static int accept_cancelled[ACCEPT_GROUPS];

static void
accept_init(void)
{
	pthread_condattr_t a;

	pthread_condattr_init(&a);
	pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
	pthread_cond_init(&accept_cond, &a);
}

void
accept_reopen(int group)
{
	pthread_once(&accept_once, accept_init);
	pthread_mutex_lock(&accept_lock);
	accept_cancelled[group] = 0;
	pthread_mutex_unlock(&accept_lock);
}

void
accept_push(struct shim_conn *c)
{
	int g = c->group;

	pthread_once(&accept_once, accept_init);
	pthread_mutex_lock(&accept_lock);
	c->accept_next = NULL;
	if (accept_tail[g])
		accept_tail[g]->accept_next = c;
	else
		accept_head[g] = c;
	accept_tail[g] = c;
	pthread_cond_broadcast(&accept_cond);
	pthread_mutex_unlock(&accept_lock);
}

int
accept_take(int32_t group, int64_t timeout_ns, struct shim_conn **out)
{
	struct timespec ts;
	int rc = 0;

	pthread_once(&accept_once, accept_init);
	clock_gettime(CLOCK_MONOTONIC, &ts);
	if (timeout_ns >= 0) {
		uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)timeout_ns;

		ts.tv_sec += (time_t)(ns / 1000000000ull);
		ts.tv_nsec = (long)(ns % 1000000000ull);
	}
	pthread_mutex_lock(&accept_lock);
	while (accept_head[group] == NULL && rc == 0) {
		if (accept_cancelled[group] || atomic_load(&shutting_down))
			rc = -ESHUTDOWN;
		else if (timeout_ns < 0)
			pthread_cond_wait(&accept_cond, &accept_lock);
		else if (pthread_cond_timedwait(&accept_cond, &accept_lock, &ts) == ETIMEDOUT)
			rc = accept_head[group] ? 0 : -ETIMEDOUT;
	}
	if (rc == 0) {
		struct shim_conn *c = accept_head[group];

		accept_head[group] = c->accept_next;
		if (accept_head[group] == NULL)
			accept_tail[group] = NULL;
		c->accepted = true;
		*out = c;
	}
	pthread_mutex_unlock(&accept_lock);
	return rc;
}

void
accept_cancel(int32_t group)
{
	pthread_once(&accept_once, accept_init);
	pthread_mutex_lock(&accept_lock);
	accept_cancelled[group] = 1;
	pthread_cond_broadcast(&accept_cond);
	pthread_mutex_unlock(&accept_lock);
}
