// Host side of the Hopper backward: TMA descriptors for Q, dO, K, V, the tile per head dim
// (docs/kernels-sm90-bwd.md), the preprocess kernel and the main kernel's launch.
#pragma once
#include "common/kernel_smem.h"
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>
#include <string>

#include "dispatch/bwd_dispatch.h"
#include "error.h"
#include "sm90/bwd_kernel.cuh"
#include "common/pdl.h"
#include "sm90/tensor_map_encode.h"

namespace flash_ext {

namespace sm90 {

// after_preprocess: the preprocess kernel was launched just before, and this launch may overlap its
// last wave (common/pdl.h).
template <typename Traits, bool kHasWindow, bool kGroupLoop, bool kVarlen, bool kFlashMask, bool kDeterministic = false>
void launch_bwd(BwdParams& p, cudaStream_t stream, bool after_preprocess) {
  using Args = BwdArgs<Traits>;
  using Element = typename Traits::Element;
  static_assert(kBwdSm90PadRows % Traits::kBlockM == 0);
  static_assert(Traits::kBlockN == sm90_bwd_block_n(Traits::kHeadDim), "FlashMask summaries' block size");
  static_assert(Traits::kBlockM == sm90_bwd_block_m(Traits::kHeadDim), "the GQA schedule's estimate");
  // FlashMask runs in the kFlashMask instantiations of the windowed kernel, on summaries made for
  // this kernel's key blocks.
  if (p.has_flashmask) {
    if (!kFlashMask) raise_error("flash_ext: internal: FlashMask backward launched in a kernel without it");
    if (p.fm.block_n != Traits::kBlockN) {
      raise_error("flash_ext: FlashMask backward: key-block summaries made for block_n = " +
                  std::to_string(p.fm.block_n) + ", the Hopper backward kernel uses " + std::to_string(Traits::kBlockN));
    }
  }
  Args args;
  args.p = p;
  args.lse_log2 = p.lse_log2;
  args.dsum = p.dsum;
  args.seqlen_q_padded = p.seqlen_q_padded;
  // Varlen: the packed tensors as one batch of total rows (a CTA moves to its sequence's rows).
  args.shape_q = make_shape(kVarlen ? p.total_q : p.seqlen_q, p.head_dim, p.heads_q, kVarlen ? 1 : p.batch);
  args.shape_k = make_shape(kVarlen ? p.total_k : p.seqlen_k, p.head_dim, p.heads_kv, kVarlen ? 1 : p.batch);
  auto gtensor = [&](const void* ptr, TmaTensorShape shape, int64_t row, int64_t head, int64_t batch) {
    return tma_gtensor(static_cast<Element const*>(ptr), shape, row, head, kVarlen ? int64_t(0) : batch);
  };
  auto q_box = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{};
  auto k_box = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{};
  auto q_smem = take<0, 2>(typename Traits::SmemLayoutQ{});
  args.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.q, args.shape_q, p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                             q_smem, q_box, _1{});
  args.tma_do = make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.dout, args.shape_q, p.do_row_stride, p.do_head_stride, p.do_batch_stride),
                              q_smem, q_box, _1{});
  args.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.k, args.shape_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                             typename Traits::SmemLayoutK{}, k_box, _1{});
  args.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.v, args.shape_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride),
                             typename Traits::SmemLayoutK{}, k_box, _1{});

  if (kDeterministic && (p.dq_semaphore == nullptr || p.sm90_lpt_section > 0 || p.sm90_gqa_loop)) {
    raise_error("flash_ext: internal: deterministic Hopper backward needs its counters, the 3-D grid and the expand schedule");
  }
  auto kernel = &bwd_kernel<Traits, kHasWindow, kGroupLoop, kVarlen, kFlashMask, kDeterministic>;
  constexpr int smem = Traits::kSmemBytes;
  set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  // Key blocks in blockIdx.x order: under a causal mask block 0 has the most query blocks, so
  // the longest CTAs start first. With the group loop, one CTA per KV head. Varlen: key blocks of
  // the longest sequence (p.seqlen_k), one z per sequence.
  // The longest-first order (sm90/bwd_tile_order.h) is one dimension of the same CTAs.
  const int n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, heads_y = kGroupLoop ? p.heads_kv : p.heads_q;
  const bool lpt = !kVarlen && p.sm90_lpt_section > 0;
  const dim3 grid = lpt ? dim3(unsigned(n_blocks) * heads_y * p.batch) : dim3(n_blocks, heads_y, p.batch);
  if (after_preprocess) {
    launch_with_pdl(kernel, grid, dim3(Traits::kThreads), smem, stream, args);
  } else {
    kernel<<<grid, Traits::kThreads, smem, stream>>>(args);
  }
}

