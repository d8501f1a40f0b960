/* dosa dataplane state: the structs the XDP program and user space share through BPF maps.
 * dataplane/layout.py holds each struct's layout table (ctypes) for user space;
 * tests/dataplane/test_layout.py checks them against the ones BCC compiled (so the two cannot drift).
 * See docs/dataplane.md for the map layouts and why they are shaped this way. */
#ifndef DOSA_STATE_H
#define DOSA_STATE_H

#include <linux/types.h>

/* Sizes fixed at load time (the loader passes -D...; defaults here). */
#ifndef DOSA_POOL_SLOTS
#define DOSA_POOL_SLOTS (1u << 22) /* s64 aggregation slots: 32 MiB */
#endif
#ifndef DOSA_PSTATE_SLOTS
#define DOSA_PSTATE_SLOTS 65536 /* (job, slot) states */
#endif
#ifndef DOSA_WSTATE_SLOTS
#define DOSA_WSTATE_SLOTS 262144 /* (job, slot, parity, worker) states */
#endif
#ifndef DOSA_MAX_JOBS
#define DOSA_MAX_JOBS 64
#endif
#ifndef DOSA_MAX_FLOWS
#define DOSA_MAX_FLOWS 4096 /* (job, worker) flows */
#endif
#ifndef DOSA_MAX_PORTS
#define DOSA_MAX_PORTS 16
#endif
#ifndef DOSA_RINGBUF_PAGES
#define DOSA_RINGBUF_PAGES 64 /* 256 KiB: > 10k completion events */
#endif

/* DOSA_SCALE_TAG_BIAS comes from dataplane/layout.py (c_defines(), put before the program text). */

/* jobs: hash job_id -> job. Written only by the control plane. */
struct dosa_job {
	__u32 workers;        /* worker_id < workers */
	__u32 partition_size; /* indices per partition */
	__u32 numel;          /* index space [0, numel) */
	__u32 num_partitions;
	__u32 dpu_index;      /* this DPU owns partition p iff p % num_dpus == dpu_index */
	__u32 num_dpus;
	__u32 num_owned;      /* partitions owned here: local index j = p / num_dpus */
	__u32 mode;           /* DOSA_MODE_* (informational for XDP) */
	__u32 pool_off;       /* first s64 slot of the job's region in the aggregation pool */
	__u32 pstate_off;     /* first entry of its `slots` slot states */
	__u32 wstate_off;     /* first entry of its slots * 2 * workers worker states */
	__s32 scale_exp;      /* initial scale exponent (round 0) */
	__u32 port;           /* UDP port of the job */
	__u32 stride;         /* s64 sums per buffer: min(partition_size, numel) (a one-partition
			       * job smaller than partition_size does not waste the pool) */
	__u32 slots;          /* aggregation slots (1..num_owned): owned partition j aggregates in
			       * slot j % slots; its memory is slots * 2 * pitch pool entries */
	__u32 list_cap;       /* u16 offsets in each buffer's touched list, a multiple of 4 (0: no
			       * lists). A buffer is pitch = stride + list_cap / 4 pool entries: its
			       * stride sums, then the list packed 4 offsets per s64 entry */
};

/* workers: hash (job, worker) -> the only source allowed to send as that worker. */
struct dosa_flow_key {
	__u32 job_id;
	__u32 worker_id;
};

struct dosa_flow {
	__be32 saddr; /* IPv4 source, network order */
	__be16 sport; /* UDP source port, network order */
	__u16 reserved;
};

/* pstate: mmapable array; one per (job, slot). Index pstate_off + slot.
 * The occupants of slot s are the owned partitions j = s, s + slots, ... (n_s = ceil((num_owned -
 * s) / slots) of them a round), round after round; occupant (round r, j) is generation
 * g = r * n_s + j / slots, so a slot's occupants are numbered 0, 1, 2, ... without gaps. */
struct dosa_pstate {
	__u64 base_gen;        /* generations base_gen and base_gen + 1 are accepted */
	/* 64-bit because BCC's BPF target only has fetching atomics (fetch_add, cmpxchg) on 64 bits */
	__u64 workers_done[2]; /* per parity (g & 1): workers whose contribution is complete */
	__u64 scale_tag[2];    /* per parity: scale_exp + DOSA_SCALE_TAG_BIAS of the round, 0 = unset */
	__u64 touched[2];      /* per parity: entries of the buffer that went from 0 to non-zero (its
				* touched list's length; past list_cap the list is incomplete) */
};

/* wstate: mmapable array; index wstate_off + (slot * 2 + parity) * workers + worker_id. */
struct dosa_wstate {
	__u64 seen[4];  /* dedup bitmap: bit seq (< 256) */
	__u64 received; /* distinct seqs merged (64-bit: fetching atomics) */
	__u64 total;    /* the worker's packet total for this (round, partition), 0 = unset */
};

/* completions ring buffer record: exactly one per completed (job, partition, round). */
struct dosa_completion {
	__u32 job_id;
	__u32 round;
	__u16 partition;
	__s8 scale_exp;
	__u8 reserved;
	__u32 reserved2;
};

#endif /* DOSA_STATE_H */
