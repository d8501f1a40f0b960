/* AF_XDP transmit rate, for `dosa bench afxdp` (benchmarks/afxdp.py): one TX-only AF_XDP socket
 * on queue 0 of an interface sends COUNT copies of one Ethernet/IPv4/UDP frame, and prints one JSON
 * line: packets completed, wall seconds, this process's user and system CPU seconds, kicks.
 *
 * Raw syscalls and <linux/if_xdp.h> only (no libxdp): a UMEM of FRAMES 4 KiB chunks, its fill and
 * completion rings (the kernel wants both before bind), a TX ring; bind in copy mode (XDP_COPY:
 * veth has no zero-copy) or zero-copy (XDP_ZEROCOPY) when asked. Every frame is written once; the
 * loop only posts descriptors, kicks the kernel with sendto (copy mode transmits at most 32 frames
 * a kick: __xsk_generic_xmit's TX_BATCH_SIZE) and reaps completions.
 *
 * usage: afxdp_tx IFACE DST_MAC SRC_IP DST_IP DST_PORT PAYLOAD_BYTES COUNT [copy|zerocopy]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_ether.h>
#include <linux/if_xdp.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <net/if.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef SOL_XDP
#define SOL_XDP 283
#endif
#ifndef AF_XDP
#define AF_XDP 44
#endif

#define FRAMES 4096
#define FRAME_SIZE 4096
#define RING 2048

struct ring {
    uint32_t *producer, *consumer;
    void *desc;
};

static void die(const char *what) {
    fprintf(stderr, "afxdp_tx: %s: %s\n", what, strerror(errno));
    exit(1);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint16_t csum(const void *data, size_t len) {
    const uint16_t *p = data;
    uint32_t s = 0;
    for (; len > 1; len -= 2) s += *p++;
    if (len) s += *(const uint8_t *)p;
    while (s >> 16) s = (s & 0xffff) + (s >> 16);
    return (uint16_t)~s;
}

static void map_ring(int fd, struct xdp_ring_offset *off, size_t n, size_t entry, off_t pgoff,
                     struct ring *r) {
    uint8_t *m = mmap(NULL, off->desc + n * entry, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                      fd, pgoff);
    if (m == MAP_FAILED) die("mmap ring");
    r->producer = (uint32_t *)(m + off->producer);
    r->consumer = (uint32_t *)(m + off->consumer);
    r->desc = m + off->desc;
}

int main(int argc, char **argv) {
    if (argc < 8) {
        fprintf(stderr, "usage: afxdp_tx IFACE DST_MAC SRC_IP DST_IP DST_PORT PAYLOAD_BYTES COUNT "
                        "[copy|zerocopy]\n");
        return 2;
    }
    unsigned ifindex = if_nametoindex(argv[1]);
    if (!ifindex) die("if_nametoindex");
    uint8_t dmac[6];
    if (sscanf(argv[2], "%hhx:%hhx:%hhx:%hhx:%hhx:%hhx", &dmac[0], &dmac[1], &dmac[2], &dmac[3],
               &dmac[4], &dmac[5]) != 6) {
        fprintf(stderr, "afxdp_tx: bad MAC %s\n", argv[2]);
        return 2;
    }
    struct in_addr sip, dip;
    if (!inet_aton(argv[3], &sip) || !inet_aton(argv[4], &dip)) {
        fprintf(stderr, "afxdp_tx: bad IPv4 address\n");
        return 2;
    }
    int port = atoi(argv[5]);
    long payload = atol(argv[6]);
    long count = atol(argv[7]);
    int zerocopy = argc > 8 && !strcmp(argv[8], "zerocopy");
    long flen = sizeof(struct ethhdr) + sizeof(struct iphdr) + sizeof(struct udphdr) + payload;
    if (payload < 1 || flen > FRAME_SIZE || count < 1 || port < 1 || port > 65535) {
        fprintf(stderr, "afxdp_tx: payload 1..%ld bytes, count >= 1, port 1..65535\n",
                (long)(FRAME_SIZE - sizeof(struct ethhdr) - sizeof(struct iphdr) - sizeof(struct udphdr)));
        return 2;
    }

    int fd = socket(AF_XDP, SOCK_RAW, 0);
    if (fd < 0) die("socket(AF_XDP)");
    uint8_t *umem = mmap(NULL, (size_t)FRAMES * FRAME_SIZE, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (umem == MAP_FAILED) die("mmap umem");
    struct xdp_umem_reg mr = {.addr = (uintptr_t)umem, .len = (uint64_t)FRAMES * FRAME_SIZE,
                              .chunk_size = FRAME_SIZE, .headroom = 0};
    if (setsockopt(fd, SOL_XDP, XDP_UMEM_REG, &mr, sizeof(mr))) die("XDP_UMEM_REG");
    int n = RING;
    if (setsockopt(fd, SOL_XDP, XDP_UMEM_FILL_RING, &n, sizeof(n))) die("XDP_UMEM_FILL_RING");
    if (setsockopt(fd, SOL_XDP, XDP_UMEM_COMPLETION_RING, &n, sizeof(n))) die("XDP_UMEM_COMPLETION_RING");
    if (setsockopt(fd, SOL_XDP, XDP_TX_RING, &n, sizeof(n))) die("XDP_TX_RING");
    struct xdp_mmap_offsets off;
    socklen_t ol = sizeof(off);
    if (getsockopt(fd, SOL_XDP, XDP_MMAP_OFFSETS, &off, &ol)) die("XDP_MMAP_OFFSETS");
    struct ring tx, cq;  /* the fill ring exists (bind wants it) but a TX-only socket never uses it */
    map_ring(fd, &off.tx, RING, sizeof(struct xdp_desc), XDP_PGOFF_TX_RING, &tx);
    map_ring(fd, &off.cr, RING, sizeof(uint64_t), XDP_UMEM_PGOFF_COMPLETION_RING, &cq);
    struct sockaddr_xdp sx = {.sxdp_family = AF_XDP, .sxdp_ifindex = ifindex, .sxdp_queue_id = 0,
                              .sxdp_flags = zerocopy ? XDP_ZEROCOPY : XDP_COPY};
    if (bind(fd, (struct sockaddr *)&sx, sizeof(sx))) die("bind");

    /* one frame, written into every chunk: Ethernet (source MAC: any unicast), IPv4, UDP (no
     * checksum: 0 is valid for IPv4 UDP) */
    uint8_t frame[FRAME_SIZE];
    memset(frame, 0, sizeof(frame));
    struct ethhdr *eth = (struct ethhdr *)frame;
    memcpy(eth->h_dest, dmac, 6);
    const uint8_t smac[6] = {0x02, 0, 0, 0, 0, 1};
    memcpy(eth->h_source, smac, 6);
    eth->h_proto = htons(ETH_P_IP);
    struct iphdr *ip = (struct iphdr *)(eth + 1);
    ip->version = 4;
    ip->ihl = 5;
    ip->ttl = 64;
    ip->protocol = IPPROTO_UDP;
    ip->tot_len = htons((uint16_t)(sizeof(struct iphdr) + sizeof(struct udphdr) + payload));
    ip->saddr = sip.s_addr;
    ip->daddr = dip.s_addr;
    ip->check = csum(ip, sizeof(*ip));
    struct udphdr *udp = (struct udphdr *)(ip + 1);
    udp->source = htons(40000);
    udp->dest = htons((uint16_t)port);
    udp->len = htons((uint16_t)(sizeof(struct udphdr) + payload));
    for (long i = 0; i < payload; i++) ((uint8_t *)(udp + 1))[i] = (uint8_t)i;
    for (int f = 0; f < FRAMES; f++) memcpy(umem + (size_t)f * FRAME_SIZE, frame, flen);

    /* free chunks: a stack of frame addresses */
    static uint64_t freel[FRAMES];
    int nfree = FRAMES;
    for (int f = 0; f < FRAMES; f++) freel[f] = (uint64_t)f * FRAME_SIZE;

    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    double t0 = now();
    long posted = 0, done = 0, kicks = 0, busy = 0;
    struct xdp_desc *td = tx.desc;
    uint64_t *cd = cq.desc;
    while (done < count) {
        uint32_t prod = *tx.producer;
        uint32_t cons = __atomic_load_n(tx.consumer, __ATOMIC_ACQUIRE);
        uint32_t room = RING - (prod - cons);
        long want = count - posted;
        uint32_t k = 0;
        while (k < room && k < want && nfree > 0) {
            td[(prod + k) & (RING - 1)] = (struct xdp_desc){.addr = freel[--nfree], .len = (uint32_t)flen};
            k++;
        }
        if (k) {
            __atomic_store_n(tx.producer, prod + k, __ATOMIC_RELEASE);
            posted += k;
        }
        if (sendto(fd, NULL, 0, MSG_DONTWAIT, NULL, 0) < 0) {
            if (errno != EAGAIN && errno != EBUSY && errno != ENOBUFS) die("sendto (kick)");
            busy++;
        }
        kicks++;
        uint32_t cp = __atomic_load_n(cq.producer, __ATOMIC_ACQUIRE), cc = *cq.consumer;
        for (; cc != cp; cc++) {
            freel[nfree++] = cd[cc & (RING - 1)];
            done++;
        }
        __atomic_store_n(cq.consumer, cc, __ATOMIC_RELEASE);
    }
    double wall = now() - t0;
    getrusage(RUSAGE_SELF, &r1);
    double user = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) + (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) * 1e-6;
    double sys = (r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) + (r1.ru_stime.tv_usec - r0.ru_stime.tv_usec) * 1e-6;
    printf("{\"packets\": %ld, \"frame_bytes\": %ld, \"wall_s\": %.6f, \"user_s\": %.6f, \"sys_s\": %.6f, "
           "\"kicks\": %ld, \"kicks_busy\": %ld, \"mode\": \"%s\"}\n",
           done, flen, wall, user, sys, kicks, busy, zerocopy ? "zerocopy" : "copy");
    return 0;
}
