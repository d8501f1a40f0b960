/* dosa XDP dataplane: parse, validate, match flows, merge sparse chunks in flight.
 *
 * Compiled by BCC at load time (dataplane/loader.py prepends the counter enum generated from
 * dataplane/reasons.py and the sizes of its LoadConfig and layout.py). Every packet moves exactly
 * one verdict counter. The spec of what is accepted is docs/protocol.md; the map layouts and what
 * each part of the merge costs are explained in docs/dataplane.md.
 */
#include <uapi/linux/bpf.h>
#include "dosa_parse.h"
#include "dosa_state.h"

BPF_HASH(jobs, u32, struct dosa_job, DOSA_MAX_JOBS);
BPF_HASH(flows, struct dosa_flow_key, struct dosa_flow, DOSA_MAX_FLOWS);
BPF_HASH(ports, u32, u32, DOSA_MAX_PORTS); /* UDP destination ports (host order) that carry dosa */
BPF_F_TABLE("array", u32, struct dosa_buf, pool, DOSA_POOL_BUFS, BPF_F_MMAPABLE);
BPF_ARRAY(locks, struct dosa_lock, DOSA_POOL_BUFS);
BPF_F_TABLE("array", u32, struct dosa_pstate, pstate, DOSA_PSTATE_SLOTS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct dosa_wstate, wstate, DOSA_WSTATE_SLOTS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct dosa_settings, settings, 1, BPF_F_MMAPABLE);
BPF_PERCPU_ARRAY(counters, u64, DOSA_NUM_COUNTERS);
/* slot 0: xdp_dosa_saturate, the rare path of a packet whose adds left the s32 range (verified on
 * its own: its undo and redo loops would otherwise multiply the main program's verification) */
