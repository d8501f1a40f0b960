/* Header parsing helpers in the xdp-tutorial style: one small inline parse_<hdr>() per header,
 * advancing a cursor, with a bounds check before every access. Each returns the next protocol
 * (or a length) and -1 when the header does not fit in the frame. */
#ifndef DOSA_PARSE_H
#define DOSA_PARSE_H

#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include "dosa_wire.h"

/* dosa_ntohs/dosa_ntohl/dosa_htons come with the generated dosa_wire.h. */

#define DOSA_IP_MF 0x2000
#define DOSA_IP_OFFSET 0x1FFF

struct hdr_cursor {
	void *pos;
};

static __always_inline int parse_ethhdr(struct hdr_cursor *nh, void *data_end, struct ethhdr **ethhdr)
{
	struct ethhdr *eth = nh->pos;

	if ((void *)(eth + 1) > data_end)
		return -1;
	nh->pos = eth + 1;
	*ethhdr = eth;
	return eth->h_proto; /* network order */
}

static __always_inline int parse_iphdr(struct hdr_cursor *nh, void *data_end, struct iphdr **iphdr)
{
	struct iphdr *iph = nh->pos;
	int hdrsize;

	if ((void *)(iph + 1) > data_end)
		return -1;
	if (iph->version != 4 || iph->ihl < 5)
		return -1;
	hdrsize = iph->ihl * 4;
	if (nh->pos + hdrsize > data_end)
		return -1;
	nh->pos += hdrsize;
	*iphdr = iph;
	return iph->protocol;
}

/* Returns the UDP length field (header included) or -1. */
static __always_inline int parse_udphdr(struct hdr_cursor *nh, void *data_end, struct udphdr **udphdr)
{
	struct udphdr *h = nh->pos;

	if ((void *)(h + 1) > data_end)
		return -1;
	nh->pos = h + 1;
	*udphdr = h;
	return dosa_ntohs(h->len);
}

static __always_inline int parse_dosahdr(struct hdr_cursor *nh, void *data_end, struct dosa_hdr **dosahdr)
{
	struct dosa_hdr *h = nh->pos;

	if ((void *)(h + 1) > data_end)
		return -1;
	nh->pos = h + 1;
	*dosahdr = h;
	return h->type;
}

#endif /* DOSA_PARSE_H */
