// Flash-Decoding's merge of the splits, inside the decode kernel: the CTA of a tile's splits that
// finishes last merges them (no second kernel, whose launch and dependent reads cost more than the
// merge itself at small batches: 7 us of a 30 us call at 1 x 8k keys on an H100).
//
// Each split writes its rows' normalized fp32 output and lse to the partials (DecodeParams), then
// counts itself in the tile's arrival counter; the CTA that makes the count num_splits merges, by
// log-sum-exp (common/combine.h), and sets the counter back to 0 for the next call. The partials
// are read through L2 only (ld.global.cg): another SM wrote them during this launch, and this SM's
// L1 may hold an older copy of their lines. Splits are added in split order: the result does not
// depend on which split finished last.
#pragma once
#include <cmath>

#include "common/combine.h"
#include "decode/decode_params.h"

namespace flash_ext::decode {

// After this CTA's partial stores: true in every thread of the CTA that arrived last. Every thread
// of the CTA must call it (it synchronises the CTA).
__device__ __forceinline__ bool arrived_last(const DecodeParams& p, int tile) {
  __shared__ int last;
  __threadfence();  // this thread's partial stores are visible device-wide before the count
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(p.split_arrivals + tile, 1) == p.num_splits - 1;
  __syncthreads();
  if (last) __threadfence();  // the other splits' stores are seen after their counts
  return last;
}

// The merged output of one (batch, query head, token) row, kCols adjacent columns from col0, to
// dst (kernel head dim kHeadDim; columns past p.head_dim are not written), and its lse when
// write_lse. Rows no split saw a key of get 0 and lse -inf.
template <int kHeadDim, int kCols, typename Element>
__device__ __forceinline__ void merge_row_splits(const DecodeParams& p, int64_t lse_row, Element* dst, int col0,
                                                 bool write_lse) {
  static_assert(kCols % 8 == 0, "whole 16-byte output vectors");
  const int64_t split_rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const int splits = p.num_splits;
  const float* lse_part = p.lse_partial + lse_row;
  float lse_max = -INFINITY;
#pragma unroll 8
  for (int s = 0; s < splits; ++s) lse_max = fmaxf(lse_max, __ldcg(lse_part + s * split_rows));

  float acc[kCols];
#pragma unroll
  for (int j = 0; j < kCols; ++j) acc[j] = 0.f;
  float weight_sum = 0.f;
  const float* part = p.o_partial + lse_row * kHeadDim + col0;
  const int64_t split_stride = split_rows * kHeadDim;
#pragma unroll(kCols > 16 ? 1 : 4)
  for (int s = 0; s < splits; ++s) {
    const float w = combine::lse_part_weight(__ldcg(lse_part + s * split_rows), lse_max);  // 0: empty split
    weight_sum += w;
    const float4* x = reinterpret_cast<const float4*>(part + s * split_stride);
#pragma unroll
    for (int j = 0; j < kCols / 4; ++j) {
      const float4 v = __ldcg(x + j);
      acc[4 * j] += w * v.x, acc[4 * j + 1] += w * v.y, acc[4 * j + 2] += w * v.z, acc[4 * j + 3] += w * v.w;
    }
  }
  const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
#pragma unroll
  for (int c = 0; c < kCols; c += 8) {
    if (col0 + c >= p.head_dim) break;
    uint4 packed;
    Element* e = reinterpret_cast<Element*>(&packed);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = Element(acc[c + i] * inv);
    *reinterpret_cast<uint4*>(dst + col0 + c) = packed;
  }
  if (write_lse) p.lse[lse_row] = combine::merged_lse(lse_max, weight_sum);
}

}  // namespace flash_ext::decode
