/* dosa wire protocol v1 -- C mirror of dosa/wire.py (the one definition).
 * tests/unit/test_wire_c_header.py compiles this header and checks every offset, size and
 * constant against the Python definition. Spec: docs/protocol.md. All fields big-endian. */
#ifndef DOSA_WIRE_H
#define DOSA_WIRE_H

#include <linux/types.h>

#define DOSA_MAGIC 0x444F5341u /* "DOSA" */
#define DOSA_VERSION 1
#define DOSA_HDR_LEN 32
#define DOSA_SPARSE_ENTRY_LEN 8
#define DOSA_DENSE_ENTRY_LEN 4
#define DOSA_RETX_ENTRY_LEN 4
#define DOSA_STATUS_ENTRY_LEN 4
#define DOSA_MAX_SPARSE_ENTRIES 180
#define DOSA_MAX_DENSE_ENTRIES 360
#define DOSA_MAX_RETX_ENTRIES 360
#define DOSA_MAX_PACKETS_PER_CONTRIBUTION 256
#define DOSA_MAX_WORKERS 64
#define DOSA_MAX_PARTITIONS 65535
#define DOSA_DPU_SENDER_ID 0xFFFF
#define DOSA_SCALE_EXP_MIN (-32)
#define DOSA_SCALE_EXP_MAX 62

enum dosa_type {
	DOSA_T_SPARSE_DATA = 1,
	DOSA_T_DENSE_DATA = 2,
	DOSA_T_SPARSE_RESULT = 3,
	DOSA_T_DENSE_RESULT = 4,
	DOSA_T_RETX_REQUEST = 5,
	DOSA_T_HEARTBEAT = 6,
	DOSA_T_STATUS = 7, /* DPU -> host only: never reaches the XDP program */
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

struct dosa_sparse_entry {
	__be32 index;
	__be32 value; /* s32 two's complement, big-endian */
} __attribute__((packed, aligned(4)));

#endif /* DOSA_WIRE_H */
