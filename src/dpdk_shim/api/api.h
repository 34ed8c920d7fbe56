/* SPDX-License-Identifier: BSD-3-Clause
 * The api: shim.h's functions, and the only shim_* definitions (what Python calls through
 * cffi, and the server's C++ module calls of api/codec.c). Each is a thin face over the
 * layers below (wire/wire.h names them); the blocking calls loop "poll, check, wait" here.
 * What the api's own files share, and nothing above uses.
 */
#ifndef REMOTE_ACCEL_API_H
#define REMOTE_ACCEL_API_H

#include "wait/wait.h"

/* conn.c: wait up to timeout for the next message to start; copy its first
 * min(cap, length) bytes into head. Returns the bytes copied, *msg_len the whole length. */
int64_t conn_recv_begin(struct shim_conn *c, void *head, uint64_t cap, int64_t timeout_ns,
			uint64_t *msg_len);

#endif