// Varlen (cu_seqlens): the three kernels' kVarlen instantiations, with the expand schedule only
// (tuning/heuristics.cpp never chooses the group loop for varlen). p.seqlen_q / p.seqlen_k are
// the longest sequence's; p.seqlen_q_padded the head stride of the padded buffers,
// round_up(total_q + 128 * batch, 128) (ops_bwd.cpp).
template <typename Traits>
void run_bwd_varlen(BwdParams& p, cudaStream_t stream) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  static_assert(kBwdSm90PadRows == 128, "varlen_padded_row0 and the varlen preprocess pad to 128 rows");
  if (p.sm90_gqa_loop && p.heads_q != p.heads_kv) {
    raise_error("flash_ext: internal: the Hopper backward has no group loop for varlen batches");
  }
  // max_seqlen_q may be 0 with total_q > 0 (every sequence empty, the tokens in none): no grid of
  // 0 CTAs; the convert kernel's extra column still zeroes dq there.
  if (p.seqlen_q > 0) {
    constexpr int kRowsPerCta = 256 / (kHeadDim / 8);
    const int rows = (p.seqlen_q + kBwdSm90PadRows - 1) / kBwdSm90PadRows * kBwdSm90PadRows;
    const dim3 grid(rows / kRowsPerCta, p.heads_q, p.batch);
    bwd_preprocess_kernel<Element, kHeadDim, true><<<grid, 256, 0, stream>>>(p, p.lse_log2, p.dsum, p.seqlen_q_padded);
  }
  if (p.seqlen_k > 0) {
    // The windowed varlen kernel runs FlashMask calls too (sm90/bwd_kernel.cuh: kFlashMask).
    const bool pdl = p.seqlen_q > 0;
    p.has_window ? launch_bwd<Traits, true, false, true, true>(p, stream, pdl)
                 : launch_bwd<Traits, false, false, true, false>(p, stream, pdl);
  }
  // One column more than the longest sequence's query blocks: it zeroes dq's rows outside every sequence.
  const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM + 1, p.heads_q, p.batch);
  launch_with_pdl(&bwd_dq_convert_kernel<Traits, true>, grid, dim3(Traits::kMmaThreads), 0, stream, p);
}

}  // namespace sm90

template <int kHeadDim, bool kIsBf16>
void run_bwd_sm90(BwdParams& p, cudaStream_t stream) {
  using Element = std::conditional_t<kIsBf16, cutlass::bfloat16_t, cutlass::half_t>;
  if (p.batch == 0 || p.heads_q == 0) return;
  // (head dim, kBlockM queries, kBlockN keys, stages): see docs/kernels-sm90-bwd.md.
  using Traits = std::conditional_t<
      kHeadDim <= 64, sm90::BwdTraits<kHeadDim, 128, 128, 2, Element>,
      std::conditional_t<kHeadDim <= 128, sm90::BwdTraits<kHeadDim, 64, 128, 2, Element>,
                         sm90::BwdTraits<kHeadDim, 64, 64, 2, Element>>>;
  if (p.cu_seqlens_q != nullptr) {  // before the seqlen_q test: max_seqlen_q = 0 still zeroes dq's rows
    sm90::run_bwd_varlen<Traits>(p, stream);
    return;
  }
  if (p.seqlen_q == 0) return;
  {
    constexpr int kRowsPerCta = 256 / (kHeadDim / 8);
    // Whole CTAs past the padding exit, so every warp's shuffles see all of its lanes.
    static_assert(kBwdSm90PadRows % kRowsPerCta == 0);
    const dim3 grid((p.seqlen_q_padded + kRowsPerCta - 1) / kRowsPerCta, p.heads_q, p.batch);
    sm90::bwd_preprocess_kernel<Element, kHeadDim, false><<<grid, 256, 0, stream>>>(p, p.lse_log2, p.dsum, p.seqlen_q_padded);
  }
  if (p.seqlen_k > 0) {
    // The group loop only for GQA/MQA (with one query head per KV head it is the other kernel).
    const bool loop = p.sm90_gqa_loop && p.heads_q != p.heads_kv;
    if (p.deterministic) {  // expand schedule, 3-D grid (choose_bwd_kernel, ops_bwd.cpp)
      p.has_window ? sm90::launch_bwd<Traits, true, false, false, false, true>(p, stream, true)
                   : sm90::launch_bwd<Traits, false, false, false, false, true>(p, stream, true);
    } else if (p.has_flashmask) {
      loop ? sm90::launch_bwd<Traits, true, true, false, true>(p, stream, true)
           : sm90::launch_bwd<Traits, true, false, false, true>(p, stream, true);
    } else if (p.has_window) {
      loop ? sm90::launch_bwd<Traits, true, true, false, false>(p, stream, true)
           : sm90::launch_bwd<Traits, true, false, false, false>(p, stream, true);
    } else {
      loop ? sm90::launch_bwd<Traits, false, true, false, false>(p, stream, true)
           : sm90::launch_bwd<Traits, false, false, false, false>(p, stream, true);
    }
  }
  const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads_q, p.batch);
  launch_with_pdl(&sm90::bwd_dq_convert_kernel<Traits, false>, grid, dim3(Traits::kMmaThreads), 0, stream, p);
}

}  // namespace flash_ext
