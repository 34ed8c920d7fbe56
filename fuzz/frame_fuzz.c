/* libFuzzer target: the channel's frame parser (dpdk_shim/wire/frame.c: frame_parse), the
 * first code of the DPDK path that reads what arrives on a port: Ethernet, IPv4, UDP, the
 * frame header, its chunk and the CRC32C over them.
 *
 * The frame sits in a stand-in mbuf (one segment, its data exactly the input's bytes in
 * a buffer of their size, so ASan sees any read past them); nothing here needs the EAL.
 * Input: one byte of flags (bit 0: the port may corrupt frames; bit 1: put the right
 * CRC32C into the frame header first, so that mutated frames get past the checksum and
 * reach what follows it), then the frame. What
 * must hold for a frame it takes (0, or -ENOMSG: a sound header whose chunk the port
 * could have corrupted): the chunk lies inside the frame, the header's length is the
 * chunk's, its type is one of ours, and the CRC over what it covers is the header's. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "wire/wire.h"

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static const struct rte_ether_addr mac = {{0x02, 0, 0, 0, 0, 1}};
	struct rte_mbuf m;
	struct frame f;

	if (size < 1 || size > UINT16_MAX)  /* an mbuf's data_len is 16 bits */
		return 0;
	bool may_corrupt = data[0] & 1, fix_crc = data[0] & 2;
	data++;
	size--;
	uint8_t *buf = malloc(size ? size : 1);
	memcpy(buf, data, size);
	if (fix_crc && size >= FRAME_OVERHEAD) {
		struct frame_hdr *h = (struct frame_hdr *)(buf + L2L4_LEN);
		uint32_t len = rte_be_to_cpu_16(h->len), covered;

		if (len > size - FRAME_OVERHEAD)
			len = (uint32_t)(size - FRAME_OVERHEAD);
		covered = (h->type == FT_DATA && (h->flags & rte_cpu_to_be_16(FF_NO_DATA_CRC))) ? 0 : len;
		h->crc = rte_cpu_to_be_32(frame_crc(h, h + 1, covered));
	}
	memset(&m, 0, sizeof(m));
	m.buf_addr = buf;
	m.buf_len = (uint16_t)size;
	m.data_off = 0;
	m.data_len = (uint16_t)size;
	m.pkt_len = (uint32_t)size;
	m.nb_segs = 1;
	memset(&f, 0, sizeof(f));
	int rc = frame_parse(&m, &mac, may_corrupt, &f);
	if (rc == 0 || rc == -ENOMSG) {
		const uint8_t *end = buf + size;
		if (f.chunk < buf + FRAME_OVERHEAD || f.chunk + f.len > end || f.len != rte_be_to_cpu_16(f.h->len) ||
		    f.h->type < FT_DATA || f.h->type > FT_RESET)
			abort();
		uint32_t covered = (f.h->type == FT_DATA && (f.h->flags & rte_cpu_to_be_16(FF_NO_DATA_CRC))) ? 0 : f.len;
		if (frame_crc(f.h, f.chunk, covered) != rte_be_to_cpu_32(f.h->crc))
			abort();
		if (rc == -ENOMSG && (!may_corrupt || covered == f.len))
			abort();
	} else if (rc != -ENOENT && rc != -EBADMSG && rc != -EILSEQ) {
		abort();
	}
	free(buf);
	return 0;
}
