/* dosa wire protocol v2: GENERATED from dosa/wire.py by `python -m dosa.gen_headers`;
 * do not edit (tests/unit/test_wire_c_header.py fails when this file and wire.py differ).
 * Spec: docs/protocol.md. All fields big-endian. The check returns DOSA_C_* counters of
 * dosa/counters.py, whose enum is below. */
#ifndef DOSA_WIRE_H
#define DOSA_WIRE_H

#include <linux/types.h>

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define dosa_ntohs(x) ((__u16)__builtin_bswap16(x))
#define dosa_ntohl(x) ((__u32)__builtin_bswap32(x))
#define dosa_htons(x) ((__u16)__builtin_bswap16(x))
#else
#define dosa_ntohs(x) ((__u16)(x))
#define dosa_ntohl(x) ((__u32)(x))
#define dosa_htons(x) ((__u16)(x))
#endif

#define DOSA_MAGIC 0x444F5341u
#define DOSA_VERSION 2
#define DOSA_HDR_LEN 32
#define DOSA_SPARSE_ENTRY_LEN 6
#define DOSA_DENSE_ENTRY_LEN 4
#define DOSA_RETX_ENTRY_LEN 4
#define DOSA_STATUS_ENTRY_LEN 4
#define DOSA_MAX_SPARSE_ENTRIES 240
#define DOSA_MAX_DENSE_ENTRIES 360
#define DOSA_MAX_RETX_ENTRIES 360
#define DOSA_MAX_MTU 3500
#define DOSA_RX_MAX_SPARSE_ENTRIES 573
#define DOSA_RX_MAX_DENSE_ENTRIES 860
#define DOSA_MAX_PARTITION_SIZE 65536
#define DOSA_MAX_SPARSE_BASE 0xFFFF0000u
#define DOSA_MAX_PACKETS_PER_CONTRIBUTION 256
#define DOSA_MAX_WORKERS 64
#define DOSA_MAX_PARTITIONS 65535
#define DOSA_DPU_SENDER_ID 0xFFFF
#define DOSA_SCALE_EXP_MIN (-32)
#define DOSA_SCALE_EXP_MAX 62

enum dosa_counter {
	DOSA_C_SHORT_PACKET = 0,
	DOSA_C_BAD_MAGIC = 1,
	DOSA_C_BAD_VERSION = 2,
	DOSA_C_BAD_TYPE = 3,
	DOSA_C_COUNT_MISMATCH = 4,
	DOSA_C_BAD_FIELD = 5,
	DOSA_C_UNKNOWN_JOB = 6,
	DOSA_C_UNKNOWN_WORKER = 7,
	DOSA_C_BAD_SOURCE = 8,
	DOSA_C_NOT_OWNER = 9,
	DOSA_C_INDEX_OUT_OF_PARTITION = 10,
	DOSA_C_ROUND_TOO_OLD = 11,
	DOSA_C_ROUND_TOO_NEW = 12,
	DOSA_C_DUPLICATE = 13,
	DOSA_C_SCALE_MISMATCH = 14,
	DOSA_C_TOTAL_MISMATCH = 15,
	DOSA_C_IP_FRAGMENT = 16,
	DOSA_C_INTERNAL = 17,
	DOSA_C_WRONG_SHARD = 18,
	DOSA_C_MERGED = 19,
	DOSA_C_PASS_NOT_DOSA = 20,
	DOSA_C_PASS_CONTROL = 21,
	DOSA_C_PASS_DUP_OF_COMPLETE = 22,
	DOSA_C_MERGED_ENTRIES = 23,
	DOSA_C_COMPLETIONS = 24,
	DOSA_C_COMPLETION_LOST = 25,
	DOSA_C_SATURATED_SUMS = 26,
};
#define DOSA_NUM_COUNTERS 27

enum dosa_type {
	DOSA_T_SPARSE_DATA = 1,
	DOSA_T_DENSE_DATA = 2,
	DOSA_T_SPARSE_RESULT = 3,
	DOSA_T_DENSE_RESULT = 4,
	DOSA_T_RETX_REQUEST = 5,
	DOSA_T_HEARTBEAT = 6,
	DOSA_T_STATUS = 7,
};

