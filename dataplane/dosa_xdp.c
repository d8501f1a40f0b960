/* dosa XDP dataplane: parse, validate, match flows, merge sparse chunks in flight.
 *
 * Compiled by BCC at load time (dataplane/loader.py prepends the counter enum generated from
 * dataplane/reasons.py). Every packet moves exactly one verdict counter. The spec of what is
 * accepted is docs/protocol.md; the map layouts are explained in docs/dataplane.md.
 */
#include <uapi/linux/bpf.h>
#include "dosa_parse.h"
#include "dosa_state.h"

BPF_HASH(jobs, u32, struct dosa_job, DOSA_MAX_JOBS);
BPF_HASH(flows, struct dosa_flow_key, struct dosa_flow, DOSA_MAX_FLOWS);
BPF_HASH(ports, u32, u32, DOSA_MAX_PORTS); /* UDP destination ports (host order) that carry dosa */
BPF_F_TABLE("array", u32, s64, pool, DOSA_POOL_SLOTS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct dosa_pstate, pstate, DOSA_PSTATE_SLOTS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", u32, struct dosa_wstate, wstate, DOSA_WSTATE_SLOTS, BPF_F_MMAPABLE);
BPF_PERCPU_ARRAY(counters, u64, DOSA_NUM_COUNTERS);
BPF_RINGBUF_OUTPUT(completions, DOSA_RINGBUF_PAGES);

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

static __always_inline void emit_completion(u32 job_id, u16 partition, u32 round, s8 scale)
{
	struct dosa_completion ev = {};

	ev.job_id = job_id;
	ev.round = round;
	ev.partition = partition;
	ev.scale_exp = scale;
	count(DOSA_C_COMPLETIONS, 1);
	if (completions.ringbuf_output(&ev, sizeof(ev), 0) != 0)
		count(DOSA_C_COMPLETION_LOST, 1);
}

/* Where a data packet of a valid flow goes: its partition's state, its worker's state, its
 * buffer. Filled by locate(). */
struct merge_ctx {
	struct dosa_pstate *ps;
	struct dosa_wstate *ws;
	u64 lo, hi;   /* the partition's index range */
	u64 buf0;     /* pool entry of index lo in the occupant's buffer */
	u64 list0;    /* pool entry holding the buffer's touched-list positions 0..3 */
	u64 gen;      /* the packet's occupant of its slot (dosa_state.h, struct dosa_pstate) */
	u32 p, round, parity, workers;
	u32 list_cap; /* touched-list capacity (0: the job keeps no lists) */
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

	u32 ws_idx = job->wstate_off + (slot * 2 + mc->parity) * job->workers + wid;
	mc->ws = wstate.lookup(&ws_idx);
	if (!mc->ws)
		return DOSA_C_INTERNAL;

	/* a buffer: stride sums, then list_cap u16 offsets packed 4 per s64 entry */
	u64 stride = job->stride;
	u64 cap = job->list_cap;
	u64 pitch = stride + cap / 4;
	mc->buf0 = (u64)job->pool_off + ((u64)slot * 2 + mc->parity) * pitch;
	mc->list0 = mc->buf0 + stride;
	mc->list_cap = cap;
	if (mc->hi - mc->lo > stride || mc->buf0 + pitch > DOSA_POOL_SLOTS)
		return DOSA_C_INTERNAL;
	if (cap & 3 || (cap && stride > 65536)) /* u16 offsets; whole s64 entries */
		return DOSA_C_INTERNAL;
	return -1;
}

/* The touched list of the packet's buffer: the DPU worker reads the sums it names instead of
 * scanning the whole buffer (docs/dataplane.md, *Touched lists*). A sparse packet lists its offsets
 * in bulk: it reserves ceil(count / 4) whole list entries (4 u16 offsets each) with one fetch-add
 * on the buffer's count and copies its offset block there word by word, each u16 turned to host
 * order. No per-entry work: the offsets of every packet of every worker land in the list, the same
 * entry once per worker that sent it, and the last word may carry the two bytes of padding or of
 * the values that follow the offsets; the reader deduplicates and only takes a listed offset whose
 * sum is non-zero, so extra names are harmless, and every non-zero sum is named. The count keeps
 * growing past list_cap (nothing is written then): a count above the capacity tells the worker to
 * scan. A packet whose offsets do not count from the partition's first index (base != lo) or a
 * dense block makes the list overflow instead (the packetizer never sends the former; dense
 * blocks are for dense gradients, where a scan costs no more per non-zero). */
#define DOSA_LIST_WORDS ((DOSA_RX_MAX_SPARSE_ENTRIES + 3) / 4)

static __always_inline void list_overflow(struct merge_ctx *mc)
{
	if (mc->list_cap)
		__sync_fetch_and_add(&mc->ps->touched[mc->parity & 1], (u64)mc->list_cap + 1);
}

static __always_inline void list_offsets(struct merge_ctx *mc, struct dosa_hdr *h, void *data_end)
{
	u64 words = (dosa_ntohs(h->count) + 3) / 4;

	if (!mc->list_cap || !words)
		return;
	u64 pos = __sync_fetch_and_add(&mc->ps->touched[mc->parity & 1], words * 4);
	if (pos + words * 4 > mc->list_cap)
		return; /* overflow: the count says so */
	u64 *src = (void *)(h + 1);
	u32 el0 = (u32)(mc->list0 + pos / 4);
	for (int w = 0; w < DOSA_LIST_WORDS; w++) {
		if (w >= words)
			break;
		if ((void *)(&src[w] + 1) > data_end)
			break; /* cannot happen: values follow the offsets */
		u64 x = src[w];
		u32 el = el0 + w;
		s64 *e = pool.lookup(&el);
		if (e) /* the four big-endian u16 offsets to host order, lane by lane */
			*e = (s64)(((x & 0x00FF00FF00FF00FFULL) << 8) | ((x >> 8) & 0x00FF00FF00FF00FFULL));
	}
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
	 * advance() moved base_gen and zeroed this parity would have claimed a seq in the zeroed
	 * state of occupant base+1. advance() stores base_gen before it clears, so re-reading it
	 * here (after the full barrier of the atomic above) catches exactly that case: undo what
	 * this packet set and drop it. Occupant base+1 cannot have started yet (its hosts wait for
	 * the result the worker sends after advance() returns), so the undo races with nobody. */
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

/* The packet's entries are in the buffer: count it toward its worker's total, and the worker
 * toward the round's; exactly one packet sees the last worker complete and emits the event. */
static __always_inline int finish(struct dosa_hdr *h, u32 job_id, struct merge_ctx *mc, u32 cnt)
{
	count(DOSA_C_MERGED_ENTRIES, cnt);
	u64 got = __sync_fetch_and_add(&mc->ws->received, 1) + 1;
	if (got == dosa_ntohs(h->total)) {
		u64 done = __sync_fetch_and_add(&mc->ps->workers_done[mc->parity & 1], 1) + 1;
		if (done == mc->workers)
			emit_completion(job_id, (u16)mc->p, mc->round, h->scale_exp);
	}
	return verdict(DOSA_C_MERGED, XDP_DROP); /* consumed: merged in place */
}

static __always_inline int rejected(int reason)
{
	return verdict(reason, reason == DOSA_C_PASS_DUP_OF_COMPLETE ? XDP_PASS : XDP_DROP);
}

/* SPARSE_DATA (v2): count u16 offsets (index = base + offset), padded to 4 bytes, then count s32
 * values. Pass 1 checks every index (bounded loop), pass 2 adds each value atomically. The loops
 * run to DOSA_RX_MAX_SPARSE_ENTRIES, the most a packet of the largest MTU carries. Pass 1 is
 * skipped where it cannot fail: base == lo of a full 65536-entry partition, where every u16 offset
 * lands inside (the offsets lie inside the packet: dosa_check_header checked its length). */
static __always_inline int merge_sparse(struct dosa_hdr *h, void *data_end, u32 job_id,
					struct dosa_job *job)
{
	struct merge_ctx mc = {};
	u32 cnt = dosa_ntohs(h->count);
	u64 base = dosa_ntohl(h->base);
	int bad = locate(h, job, &mc);

	if (bad >= 0)
		return rejected(bad);
	if (cnt > DOSA_RX_MAX_SPARSE_ENTRIES) /* checked by dosa_check_header; bounds the pointer below */
		return DROP(COUNT_MISMATCH);
	__be16 *offs = (void *)(h + 1);
	__be32 *vals = (void *)h + DOSA_VALUE_OFFSET(cnt);
	/* The loops compare i with a fresh read of count: comparing with cnt would teach the verifier
	 * a different range of cnt at each of the loop's exits and make it walk pass 2 once per exit. */
	if (base != mc.lo || mc.hi - mc.lo != 65536) {
		for (int i = 0; i < DOSA_RX_MAX_SPARSE_ENTRIES; i++) {
			if (i >= dosa_ntohs(*(volatile __be16 *)&h->count))
				break;
			if ((void *)(&offs[i] + 1) > data_end)
				return DROP(SHORT_PACKET);
			u64 idx = base + dosa_ntohs(offs[i]);
			if (idx < mc.lo || idx >= mc.hi)
				return DROP(INDEX_OUT_OF_PARTITION);
		}
	}
	bad = claim(h, &mc);
	if (bad >= 0)
		return rejected(bad);
	u64 first = mc.buf0 + base - mc.lo; /* pool slot of offset 0 (base may lie below lo) */
	for (int i = 0; i < DOSA_RX_MAX_SPARSE_ENTRIES; i++) {
		if (i >= dosa_ntohs(*(volatile __be16 *)&h->count))
			break;
		if ((void *)(&offs[i] + 1) > data_end || (void *)(&vals[i] + 1) > data_end)
			break; /* cannot happen: the length was checked against count */
		u32 slot = (u32)(first + dosa_ntohs(offs[i]));
		s64 *v = pool.lookup(&slot);
		if (v)
			__sync_fetch_and_add(v, (s64)(s32)dosa_ntohl(vals[i]));
	}
	if (base == mc.lo)
		list_offsets(&mc, h, data_end);
	else
		list_overflow(&mc);
	return finish(h, job_id, &mc, cnt);
}

/* DENSE_DATA: values for [base, base + count), which must lie inside the partition; summed into
 * the same buffer, counted toward the same per-worker total as sparse packets (a contribution may
 * mix both). */
static __always_inline int merge_dense(struct dosa_hdr *h, void *data_end, u32 job_id,
				       struct dosa_job *job)
{
	struct merge_ctx mc = {};
	u32 cnt = dosa_ntohs(h->count);
	u64 base = dosa_ntohl(h->base);
	int bad = locate(h, job, &mc);

	if (bad >= 0)
		return rejected(bad);
	if (base < mc.lo || base + cnt > mc.hi)
		return DROP(INDEX_OUT_OF_PARTITION);
	bad = claim(h, &mc);
	if (bad >= 0)
		return rejected(bad);
	__be32 *vals = (void *)(h + 1);
	u64 first = mc.buf0 + (base - mc.lo);
	for (int i = 0; i < DOSA_RX_MAX_DENSE_ENTRIES; i++) {
		if (i >= dosa_ntohs(*(volatile __be16 *)&h->count))
			break;
		if ((void *)(&vals[i] + 1) > data_end)
			break; /* cannot happen: the length was checked against count */
		u32 slot = (u32)(first + i);
		s64 *v = pool.lookup(&slot);
		if (v)
			__sync_fetch_and_add(v, (s64)(s32)dosa_ntohl(vals[i]));
	}
	list_overflow(&mc);
	return finish(h, job_id, &mc, cnt);
}

int xdp_dosa(struct xdp_md *ctx)
{
	void *data_end = (void *)(long)ctx->data_end;
	void *data = (void *)(long)ctx->data;
	struct hdr_cursor nh = { .pos = data };
	struct ethhdr *eth;
	struct iphdr *iph;
	struct udphdr *udph;
	struct dosa_hdr *h;

	if (parse_ethhdr(&nh, data_end, &eth) != dosa_htons(ETH_P_IP))
		return PASS(PASS_NOT_DOSA);
	if (parse_iphdr(&nh, data_end, &iph) != IPPROTO_UDP)
		return PASS(PASS_NOT_DOSA);
	u16 frag = dosa_ntohs(iph->frag_off);
	if (frag & DOSA_IP_OFFSET)
		return PASS(PASS_NOT_DOSA); /* a later fragment: no UDP header to tell the port */
	int ulen = parse_udphdr(&nh, data_end, &udph);
	if (ulen < 0)
		return PASS(PASS_NOT_DOSA);
	u32 dport = dosa_ntohs(udph->dest);
	if (!ports.lookup(&dport))
		return PASS(PASS_NOT_DOSA);

	/* From here on the packet is addressed to dosa: every fault is a counted drop. */
	if (frag & DOSA_IP_MF)
		return DROP(IP_FRAGMENT);
	if (ulen < (int)sizeof(struct udphdr) + DOSA_HDR_LEN)
		return DROP(SHORT_PACKET);
	if ((void *)udph + ulen > data_end)
		return DROP(SHORT_PACKET);
	if (parse_dosahdr(&nh, data_end, &h) < 0)
		return DROP(SHORT_PACKET);

	int bad = check_header(h, ulen - sizeof(struct udphdr));
	if (bad >= 0)
		return verdict(bad, XDP_DROP);

	u32 job_id = dosa_ntohl(h->job_id);
	struct dosa_job *job = jobs.lookup(&job_id);
	if (!job)
		return DROP(UNKNOWN_JOB);
	struct dosa_flow_key fk = { .job_id = job_id, .worker_id = dosa_ntohs(h->worker_id) };
	if (fk.worker_id >= job->workers)
		return DROP(UNKNOWN_WORKER);
	struct dosa_flow *flow = flows.lookup(&fk);
	if (!flow)
		return DROP(UNKNOWN_WORKER);
	if (flow->saddr != iph->saddr || flow->sport != udph->source)
		return DROP(BAD_SOURCE);

	switch (h->type) {
	case DOSA_T_SPARSE_DATA:
		return merge_sparse(h, data_end, job_id, job);
	case DOSA_T_DENSE_DATA:
		return merge_dense(h, data_end, job_id, job);
	default: /* RETX_REQUEST, HEARTBEAT */
		return PASS(PASS_CONTROL);
	}
}
