// FlashMask on the score tiles of the sm80 kernels (common/flashmask.h has the representation):
// one CTA's view of its batch row's and mask head's normalized bounds and key-block summaries,
// the class of a (query rows, key block) pair, and the elementwise interval mask.
#pragma once
#include <cute/tensor.hpp>
#include <cmath>

#include "common/flashmask.h"

namespace flash_ext {

template <int kBlockN>
struct FlashMaskTile {
  const int4* nb = nullptr;   // column 0 of this sequence, this mask head
  const int4* kbs = nullptr;  // summary pair of key block 0 of this sequence, this mask head

  FlashMaskTile() = default;
  // cu_seqlens_k: nullptr when not varlen. The summaries must be made for kBlockN (the host's
  // choice of block size matches the kernel's; see sm80/fwd_launch.cuh).
  __device__ __forceinline__ FlashMaskTile(const FlashMaskView& v, const int* cu_seqlens_k, int batch,
                                           int mask_head)
      : nb(v.nb + mask_head * v.nb_head_stride + fm_col0(v, cu_seqlens_k, batch)),
        kbs(v.kbs + 2 * (mask_head * v.kbs_head_stride + fm_blk0(v, cu_seqlens_k, batch))) {}

  // kFmSkip / kFmFull / kFmPartial of query rows [r0, r1) (within the sequence) and key block n.
  __device__ __forceinline__ int classify(int n_block, int r0, int r1) const {
    return fm_classify(__ldg(kbs + 2 * n_block), __ldg(kbs + 2 * n_block + 1), r0, r1);
  }

  // Sets the masked scores of key block n_block to -inf. `scores` is a (rows, cols) view of an
  // accumulator fragment and `coords` the same view of an identity tensor over the tile (as in
  // BlockMask::apply); row0: the tile's first query row within the sequence. One bounds load per
  // column the thread holds.
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(TensorS& scores, const TensorC& coords, int row0, int n_block) const {
    using namespace cute;
    const int4* cols = nb + n_block * kBlockN;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) {
      const int4 b = __ldg(cols + get<1>(coords(0, c)));
      CUTE_UNROLL
      for (int r = 0; r < size<0>(scores); ++r) {
        if (fm_masked(b, row0 + get<0>(coords(r, 0)))) scores(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace flash_ext
