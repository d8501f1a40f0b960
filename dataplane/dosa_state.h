/* dosa dataplane state: the structs the XDP program and user space share through BPF maps.
 * dataplane/layout.py holds each struct's layout table (ctypes) for user space;
 * tests/dataplane/test_layout.py checks them against the ones BCC compiled (so the two cannot drift).
 * See docs/dataplane.md for the map layouts and why they are shaped this way.
 *
 * The DPU worker's compiled code includes this header too (dpu_fw/_state.pxd): one C view of the
 * state for the XDP program, the worker and its userspace merge.
 *
 * The buffer geometry (DOSA_BUF_SUMS, DOSA_LIST_WORDS, DOSA_MAX_SHARDS, DOSA_SCALE_TAG_BIAS) comes
 * from dosa_layout.h, generated from dataplane/layout.py; the map sizes (DOSA_POOL_BUFS,
 * DOSA_PSTATE_SLOTS, DOSA_WSTATE_SLOTS, DOSA_MAX_JOBS, DOSA_MAX_FLOWS, DOSA_MAX_PORTS,
 * DOSA_RINGBUF_PAGES) from dataplane/loader.py's LoadConfig when it compiles the program (which
 * defines DOSA_BPF): each number is written once. */
#ifndef DOSA_STATE_H
#define DOSA_STATE_H

#include <linux/types.h>
#include "dosa_layout.h"

#ifdef DOSA_BPF
#if !defined(DOSA_POOL_BUFS) || !defined(DOSA_PSTATE_SLOTS) || !defined(DOSA_WSTATE_SLOTS) || \
	!defined(DOSA_MAX_JOBS) || !defined(DOSA_MAX_FLOWS) || !defined(DOSA_MAX_PORTS) || \
	!defined(DOSA_RINGBUF_PAGES)
#error "the map sizes come from dataplane/loader.py (LoadConfig.cflags)"
#endif
#endif

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
	__u32 pool_off;       /* first buffer of the job's region in the aggregation pool */
	__u32 pstate_off;     /* first entry of its `slots` slot states */
	__u32 wstate_off;     /* first entry of its slots * 2 * workers worker states */
	__s32 scale_exp;      /* initial scale exponent (round 0) */
	__u32 port;           /* UDP port of the job */
	__u32 stride;         /* sums used in each buffer: min(partition_size, numel) */
	__u32 slots;          /* aggregation slots (1..num_owned): owned partition j aggregates in
			       * slot j % slots; its buffers are pool_off + slot * 2 + parity */
	__u32 list_cap;       /* u16 offsets of each buffer's touched list in use, a multiple of 4
			       * (at most 4 * DOSA_LIST_WORDS; 0: no lists) */
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

/* pool: mmapable array of aggregation buffers; buffer pool_off + slot * 2 + parity of a job.
 * One lookup per packet gives the whole buffer: the merge loop indexes it with a masked u16
 * offset, so the verifier needs no check per entry. */
struct dosa_buf {
	__s32 sums[DOSA_BUF_SUMS];     /* index lo + i sums at sums[i]; saturated at +-(2^31 - 1) */
	__u64 list[DOSA_LIST_WORDS];   /* touched list: u16 offsets, 4 a word, in host order */
};

#ifdef DOSA_BPF
/* locks: one per pool buffer, taken around a packet's adds and list copy so the adds need no
 * atomics (a bpf_spin_lock cannot live in an mmapable map, hence its own map). Padded to a cache
 * line: neighbouring buffers' locks are taken on other CPUs at the same time. User space never
 * touches them. */
struct dosa_lock {
	struct bpf_spin_lock lock;
	__u32 pad[15];
};
#endif

/* pstate: mmapable array; one per (job, slot). Index pstate_off + slot.
 * The occupants of slot s are the owned partitions j = s, s + slots, ... (n_s = ceil((num_owned -
 * s) / slots) of them a round), round after round; occupant (round r, j) is generation
 * g = r * n_s + j / slots, so a slot's occupants are numbered 0, 1, 2, ... without gaps. */
struct dosa_pstate {
	__u64 base_gen;        /* generations base_gen and base_gen + 1 are accepted */
	/* 64-bit because BCC's BPF target only has fetching atomics (fetch_add, cmpxchg) on 64 bits */
	__u64 workers_done[2]; /* per parity (g & 1): workers whose contribution is complete */
	__u64 scale_tag[2];    /* per parity: scale_exp + DOSA_SCALE_TAG_BIAS of the round, 0 = unset */
	__u64 touched[2];      /* per parity: u16 positions of the buffer's touched list reserved
				* (written under the buffer's lock; past list_cap the list is incomplete) */
};

/* wstate: mmapable array; index wstate_off + (slot * 2 + parity) * workers + worker_id. */
struct dosa_wstate {
	__u64 seen[4];  /* dedup bitmap: bit seq (< 256) */
	__u64 received; /* distinct seqs merged (64-bit: fetching atomics) */
	__u64 total;    /* the worker's packet total for this (round, partition), 0 = unset */
};

/* completions0..N ring buffers: exactly one record per completed (job, partition, round), in the
 * ring of its slot's shard (slot % shards): each DPU worker shard consumes its own. */
struct dosa_completion {
	__u32 job_id;
	__u32 round;
	__u16 partition;
	__s8 scale_exp;
	__u8 reserved;
	__u32 reserved2;
};

/* settings: mmapable array of one, written by the DPU worker. */
struct dosa_settings {
	__u32 shards;                  /* completion rings in use (1..DOSA_MAX_SHARDS; 0 reads as 1) */
	__u32 reserved;
	__u64 asleep[DOSA_MAX_SHARDS]; /* shard i blocks on its ring: wake it (else its records wait
					* for its next poll, like virtio's event suppression) */
};

#endif /* DOSA_STATE_H */
