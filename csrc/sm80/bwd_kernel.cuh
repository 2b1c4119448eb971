// FlashAttention-2 backward for sm80 and newer (mma.sync, ldmatrix, cp.async): the main kernel.
// D = rowsum(dO * O) comes first from sm80/bwd_preprocess.cuh; docs/kernels-sm80-bwd.md.
//
// Grid (key blocks, heads_q, batch), sequence-parallel over key blocks. A CTA keeps K_j, V_j in
// shared memory and walks the query blocks i that can see key block j (KeyBlockMask):
//   S  = Q_i K_j^T, P = exp(S * scale - lse)   (softcap: see below)
//   dV_j += P^T dO_i
//   dP = dO_i V_j^T, dS = P * (dP - D_i) * scale
//   dK_j += dS^T Q_i,  dQ_i += dS K_j  (fp32 atomics, or one slice per key block when deterministic)
// P and dS are staged in shared memory in the input dtype: the dV / dK GEMMs read them back
// transposed with ldmatrix.trans (P^T, dS^T as A operands), the dQ GEMM reads dS as is.
//
// kDropout (dropout_p > 0): the forward computed O = (P o Z) V with Z = keep / (1 - p)
// elementwise (common/dropout.h regenerates keep from the rng state). Then
//     dV += (P o Z)^T dO                        (sP holds P o Z)
//     dS  = P o (Z o (dO V^T) - D),  D = rowsum(dO o O)
// since dL/dP = Z o (dO V^T) and sum_k P_ik (dL/dP)_ik = dO_i . sum_k (P o Z)_ik V_k = dO_i . O_i.
// The keep decision is kept in the sign of P in registers (dropped: -P; P >= 0), so the mask is
// generated once per block.
//
// Two ways to feed the query blocks (kPrefetch), the same math and the same per-element
// operations (results identical up to the order of the dQ atomics):
//   bwd_kernel     one buffer: Q (with K, V on the first pass) in one cp.async group, dO in the
//                  next, so S = Q K^T starts while dO is still landing; lse and D read from global
//                  memory into registers; four barriers per query block.
//   bwd_kernel_v2  (FLASH_EXT_BWD_VARIANT=2; docs/kernels-sm80-bwd.md, "Variant 2") Q, dO, lse
//                  and D double-buffered in shared memory. Block i+1's loads are issued right
//                  after the barrier that opens block i and have a whole block's GEMMs to land.
//                  Two barriers per query block: "block i's data landed and every warp is done
//                  with block i-1" (which also frees the buffers the prefetch and the P/dS stores
//                  overwrite), and "P and dS visible". dQ: two adjacent columns per access.
#pragma once
#include <cute/tensor.hpp>
#include <cmath>

#include "common/bwd_params.h"
#include "common/copy.h"
#include "common/dropout.h"
#include "common/flashmask_bwd.h"
#include "common/fragment.h"
#include "common/alibi.h"
#include "common/mask.h"
#include "common/seqlen.h"
#include "common/softmax.h"
#include "sm80/bwd_epilogue.h"
#include "sm80/bwd_gmem.h"
#include "sm80/bwd_kernel_traits.h"
#include "sm80/gemm.h"

namespace flash_ext::sm80 {

using namespace cute;

// Dropout: P (fp32, dropped entries negated) -> P o Z in the input dtype: kept entries times
// 1 / (1 - p), dropped ones 0.
template <typename TensorDst, typename TensorSrc>
__device__ __forceinline__ void convert_dropout_into(TensorDst& dst, const TensorSrc& src, float scale) {
  static_assert(decltype(size(dst))::value == decltype(size(src))::value);
  using To = typename TensorDst::value_type;
  CUTE_UNROLL
  for (int i = 0; i < size(src); i += 2) {  // pairs: one cvt.rn.{bf16x2,f16x2}.f32 each
    dst(i) = To(fmaxf(src(i), 0.f) * scale);
    dst(i + 1) = To(fmaxf(src(i + 1), 0.f) * scale);
  }
}

// A tensor (a partition of buffer 0) moved to the same position in another buffer `offset`
// elements further on. Exact for swizzled layouts because offset is a multiple of the swizzle
// period (static_assert in BwdTraits).
template <typename T>
__device__ __forceinline__ auto shifted(const T& t, int offset) {
  return make_tensor(t.data() + offset, t.layout());
}

// One CTA of the main kernel: key block blockIdx.x of (head blockIdx.y, batch blockIdx.z).
template <typename Traits, bool kHasWindow, bool kDropout, bool kPrefetch, bool kAlibi>
__device__ __forceinline__ void bwd_key_block(const BwdParams& p, char* smem_raw) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kQElems = Traits::kSmemQElems;
  constexpr int kQBuffers = kPrefetch ? 2 : 1;  // Q and dO buffers each