BPF_PROG_ARRAY(slow_path, 1);
/* one completion ring per DPU worker shard (DOSA_MAX_SHARDS of them, see ring_output) */
BPF_RINGBUF_OUTPUT(completions0, DOSA_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(completions1, DOSA_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(completions2, DOSA_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(completions3, DOSA_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(completions4, DOSA_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(completions5, DOSA_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(completions6, DOSA_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(completions7, DOSA_RINGBUF_PAGES);

#define S32_LIMIT 2147483647LL /* sums saturate at +-(2^31 - 1), as the DPU worker always did */

static __always_inline void count(u32 idx, u64 n)
{
	u64 *v = counters.lookup(&idx);

	if (v)
		*v += n; /* per-CPU slot: no atomic needed */
}

static __always_inline int verdict(u32 idx, int action)
{
	count(idx, 1);
	return action;
}

#define DROP(reason) verdict(DOSA_C_##reason, XDP_DROP)
#define PASS(reason) verdict(DOSA_C_##reason, XDP_PASS)

/* p + n bytes still inside the packet? The barrier keeps clang from rewriting the comparison into
 * arithmetic on data_end (which the verifier refuses) or from recomputing p from another base
 * (which loses the range the check proved). */
static __always_inline int fits(void *p, u32 n, void *data_end)
{
	void *e = p + n;

	asm volatile("" : "+r"(e));
	return e <= data_end;
}

/* The packet's entry count, read again from the packet. The merge loops compare with it rather
 * than with a register holding count: each exit of a loop would teach the verifier a different
 * range of that register, and it would walk everything after the loop once per exit. */
static __always_inline u32 fresh_count(struct dosa_hdr *h)
{
	return dosa_ntohs(*(volatile __be16 *)&h->count);
}

/* The header rules live once, in dosa/wire.py: dosa_check_header() is generated from them into
 * dosa_wire.h. What only the DPU adds is the direction: results and STATUS travel DPU -> host, so
 * one arriving here is misdirected. Returns a counter index, or -1 when the packet may go on. */
static __always_inline int check_header(struct dosa_hdr *h, u32 plen)
{
	int bad = dosa_check_header(h, plen);

	if (bad >= 0)
		return bad;
	if (h->type == DOSA_T_SPARSE_RESULT || h->type == DOSA_T_DENSE_RESULT || h->type == DOSA_T_STATUS)
		return DOSA_C_BAD_TYPE;
	return -1;
}

/* The record into the ring of the slot's shard. Its consumer asks for a wakeup only while it
 * blocks on the ring (settings.asleep): a busy consumer finds the record at its next poll, and
 * each wakeup is an irq_work (an IPI), which cost ~10 us per completion when every record woke. */
static __always_inline long ring_output(u32 slot, struct dosa_completion *ev)
{
	u32 zero = 0, shard = 0;
	u64 flags = BPF_RB_NO_WAKEUP;
	struct dosa_settings *st = settings.lookup(&zero);

	if (st) {
		u32 n = st->shards;
		if (n > 1 && n <= DOSA_MAX_SHARDS)
			shard = slot % n;
		asm volatile("" : "+r"(shard)); /* the verifier does not bound a remainder: mask it */
		shard &= DOSA_MAX_SHARDS - 1;
		if (*(volatile u64 *)&st->asleep[shard])
			flags = BPF_RB_FORCE_WAKEUP;
	}
	switch (shard) {
	case 1: return completions1.ringbuf_output(ev, sizeof(*ev), flags);
	case 2: return completions2.ringbuf_output(ev, sizeof(*ev), flags);
	case 3: return completions3.ringbuf_output(ev, sizeof(*ev), flags);
	case 4: return completions4.ringbuf_output(ev, sizeof(*ev), flags);
	case 5: return completions5.ringbuf_output(ev, sizeof(*ev), flags);
	case 6: return completions6.ringbuf_output(ev, sizeof(*ev), flags);
	case 7: return completions7.ringbuf_output(ev, sizeof(*ev), flags);
	default: return completions0.ringbuf_output(ev, sizeof(*ev), flags);
	}
}

static __always_inline void emit_completion(u32 job_id, u16 partition, u32 round, s8 scale, u32 slot)
{
	struct dosa_completion ev = {};

	ev.job_id = job_id;
	ev.round = round;
	ev.partition = partition;
	ev.scale_exp = scale;
	count(DOSA_C_COMPLETIONS, 1);
	if (ring_output(slot, &ev) != 0)
		count(DOSA_C_COMPLETION_LOST, 1);
}

/* Where a data packet of a valid flow goes: its partition's state, its worker's state, its
 * buffer and that buffer's lock. Filled by locate(). */
struct merge_ctx {
	struct dosa_pstate *ps;
	struct dosa_wstate *ws;
	struct dosa_buf *buf;
	struct dosa_lock *lock;
	u64 lo, hi;   /* the partition's index range */
	u64 gen;      /* the packet's occupant of its slot (dosa_state.h, struct dosa_pstate) */
	u32 p, round, parity, workers, slot;
	u32 list_cap; /* touched-list capacity in u16 offsets (0: the job keeps no lists) */
};

/* Partition, ownership, slot, occupant window and state of a data packet. Owned partition j
 * aggregates in slot j % slots as generation g = round * n + j / slots (n: the slot's occupants a
 * round); the slot accepts g in {base_gen, base_gen + 1}: older is a late packet of an occupant
 * the slot has moved past (round_too_old), newer one whose slot is still held (round_too_new).
 * Returns a counter index of the rule it breaks, or -1. */
static __always_inline int locate(struct dosa_hdr *h, struct dosa_job *job, struct merge_ctx *mc)
{
	u32 p = dosa_ntohs(h->partition);
	u32 round = dosa_ntohl(h->round);
	u32 wid = dosa_ntohs(h->worker_id);
	u32 ndpus = job->num_dpus;
	u32 psize = job->partition_size;

	if (p >= job->num_partitions)
		return DOSA_C_BAD_FIELD;
	if (ndpus == 0 || psize == 0 || p % ndpus != job->dpu_index)
		return DOSA_C_NOT_OWNER;
	u32 local = p / ndpus;
	if (local >= job->num_owned)
		return DOSA_C_INTERNAL;

	mc->lo = (u64)p * psize;
	mc->hi = mc->lo + psize;
	if (mc->hi > job->numel)
		mc->hi = job->numel;
	if (mc->hi - mc->lo > DOSA_BUF_SUMS || job->list_cap > DOSA_LIST_WORDS * 4 || job->list_cap & 3)
		return DOSA_C_INTERNAL;

	u32 nslots = job->slots;
	if (nslots == 0 || nslots > job->num_owned)
		return DOSA_C_INTERNAL;
	u32 slot = local % nslots;
	u64 per_round = (job->num_owned - slot + nslots - 1) / nslots;
	mc->gen = (u64)round * per_round + local / nslots;

	u32 ps_idx = job->pstate_off + slot;
	mc->ps = pstate.lookup(&ps_idx);
	if (!mc->ps)
		return DOSA_C_INTERNAL;
	u64 base = *(volatile u64 *)&mc->ps->base_gen;
	if (mc->gen < base)
		return DOSA_C_ROUND_TOO_OLD;
	if (mc->gen - base > 1)
		return DOSA_C_ROUND_TOO_NEW;
	mc->parity = mc->gen & 1;
	mc->workers = job->workers;
	mc->p = p;
	mc->round = round;
	mc->slot = slot;

	u32 ws_idx = job->wstate_off + (slot * 2 + mc->parity) * job->workers + wid;
	mc->ws = wstate.lookup(&ws_idx);
	if (!mc->ws)
		return DOSA_C_INTERNAL;
	u32 bi = job->pool_off + slot * 2 + mc->parity;
	mc->buf = pool.lookup(&bi);
	mc->lock = locks.lookup(&bi);
	if (!mc->buf || !mc->lock)
		return DOSA_C_INTERNAL;
	mc->list_cap = job->list_cap;
	return -1;
}

/* After every check that can reject the packet has passed: agree on the worker's total and the
 * round's scale (the first packet sets them, by compare-and-swap), then claim the seq with an
 * atomic test-and-set of its dedup bit. Returns -1 when this copy is the one to merge, else the
 * verdict counter. Nothing is claimed for a packet rejected earlier, so its corrected copy merges. */
static __always_inline int claim(struct dosa_hdr *h, struct merge_ctx *mc)
{
	u32 seq = dosa_ntohs(h->seq);
	u64 total = dosa_ntohs(h->total);
	struct dosa_wstate *ws = mc->ws;
	struct dosa_pstate *ps = mc->ps;

	u64 old_total = __sync_val_compare_and_swap(&ws->total, 0, total);
	if (old_total != 0 && old_total != total)
		return DOSA_C_TOTAL_MISMATCH;
	u64 tag = (u64)((s32)h->scale_exp + DOSA_SCALE_TAG_BIAS);
	u64 old_tag = __sync_val_compare_and_swap(&ps->scale_tag[mc->parity & 1], 0, tag);
	if (old_tag != 0 && old_tag != tag)
		return DOSA_C_SCALE_MISMATCH;

	u64 bit = 1ULL << (seq & 63);
	u64 old_bits = __sync_fetch_and_or(&ws->seen[(seq >> 6) & 3], bit);
	if (old_bits & bit) {
		if (*(volatile u64 *)&ps->workers_done[mc->parity & 1] >= mc->workers)
			return DOSA_C_PASS_DUP_OF_COMPLETE;
		return DOSA_C_DUPLICATE;
	}
	/* A late copy of occupant base-1 that passed the window check just before the DPU worker's
	 * settle moved base_gen and zeroed this parity would have claimed a seq in the zeroed
	 * state of occupant base+1. The settle stores base_gen before it clears, so re-reading it
	 * here (after the full barrier of the atomic above) catches exactly that case: undo what
	 * this packet set and drop it. Occupant base+1 cannot have started yet (its hosts wait for
	 * the result the worker sends after the settle), so the undo races with nobody. */
	if (mc->gen < *(volatile u64 *)&ps->base_gen) {
		__sync_fetch_and_and(&ws->seen[(seq >> 6) & 3], ~bit);
		if (old_total == 0)
			__sync_val_compare_and_swap(&ws->total, total, 0);
		if (old_tag == 0)
			__sync_val_compare_and_swap(&ps->scale_tag[mc->parity & 1], tag, 0);
		return DOSA_C_ROUND_TOO_OLD;
	}
	return -1;
}

/* Sums are s32, saturated at +-(2^31 - 1). Hosts keep every value within the clip bound
 * (2^31 - 1) / workers, so a sum never saturates unless a host broke that rule. The adds run under
 * the buffer's lock as plain adds that wrap, each folding t + LIMIT and 2 LIMIT - (t + LIMIT) into
 * ``acc`` (t the exact sum): both are non-negative exactly when t is in range, so the sign bit of
 * ``acc`` says whether any add left it, without a branch per entry (a branch per entry would also
 * multiply the paths the verifier walks). Only then does the packet take the slow path
 * (resaturate_*): undo its adds (wrapping arithmetic restores the old sums exactly) and redo them
 * saturating, counting the sums that hit the bound. */
#define OUT_OF_RANGE(acc) ((s64)(acc) < 0)

static __always_inline void add_wrap(s32 *sums, u32 o, s32 v, u64 *acc)
{
	s32 *p = &sums[o & (DOSA_BUF_SUMS - 1)];
	s64 t = (s64)*p + v;
	u64 u = (u64)(t + S32_LIMIT);

	*p = (s32)t;
	*acc |= u | ((u64)(2 * S32_LIMIT) - u);
}

/* The slow path's step for one entry whose add (v) may have wrapped: the sum before it is the
 * stored one minus v in wrapping arithmetic, so the exact sum is that plus v; clamp it into
 * [-LIMIT, LIMIT] without a branch and store it. Returns 1 when it was clamped. (Exact when a
 * packet names each offset once, as every host's packet does; a packet repeating an offset is a
 * host bug, and its sums end within the bound all the same.) */
static __always_inline u32 saturate(s32 *sums, u32 o, s32 v)
{
	s32 *p = &sums[o & (DOSA_BUF_SUMS - 1)];
	s64 t = (s64)(s32)((u32)*p - (u32)v) + v;
	s64 over = t - S32_LIMIT, under = t + S32_LIMIT;
	s64 om = over >> 63, um = under >> 63; /* sign masks */

	/* the barrier keeps clang from turning the masks back into a select, i.e. a branch: a branch
	 * per entry would multiply the paths the verifier walks by 3 per entry */
	asm volatile("" : "+r"(om), "+r"(um));
	over &= ~om;  /* t - LIMIT when positive, else 0 */
	under &= um;  /* t + LIMIT when negative, else 0 */
	*p = (s32)(t - over - under);
	return (u32)(((u64)-over >> 63) | ((u64)under >> 63));
}

/* Calls STEP(o, v) for each entry of a sparse packet, o its offset minus ``shift`` (lo - base),
 * in blocks of 8 with one bounds check for a block's offsets and one for its values, then at most
 * 7 single entries: the verifier walks 71 + 7 steps, not 573. */
#define DOSA_BLOCKS (DOSA_RX_MAX_SPARSE_ENTRIES / 8)
#define FOR_SPARSE_ENTRIES(h, offs, vals, shift, data_end, STEP)					\
	do {												\
		u32 i_ = 0;										\
		for (int b_ = 0; b_ < DOSA_BLOCKS; b_++) {						\
			if (i_ + 8 > fresh_count(h))							\
				break;									\
			__be16 *o_ = (offs) + i_;							\
			__be32 *v_ = (vals) + i_;							\
			asm volatile("" : "+r"(o_), "+r"(v_));						\
			if (!fits(o_, 16, data_end) || !fits(v_, 32, data_end))			\
				break; /* cannot happen: the length was checked against count */	\
			_Pragma("unroll")								\
			for (int k_ = 0; k_ < 8; k_++)							\
				STEP((u32)(dosa_ntohs(o_[k_]) - (shift)), (s32)dosa_ntohl(v_[k_]));	\
			i_ += 8;									\
		}											\
		for (int k_ = 0; k_ < 7; k_++) {							\
			if (i_ >= fresh_count(h) || i_ >= DOSA_RX_MAX_SPARSE_ENTRIES)			\
				break;									\
			__be16 *o_ = (offs) + i_;							\
			__be32 *v_ = (vals) + i_;							\
			asm volatile("" : "+r"(o_), "+r"(v_));						\
			if (!fits(o_, 2, data_end) || !fits(v_, 4, data_end))				\
				break;									\
			STEP((u32)(dosa_ntohs(*o_) - (shift)), (s32)dosa_ntohl(*v_));			\
			i_++;										\
		}											\
	} while (0)

/* The slow path over a sparse or a dense packet's entries: saturate() each (the dense loop in
 * blocks of 8 like FOR_SPARSE_ENTRIES). Returns the clamps. */
static __always_inline u32 saturate_sparse(s32 *sums, struct dosa_hdr *h, __be16 *offs, __be32 *vals,
					   u32 shift, void *data_end)
{
	u32 sat = 0;

#define FIX(o, v) (sat += saturate(sums, o, v))
	FOR_SPARSE_ENTRIES(h, offs, vals, shift, data_end, FIX);
#undef FIX
	return sat;
}

#define DOSA_DENSE_BLOCKS (DOSA_RX_MAX_DENSE_ENTRIES / 8)

static __always_inline u32 saturate_dense(s32 *sums, struct dosa_hdr *h, __be32 *vals, u32 first,
					  void *data_end)
{
	u32 i = 0, sat = 0;

	for (int b = 0; b < DOSA_DENSE_BLOCKS; b++) {
		if (i + 8 > fresh_count(h))
			break;
		__be32 *v = vals + i;
		asm volatile("" : "+r"(v));
		if (!fits(v, 32, data_end))
			break;
#pragma unroll
		for (int k = 0; k < 8; k++)
			sat += saturate(sums, first + i + k, (s32)dosa_ntohl(v[k]));
		i += 8;
	}
	for (int k = 0; k < 7; k++) {
		if (i >= fresh_count(h) || i >= DOSA_RX_MAX_DENSE_ENTRIES)
			break;
		__be32 *v = vals + i;
		asm volatile("" : "+r"(v));
		if (!fits(v, 4, data_end))
			break;
		sat += saturate(sums, first + i, (s32)dosa_ntohl(*v));
		i++;
	}
	return sat;
}

/* The touched list of the packet's buffer: the DPU worker reads the sums it names instead of
 * scanning the whole buffer (docs/dataplane.md, *Touched lists*). A sparse packet lists its offsets
 * in bulk: it takes ceil(count / 4) whole list words (4 u16 offsets each) from the buffer's count
 * and copies its offset block there word by word, each u16 turned to host order. No per-entry
 * work: the offsets of every packet of every worker land in the list, the same entry once per
 * worker that sent it, and the last word may carry the two bytes of padding or of the values
 * that follow the offsets; the reader deduplicates and only takes a listed offset whose sum is
 * non-zero, so extra names are harmless, and every non-zero sum is named. The count keeps
 * growing past list_cap (nothing is written then): a count above the capacity tells the worker to
 * scan. A packet whose offsets do not count from the partition's first index (base != lo) or a
 * dense block makes the list overflow instead. Runs under the buffer's lock (the count is the
 * buffer's), like the adds. */
#define DOSA_PKT_LIST_WORDS ((DOSA_RX_MAX_SPARSE_ENTRIES + 3) / 4)

static __always_inline void list_overflow(struct merge_ctx *mc)
{
	if (mc->list_cap)
		mc->ps->touched[mc->parity & 1] += (u64)mc->list_cap + 1;
}

static __always_inline void list_offsets(struct merge_ctx *mc, struct dosa_hdr *h, __be16 *offs,
					 void *data_end)
{
	u32 words = (fresh_count(h) + 3) / 4;
	u64 *count = &mc->ps->touched[mc->parity & 1];
	u64 pos = *count;

	if (!mc->list_cap || !words)
		return;
	*count = pos + words * 4;
	if (pos + words * 4 > mc->list_cap)
		return; /* overflow: the count says so */
	u64 *src = (u64 *)offs;
	u32 w0 = pos / 4;
	for (int w = 0; w < DOSA_PKT_LIST_WORDS; w++) {
		if (w >= (fresh_count(h) + 3) / 4)
			break;
		if (!fits(&src[w], 8, data_end))
			break; /* cannot happen: values follow the offsets */
		u64 x = src[w];
		u32 el = w0 + w;
		asm volatile("" : "+r"(el));
		/* the four big-endian u16 offsets to host order, lane by lane */
		mc->buf->list[el & (DOSA_LIST_WORDS - 1)] =
			((x & 0x00FF00FF00FF00FFULL) << 8) | ((x >> 8) & 0x00FF00FF00FF00FFULL);
	}
}

/* The packet's entries are in the buffer: count it toward its worker's total, and the worker
 * toward the round's; exactly one packet sees the last worker complete and emits the event. */
static __always_inline int finish(struct dosa_hdr *h, u32 job_id, struct merge_ctx *mc, u32 cnt, u32 sat)
{
	count(DOSA_C_MERGED_ENTRIES, cnt);
	if (sat)
		count(DOSA_C_SATURATED_SUMS, sat);
	u64 got = __sync_fetch_and_add(&mc->ws->received, 1) + 1;
	if (got == dosa_ntohs(h->total)) {
		u64 done = __sync_fetch_and_add(&mc->ps->workers_done[mc->parity & 1], 1) + 1;
		if (done == mc->workers)
			emit_completion(job_id, (u16)mc->p, mc->round, h->scale_exp, mc->slot);
	}
	return verdict(DOSA_C_MERGED, XDP_DROP); /* consumed: merged in place */
}

static __always_inline int rejected(int reason)
{
	return verdict(reason, reason == DOSA_C_PASS_DUP_OF_COMPLETE ? XDP_PASS : XDP_DROP);
}

/* The dosa header of the packet again, as a fresh pointer (NULL if it no longer fits, which cannot
 * happen). Each merge loop checks its accesses against data_end, and every check widens the range
 * the verifier knows for the header pointer: after a loop, each of its exits would carry another
 * range into the code that follows, and the verifier would walk that code once per exit (past its
 * million-instruction budget). Code after a loop starts from a reloaded pointer instead, so every
 * exit arrives in the same state and is pruned. */
static __always_inline struct dosa_hdr *reload(struct xdp_md *ctx, u32 hoff, void **data_end)
{
	void *data = (void *)(long)ctx->data;
	struct dosa_hdr *h = data + (hoff & 0xff);

	*data_end = (void *)(long)ctx->data_end;
	if (!fits(h, sizeof(*h), *data_end))
		return NULL;
	return h;
}

#define RELOAD()								\
	do {									\
		h = reload(ctx, hoff, &data_end);				\
		if (!h)								\
			return DROP(INTERNAL);					\
		offs = (void *)(h + 1);						\
		vals = (void *)h + DOSA_VALUE_OFFSET(cnt);			\
	} while (0)

/* SPARSE_DATA (v2): count u16 offsets (index = base + offset), padded to 4 bytes, then count s32
 * values. A first bounded loop checks every index when one can lie outside the partition (a
 * partition shorter than 65536 entries, or base != lo); for the hosts' packets of a full
 * partition every u16 offset lands inside by construction. Then the claim (dedup), then, under
 * the buffer's lock, the adds and the touched-list copy. */
static __always_inline int merge_sparse(struct xdp_md *ctx, u32 hoff, u32 job_id, struct dosa_job *job)
{
	struct merge_ctx mc = {};
	void *data_end;
	struct dosa_hdr *h;
	__be16 *offs;
	__be32 *vals;
	u32 cnt = 0;

	RELOAD();
	cnt = dosa_ntohs(h->count);
	if (cnt > DOSA_RX_MAX_SPARSE_ENTRIES) /* checked by dosa_check_header; bounds the pointer below */
		return DROP(COUNT_MISMATCH);
	vals = (void *)h + DOSA_VALUE_OFFSET(cnt);
	u64 base = dosa_ntohl(h->base);
	int bad = locate(h, job, &mc);
	if (bad >= 0)
		return rejected(bad);
	if (base != mc.lo || mc.hi - mc.lo != DOSA_BUF_SUMS) {
		/* offset o is inside iff d = o - (lo - base) lies in [0, span): both d and span - 1 - d
		 * are non-negative; their sign bits, OR-ed without a branch, say whether any is not */
		s64 first = (s64)mc.lo - (s64)base, last = (s64)(mc.hi - mc.lo) - 1;
		s64 outside = 0;
#define CHECK(o, v) (outside |= ((s64)(o) - first) | (last - ((s64)(o) - first)))
		FOR_SPARSE_ENTRIES(h, offs, vals, 0, data_end, CHECK);
#undef CHECK
		if (outside < 0)
			return DROP(INDEX_OUT_OF_PARTITION);
		RELOAD();
	}
	bad = claim(h, &mc);
	if (bad >= 0)
		return rejected(bad);
	s32 *sums = mc.buf->sums;
	/* offsets count from base, sums from lo: o - (lo - base) in u32 arithmetic, 0 for a host's */
	u32 sat = 0, shift = (u32)(mc.lo - base);
	u64 acc = 0;
	bpf_spin_lock(&mc.lock->lock);
#define ADD(o, v) add_wrap(sums, o, v, &acc)
	FOR_SPARSE_ENTRIES(h, offs, vals, shift, data_end, ADD);
#undef ADD
	h = reload(ctx, hoff, &data_end);
	if (h) {
		offs = (void *)(h + 1);
		vals = (void *)h + DOSA_VALUE_OFFSET(cnt);
		if (shift == 0)
			list_offsets(&mc, h, offs, data_end);
		else
			list_overflow(&mc); /* offsets not from lo: the worker scans this buffer */
	}
	bpf_spin_unlock(&mc.lock->lock);
	if (OUT_OF_RANGE(acc)) {
		slow_path.call(ctx, 0); /* redoes the adds saturating, then finishes; returns only if absent */
		sat = cnt;              /* (then the sums wrapped: counted all the same) */
	}
	RELOAD();
	return finish(h, job_id, &mc, cnt, sat);
}

/* DENSE_DATA: values for [base, base + count), which must lie inside the partition; summed into
 * the same buffer, counted toward the same per-worker total as sparse packets (a contribution may
 * mix both). */
static __always_inline int merge_dense(struct xdp_md *ctx, u32 hoff, u32 job_id, struct dosa_job *job)
{
	struct merge_ctx mc = {};
	void *data_end;
	struct dosa_hdr *h;
	__be16 *offs;
	__be32 *vals;
	u32 cnt = 0;

	RELOAD();
	cnt = dosa_ntohs(h->count);
	u64 base = dosa_ntohl(h->base);
	int bad = locate(h, job, &mc);
	if (bad >= 0)
		return rejected(bad);
	if (base < mc.lo || base + cnt > mc.hi)
		return DROP(INDEX_OUT_OF_PARTITION);
	bad = claim(h, &mc);
	if (bad >= 0)
		return rejected(bad);
	vals = (void *)(h + 1);
	u32 first = (u32)(base - mc.lo);
	s32 *sums = mc.buf->sums;
	u32 sat = 0;
	u64 acc = 0;
	bpf_spin_lock(&mc.lock->lock);
	for (int k = 0; k < DOSA_RX_MAX_DENSE_ENTRIES; k++) {
		if (k >= fresh_count(h))
			break;
		if (!fits(&vals[k], 4, data_end))
			break; /* cannot happen: the length was checked against count */
		add_wrap(sums, first + k, (s32)dosa_ntohl(vals[k]), &acc);
	}
	list_overflow(&mc);
	bpf_spin_unlock(&mc.lock->lock);
	if (OUT_OF_RANGE(acc)) {
		slow_path.call(ctx, 0); /* redoes the adds saturating, then finishes; returns only if absent */
		sat = cnt;
	}
	RELOAD();
	return finish(h, job_id, &mc, cnt, sat);
}

/* Ethernet, IPv4, UDP to a dosa port, then the dosa header, its rules, its job and flow: a
 * counter index when the packet is to be dropped or passed (*action), or -1 with *hp and *jobp
 * set for a data or control packet of a valid flow. */
static __always_inline int classify(struct xdp_md *ctx, struct dosa_hdr **hp, struct dosa_job **jobp,
				    int *action)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct hdr_cursor nh = { .pos = data };
	struct ethhdr *eth;
	struct iphdr *iph;
	struct udphdr *udph;
	struct dosa_hdr *h;

	*action = XDP_PASS;
	if (parse_ethhdr(&nh, data_end, &eth) != dosa_htons(ETH_P_IP))
		return DOSA_C_PASS_NOT_DOSA;
	if (parse_iphdr(&nh, data_end, &iph) != IPPROTO_UDP)
		return DOSA_C_PASS_NOT_DOSA;
	u16 frag = dosa_ntohs(iph->frag_off);
	if (frag & DOSA_IP_OFFSET)
		return DOSA_C_PASS_NOT_DOSA; /* a later fragment: no UDP header to tell the port */
	int ulen = parse_udphdr(&nh, data_end, &udph);
	if (ulen < 0)
		return DOSA_C_PASS_NOT_DOSA;
	u32 dport = dosa_ntohs(udph->dest);
	if (!ports.lookup(&dport))
		return DOSA_C_PASS_NOT_DOSA;

	/* From here on the packet is addressed to dosa: every fault is a counted drop. */
	*action = XDP_DROP;
	if (frag & DOSA_IP_MF)
		return DOSA_C_IP_FRAGMENT;
	if (ulen < (int)sizeof(struct udphdr) + DOSA_HDR_LEN)
		return DOSA_C_SHORT_PACKET;
	if ((void *)udph + ulen > data_end)
		return DOSA_C_SHORT_PACKET;
	if (parse_dosahdr(&nh, data_end, &h) < 0)
		return DOSA_C_SHORT_PACKET;

	int bad = check_header(h, ulen - sizeof(struct udphdr));
	if (bad >= 0)
		return bad;

	u32 job_id = dosa_ntohl(h->job_id);
	struct dosa_job *job = jobs.lookup(&job_id);
	if (!job)
		return DOSA_C_UNKNOWN_JOB;
	struct dosa_flow_key fk = { .job_id = job_id, .worker_id = dosa_ntohs(h->worker_id) };
	if (fk.worker_id >= job->workers)
		return DOSA_C_UNKNOWN_WORKER;
	struct dosa_flow *flow = flows.lookup(&fk);
	if (!flow)
		return DOSA_C_UNKNOWN_WORKER;
	if (flow->saddr != iph->saddr || flow->sport != udph->source)
		return DOSA_C_BAD_SOURCE;
	*hp = h;
	*jobp = job;
	return -1;
}

int xdp_dosa(struct xdp_md *ctx)
{
	struct dosa_hdr *h = NULL;
	struct dosa_job *job = NULL;
	int action;
	int c = classify(ctx, &h, &job, &action);

	if (c >= 0 || !h || !job)
		return verdict(c >= 0 ? c : DOSA_C_INTERNAL, action);
	u32 job_id = dosa_ntohl(h->job_id);
	u32 hoff = (void *)h - (void *)(long)ctx->data; /* the header again after each loop: reload() */
	switch (h->type) {
	case DOSA_T_SPARSE_DATA:
		return merge_sparse(ctx, hoff, job_id, job);
	case DOSA_T_DENSE_DATA:
		return merge_dense(ctx, hoff, job_id, job);
	default: /* RETX_REQUEST, HEARTBEAT */
		return PASS(PASS_CONTROL);
	}
}

/* The slow path (slot 0 of slow_path), entered by a tail call from xdp_dosa after a data packet
 * was claimed and added but some sum left the s32 range: the same packet classified and located
 * again (it passed every check a moment ago; its occupant cannot move on before it finishes),
 * its adds undone and redone saturating under the buffer's lock, the clamps counted, then the
 * packet finished as xdp_dosa would have. */
int xdp_dosa_saturate(struct xdp_md *ctx)
{
	struct dosa_hdr *h = NULL;
	struct dosa_job *job = NULL;
	struct merge_ctx mc = {};
	int action;
	int c = classify(ctx, &h, &job, &action);

	if (c >= 0 || !h || !job)
		return DROP(INTERNAL);
	void *data_end = (void *)(long)ctx->data_end;
	u32 job_id = dosa_ntohl(h->job_id);
	u32 cnt = dosa_ntohs(h->count);
	u64 base = dosa_ntohl(h->base);
	if (locate(h, job, &mc) >= 0)
		return DROP(INTERNAL);
	u32 hoff = (void *)h - (void *)(long)ctx->data, sat = 0;
	u8 type = h->type;
	if (type != DOSA_T_SPARSE_DATA && (type != DOSA_T_DENSE_DATA || base < mc.lo))
		return DROP(INTERNAL);
	if (cnt > DOSA_RX_MAX_SPARSE_ENTRIES)
		return DROP(INTERNAL);
	u32 shift = (u32)(mc.lo - base), first = (u32)(base - mc.lo);
	s32 *sums = mc.buf->sums;
	h = reload(ctx, hoff, &data_end); /* one state for every path through classify() */
	if (!h)
		return DROP(INTERNAL);
	bpf_spin_lock(&mc.lock->lock);
	if (type == DOSA_T_SPARSE_DATA)
		sat = saturate_sparse(sums, h, (void *)(h + 1), (void *)h + DOSA_VALUE_OFFSET(cnt), shift,
				      data_end);
	else
		sat = saturate_dense(sums, h, (void *)(h + 1), first, data_end);
	bpf_spin_unlock(&mc.lock->lock);
	h = reload(ctx, hoff, &data_end);
	if (!h)
		return DROP(INTERNAL);
	return finish(h, job_id, &mc, cnt, sat);
}