#define DOSA_F_LAST 0x0001
#define DOSA_F_RETRANSMIT 0x0002
#define DOSA_F_GTOPK 0x0004
#define DOSA_F_VALID_MASK 0x0007

struct dosa_hdr {
	__be32 magic;
	__u8 version;
	__u8 type;
	__be16 flags;
	__be32 job_id;
	__be16 worker_id;
	__be16 partition;
	__be32 round;
	__be16 seq;
	__be16 count;
	__be16 total;
	__s8 scale_exp;
	__u8 reserved;
	__be32 base;
} __attribute__((packed, aligned(4)));

/* Sparse payload: count x u16 offset (index = base + offset), zero-padded to 4 bytes, then
 * count x s32 value starting at this byte offset from the dosa header. */
#define DOSA_VALUE_OFFSET(count) (DOSA_HDR_LEN + 2 * (count) + 2 * ((count) & 1))

static __always_inline __u32 dosa_type_ok(__u32 type)
{
	if (type == DOSA_T_SPARSE_DATA)
		return 1;
	if (type == DOSA_T_DENSE_DATA)
		return 1;
	if (type == DOSA_T_SPARSE_RESULT)
		return 1;
	if (type == DOSA_T_DENSE_RESULT)
		return 1;
	if (type == DOSA_T_RETX_REQUEST)
		return 1;
	if (type == DOSA_T_HEARTBEAT)
		return 1;
	if (type == DOSA_T_STATUS)
		return 1;
	return 0;
}

static __always_inline __u32 dosa_sequenced(__u32 type)
{
	if (type == DOSA_T_SPARSE_DATA)
		return 1;
	if (type == DOSA_T_DENSE_DATA)
		return 1;
	if (type == DOSA_T_SPARSE_RESULT)
		return 1;
	if (type == DOSA_T_DENSE_RESULT)
		return 1;
	return 0;
}

static __always_inline __u32 dosa_sparse(__u32 type)
{
	if (type == DOSA_T_SPARSE_DATA)
		return 1;
	if (type == DOSA_T_SPARSE_RESULT)
		return 1;
	return 0;
}

static __always_inline __u32 dosa_dense(__u32 type)
{
	if (type == DOSA_T_DENSE_DATA)
		return 1;
	if (type == DOSA_T_DENSE_RESULT)
		return 1;
	return 0;
}

static __always_inline __u32 dosa_entry_len(__u32 type)
{
	if (type == DOSA_T_SPARSE_DATA)
		return 6;
	if (type == DOSA_T_DENSE_DATA)
		return 4;
	if (type == DOSA_T_SPARSE_RESULT)
		return 6;
	if (type == DOSA_T_DENSE_RESULT)
		return 4;
	if (type == DOSA_T_RETX_REQUEST)
		return 4;
	if (type == DOSA_T_STATUS)
		return 4;
	return 0;
}

static __always_inline __u32 dosa_odd_pad(__u32 type)
{
	if (type == DOSA_T_SPARSE_DATA)
		return 2;
	if (type == DOSA_T_SPARSE_RESULT)
		return 2;
	return 0;
}

static __always_inline __u32 dosa_max_entries(__u32 type)
{
	if (type == DOSA_T_SPARSE_DATA)
		return 573;
	if (type == DOSA_T_DENSE_DATA)
		return 860;
	if (type == DOSA_T_SPARSE_RESULT)
		return 573;
	if (type == DOSA_T_DENSE_RESULT)
		return 860;
	if (type == DOSA_T_RETX_REQUEST)
		return 860;
	if (type == DOSA_T_STATUS)
		return 860;
	return 0;
}

/* What a packet says about itself (dosa/wire.py HEADER_RULES, in order): the counter of
 * the first broken rule, or -1 when the header is well formed for a plen-byte payload. */
