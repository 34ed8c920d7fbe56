/* SPDX-License-Identifier: BSD-3-Clause
 * CRC32C (Castagnoli, as iSCSI and the crc32c Python package) with the SSE4.2
 * instruction, three streams at once.
 *
 * Why not rte_hash_crc: it runs one dependent chain of crc32q (3-cycle latency, so
 * about 2.7 bytes per cycle); every frame of a bulk transfer is checksummed on both
 * sides, and one chain would cost more than the copies themselves. Three independent
 * chains over three blocks keep the unit busy every cycle; the partial CRCs are then
 * joined by "shifting" one over the zeros that the next block stands for, done with
 * four 256-entry tables per block length (Mark Adler's construction, public domain
 * idea, written here from the math). Tables are built once, at first use.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <nmmintrin.h>

#include "shim_internal.h"

#define POLY 0x82f63b78u  /* CRC32C, reflected */
#define LONG_BLOCK 2048   /* three of these per loop round: 6 KiB */
#define SHORT_BLOCK 256   /* three of these: 768 bytes */

static uint32_t crc_long[4][256];
static uint32_t crc_short[4][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

/* Multiply a 32x32 GF(2) matrix by a vector. */
static uint32_t
gf2_times(const uint32_t *mat, uint32_t vec)
{
	uint32_t sum = 0;

	while (vec) {
		if (vec & 1)
			sum ^= *mat;
		vec >>= 1;
		mat++;
	}
	return sum;
}

static void
gf2_square(uint32_t *square, const uint32_t *mat)
{
	for (int n = 0; n < 32; n++)
		square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends `len` zero bytes to a (pre/post-conditioned-free) CRC. */
static void
zeros_op(uint32_t *even, size_t len)
{
	uint32_t odd[32];
	uint32_t row = 1;

	odd[0] = POLY;  /* operator for one zero bit */
	for (int n = 1; n < 32; n++) {
		odd[n] = row;
		row <<= 1;
	}
	gf2_square(even, odd);  /* two zero bits */
	gf2_square(odd, even);  /* four zero bits */
	/* Each round squares again: first round gives one zero byte. */
	do {
		gf2_square(even, odd);
		len >>= 1;
		if (len == 0)
			return;
		gf2_square(odd, even);
		len >>= 1;
	} while (len);
	memcpy(even, odd, sizeof(odd));
}

static void
zeros_table(uint32_t table[4][256], size_t len)
{
	uint32_t op[32];

	zeros_op(op, len);
	for (uint32_t n = 0; n < 256; n++) {
		table[0][n] = gf2_times(op, n);
		table[1][n] = gf2_times(op, n << 8);
		table[2][n] = gf2_times(op, n << 16);
		table[3][n] = gf2_times(op, n << 24);
	}
}

static void
crc_init(void)
{
	zeros_table(crc_long, LONG_BLOCK);
	zeros_table(crc_short, SHORT_BLOCK);
}

static inline uint32_t
shift(uint32_t table[4][256], uint32_t crc)
{
	return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^
	       table[2][(crc >> 16) & 0xff] ^ table[3][crc >> 24];
}

uint32_t
shim_crc32c(uint32_t crc, const void *buf, size_t len)
{
	const unsigned char *next = buf;
	uint64_t c0, c1, c2;

	pthread_once(&crc_once, crc_init);
	c0 = crc ^ 0xffffffffu;
	while (len && ((uintptr_t)next & 7) != 0) {
		c0 = _mm_crc32_u8((uint32_t)c0, *next++);
		len--;
	}
	while (len >= 3 * LONG_BLOCK) {
		const unsigned char *end = next + LONG_BLOCK;

		c1 = 0;
		c2 = 0;
		do {
			uint64_t a, b, d;

			memcpy(&a, next, 8);
			memcpy(&b, next + LONG_BLOCK, 8);
			memcpy(&d, next + 2 * LONG_BLOCK, 8);
			c0 = _mm_crc32_u64(c0, a);
			c1 = _mm_crc32_u64(c1, b);
			c2 = _mm_crc32_u64(c2, d);
			next += 8;
		} while (next < end);
		c0 = shift(crc_long, (uint32_t)c0) ^ (uint32_t)c1;
		c0 = shift(crc_long, (uint32_t)c0) ^ (uint32_t)c2;
		next += 2 * LONG_BLOCK;
		len -= 3 * LONG_BLOCK;
	}
	while (len >= 3 * SHORT_BLOCK) {
		const unsigned char *end = next + SHORT_BLOCK;

		c1 = 0;
		c2 = 0;
		do {
			uint64_t a, b, d;

			memcpy(&a, next, 8);
			memcpy(&b, next + SHORT_BLOCK, 8);
			memcpy(&d, next + 2 * SHORT_BLOCK, 8);
			c0 = _mm_crc32_u64(c0, a);
			c1 = _mm_crc32_u64(c1, b);
			c2 = _mm_crc32_u64(c2, d);
			next += 8;
		} while (next < end);
		c0 = shift(crc_short, (uint32_t)c0) ^ (uint32_t)c1;
		c0 = shift(crc_short, (uint32_t)c0) ^ (uint32_t)c2;
		next += 2 * SHORT_BLOCK;
		len -= 3 * SHORT_BLOCK;
	}
	while (len >= 8) {
		uint64_t a;

		memcpy(&a, next, 8);
		c0 = _mm_crc32_u64(c0, a);
		next += 8;
		len -= 8;
	}
	while (len) {
		c0 = _mm_crc32_u8((uint32_t)c0, *next++);
		len--;
	}
	return (uint32_t)c0 ^ 0xffffffffu;
}
