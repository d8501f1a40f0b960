// Random loss, duplication and reordering of a link's packets (testbed/impair.py).
//
// Loss and duplication: attached to both hooks of the link's bridge port in the fabric namespace:
//   tc qdisc add dev PORT clsact
//   tc filter add dev PORT ingress bpf da obj impair.o sec tc_in   (node -> fabric)
//   tc filter add dev PORT egress  bpf da obj impair.o sec tc_out  (fabric -> node)
// Dropping there is silent for the sending application, as on a real wire, and happens before a
// DPU's XDP program sees the packet. Only IPv4 is impaired (ARP stays reliable so that loss
// experiments measure the data path, not neighbour resolution). This kernel has no netem; this
// program is the one loss/duplication path on every kernel. LOSS_THRESH / DUP_THRESH are
// probabilities scaled to 2^32, given with -D at compile time.
//
// Reordering (section "reorder"): a cls_bpf classifier (direct action) of the HTB qdisc on the
// egress of both ends of the link (testbed/shaping.py). It sends a random REORDER_THRESH / 2^32 of
// the UDP-over-IPv4 packets into HTB's slow class (minor REORDER_MINOR), whose small hard rate
// holds them while later packets pass through the fast default class. Everything else (ARP, TCP, ...)
// keeps its order: the control plane's TCP and neighbour resolution are not what is tested.
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>

#ifndef LOSS_THRESH
#define LOSS_THRESH 0ULL
#endif
#ifndef DUP_THRESH
#define DUP_THRESH 0ULL
#endif
#ifndef REORDER_THRESH
#define REORDER_THRESH 0ULL
#endif
// minor number of the slow class: the kernel keeps only 16 bits of tc_classid and takes the major
// number from the filter's own classid (`tc filter ... bpf da ... classid 1:20`)
#ifndef REORDER_MINOR
#define REORDER_MINOR 0x20U
#endif
// skb->mark of the copy we inject, so the copy is not dropped or duplicated again when it passes
// this hook a second time
#define DUP_MARK 0xd05a0d0bU

static __u32 (*bpf_get_prandom_u32)(void) = (void *)BPF_FUNC_get_prandom_u32;
static long (*bpf_clone_redirect)(struct __sk_buff *skb, __u32 ifindex, __u64 flags) =
    (void *)BPF_FUNC_clone_redirect;
static long (*bpf_skb_load_bytes)(const struct __sk_buff *skb, __u32 offset, void *to, __u32 len) =
    (void *)BPF_FUNC_skb_load_bytes;

static __always_inline int impair(struct __sk_buff *skb, __u64 redirect_flags)
{
    if (skb->mark == DUP_MARK) {
        skb->mark = 0;
        return TC_ACT_OK;
    }
    if (skb->protocol != __builtin_bswap16(0x0800))
        return TC_ACT_OK;
    if (LOSS_THRESH && (__u64)bpf_get_prandom_u32() < (__u64)LOSS_THRESH)
        return TC_ACT_SHOT;
    if (DUP_THRESH && (__u64)bpf_get_prandom_u32() < (__u64)DUP_THRESH) {
        __u32 mark = skb->mark;
        skb->mark = DUP_MARK;
        bpf_clone_redirect(skb, skb->ifindex, redirect_flags);
        skb->mark = mark;
    }
    return TC_ACT_OK;
}

__attribute__((section("tc_in"), used)) int impair_in(struct __sk_buff *skb)
{
    return impair(skb, BPF_F_INGRESS);
}

__attribute__((section("tc_out"), used)) int impair_out(struct __sk_buff *skb)
{
    return impair(skb, 0);
}

// Classifier of the HTB qdisc: TC_ACT_OK with tc_classid = the slow class, or TC_ACT_UNSPEC
// ("no match": HTB then uses its default, fast class).
__attribute__((section("reorder"), used)) int reorder_classify(struct __sk_buff *skb)
{
    __u8 proto;

    if (!REORDER_THRESH || skb->protocol != __builtin_bswap16(ETH_P_IP))
        return TC_ACT_UNSPEC;
    // egress: skb data starts at the Ethernet header; offset 9 of the IPv4 header is the protocol
    if (bpf_skb_load_bytes(skb, ETH_HLEN + 9, &proto, 1) < 0 || proto != IPPROTO_UDP)
        return TC_ACT_UNSPEC;
    if ((__u64)bpf_get_prandom_u32() >= (__u64)REORDER_THRESH)
        return TC_ACT_UNSPEC;
    skb->tc_classid = REORDER_MINOR;
    return TC_ACT_OK;
}

char _license[] __attribute__((section("license"), used)) = "GPL";