  const int n_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int tid = threadIdx.x;

  const SeqInfo seq(p, batch);
  if (n_block * kBlockN >= seq.seqlen_k) return;
  const BwdSeqOffsets off(p, batch);
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const int rows_k = seq.seqlen_k - n_block * kBlockN;  // valid key rows of this CTA

  const KeyBlockMask<kBlockM, kBlockN, kHasWindow> mask(seq.seqlen_q, seq.seqlen_k, p.window_left,
                                                         p.window_right, n_block);
  int m_min, m_max;
  mask.query_block_range(m_min, m_max);
  // FlashMask (p.has_flashmask) is a runtime mode of the windowed, dropout-free variants: the loop
  // below visits only the query blocks of [m_min, m_max) that its summary does not skip. No
  // visible block at all: the empty path (no loads, dK = dV = 0, nothing added to dQ).
  const FlashMaskKeyBlock<kBlockM, kBlockN, kHasWindow && !kDropout> fm(p, head, batch, n_block,
                                                                        seq.seqlen_q);
  m_min = fm.next_visible(m_min, m_max);

  // Global memory views.
  const Element* q_base = static_cast<const Element*>(p.q) + seq.q_offset + head * p.q_head_stride;
  const Element* k_base = static_cast<const Element*>(p.k) + seq.k_offset + head_kv * p.k_head_stride;
  const Element* v_base = static_cast<const Element*>(p.v) + seq.v_offset + head_kv * p.v_head_stride;
  const Element* do_base = static_cast<const Element*>(p.dout) + off.do_offset + head * p.do_head_stride;
  const float* lse_base = p.lse + seq.lse_offset + head * p.lse_head_stride;
  const float* dsum_base = p.dsum + seq.lse_offset + head * p.lse_head_stride;
  float* dqa_base = p.dq_accum + off.dqa_offset + head * p.dqa_head_stride +
                    (p.deterministic ? int64_t(n_block) * p.dq_split_stride : 0);
  Element* dk_base = static_cast<Element*>(p.dk) + off.dk_offset + head * p.dk_head_stride;
  Element* dv_base = static_cast<Element*>(p.dv) + off.dv_offset + head * p.dv_head_stride;

  const int64_t k_row0 = int64_t(n_block) * kBlockN;
  Tensor gK = make_tensor(make_gmem_ptr(k_base + k_row0 * p.k_row_stride),
                          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(p.k_row_stride, _1{}));
  Tensor gV = make_tensor(make_gmem_ptr(v_base + k_row0 * p.v_row_stride),
                          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(p.v_row_stride, _1{}));
  Tensor gdK = make_tensor(make_gmem_ptr(dk_base + k_row0 * p.dk_row_stride),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(p.dk_row_stride, _1{}));
  Tensor gdV = make_tensor(make_gmem_ptr(dv_base + k_row0 * p.dv_row_stride),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(p.dv_row_stride, _1{}));
  auto gQ_block = [&](int m_block) {
    return make_tensor(make_gmem_ptr(q_base + int64_t(m_block) * kBlockM * p.q_row_stride),
                       Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(p.q_row_stride, _1{}));
  };
  auto gdO_block = [&](int m_block) {
    return make_tensor(make_gmem_ptr(do_base + int64_t(m_block) * kBlockM * p.do_row_stride),
                       Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(p.do_row_stride, _1{}));
  };

