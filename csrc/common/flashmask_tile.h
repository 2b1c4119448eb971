// FlashMask on the score tiles of the sm80 kernels (common/flashmask.h has the representation):
// one CTA's place in the normalized bounds and key-block summaries (its batch row and mask head),
// the class of a (query rows, key block) pair, and the elementwise interval mask.
//
// The view itself stays in the kernel parameters (FlashMaskView, constant memory); a CTA keeps
// two int32 offsets only, since it carries them through a key loop that is short of registers.
#pragma once
#include <cute/tensor.hpp>
#include <cmath>
#include <cstdint>

#include "common/flashmask.h"

namespace flash_ext {

template <int kBlockN>
struct FlashMaskTile {
  int nb0 = 0;   // int4 index in v.nb of column 0 of this sequence, this mask head
  int kbs0 = 0;  // int4 index in v.kbs of key block 0's summary pair, ditto

  FlashMaskTile() = default;
  // cu_seqlens_k: nullptr when not varlen. The summaries must be made for kBlockN (the host
  // checks; sm80/fwd_launch.cuh) and fit int32 indices (api/flashmask.cpp checks).
  __device__ __forceinline__ FlashMaskTile(const FlashMaskView& v, const int* cu_seqlens_k, int batch, int mask_head)
      : nb0(int(mask_head * v.nb_head_stride + fm_col0(v, cu_seqlens_k, batch))),
        kbs0(int(2 * (mask_head * v.kbs_head_stride + fm_blk0(v, cu_seqlens_k, batch)))) {}

  // kFmSkip / kFmFull / kFmPartial of query rows [r0, r1) (within the sequence) and key block n.
  __device__ __forceinline__ int classify(const FlashMaskView& v, int n_block, int r0, int r1) const {
    const int4* s = v.kbs + kbs0 + 2 * n_block;
    return fm_classify(__ldg(s), __ldg(s + 1), r0, r1);
  }

  // For a block the walk visits (not kFmSkip): whether the intervals may touch rows [r0, r1),
  // i.e. kFmPartial rather than kFmFull. Reads the full half of the summary only.
  __device__ __forceinline__ bool touches(const FlashMaskView& v, int n_block, int r0, int r1) const {
    const int4 full = __ldg(v.kbs + kbs0 + 2 * n_block + 1);  // (ls_min, le_max, us_min, ue_max)
    return !((full.x >= r1 || full.y <= r0) && (full.z >= r1 || full.w <= r0));
  }

  // Sets the masked scores of key block n_block to -inf. `scores` is a (rows, cols) view of an
  // accumulator fragment and `coords` the same view of an identity tensor over the tile (as in
  // BlockMask::apply); row0: the tile's first query row within the sequence. The two intervals
  // in two passes, each reading one half (int2) of the column's bounds: half the registers.
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(const FlashMaskView& v, TensorS& scores, const TensorC& coords, int row0,
                                        int n_block) const {
    using namespace cute;
    const int2* cols = reinterpret_cast<const int2*>(v.nb + nb0 + n_block * kBlockN);
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {  // (ls, le - ls), then (us, ue - us)
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const int2 b = __ldg(cols + 2 * get<1>(coords(0, c)) + half);
        CUTE_UNROLL
        for (int r = 0; r < size<0>(scores); ++r) {
          if (unsigned(row0 + get<0>(coords(r, 0)) - b.x) < unsigned(b.y)) scores(r, c) = -INFINITY;
        }
      }
    }
  }
};

}  // namespace flash_ext
