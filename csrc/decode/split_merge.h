// Flash-Decoding's merge of the splits, inside the decode kernel: the CTA of a tile's splits that
// finishes last merges them (no second kernel, whose launch and dependent reads cost more than the
// merge itself at small batches: 7 us of a 30 us call at 1 x 8k keys on an H100).
//
// Each split writes its rows' normalized fp32 output and lse to the partials (DecodeParams), then
// counts itself in the tile's arrival counter; the CTA that makes the count num_splits merges, by
// log-sum-exp (common/combine.h), with all its threads (a tile has few valid rows: 4 at GQA 32/8
// and one token), and sets the counter back to 0 for the next call. The partials
// are read through L2 only (ld.global.cg): another SM wrote them during this launch, and this SM's
// L1 may hold an older copy of their lines. Splits are added in split order: the result does not
// depend on which split finished last.
#pragma once
#include <cmath>

#include "common/combine.h"
#include "decode/decode_params.h"

namespace flash_ext::decode {

// After this CTA's partial stores: true in every thread of the CTA that arrived last. Every thread
// of the CTA must call it (it synchronises the CTA). One acquire-release atomic of thread 0 does
// what a fence in every thread, the atomic and the last CTA's second fence did: the barrier
// orders the CTA's stores before it (release is cumulative), and the barrier after it orders the
// CTA's later loads after the other splits' counts (acquire), as CUTLASS's semaphores and
// cooperative groups' grid sync do. A `__threadfence()` is a sequentially consistent fence
// (MEMBAR.SC.GPU), on the call's critical path twice in the split that arrives last.
__device__ __forceinline__ bool arrived_last(const DecodeParams& p, int tile) {
  __shared__ int last;
  __syncthreads();  // every thread's partial stores happen before thread 0's release
  if (threadIdx.x == 0) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(p.split_arrivals + tile) : "memory");
    last = old == p.num_splits - 1;
  }
  __syncthreads();  // the other splits' stores (acquired by thread 0) happen before every thread's loads
  return last;
}

// Merges the splits of a tile's `rows` rows (all threads of the CTA call it, nthreads of them):
// row r's lse index is lse_row(r) and its output row starts at out_row(r). First every (row,
// split) lse in one round of loads into `weights` (shared, rows x num_splits floats), turned into
// weights by the row's max and normalized by their sum; then each thread takes (row, 4 columns)
// items and adds the splits' parts, several splits' loads in flight. Rows no split saw a key get
// 0 and lse -inf.
template <int kHeadDim, typename Element, typename LseRow, typename OutRow>
__device__ __forceinline__ void merge_tile_splits(const DecodeParams& p, int rows, LseRow lse_row, OutRow out_row,
                                                  float* weights, int nthreads) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int splits = p.num_splits;
  const int64_t split_rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  constexpr int kQuads = kHeadDim / 4;
  const int64_t split_stride = split_rows * kHeadDim;
  auto parts_of = [&](int i) {  // item i = (row, 4 columns): its split 0 part
    return reinterpret_cast<const float4*>(p.o_partial + lse_row(i / kQuads) * kHeadDim + (i % kQuads) * 4);
  };
  // The thread's first item's parts of the first kEarly splits are loaded now, in flight with the
  // lse loads and the weights (they do not depend on them): the merge's tail then waits on one
  // round of L2 loads instead of two (1 x 8k keys: 16 splits, one item per thread at d <= 128).
  constexpr int kEarly = 16;
  float4 early[kEarly];
  const bool has_early = tid < rows * kQuads && (tid % kQuads) * 4 < p.head_dim;
  if (has_early) {
    const float4* part = parts_of(tid);
#pragma unroll
    for (int s = 0; s < kEarly; ++s) {
      if (s < splits) early[s] = __ldcg(part + s * (split_stride / 4));
    }
  }
  for (int i = tid; i < rows * splits; i += nthreads) {
    const int r = i / splits, s = i % splits;
    weights[i] = __ldcg(p.lse_partial + s * split_rows + lse_row(r));
  }
  __syncthreads();
  // A warp per row: max, weights, their sum; the row's lse; the weights divided by the sum.
  for (int r = warp; r < rows; r += nthreads / 32) {
    float* w = weights + r * splits;
    float lse_max = -INFINITY;
    for (int s = lane; s < splits; s += 32) lse_max = fmaxf(lse_max, w[s]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffff, lse_max, o));
    float sum = 0.f;
    for (int s = lane; s < splits; s += 32) {
      w[s] = combine::lse_part_weight(w[s], lse_max);  // 0 for an empty split
      sum += w[s];
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int s = lane; s < splits; s += 32) w[s] *= inv;
    if (lane == 0) p.lse[lse_row(r)] = combine::merged_lse(lse_max, sum);
  }
  __syncthreads();
  for (int i = tid; i < rows * kQuads; i += nthreads) {
    const int r = i / kQuads, col = (i % kQuads) * 4;
    if (col >= p.head_dim) continue;
    const float* w = weights + r * splits;
    const float4* part = parts_of(i);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    int s0 = 0;
    if (i == tid) {  // the early item (has_early holds here)
#pragma unroll
      for (int s = 0; s < kEarly; ++s) {
        if (s < splits) {
          const float ws = w[s];
          acc.x += ws * early[s].x, acc.y += ws * early[s].y, acc.z += ws * early[s].z, acc.w += ws * early[s].w;
        }
      }
      s0 = kEarly;
    }
#pragma unroll 8
    for (int s = s0; s < splits; ++s) {
      const float4 v = __ldcg(part + s * (split_stride / 4));
      const float ws = w[s];
      acc.x += ws * v.x, acc.y += ws * v.y, acc.z += ws * v.z, acc.w += ws * v.w;
    }
    Element e[4] = {Element(acc.x), Element(acc.y), Element(acc.z), Element(acc.w)};
    *reinterpret_cast<uint2*>(out_row(r) + col) = *reinterpret_cast<const uint2*>(e);
  }
}

}  // namespace flash_ext::decode
