/* SPDX-License-Identifier: BSD-3-Clause
 * CRC32C (Castagnoli, as iSCSI and the crc32c Python package): with the CPU's CRC32C
 * instruction, three streams at once, where it has one; else a portable table.
 *
 * Why not rte_hash_crc: it runs one dependent chain of crc32q (3-cycle latency, so
 * about 2.7 bytes per cycle); every frame of a bulk transfer is checksummed on both
 * sides, and one chain would cost more than the copies themselves. Three independent
 * chains over three blocks keep the unit busy every cycle; the partial CRCs are then
 * joined by "shifting" one over the zeros that the next block stands for, done with
 * four 256-entry tables per block length (Mark Adler's construction, public domain
 * idea, written here from the math). Tables are built once, at first use.
 *
 * The instruction: SSE4.2 on x86-64, asked of the CPU at run time (the package is
 * built for any x86-64, not with -msse4.2); the CRC extension on AArch64 where the
 * compiler targets it (-march=armv8-a+crc and later). Elsewhere, and on x86 CPUs
 * without SSE4.2, slicing by 8 over tables. This file needs no DPDK header, so that
 * tests/unit/test_crc.py can build it alone, for AArch64 too (shim_crc32c, in api/codec.c,
 * is this function for Python).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>

#define WIRE_NO_DPDK
#include "wire/wire.h"

#if defined(__x86_64__) && !defined(SHIM_CRC_PORTABLE_ONLY)
#include <nmmintrin.h>
#define HW_TARGET __attribute__((target("sse4.2")))
#define HW_U8(c, b) _mm_crc32_u8((uint32_t)(c), (b))
#define HW_U64(c, w) _mm_crc32_u64((c), (w))
static int
hw_present(void)
{
	__builtin_cpu_init();
	return __builtin_cpu_supports("sse4.2");
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32) && !defined(SHIM_CRC_PORTABLE_ONLY)
#include <arm_acle.h>
#define HW_TARGET
#define HW_U8(c, b) __crc32cb((uint32_t)(c), (b))
#define HW_U64(c, w) __crc32cd((uint32_t)(c), (w))
static int
hw_present(void)
{
	return 1;
}
#endif

#define POLY 0x82f63b78u  /* CRC32C, reflected */
#define LONG_BLOCK 2048   /* three of these per loop round: 6 KiB */
#define SHORT_BLOCK 256   /* three of these: 768 bytes */

static uint32_t crc_bytes[8][256];  /* slicing by 8: the CRC of byte n followed by k zero bytes */
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static uint32_t (*crc_impl)(uint32_t c, const unsigned char *next, size_t len);

#ifdef HW_U64
/* -- joining three chains: tables that shift a CRC over a block of zeros -------------- */
static uint32_t crc_long[4][256];
static uint32_t crc_short[4][256];

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

static uint32_t crc_hw(uint32_t crc, const unsigned char *next, size_t len);
#endif

/* Portable: eight bytes per step through eight tables (c is pre-conditioned). */
static uint32_t
crc_sliced(uint32_t c, const unsigned char *next, size_t len)
{
	while (len && ((uintptr_t)next & 7) != 0) {
		c = crc_bytes[0][(c ^ *next++) & 0xff] ^ (c >> 8);
		len--;
	}
	while (len >= 8) {
		uint64_t w;

		memcpy(&w, next, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
		w = __builtin_bswap64(w);
#endif
		w ^= c;
		c = crc_bytes[7][w & 0xff] ^ crc_bytes[6][(w >> 8) & 0xff] ^
		    crc_bytes[5][(w >> 16) & 0xff] ^ crc_bytes[4][(w >> 24) & 0xff] ^
		    crc_bytes[3][(w >> 32) & 0xff] ^ crc_bytes[2][(w >> 40) & 0xff] ^
		    crc_bytes[1][(w >> 48) & 0xff] ^ crc_bytes[0][w >> 56];
		next += 8;
		len -= 8;
	}
	while (len) {
		c = crc_bytes[0][(c ^ *next++) & 0xff] ^ (c >> 8);
		len--;
	}
	return c;
}

static void
crc_init(void)
{
	for (uint32_t n = 0; n < 256; n++) {
		uint32_t c = n;

		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (POLY & (0u - (c & 1)));
		crc_bytes[0][n] = c;
	}
	for (uint32_t n = 0; n < 256; n++)
		for (int k = 1; k < 8; k++)
			crc_bytes[k][n] = crc_bytes[0][crc_bytes[k - 1][n] & 0xff] ^ (crc_bytes[k - 1][n] >> 8);
	crc_impl = crc_sliced;
#ifdef HW_U64
	if (hw_present()) {
		zeros_table(crc_long, LONG_BLOCK);
		zeros_table(crc_short, SHORT_BLOCK);
		crc_impl = crc_hw;
	}
#endif
}

uint32_t
crc32c(uint32_t crc, const void *buf, size_t len)
{
	pthread_once(&crc_once, crc_init);
	return crc_impl(crc ^ 0xffffffffu, buf, len) ^ 0xffffffffu;
}

static inline uint32_t
shift(uint32_t table[4][256], uint32_t crc)
{
	return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^
	       table[2][(crc >> 16) & 0xff] ^ table[3][crc >> 24];
}

#ifdef HW_U64
/* With the instruction: three chains over three blocks, joined by shifting. */
static HW_TARGET uint32_t
crc_hw(uint32_t crc, const unsigned char *next, size_t len)
{
	uint64_t c0 = crc, c1, c2;

	while (len && ((uintptr_t)next & 7) != 0) {
		c0 = HW_U8(c0, *next++);
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
			c0 = HW_U64(c0, a);
			c1 = HW_U64(c1, b);
			c2 = HW_U64(c2, d);
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
			c0 = HW_U64(c0, a);
			c1 = HW_U64(c1, b);
			c2 = HW_U64(c2, d);
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
		c0 = HW_U64(c0, a);
		next += 8;
		len -= 8;
	}
	while (len) {
		c0 = HW_U8(c0, *next++);
		len--;
	}
	return (uint32_t)c0;
}
#endif