static __always_inline int dosa_check_header(const struct dosa_hdr *h, __u32 plen)
{
	__s64 f_length = plen;
	__s64 f_magic = dosa_ntohl(h->magic);
	__s64 f_version = (h->version);
	__s64 f_type = (h->type);
	__s64 f_flags = dosa_ntohs(h->flags);
	__s64 f_job_id = dosa_ntohl(h->job_id);
	__s64 f_worker_id = dosa_ntohs(h->worker_id);
	__s64 f_partition = dosa_ntohs(h->partition);
	__s64 f_round = dosa_ntohl(h->round);
	__s64 f_seq = dosa_ntohs(h->seq);
	__s64 f_count = dosa_ntohs(h->count);
	__s64 f_total = dosa_ntohs(h->total);
	__s64 f_scale_exp = (__s8)(h->scale_exp);
	__s64 f_reserved = (h->reserved);
	__s64 f_base = dosa_ntohl(h->base);
	if ((f_length < DOSA_HDR_LEN))
		return DOSA_C_SHORT_PACKET;
	if ((f_magic != DOSA_MAGIC))
		return DOSA_C_BAD_MAGIC;
	if ((f_version != DOSA_VERSION))
		return DOSA_C_BAD_VERSION;
	if ((dosa_type_ok(f_type) == 0))
		return DOSA_C_BAD_TYPE;
	if ((f_count > dosa_max_entries(f_type)))
		return DOSA_C_COUNT_MISMATCH;
	if ((f_length != ((DOSA_HDR_LEN + (dosa_entry_len(f_type) * f_count)) + (dosa_odd_pad(f_type) * (f_count & 1)))))
		return DOSA_C_COUNT_MISMATCH;
	if (((f_flags & ~DOSA_F_VALID_MASK) != 0))
		return DOSA_C_BAD_FIELD;
	if ((f_reserved != 0))
		return DOSA_C_BAD_FIELD;
	if ((dosa_sequenced(f_type) & ((f_total < 1) | (f_total > DOSA_MAX_PACKETS_PER_CONTRIBUTION))))
		return DOSA_C_BAD_FIELD;
	if ((dosa_sequenced(f_type) & (f_seq >= f_total)))
		return DOSA_C_BAD_FIELD;
	if ((dosa_sequenced(f_type) & (((f_flags & DOSA_F_LAST) != 0) != (f_seq == (f_total - 1)))))
		return DOSA_C_BAD_FIELD;
	if ((dosa_sequenced(f_type) & ((f_scale_exp < DOSA_SCALE_EXP_MIN) | (f_scale_exp > DOSA_SCALE_EXP_MAX))))
		return DOSA_C_BAD_FIELD;
	if ((dosa_sparse(f_type) & (f_base > DOSA_MAX_SPARSE_BASE)))
		return DOSA_C_BAD_FIELD;
	if (((f_worker_id >= DOSA_MAX_WORKERS) & (f_worker_id != DOSA_DPU_SENDER_ID)))
		return DOSA_C_BAD_FIELD;
	if ((f_partition >= DOSA_MAX_PARTITIONS))
		return DOSA_C_BAD_FIELD;
	(void)f_job_id;
	(void)f_round;
	return -1;
}

/* Big-endian integers at a byte pointer (any alignment), in host order: every reader and writer
 * of a packet's fields and entries below goes through these. */
static __always_inline __u32 dosa_get_be16(const __u8 *p)
{
	return ((__u32)p[0] << 8) | p[1];
}

static __always_inline __u32 dosa_get_be32(const __u8 *p)
{
	return ((__u32)p[0] << 24) | ((__u32)p[1] << 16) | ((__u32)p[2] << 8) | p[3];
}

static __always_inline void dosa_put_be16(__u8 *p, __u32 v)
{
	p[0] = (__u8)(v >> 8);
	p[1] = (__u8)v;
}

static __always_inline void dosa_put_be32(__u8 *p, __u32 v)
{
	p[0] = (__u8)(v >> 24);
	p[1] = (__u8)(v >> 16);
	p[2] = (__u8)(v >> 8);
	p[3] = (__u8)v;
}

/* A packet's header fields and entries at the byte pointer pk to its first header byte, in
 * host order (dosa/wire.py HEADER_FIELDS and PAYLOAD_BLOCKS): dosa_hdr_<field>(pk);
 * dosa_<layout>_<block>(pk, count, j) is entry j of a packet of count entries and
 * dosa_put_<layout>_<block>(pk, count, j, v) writes it. No caller spells an offset. */
static __always_inline __u32 dosa_hdr_magic(const __u8 *pk)
{
	return dosa_get_be32(pk + 0);
}

static __always_inline __u32 dosa_hdr_version(const __u8 *pk)
{
	return pk[4];
}