  // Shared memory: Q | dO | K | V | P | dS, with kPrefetch Q0 | Q1 | dO0 | dO1 | K | V | P | dS |
  // lse[2][M] | D[2][M]. The tensors below are buffer 0; buffer b is `shifted(t, b * kQElems)`
  // (Q and dO) or + b * kBlockM (lse, D). dK and dV reuse K and V in the epilogue.
  Element* smem = reinterpret_cast<Element*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(sQ.data() + kQBuffers * kQElems, typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sdO.data() + kQBuffers * kQElems, typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + int(Traits::kSmemKVElems), typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + int(Traits::kSmemKVElems), typename Traits::SmemLayoutP{});
  Tensor sdS = make_tensor(sP.data() + int(Traits::kSmemPElems), typename Traits::SmemLayoutP{});
  Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQt{});
  Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
  Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPt{});
  Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPt{});
  float* s_lse = reinterpret_cast<float*>(smem_raw + (4 * kQElems + 2 * Traits::kSmemKVElems +
                                                      2 * Traits::kSmemPElems) * int(sizeof(Element)));
  float* s_dsum = s_lse + 2 * kBlockM;

  // global <-> shared partitions with (row, col) coordinates for predication.
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tdOsdO = gmem_thr.partition_D(sdO);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tQc = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVc = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  // S = Q K^T and dP = dO V^T.
  typename Traits::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  auto s2r_sdp_a = make_tiled_copy_A(typename Traits::S2RCopy{}, mma_sdp);
  auto s2r_sdp_b = make_tiled_copy_B(typename Traits::S2RCopy{}, mma_sdp);
  Tensor tSsQ = s2r_sdp_a.get_thread_slice(tid).partition_S(sQ);
  Tensor tSsK = s2r_sdp_b.get_thread_slice(tid).partition_S(sK);
  Tensor tdPsdO = s2r_sdp_a.get_thread_slice(tid).partition_S(sdO);
  Tensor tdPsV = s2r_sdp_b.get_thread_slice(tid).partition_S(sV);
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rows = make_tensor(cS.data(), acc_as_rows_cols(cS.layout()));
  constexpr int kRows = decltype(size<0>(cS_rows))::value;
  // P and dS (input dtype) -> shared memory.
  auto r2s_p = make_tiled_copy_C(typename Traits::R2SCopy{}, mma_sdp);
  auto r2s_p_thr = r2s_p.get_thread_slice(tid);
  Tensor tPsP = r2s_p_thr.partition_D(sP);
  Tensor tPsdS = r2s_p_thr.partition_D(sdS);

  // dV += P^T dO and dK += dS^T Q: all four operands transposed views, ldmatrix.trans.
  typename Traits::TiledMmadKV mma_kv;
  auto thr_kv = mma_kv.get_thread_slice(tid);
  Tensor tdVrPt = thr_kv.partition_fragment_A(sPt);
  Tensor tdVrdOt = thr_kv.partition_fragment_B(sdOt);
  Tensor tdKrdSt = thr_kv.partition_fragment_A(sdSt);
  Tensor tdKrQt = thr_kv.partition_fragment_B(sQt);
  auto s2r_kv_a = make_tiled_copy_A(typename Traits::S2RCopyT{}, mma_kv);
  auto s2r_kv_b = make_tiled_copy_B(typename Traits::S2RCopyT{}, mma_kv);
  Tensor tdVsPt = s2r_kv_a.get_thread_slice(tid).partition_S(sPt);
  Tensor tdVsdOt = s2r_kv_b.get_thread_slice(tid).partition_S(sdOt);
  Tensor tdKsdSt = s2r_kv_a.get_thread_slice(tid).partition_S(sdSt);
  Tensor tdKsQt = s2r_kv_b.get_thread_slice(tid).partition_S(sQt);
  Tensor acc_dk = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  // dQ = dS K: dS as stored, K^T through ldmatrix.trans.
  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
  auto s2r_dq_a = make_tiled_copy_A(typename Traits::S2RCopy{}, mma_dq);
  auto s2r_dq_b = make_tiled_copy_B(typename Traits::S2RCopyT{}, mma_dq);
  Tensor tdQsdS = s2r_dq_a.get_thread_slice(tid).partition_S(sdS);
  Tensor tdQsKt = s2r_dq_b.get_thread_slice(tid).partition_S(sKt);
  Tensor cdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));

  const bool use_softcap = p.softcap > 0.f;
  const float scale_log2 = p.softmax_scale_log2;  // log2(e) with softcap (scores already scaled)
  const float softmax_scale = p.softmax_scale;
  // Softcap: S' = cap * tanh(S * scale / cap) and dS_raw = dS' * (1 - (S'/cap)^2) * scale. S' is
  // recovered from P = exp(S' - lse) as ln(P) + lse = (log2(P) + lse * log2(e)) * ln(2).
  const float softcap_t_factor = use_softcap ? float(M_LN2) / p.softcap : 0.f;
  // ALiBi; with softcap, the derivative above is recovered from P, which carries the bias: the
  // dS loop takes it out again.
  constexpr bool use_alibi = kAlibi;  // a variant of its own, so that the others keep their registers
  const float slope = kAlibi ? alibi_slope(p, batch, head) : 0.f;
  const Dropout dropout(p.dropout_seed, p.dropout_offset, batch * p.heads_q + head,
                        p.dropout_threshold);  // used only when kDropout
  const float dropout_scale = p.dropout_scale;
  const bool deterministic = p.deterministic;

  // kPrefetch: all loads of query block m_block into buffer `buf` (no commit): Q, dO, and lse, D
  // of its rows (zero-filled past the sequence end, replaced below).
  auto load_query_block = [&](int m_block, int buf) {
    const int rows_q = seq.seqlen_q - m_block * kBlockM;
    Tensor tQsQ_b = shifted(tQsQ, buf * kQElems);
    Tensor tdOsdO_b = shifted(tdOsdO, buf * kQElems);
    load_tile_async(gmem_thr.partition_S(gQ_block(m_block)), tQsQ_b, tQc, rows_q, p.head_dim);
    load_tile_async(gmem_thr.partition_S(gdO_block(m_block)), tdOsdO_b, tQc, rows_q, p.head_dim);
    if (tid < 2 * kBlockM) {
      const int r = tid % kBlockM;
      const bool ok = r < rows_q;
      const int g = ok ? m_block * kBlockM + r : 0;  // in range even when not read
      const float* src = tid < kBlockM ? lse_base + g : dsum_base + g;
      float* dst = (tid < kBlockM ? s_lse : s_dsum) + buf * kBlockM + r;
      cp_async_4_zfill(dst, src, ok);
    }
  };

  if (m_min < m_max) {
    load_tile_async(gmem_thr.partition_S(gK), tKsK, tKVc, rows_k, p.head_dim);
    load_tile_async(gmem_thr.partition_S(gV), tVsV, tKVc, rows_k, p.head_dim);
    if constexpr (kPrefetch) {
      load_query_block(m_min, 0);
      cp_async_fence();
    }

    int buf = 0;  // kPrefetch: Q/dO/lse/D buffer of m_block, alternating per visited block
    for (int m_block = m_min, m_next; m_block < m_max; m_block = m_next) {
      m_next = fm.next_visible(m_block + 1, m_max);
      const int rows_q = seq.seqlen_q - m_block * kBlockM;  // valid query rows of this block

      // lse (in log2 units) of this thread's rows, and (one buffer) D. Rows past the sequence
      // end and rows that see no key (lse = -inf) get lse = +inf, so that P = exp2(s - inf) = 0,
      // never NaN. D = 0 past the sequence end (zero-filled with kPrefetch), where P = 0 anyway.
      float lse_log2[kRows], dsum_r[kRows];
      if constexpr (kPrefetch) {
        cp_async_wait<0>();
        // Block m_block's Q, dO, lse, D (and K, V) landed, and every warp is done with the block
        // visited before: its Q/dO/lse/D buffer (buf ^ 1) and sP, sdS may be overwritten.
        __syncthreads();
        if (m_next < m_max) load_query_block(m_next, buf ^ 1);
        cp_async_fence();
        const float* lse_s = s_lse + buf * kBlockM;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int row = get<0>(cS_rows(r, 0));
          const float lse = lse_s[row];
          lse_log2[r] = (row >= rows_q || lse == -INFINITY) ? INFINITY : lse * float(M_LOG2E);
        }
      } else {
        load_tile_async(gmem_thr.partition_S(gQ_block(m_block)), tQsQ, tQc, rows_q, p.head_dim);
        cp_async_fence();
        load_tile_async(gmem_thr.partition_S(gdO_block(m_block)), tdOsdO, tQc, rows_q, p.head_dim);
        cp_async_fence();
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int row = get<0>(cS_rows(r, 0));
          const bool ok = row < rows_q;
          const float lse = ok ? lse_base[m_block * kBlockM + row] : INFINITY;
          lse_log2[r] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
          dsum_r[r] = ok ? dsum_base[m_block * kBlockM + row] : 0.f;
        }
        cp_async_wait<1>();
        __syncthreads();  // Q (and K, V) landed
      }
      const int q_off = buf * kQElems;  // Q and dO of this block: buffer `buf`
      const float* dsum_s = s_dsum + buf * kBlockM;

      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      gemm_ss(mma_sdp, acc_s, tSrQ, tSrK, shifted(tSsQ, q_off), tSsK, s2r_sdp_a, s2r_sdp_b, tid);
      if (use_softcap) apply_softcap(acc_s, softmax_scale / p.softcap, p.softcap);
      // (rows, cols) views of S and of its coordinates, as BlockMask::apply takes them.
      Tensor scores = make_tensor(acc_s.data(), acc_as_rows_cols(acc_s.layout()));
      if constexpr (use_alibi) {
        apply_alibi(scores, cS_rows, m_block * kBlockM, n_block * kBlockN, seq.seqlen_k - seq.seqlen_q, slope);
      }
      if (mask.needs_mask(m_block)) mask.apply(scores, cS_rows, m_block);
      if (fm.partial(m_block)) fm.apply(scores, cS_rows, m_block);  // after softcap, before exp

      // P = exp(S * scale - lse), recomputed exactly as the forward normalized it.
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) {
          scores(r, c) = exp2f(scores(r, c) * scale_log2 - lse_log2[r]);
        }
      }
      if constexpr (kDropout) {
        // Dropped: -P (the sign carries the decision to dS below).
        dropout.apply(acc_s, cS, m_block * kBlockM, n_block * kBlockN, [](float x) { return -x; });
      }
      {
        Tensor rP = make_tensor_like<Element>(acc_s);
        if constexpr (kDropout) {
          convert_dropout_into(rP, acc_s, dropout_scale);  // P o Z for dV
        } else {
          convert_into(rP, acc_s);
        }
        copy(r2s_p, r2s_p_thr.retile_S(rP), tPsP);  // nobody reads sP until the barrier below
      }

      if constexpr (!kPrefetch) {
        cp_async_wait<0>();
        __syncthreads();  // dO landed
      }

      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_dp);
      gemm_ss(mma_sdp, acc_dp, tdPrdO, tdPrV, shifted(tdPsdO, q_off), tdPsV, s2r_sdp_a, s2r_sdp_b,
              tid);

      // dS = P * (dP - D) * scale (times the softcap derivative), the gradient of the raw Q K^T.
      Tensor dp = make_tensor(acc_dp.data(), acc_as_rows_cols(acc_dp.layout()));
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float dsum;
        if constexpr (kPrefetch) {
          dsum = dsum_s[get<0>(cS_rows(r, 0))];
        } else {
          dsum = dsum_r[r];
        }
        CUTE_UNROLL
        for (int c = 0; c < size<1>(dp); ++c) {
          float pr = scores(r, c);
          float dpr = dp(r, c);
          if constexpr (kDropout) {
            dpr = pr >= 0.f ? dpr * dropout_scale : 0.f;  // dL/dP = Z o dP'
            pr = fabsf(pr);
          }
          float ds = pr * (dpr - dsum);
          if (use_softcap) {
            float t = (__log2f(pr) + lse_log2[r]) * softcap_t_factor;  // S'/cap = tanh(.)
            if constexpr (kAlibi) {  // ln P + lse carries the bias - slope |i + shift - j|: take it out
              const int diag = m_block * kBlockM + get<0>(cS_rows(r, 0)) + seq.seqlen_k - seq.seqlen_q -
                               n_block * kBlockN;
              t += slope * float(abs(diag - get<1>(cS_rows(r, c)))) / p.softcap;
            }
            ds = pr > 0.f ? ds * (1.f - t * t) : 0.f;
          }
          dp(r, c) = ds * softmax_scale;
        }
      }
      {
        Tensor rdS = make_tensor_like<Element>(acc_dp);
        convert_into(rdS, acc_dp);
        copy(r2s_p, r2s_p_thr.retile_S(rdS), tPsdS);
      }
      __syncthreads();  // P and dS visible to every warp

      gemm_ss(mma_kv, acc_dv, tdVrPt, tdVrdOt, tdVsPt, shifted(tdVsdOt, q_off), s2r_kv_a, s2r_kv_b,
              tid);
      gemm_ss(mma_kv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, shifted(tdKsQt, q_off), s2r_kv_a, s2r_kv_b,
              tid);

      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      clear(acc_dq);
      gemm_ss(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, s2r_dq_a, s2r_dq_b, tid);
      float* dq_tile = dqa_base + int64_t(m_block) * kBlockM * p.dqa_row_stride;
      if constexpr (kPrefetch) {  // pairs of adjacent columns (see dq_accumulate2)
        static_assert(decltype(size<0, 0>(cdQ))::value == 2 && decltype(size(cdQ))::value % 2 == 0);
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dq); i += 2) {
          const int row = get<0>(cdQ(i)), col = get<1>(cdQ(i));  // cdQ(i + 1) is (row, col + 1)
          if (row < rows_q && col < p.head_dim) {  // head_dim % 8 == 0: col + 1 < head_dim too
            dq_accumulate2(dq_tile + int64_t(row) * p.dqa_row_stride + col, acc_dq(i), acc_dq(i + 1),
                           deterministic);
          }
        }
      } else {
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dq); ++i) {
          const int row = get<0>(cdQ(i)), col = get<1>(cdQ(i));
          if (row < rows_q && col < p.head_dim) {
            float* dst = dq_tile + int64_t(row) * p.dqa_row_stride + col;
            if (deterministic) {
              *dst = acc_dq(i);  // this CTA's own slice: written once
            } else {
              atomicAdd(dst, acc_dq(i));
            }
          }
        }
      }
      // Every warp must be done with sQ, sdO, sP, sdS before the next loads overwrite them; with
      // kPrefetch the next block's first barrier orders that.
      if constexpr (!kPrefetch) __syncthreads();
      buf ^= int(kPrefetch);
    }
  }
  // else: no query row sees this key block; dK = dV = 0.

  store_dk_dv<kPrefetch, Traits>(mma_kv, acc_dk, acc_dv, sK, sV, gmem_thr, gdK, gdV, tKVc, rows_k,
                                 p.head_dim, tid);
}

template <typename Traits, bool kHasWindow, bool kDropout, bool kAlibi = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(const __grid_constant__ BwdParams p) {
  extern __shared__ __align__(128) char smem_raw[];
  bwd_key_block<Traits, kHasWindow, kDropout, /*kPrefetch=*/false, kAlibi>(p, smem_raw);
}

template <typename Traits, bool kHasWindow, bool kDropout, bool kAlibi = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel_v2(const __grid_constant__ BwdParams p) {
  extern __shared__ __align__(128) char smem_raw[];
  bwd_key_block<Traits, kHasWindow, kDropout, /*kPrefetch=*/true, kAlibi>(p, smem_raw);
}

}  // namespace flash_ext::sm80
