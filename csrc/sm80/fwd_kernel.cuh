// FlashAttention-2 forward for sm80 and newer (mma.sync, ldmatrix, cp.async).
//
// Grid (query blocks, heads, batch): sequence-parallel over query blocks. A CTA loads its Q
// tile once and walks the visible key blocks from the last to the first (the blocks that need
// an elementwise mask come first). K of the next block streams in (cp.async) while this block's
// softmax and P V run; V of this block streams in while Q K^T runs.
//
// FlashMask (p.has_flashmask, a runtime mode of the windowed variant only; common/flashmask.h):
// the walk visits the same range but skips the key blocks whose summary says every entry is
// masked for this tile's rows (no loads, no MMA: K is prefetched for the next visible block), and
// on the blocks it cannot classify as unmasked it applies the interval mask after the usual one.
//
// kDropout (dropout_p > 0, common/dropout.h): after the online softmax of a block (whose row
// sums use the un-dropped P, so l and lse are those of the plain softmax), dropped entries of P
// are zeroed before P V; the 1 / (1 - p) of the kept ones is folded into the final 1 / l.
#pragma once
#include <cute/tensor.hpp>

#include "common/alibi.h"
#include "common/copy.h"
#include "common/dropout.h"
#include "common/flashmask_tile.h"
#include "common/fragment.h"
#include "common/mask.h"
#include "common/seqlen.h"
#include "common/softmax.h"
#include "params.h"
#include "sm80/gemm.h"
#include "sm80/kernel_traits.h"

