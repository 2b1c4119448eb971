// FlashMask on the score tiles of the sm80 kernels (common/flashmask.h has the representation):
// one CTA's place in the normalized bounds and key-block summaries (its batch row and mask head),
// the class of a (query rows, key block) pair, and the elementwise interval mask.
//
// The view itself stays in the kernel parameters (FlashMaskView, constant memory) and a CTA keeps
// nothing of it in registers: its key loop is short of them.
#pragma once
#include <cute/tensor.hpp>
#include <cmath>
#include <cstdint>

#include "common/flashmask.h"

namespace flash_ext {

// blockIdx.y / .z read anew at each use: what the kernels derive from them here is then
// recomputed where needed rather than held in registers through the key loop.
__device__ __forceinline__ int fm_ctaid_y() {
  int v;
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(v));
  return v;
}
__device__ __forceinline__ int fm_ctaid_z() {
  int v;
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(v));
  return v;
}

// A CTA of grid (query blocks, query heads, batch) and its batch row's and mask head's bounds and
// summaries, located from the kernel parameters at each use (nothing held across the loop).
template <int kBlockN>
struct FlashMaskTile {
  const FlashMaskView& v;    // the kernel parameters' (constant memory)
  const int* cu_seqlens_k;   // nullptr when not varlen

  // The summaries must be made for kBlockN (the host checks; sm80/fwd_launch.cuh) and fit int32
  // indices (api/flashmask.cpp checks).
  __device__ __forceinline__ int mask_head() const { return fm_ctaid_y() / v.group; }

  // kFmSkip / kFmFull / kFmPartial of query rows [r0, r1) (within the sequence) and key block n.
  __device__ __forceinline__ int classify(int n_block, int r0, int r1) const {
    const int kbs0 = int(2 * (mask_head() * v.kbs_head_stride + fm_blk0(v, cu_seqlens_k, fm_ctaid_z())));
    const int4* s = v.kbs + kbs0 + 2 * n_block;
    return fm_classify(__ldg(s), __ldg(s + 1), r0, r1);
  }

  // Sets the masked scores of key block n_block to -inf. `scores` is a (rows, cols) view of an
  // accumulator fragment and `coords` the same view of an identity tensor over the tile (as in
  // BlockMask::apply); row0: the tile's first query row within the sequence. One bounds load per
  // column the thread holds.
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(TensorS& scores, const TensorC& coords, int row0, int n_block) const {
    using namespace cute;
    const int nb0 = int(mask_head() * v.nb_head_stride + fm_col0(v, cu_seqlens_k, fm_ctaid_z()));
    const int4* cols = v.nb + nb0 + n_block * kBlockN;
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
