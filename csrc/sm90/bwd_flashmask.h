// FlashMask's per-score test on the Hopper backward's transposed score tile S^T (rows: the
// CTA's keys, columns: queries). The classification of query blocks (skip / full / partial) is
// the sm80 backward's (common/flashmask_bwd.h, FlashMaskKeyBlock): a backward CTA owns one key
// block, on either architecture.
#pragma once
#include <cute/tensor.hpp>
#include <cmath>

#include "common/flashmask.h"
#include "common/flashmask_bwd.h"

namespace flash_ext::sm90 {

// A key block's query-block classes as runs of m_block, for the consumers' loop: fm_classify
// over rows [m M, min(m M + M, seqlen_q)) of every query block m, rewritten from the summary pair
// as two runs of skipped blocks and two runs that need the per-score test. Built once per CTA
// (the fields CTA-uniform through redux.sync, so they sit in uniform registers), next_visible and
// partial are then a few compares with no load in the loop: the shared loads of the summary
// queued behind the step's wgmma operand reads (ncu: docs/perf-notes.md, "the classification's
// shared loads"). kEnabled false or no FlashMask: nothing skipped, nothing partial.
struct FlashMaskQueryRuns {
  int skip0 = 0, skip0_len = 0, skip1 = 0, skip1_len = 0;
  int part0 = 0, part0_len = 0, part1 = 0, part1_len = 0;

  // skip: (ls_max, le_min, us_max, ue_min), full: (ls_min, le_max, us_min, ue_max), all >= 0.
  __device__ __forceinline__ static FlashMaskQueryRuns build(int4 skip, int4 full, int block_m, int seqlen_q) {
    const int n_blocks = (seqlen_q + block_m - 1) / block_m;
    // Block m's r0 >= x from block ceil(x / M) on; its r1 <= e before block e / M (all if seqlen_q <= e);
    // its r1 > x from block x / M on (none if seqlen_q <= x).
    auto first_at = [&](int x) { return (x + block_m - 1) / block_m; };
    auto end_below = [&](int e) { return seqlen_q <= e ? n_blocks : e / block_m; };
    FlashMaskQueryRuns r;
    r.skip0 = first_at(skip.x);  // [ls_max, le_min) covers the rows
    r.skip0_len = max(end_below(skip.y) - r.skip0, 0);
    r.skip1 = first_at(skip.z);  // [us_max, ue_min) covers them, or UT then LT, touching
    r.skip1_len = max((skip.x <= skip.w ? max(end_below(skip.w), end_below(skip.y)) : end_below(skip.w)) - r.skip1, 0);
    r.part0 = full.x / block_m;  // rows of [ls_min, le_max) in the block
    r.part0_len = seqlen_q > full.x ? max(first_at(full.y) - r.part0, 0) : 0;
    r.part1 = full.z / block_m;  // rows of [us_min, ue_max) in the block
    r.part1_len = seqlen_q > full.z ? max(first_at(full.w) - r.part1, 0) : 0;
    return r;
  }
  // The CTA's runs (all threads of full warps): empty unless FlashMask is on.
  template <typename KeyBlock>
  __device__ __forceinline__ static FlashMaskQueryRuns of(const KeyBlock& fm, const int4* summary, int block_m) {
    FlashMaskQueryRuns r;
    if (fm.on()) {
      r = build(summary[0], summary[1], block_m, fm.seqlen_q);
      r.make_uniform();
    }
    return r;
  }
  __device__ __forceinline__ void make_uniform() {
    int* f[8] = {&skip0, &skip0_len, &skip1, &skip1_len, &part0, &part0_len, &part1, &part1_len};
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) *f[i] = __reduce_max_sync(0xffffffffu, *f[i]);
  }
  __device__ __forceinline__ static bool in(int m, int start, int len) { return unsigned(m - start) < unsigned(len); }
  // The first query block >= m that is not skipped (at most three jumps: the runs are two), capped at m_max.
  __device__ __forceinline__ int next_visible(int m, int m_max) const {
    if (in(m, skip0, skip0_len)) m = skip0 + skip0_len;
    if (in(m, skip1, skip1_len)) m = skip1 + skip1_len;
    if (in(m, skip0, skip0_len)) m = skip0 + skip0_len;
    return min(m, m_max);
  }
  // For a block next_visible returned: needs the per-score test.
  __device__ __forceinline__ bool partial(int m) const { return in(m, part0, part0_len) || in(m, part1, part1_len); }
};

// Masked scores of query block m_block to -inf. `st` in (key row, query column) order and
// `coords` the (key, query) tile coordinates of its elements, as mask_transposed takes them. A
// thread's rows are its own keys: one 16-byte read-only load per key row it holds (two per
// wgmma accumulator), then a compare per score against the columns' query indices.
template <typename KeyBlock, typename TensorS, typename TensorC>
__device__ __forceinline__ void flashmask_apply_transposed(const KeyBlock& fm, TensorS& st, const TensorC& coords,
                                                           int m_block, int block_m) {
  using namespace cute;
  const int row0 = m_block * block_m;
  const int4* bounds = fm.nb();
  CUTE_UNROLL
  for (int r = 0; r < size<0>(st); ++r) {
    // fm_masked's test with the intervals moved into tile columns: per score, a subtraction
    // from a per-row value and an unsigned compare, as mask_transposed's per-row bounds.
    const int4 b = __ldg(bounds + get<0>(coords(r, 0)));
    const int lt0 = b.x - row0, ut0 = b.z - row0;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(st); ++c) {
      const int col = get<1>(coords(0, c));
      if (unsigned(col - lt0) < unsigned(b.y) || unsigned(col - ut0) < unsigned(b.w)) st(r, c) = -INFINITY;
    }
  }
}

}  // namespace flash_ext::sm90