namespace flash_ext::sm80 {

using namespace cute;

template <typename Traits, bool kHasWindow, bool kDropout, bool kAlibi = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel(const __grid_constant__ FwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  extern __shared__ __align__(128) char smem_raw[];

  // Query blocks run heaviest first: under a causal mask the last blocks see the most keys.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int tid = threadIdx.x;

  const SeqInfo seq(p, batch);
  if (m_block * kBlockM >= seq.seqlen_q) return;
  const int head_kv = head / (p.heads_q / p.heads_kv);  // MQA/GQA by index, never copied
  const int rows_q = seq.seqlen_q - m_block * kBlockM;  // valid rows of this query tile

  const BlockMask<kBlockM, kBlockN, kHasWindow> mask(seq.seqlen_q, seq.seqlen_k, p.window_left,
                                                      p.window_right);
  int n_min, n_max;
  mask.key_block_range(m_block, n_min, n_max);

  // Global memory views of this CTA's tiles.
  const Element* q_base = static_cast<const Element*>(p.q) + seq.q_offset + head * p.q_head_stride;
  const Element* k_base = static_cast<const Element*>(p.k) + seq.k_offset + head_kv * p.k_head_stride;
  const Element* v_base = static_cast<const Element*>(p.v) + seq.v_offset + head_kv * p.v_head_stride;
  Element* o_base = static_cast<Element*>(p.o) + seq.o_offset + head * p.o_head_stride;
  const int64_t q_row0 = int64_t(m_block) * kBlockM;
  Tensor gQ = make_tensor(make_gmem_ptr(q_base + q_row0 * p.q_row_stride),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(p.q_row_stride, _1{}));
  Tensor gO = make_tensor(make_gmem_ptr(o_base + q_row0 * p.o_row_stride),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(p.o_row_stride, _1{}));
  auto gK_block = [&](int n_block) {
    return make_tensor(make_gmem_ptr(k_base + int64_t(n_block) * kBlockN * p.k_row_stride),
                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(p.k_row_stride, _1{}));
  };
  auto gV_block = [&](int n_block) {
    return make_tensor(make_gmem_ptr(v_base + int64_t(n_block) * kBlockN * p.v_row_stride),
                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(p.v_row_stride, _1{}));
  };

  // Shared memory: Q | K | V; the output tile reuses Q's space.
  Element* smem = reinterpret_cast<Element*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem + Traits::kSmemQElems),
                          typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + int(Traits::kSmemKVElems), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});

  // global <-> shared partitions, with (row, col) coordinates for predication.
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tQc = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVc = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  // MMA partitions.
  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt);
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rows = make_tensor(cS.data(), acc_as_rows_cols(cS.layout()));

  auto s2r_q = make_tiled_copy_A(typename Traits::S2RCopyQK{}, mma);
  auto s2r_k = make_tiled_copy_B(typename Traits::S2RCopyQK{}, mma);
  auto s2r_v = make_tiled_copy_B(typename Traits::S2RCopyVt{}, mma);
  Tensor tSsQ = s2r_q.get_thread_slice(tid).partition_S(sQ);
  Tensor tSsK = s2r_k.get_thread_slice(tid).partition_S(sK);
  Tensor tOsVt = s2r_v.get_thread_slice(tid).partition_S(sVt);

  Tensor o_rows = make_tensor(acc_o.data(), acc_as_rows_cols(acc_o.layout()));
  constexpr int kRows = decltype(size<0>(o_rows))::value;
  OnlineSoftmax<kRows> softmax;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    softmax.row_max[r] = -INFINITY;
    softmax.row_sum[r] = 0.f;
  }
  clear(acc_o);

  const bool use_softcap = p.softcap > 0.f;
  const float scale_log2 = p.softmax_scale_log2;
  // ALiBi: a variant of its own (windowed, no dropout), so that the others keep their registers.
  constexpr bool use_alibi = kAlibi;
  const float slope = kAlibi ? alibi_slope(p, batch, head) : 0.f;
  const Dropout dropout(p.dropout_seed, p.dropout_offset, batch * p.heads_q + head,
                        p.dropout_threshold);  // used only when kDropout

  // FlashMask: a runtime mode of the windowed dropout-free variant (kFmVariant) only; this
  // tile's query rows (within the sequence) are [m_block * kBlockM, fm_r1).
  constexpr bool kFmVariant = kHasWindow && !kDropout;
  bool flashmask = false;
  if constexpr (kFmVariant) flashmask = p.has_flashmask;
  FlashMaskTile<kBlockN> fm;
  if (flashmask) fm = FlashMaskTile<kBlockN>(p.fm, p.cu_seqlens_k, batch, head / p.fm.group);
  const int fm_r1 = m_block * kBlockM + min(kBlockM, rows_q);
  // The first block to visit at or below n_block (below n_min: none left).
  auto visible_from = [&](int n_block) {
    if (flashmask) {
      while (n_block >= n_min && fm.classify(p.fm, n_block, m_block * kBlockM, fm_r1) == kFmSkip) --n_block;
    }
    return n_block;
  };

  // One key block: S = Q K^T, mask, online softmax, O += P V; K of the next block visited (with
  // FlashMask the next one not skipped) streams in meanwhile. Returns that block (below n_min:
  // none; the next block is chosen only once V has landed, so that no summary is held in
  // registers through Q K^T).
  auto step = [&](int n_block, auto is_first) {
    constexpr bool kFirst = decltype(is_first)::value;
    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    cp_async_wait<0>();
    __syncthreads();  // K[n_block] (and Q) landed; every warp is done reading the previous V
    load_tile_async(gmem_thr.partition_S(gV_block(n_block)), tVsV, tKVc,
                    seq.seqlen_k - n_block * kBlockN, p.head_dim);
    cp_async_fence();

    gemm_ss(mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, s2r_q, s2r_k, tid);
    if (use_softcap) apply_softcap(acc_s, p.softmax_scale / p.softcap, p.softcap);
    Tensor scores = make_tensor(acc_s.data(), acc_as_rows_cols(acc_s.layout()));
    if constexpr (use_alibi) {
      apply_alibi(scores, cS_rows, m_block * kBlockM, n_block * kBlockN, seq.seqlen_k - seq.seqlen_q, slope);
    }
    if (mask.needs_mask(m_block, n_block)) mask.apply(scores, cS_rows, m_block, n_block);
    if constexpr (kFmVariant) {
      if (flashmask && fm.touches(p.fm, n_block, m_block * kBlockM, fm_r1)) {  // kFmPartial
        fm.apply(p.fm, scores, cS_rows, m_block * kBlockM, n_block);
      }
    }

    cp_async_wait<0>();
    __syncthreads();  // V[n_block] landed; every warp is done reading K
    int next = n_block - 1;
    if constexpr (kFmVariant) {
      next = visible_from(n_block - 1);
      if (next >= n_min) {
        load_tile_async(gmem_thr.partition_S(gK_block(next)), tKsK, tKVc, seq.seqlen_k - next * kBlockN,
                        p.head_dim);
        cp_async_fence();
      }
    } else if (n_block > n_min) {
      load_tile_async(gmem_thr.partition_S(gK_block(n_block - 1)), tKsK, tKVc,
                      seq.seqlen_k - (n_block - 1) * kBlockN, p.head_dim);
      cp_async_fence();
    }

    softmax.template update<kFirst>(scores, o_rows, scale_log2);
    if constexpr (kDropout) {
      dropout.apply(acc_s, cS, m_block * kBlockM, n_block * kBlockN, [](float) { return 0.f; });
    }

    Tensor rP = make_tensor_like<Element>(acc_s);
    convert_into(rP, acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_mma_a(rP.layout()));
    gemm_rs(mma, acc_o, tOrP, tOrVt, tOsVt, s2r_v, tid);
    return next;
  };

  if constexpr (kFmVariant) {
    // The walk over the blocks that FlashMask does not skip (all of them without it).
    const int n_first = visible_from(n_max - 1);
    if (n_first >= n_min) {
      load_tile_async(gmem_thr.partition_S(gQ), tQsQ, tQc, rows_q, p.head_dim);
      load_tile_async(gmem_thr.partition_S(gK_block(n_first)), tKsK, tKVc, seq.seqlen_k - n_first * kBlockN,
                      p.head_dim);
      cp_async_fence();
      for (int n_block = step(n_first, cute::true_type{}); n_block >= n_min;) {
        n_block = step(n_block, cute::false_type{});
      }
    }
  } else if (n_min < n_max) {
    load_tile_async(gmem_thr.partition_S(gQ), tQsQ, tQc, rows_q, p.head_dim);
    load_tile_async(gmem_thr.partition_S(gK_block(n_max - 1)), tKsK, tKVc,
                    seq.seqlen_k - (n_max - 1) * kBlockN, p.head_dim);
    cp_async_fence();
    step(n_max - 1, cute::true_type{});
    for (int n_block = n_max - 2; n_block >= n_min; --n_block) step(n_block, cute::false_type{});
  }
  // else: no visible key at all; the epilogue writes zeros and lse = -inf.

  // Epilogue: normalize once, O through shared memory for 16-byte coalesced stores, lse in fp32.
  float lse[kRows];
  softmax.finalize(o_rows, scale_log2, lse);
  if constexpr (kDropout) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= p.dropout_scale;  // kept P: x 1 / (1 - p)
  }

  Tensor rO = make_tensor_like<Element>(acc_o);
  convert_into(rO, acc_o);
  auto r2s = make_tiled_copy_C(typename Traits::R2SCopyO{}, mma);
  auto r2s_thr = r2s.get_thread_slice(tid);
  __syncthreads();  // all warps are done with sQ (and sV) before sO overwrites it
  copy(r2s, r2s_thr.retile_S(rO), r2s_thr.partition_D(sO));
  __syncthreads();
  Tensor tOgO = gmem_thr.partition_D(gO);
  store_tile(gmem_thr.partition_S(sO), tOgO, tQc, rows_q, p.head_dim);

  Tensor cO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO_rows = make_tensor(cO.data(), acc_as_rows_cols(cO.layout()));
  if (get<1>(cO_rows(0, 0)) == 0) {  // the thread of each quad that holds column 0
    float* lse_out = p.lse + seq.lse_offset + head * p.lse_head_stride + q_row0;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(cO_rows(r, 0));
      if (row < rows_q) lse_out[row] = lse[r];
    }
  }
}

}  // namespace flash_ext::sm80
