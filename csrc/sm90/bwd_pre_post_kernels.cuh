// The Hopper backward's kernels around the main one (sm90/bwd_kernel.cuh; docs/kernels-sm90-bwd.md):
//   bwd_preprocess_kernel  D = rowsum(dO * O) and lse * log2(e) per query row, written into
//                          buffers padded to a multiple of kBlockM rows (pad: D = 0, lse = +inf,
//                          so padded rows give P = 0 and need no mask), and the layout the
//                          main kernel bulk-copies (16-byte aligned rows); zeroes dq_accum.
//   bwd_dq_convert_kernel  dq (input dtype) = softmax_scale * the fp32 dq_accum tiles (the main
//                          kernel's dS leaves the scale out).
// and the dq_accum tile layout that the main kernel's dQ reductions and the convert kernel share.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <cmath>

#include "params.h"
#include "common/pdl.h"

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

// dQ_i += dS K in fp32: a consumer thread adds its dQ accumulators to its slots of the tile, four
// values per reduction. No predicate: the buffer has padded rows and kHeadDim columns, and whatever
// lands past seqlen_q or head_dim is never read (it is 0 anyway: P = 0 on padded rows, K's columns
// past head_dim load as 0).
template <typename Traits, typename Acc>
__device__ __forceinline__ void dq_accum_add(float* dq_tile, const Acc& acc_dq, int thread) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += 4) {
    float* dst = dq_tile + dq_accum_slot<Traits>(i, thread);
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(acc_dq(i)), "f"(acc_dq(i + 1)),
                 "f"(acc_dq(i + 2)), "f"(acc_dq(i + 3))
                 : "memory");
  }
}

// Varlen: the padded buffers are (heads_q, seqlen_q_padded) rows (x kernel head dim for
// dq_accum) and sequence b's rows of a head start at this row, a multiple of 128; the next
// sequence's start at least round_up(its seqlen_q, 128) rows later, so every query block of b
// stays inside b's rows. seqlen_q_padded = round_up(total_q + 128 * batch, 128) holds them all.
__device__ __forceinline__ int64_t varlen_padded_row0(const int* cu_seqlens_q, int batch) {
  return (int64_t(cu_seqlens_q[batch]) + 128 * int64_t(batch)) / 128 * 128;
}

// D = rowsum(dO * O) over the real head dim, and lse in log2 units, into the padded buffers.
// kHeadDim / 8 threads per row, 16 bytes of O and dO each (a d = 64 row is 8 threads: a warp per
// row left 3/4 of the lanes idle); rows past seqlen_q (up to the padding) get D = 0, lse = +inf.
// Rows that see no key (lse = -inf, output 0) also get lse = +inf: P = exp2(s - inf) = 0, never
// NaN. The threads also zero their row's kHeadDim floats of dq_accum, so no separate memset runs.
// kVarlen: (batch, row) is row `row` of sequence `batch` (rows from cu_seqlens_q[batch] in o, dO
// and lse); the grid covers the longest sequence, and a CTA past round_up(seqlen_q, 128) rows of
// its sequence exits (kRowsPerCta divides 128: whole CTAs, as at the fixed-length padding).
template <typename Element, int kHeadDim, bool kVarlen>
__global__ void __launch_bounds__(256) bwd_preprocess_kernel(const __grid_constant__ BwdParams p, float* lse_log2,
                                                             float* dsum, int seqlen_q_padded) {
  constexpr int kThreadsPerRow = kHeadDim / 8;
  static_assert(kThreadsPerRow <= 32 && 32 % kThreadsPerRow == 0, "a row's threads are lanes of one warp");
  constexpr int kRowsPerCta = 256 / kThreadsPerRow;
  pdl_launch_dependents();  // the main kernel's launch and prologue overlap the last wave (common/pdl.h)
  const int head = blockIdx.y, batch = blockIdx.z;
  const int t = threadIdx.x % kThreadsPerRow;
  const int row = blockIdx.x * kRowsPerCta + threadIdx.x / kThreadsPerRow;
  const int q_start = kVarlen ? p.cu_seqlens_q[batch] : 0;
  const int seqlen_q = kVarlen ? p.cu_seqlens_q[batch + 1] - q_start : p.seqlen_q;
  if (row >= (kVarlen ? (seqlen_q + 127) / 128 * 128 : seqlen_q_padded)) return;
  const int64_t out = kVarlen ? int64_t(head) * seqlen_q_padded + varlen_padded_row0(p.cu_seqlens_q, batch) + row
                              : (int64_t(batch) * p.heads_q + head) * seqlen_q_padded + row;
  float4* dqa_row = reinterpret_cast<float4*>(p.dq_accum + out * kHeadDim);
  dqa_row[2 * t] = make_float4(0.f, 0.f, 0.f, 0.f);
  dqa_row[2 * t + 1] = make_float4(0.f, 0.f, 0.f, 0.f);
  float acc = 0.f;
  if (row < seqlen_q && t * 8 < p.head_dim) {  // head_dim is a multiple of 8 (checked on the host)
    // Varlen: no batch stride, the sequence's rows start at q_start.
    const int64_t o_seq = kVarlen ? int64_t(q_start) * p.o_row_stride : batch * p.o_batch_stride;
    const int64_t do_seq = kVarlen ? int64_t(q_start) * p.do_row_stride : batch * p.do_batch_stride;
    const Element* o_row = static_cast<const Element*>(p.o) + o_seq + head * p.o_head_stride +
                           int64_t(row) * p.o_row_stride;
    const Element* do_row = static_cast<const Element*>(p.dout) + do_seq +
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
    if (row < seqlen_q) {
      // lse: (batch, heads, seqlen_q) or varlen (heads, total_q).
      const int64_t lse_seq = kVarlen ? int64_t(q_start) : batch * p.lse_batch_stride;
      const float lse = p.lse[lse_seq + head * p.lse_head_stride + row];
      lse_log2[out] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
      dsum[out] = acc;
    } else {
      lse_log2[out] = INFINITY;
      dsum[out] = 0.f;
    }
  }
}