static __always_inline __u32 dosa_hdr_type(const __u8 *pk)
{
	return pk[5];
}

static __always_inline __u32 dosa_hdr_flags(const __u8 *pk)
{
	return dosa_get_be16(pk + 6);
}

static __always_inline __u32 dosa_hdr_job_id(const __u8 *pk)
{
	return dosa_get_be32(pk + 8);
}

static __always_inline __u32 dosa_hdr_worker_id(const __u8 *pk)
{
	return dosa_get_be16(pk + 12);
}

static __always_inline __u32 dosa_hdr_partition(const __u8 *pk)
{
	return dosa_get_be16(pk + 14);
}

static __always_inline __u32 dosa_hdr_round(const __u8 *pk)
{
	return dosa_get_be32(pk + 16);
}

static __always_inline __u32 dosa_hdr_seq(const __u8 *pk)
{
	return dosa_get_be16(pk + 20);
}

static __always_inline __u32 dosa_hdr_count(const __u8 *pk)
{
	return dosa_get_be16(pk + 22);
}

static __always_inline __u32 dosa_hdr_total(const __u8 *pk)
{
	return dosa_get_be16(pk + 24);
}

static __always_inline __s32 dosa_hdr_scale_exp(const __u8 *pk)
{
	return (__s8)pk[26];
}

static __always_inline __u32 dosa_hdr_reserved(const __u8 *pk)
{
	return pk[27];
}

static __always_inline __u32 dosa_hdr_base(const __u8 *pk)
{
	return dosa_get_be32(pk + 28);
}

static __always_inline __u32 dosa_sparse_offset(const __u8 *pk, __u32 count, __u32 j)
{
	(void)count;
	return dosa_get_be16(pk + DOSA_HDR_LEN + 2 * j);
}

static __always_inline void dosa_put_sparse_offset(__u8 *pk, __u32 count, __u32 j, __u32 v)
{
	(void)count;
	dosa_put_be16(pk + DOSA_HDR_LEN + 2 * j, (__u32)v);
}

static __always_inline __s32 dosa_sparse_value(const __u8 *pk, __u32 count, __u32 j)
{
	return (__s32)dosa_get_be32(pk + DOSA_HDR_LEN + 2 * count + 2 * (count & 1) + 4 * j);
}

static __always_inline void dosa_put_sparse_value(__u8 *pk, __u32 count, __u32 j, __s32 v)
{
	dosa_put_be32(pk + DOSA_HDR_LEN + 2 * count + 2 * (count & 1) + 4 * j, (__u32)v);
}

static __always_inline void dosa_put_sparse_pad(__u8 *pk, __u32 count)
{
	if (count & 1)
		dosa_put_be16(pk + DOSA_HDR_LEN + 2 * count, 0);
}

static __always_inline __s32 dosa_dense_value(const __u8 *pk, __u32 count, __u32 j)
{
	(void)count;
	return (__s32)dosa_get_be32(pk + DOSA_HDR_LEN + 4 * j);
}

static __always_inline void dosa_put_dense_value(__u8 *pk, __u32 count, __u32 j, __s32 v)
{
	(void)count;
	dosa_put_be32(pk + DOSA_HDR_LEN + 4 * j, (__u32)v);
}

static __always_inline __u32 dosa_retx_seq(const __u8 *pk, __u32 count, __u32 j)
{
	(void)count;
	return dosa_get_be32(pk + DOSA_HDR_LEN + 4 * j);
}

static __always_inline void dosa_put_retx_seq(__u8 *pk, __u32 count, __u32 j, __u32 v)
{
	(void)count;
	dosa_put_be32(pk + DOSA_HDR_LEN + 4 * j, (__u32)v);
}

static __always_inline __u32 dosa_status_worker_id(const __u8 *pk, __u32 count, __u32 j)
{
	(void)count;
	return dosa_get_be32(pk + DOSA_HDR_LEN + 4 * j);
}

static __always_inline void dosa_put_status_worker_id(__u8 *pk, __u32 count, __u32 j, __u32 v)
{
	(void)count;
	dosa_put_be32(pk + DOSA_HDR_LEN + 4 * j, (__u32)v);
}

#endif /* DOSA_WIRE_H */
