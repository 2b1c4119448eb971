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
