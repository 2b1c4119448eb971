// The Hopper backward's kernels around the main one (sm90/bwd_kernel.cuh; docs/kernels-sm90-bwd.md):
//   bwd_preprocess_kernel  D = rowsum(dO * O) and lse * log2(e) per query row, written into
//                          buffers padded to a multiple of kBlockM rows (pad: D = 0, lse = +inf,
//                          so padded rows give P = 0 and need no mask), and the layout the
//                          main kernel bulk-copies (16-byte aligned rows); zeroes dq_accum.
//   bwd_dq_convert_kernel  dq (input dtype) from the fp32 dq_accum tiles.
// and the dq_accum tile layout that the main kernel's dQ reductions and the convert kernel share.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <cmath>

#include "params.h"

namespace flash_ext::sm90 {

using namespace cute;

// dq_accum layout. The dQ tile of query block m of (batch, head) is kBlockM x kHeadDim floats at
// ((batch * heads_q + head) * seqlen_q_padded + m * kBlockM) * kHeadDim, stored in the order of
// the dQ GEMM's accumulator fragments rather than by rows: value i of consumer thread t sits at
// slot ((i / 4) * kMmaThreads + t) * 4 + i % 4. A warp's 16-byte reductions (red.v4) then cover
// 512 contiguous bytes (row order would scatter them over 8 rows); bwd_dq_convert_kernel undoes
// the permutation with the same fragment coordinates.
template <typename Traits>
__device__ __forceinline__ int dq_accum_slot(int i, int thread) {
  return ((i / 4) * Traits::kMmaThreads + thread) * 4 + i % 4;
}

// D = rowsum(dO * O) over the real head dim, and lse in log2 units, into the padded buffers.
// kHeadDim / 8 threads per row, 16 bytes of O and dO each (a d = 64 row is 8 threads: a warp per
// row left 3/4 of the lanes idle); rows past seqlen_q (up to the padding) get D = 0, lse = +inf.
// Rows that see no key (lse = -inf, output 0) also get lse = +inf: P = exp2(s - inf) = 0, never
// NaN. The threads also zero their row's kHeadDim floats of dq_accum, so no separate memset runs.
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(256) bwd_preprocess_kernel(const __grid_constant__ BwdParams p, float* lse_log2,
                                                             float* dsum, int seqlen_q_padded) {
  constexpr int kThreadsPerRow = kHeadDim / 8;
  static_assert(kThreadsPerRow <= 32 && 32 % kThreadsPerRow == 0, "a row's threads are lanes of one warp");
  constexpr int kRowsPerCta = 256 / kThreadsPerRow;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int t = threadIdx.x % kThreadsPerRow;
  const int row = blockIdx.x * kRowsPerCta + threadIdx.x / kThreadsPerRow;
  if (row >= seqlen_q_padded) return;
  const int64_t out = (int64_t(batch) * p.heads_q + head) * seqlen_q_padded + row;
  float4* dqa_row = reinterpret_cast<float4*>(p.dq_accum + out * kHeadDim);
  dqa_row[2 * t] = make_float4(0.f, 0.f, 0.f, 0.f);
  dqa_row[2 * t + 1] = make_float4(0.f, 0.f, 0.f, 0.f);
  float acc = 0.f;
  if (row < p.seqlen_q && t * 8 < p.head_dim) {  // head_dim is a multiple of 8 (checked on the host)
    const Element* o_row = static_cast<const Element*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride +
                           int64_t(row) * p.o_row_stride;
    const Element* do_row = static_cast<const Element*>(p.dout) + batch * p.do_batch_stride +
                            head * p.do_head_stride + int64_t(row) * p.do_row_stride;
    const uint4 a = *reinterpret_cast<const uint4*>(o_row + t * 8);
    const uint4 b = *reinterpret_cast<const uint4*>(do_row + t * 8);
    const Element* ea = reinterpret_cast<const Element*>(&a);
    const Element* eb = reinterpret_cast<const Element*>(&b);
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) acc += float(ea[i]) * float(eb[i]);
  }
  CUTE_UNROLL
  for (int s = kThreadsPerRow / 2; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffff, acc, s);
  if (t == 0) {
    if (row < p.seqlen_q) {
      const float lse = p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + row];
      lse_log2[out] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
      dsum[out] = acc;
    } else {
      lse_log2[out] = INFINITY;
      dsum[out] = 0.f;
    }
  }
}

// dq = dq_accum in the input dtype: one CTA per (query block, head, batch). Each thread reads its
// own fragment's slots (coalesced 16-byte loads), places the values by their (row, col) in a
// shared-memory tile, and the CTA writes the rows < seqlen_q, columns < head_dim out with 16-byte
// stores (element by element when head_dim is not a multiple of 8).
template <typename Traits>
__global__ void __launch_bounds__(Traits::kMmaThreads) bwd_dq_convert_kernel(const __grid_constant__ BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kCols = kHeadDim + 8;  // + 16 bytes: consecutive rows start in different banks
  __shared__ alignas(16) Element tile[kBlockM * kCols];
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x;
  typename Traits::TiledMmaDQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor cdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  const float* src = p.dq_accum +
                     ((int64_t(batch) * p.heads_q + head) * p.seqlen_q_padded + int64_t(m_block) * kBlockM) * kHeadDim;
  CUTE_UNROLL
  for (int i = 0; i < size(cdQ); i += 4) {
    const float4 v = *reinterpret_cast<const float4*>(src + dq_accum_slot<Traits>(i, tid));
    const float vals[4] = {v.x, v.y, v.z, v.w};
    CUTE_UNROLL
    for (int e = 0; e < 4; e += 2) {  // values i + e, i + e + 1 are adjacent columns of one row
      cutlass::Array<Element, 2> pair;
      pair[0] = Element(vals[e]);
      pair[1] = Element(vals[e + 1]);
      const int row = get<0>(cdQ(i + e)), col = get<1>(cdQ(i + e));
      *reinterpret_cast<cutlass::Array<Element, 2>*>(&tile[row * kCols + col]) = pair;
    }
  }
  __syncthreads();
  const int rows = min(kBlockM, p.seqlen_q - m_block * kBlockM);
  Element* dst = static_cast<Element*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride +
                 int64_t(m_block) * kBlockM * p.dq_row_stride;
  if (p.head_dim % 8 == 0) {
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
    const int chunks = p.head_dim / 8;
    for (int c = tid; c < rows * kChunks; c += Traits::kMmaThreads) {
      const int row = c / kChunks, chunk = c % kChunks;
      if (chunk < chunks) {
        *reinterpret_cast<uint4*>(dst + row * p.dq_row_stride + chunk * 8) =
            *reinterpret_cast<const uint4*>(&tile[row * kCols + chunk * 8]);
      }
    }
  } else {
    for (int c = tid; c < rows * kHeadDim; c += Traits::kMmaThreads) {
      const int row = c / kHeadDim, col = c % kHeadDim;
      if (col < p.head_dim) dst[row * p.dq_row_stride + col] = tile[row * kCols + col];
    }
  }
}

}  // namespace flash_ext::sm90
