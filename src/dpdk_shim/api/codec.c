/* SPDX-License-Identifier: BSD-3-Clause
 * The wire's codec as shim.h offers it: CRC32C and the message prologue (wire/crc.c,
 * wire/prologue.c). No DPDK here either: the server's C++ module compiles this file with
 * those two, for its TCP sessions (server/csrc/tcp_link.cpp).
 */
#define WIRE_NO_DPDK
#include "wire/wire.h"

uint32_t
shim_crc32c(uint32_t crc, const void *buf, size_t len)
{
	return crc32c(crc, buf, len);
}

int64_t
shim_wire_encode(const struct shim_wire *w, void *buf, uint64_t cap, uint8_t type,
		 uint16_t flags, uint32_t req_id, const char *meta, uint32_t meta_len,
		 const struct shim_iov *payloads, int n)
{
	return prologue_encode(w, buf, cap, type, flags, req_id, meta, meta_len, payloads, n);
}

int
shim_wire_check(const struct shim_wire *w, const void *buf, uint64_t len, uint64_t msg_len,
		struct shim_msg_info *out)
{
	return prologue_check(w, buf, len, msg_len, out);
}
