/* GENERATED from dataplane/layout.py by `python -m dataplane.gen_headers`; do not edit
 * (tests/unit/test_generated_headers.py fails when it is stale). */
#ifndef DOSA_LAYOUT_H
#define DOSA_LAYOUT_H

#define DOSA_SCALE_TAG_BIAS 256
#define DOSA_BUF_SUMS 65536
#define DOSA_LIST_WORDS 4096
#define DOSA_MAX_SHARDS 8
#define DOSA_SUM_LIMIT 2147483647LL
#define DOSA_TOUCHED_SORTED (1ULL << 60)
#define DOSA_TOUCHED_WRITING (1ULL << 61)
#define DOSA_TOUCHED_COMPACT (1ULL << 62)
#define DOSA_TOUCHED_ZEROED (1ULL << 63)

#endif /* DOSA_LAYOUT_H */
