/* libFuzzer target: the message prologue check (dpdk_shim/wire/prologue.c), the first C
 * that reads a peer's bytes on every DPDK message and every TCP message of the server's
 * C++ loop (server/csrc/tcp_link.cpp).
 *
 * Input: a flags byte, 8 bytes of msg_len (the length the transport says the whole
 * message has; taken as the input's own length where they are zero), then the head
 * bytes. Flag bit 0 puts the right CRC32C into a prologue the input holds whole before
 * the check: a mutated prologue then fails only on what it says, not on its checksum,
 * so the fuzzer reaches the checks after the CRC as well as the CRC's own. Beyond "no crash,
 * no out-of-bounds read": a prologue called valid must hold what its fields promise, and
 * encoding its fields again must give back the very bytes, so that prologue_check cannot
 * accept a prologue wire.py would refuse (wire.py and prologue_encode agree byte for byte:
 * tests/server/test_fast_loop.py). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define WIRE_NO_DPDK
#include "wire/wire.h"

/* dataplane/wire.py's magic and version, with limits small enough for the fuzzer to reach */
static const struct shim_wire kWire = {
	.magic0 = 'R', .magic1 = 'A', .version = 3,  /* _version.WIRE_VERSION */
	.max_meta = 1u << 20, .max_payloads = 64, .max_payload_total = 1ull << 40,
};

static uint64_t
get_be(const uint8_t *p, int n)
{
	uint64_t v = 0;

	for (int i = 0; i < n; i++)
		v = v << 8 | p[i];
	return v;
}

/* The CRC32C over the prologue the header describes, if the input holds all of it. */
static void
put_crc(uint8_t *head, size_t size)
{
	uint64_t plen = SHIM_WIRE_HEADER + 8 * get_be(head + 6, 2) + get_be(head + 12, 4);
	uint32_t crc;

	if (plen > size)
		return;
	memset(head + 24, 0, 4);
	crc = crc32c(0, head, plen);
	for (int i = 0; i < 4; i++)
		head[24 + i] = (uint8_t)(crc >> (24 - 8 * i));
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct shim_msg_info info;
	uint64_t msg_len;

	if (size < 9)
		return 0;
	const int fix_crc = data[0] & 1;
	memcpy(&msg_len, data + 1, 8);
	data += 9;
	size -= 9;
	if (msg_len == 0)
		msg_len = size;
	/* a copy of exactly `size` bytes, so ASan sees any read past the head */
	uint8_t *head = malloc(size ? size : 1);
	memcpy(head, data, size);
	if (fix_crc && size >= SHIM_WIRE_HEADER)
		put_crc(head, size);
	if (prologue_check(&kWire, head, size, msg_len, &info) != 0)
		abort();
	if (info.status == 0) {
		uint64_t total = 0;
		if (info.prologue_len > size || info.prologue_len + info.payload_total != msg_len ||
		    info.meta_len > kWire.max_meta || info.n_payloads > kWire.max_payloads)
			abort();
		struct shim_iov *iov = calloc(info.n_payloads + 1, sizeof(*iov));
		for (uint32_t i = 0; i < info.n_payloads; i++) {
			uint64_t len = get_be(head + SHIM_WIRE_HEADER + 8 * i, 8);
			iov[i].len = len;
			if (len > info.payload_total)  /* wire.py's Python sum never wraps; u64 may */
				abort();
			total += len;
		}
		if (total != info.payload_total)
			abort();
		uint8_t *again = malloc(info.prologue_len);
		int64_t n = prologue_encode(&kWire, again, info.prologue_len, info.type, info.flags, info.req_id,
					    (const char *)head + info.prologue_len - info.meta_len,
					    info.meta_len, iov, info.n_payloads);
		if (n != (int64_t)info.prologue_len || memcmp(again, head, info.prologue_len) != 0)
			abort();
		free(again);
		free(iov);
	}
	free(head);
	return 0;
}