// Varlen: zeroes head `head`'s rows of dq outside every sequence (before cu_seqlens_q[0] and from
// cu_seqlens_q[batch] to total_q: a packed tensor may hold tokens of no sequence, and dq is
// allocated uninitialized), as the sm80 path's zeroed dq_accum leaves them. The CTAs
// (part, head) for part in [0, parts) share the rows.
template <typename Element, int kThreads>
__device__ __forceinline__ void zero_dq_outside_sequences(const BwdParams& p, int head, int part, int parts) {
  const int before = p.cu_seqlens_q[0], after = p.cu_seqlens_q[p.batch];
  const int rows = before + (p.total_q - after);
  const bool vec = p.head_dim % 8 == 0;
  const int per_row = vec ? p.head_dim / 8 : p.head_dim;  // 16-byte chunks, or elements
  const int lanes = min(per_row, kThreads), rows_per_pass = kThreads / lanes;
  const int lane = threadIdx.x % lanes, r0 = threadIdx.x / lanes;
  if (r0 >= rows_per_pass) return;
  Element* dst = static_cast<Element*>(p.dq) + head * p.dq_head_stride;
  for (int64_t r = part * rows_per_pass + r0; r < rows; r += parts * rows_per_pass) {
    Element* row = dst + (r < before ? r : after + (r - before)) * p.dq_row_stride;
    for (int i = lane; i < per_row; i += lanes) {
      if (vec) {
        *reinterpret_cast<uint4*>(row + i * 8) = make_uint4(0u, 0u, 0u, 0u);
      } else {
        row[i] = Element(0.f);
      }
    }
  }
}

// dq = softmax_scale * dq_accum in the input dtype: one CTA per (query block, head, batch). Each
// thread reads its own fragment's slots (coalesced 16-byte loads), places the values by their (row, col) in a
// shared-memory tile, and the CTA writes the rows < seqlen_q, columns < head_dim out with 16-byte
// stores (element by element when head_dim is not a multiple of 8). kVarlen: the grid covers the
// longest sequence plus one column of CTAs; a query block past its sequence exits, the others
// write the sequence's rows; the extra column's CTAs zero the rows outside every sequence
// (zero_dq_outside_sequences).
template <typename Traits, bool kVarlen>
__global__ void __launch_bounds__(Traits::kMmaThreads) bwd_dq_convert_kernel(const __grid_constant__ BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kCols = kHeadDim + 8;  // + 16 bytes: consecutive rows start in different banks
  __shared__ alignas(16) Element tile[kBlockM * kCols];
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x;
  pdl_wait();  // launched while the main kernel's last CTAs run
  if constexpr (kVarlen) {
    if (m_block == int(gridDim.x) - 1) {  // the extra column
      zero_dq_outside_sequences<Element, Traits::kMmaThreads>(p, head, batch, int(gridDim.z));
      return;
    }
  }
  const int q_start = kVarlen ? p.cu_seqlens_q[batch] : 0;
  const int seqlen_q = kVarlen ? p.cu_seqlens_q[batch + 1] - q_start : p.seqlen_q;
  if (kVarlen && m_block * kBlockM >= seqlen_q) return;  // the whole CTA, before its barrier
  typename Traits::TiledMmaDQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor cdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  const int64_t src_row0 = kVarlen ? int64_t(head) * p.seqlen_q_padded + varlen_padded_row0(p.cu_seqlens_q, batch)
                                   : (int64_t(batch) * p.heads_q + head) * p.seqlen_q_padded;
  const float* src = p.dq_accum + (src_row0 + int64_t(m_block) * kBlockM) * kHeadDim;
  CUTE_UNROLL
  for (int i = 0; i < size(cdQ); i += 4) {
    const float4 v = *reinterpret_cast<const float4*>(src + dq_accum_slot<Traits>(i, tid));
    const float sc = p.softmax_scale;
    const float vals[4] = {v.x * sc, v.y * sc, v.z * sc, v.w * sc};
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
  const int rows = min(kBlockM, seqlen_q - m_block * kBlockM);
  const int64_t dst_seq = kVarlen ? int64_t(q_start) * p.dq_row_stride : batch * p.dq_batch_stride;
  Element* dst = static_cast<Element*>(p.dq) + dst_seq + head * p.dq_head_stride +
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
