// Host side of the Hopper forward: TMA descriptors (built through CUTLASS, which reaches
// cuTensorMapEncodeTiled via the runtime's driver entry point, so nothing links libcuda) and the
// launch of the kernel with the tile and grid of the call's config (chosen on the host by
// tuning/heuristics.cpp, with its reasons; docs/kernels-sm90.md).
#pragma once
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <string>

#include "common/kernel_smem.h"
#include "dispatch/fwd_dispatch.h"
#include "error.h"
#include "tuning/heuristics.h"
#include "sm90/fwd_kernel.cuh"
#include "sm90/tensor_map_encode.h"

namespace flash_ext {

namespace sm90 {

// Main-loop order per head dim (fwd_kernel.cuh kLoop*; one kernel each, measured on an H100,
// docs/perf-notes.md): up to d = 192 the P V wait is pinned in the middle of
// the softmax (against the earlier orders, +0-3% at d = 64, +2-7% at d = 96, 128 and 192); d = 256
// keeps it behind the whole softmax (pv_mid read -3.5 to +6%, within this bench's noise).
template <int kHeadDim>
constexpr int kLoopFor = kHeadDim <= 192 ? kLoopPvMid : kLoopOverlap;

// Mask: the kernel's mask policy (sm90/fwd_mask.h); kMasked: its tiles are uneven (the
// scheduler's longest-first order, claimed dynamically; no stream-K).
template <typename Traits, typename Mask, bool kMasked>
void launch_fwd(const FwdParams& p, const Sm90FwdConfig& config, cudaStream_t stream) {
  using Args = FwdArgs<Traits>;
  using Element = typename Traits::Element;
  const bool varlen = p.cu_seqlens_q != nullptr;
  Args args;
  args.p = p;  // with the schedule the host resolved (tuning/heuristics.h)
  // Varlen tensors are one packed "batch"; a CTA offsets its TMA coordinates by cu_seqlens.
  args.shape_q = make_shape(varlen ? p.total_q : p.seqlen_q, p.head_dim, p.heads_q, varlen ? 1 : p.batch);
  args.shape_k = make_shape(varlen ? p.total_k : p.seqlen_k, p.head_dim, p.heads_kv, varlen ? 1 : p.batch);
  auto gtensor = [&](const void* ptr, TmaTensorShape shape, int64_t row, int64_t head, int64_t batch) {
    return tma_gtensor(static_cast<Element const*>(ptr), shape, row, head, varlen ? int64_t(0) : batch);
  };
  args.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.q, args.shape_q, p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                             typename Traits::SmemLayoutQSlab{}, Shape<_64, Int<Traits::kHeadDim>>{}, _1{});
  args.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.k, args.shape_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                             take<0, 2>(typename Traits::SmemLayoutKV{}),
                             Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{});
  args.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.v, args.shape_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride),
                             take<0, 2>(typename Traits::SmemLayoutKV{}),
                             Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{});
  if (p.sm90_tma_store_o) {
    // O through shared memory and a TMA store (staged in its own buffer, or at d = 256 in Q's:
    // kernel_traits.h). Built on O's real shape (q's): the store clips rows >= seqlen_q and
    // columns >= head_dim.
    auto g_o = tma_gtensor(static_cast<Element*>(p.o), args.shape_q, p.o_row_stride, p.o_head_stride, p.o_batch_stride);
    args.tma_o = make_tma_copy(SM90_TMA_STORE{}, g_o, typename Traits::SmemLayoutOStage{},
                               Shape<_64, Int<Traits::kHeadDim>>{}, _1{});
  }

  // The FlashMask consumers' bound slots are static shared memory beside the dynamic storage that
  // kernel_traits.h budgets: both must fit (fwd_mask.h, stage_columns).
  if constexpr (Mask::kIsFlashMask) {
    static_assert(Traits::kSmemBytes + Mask::kStaticSmemBytes <= Traits::kSmemLimit,
                  "FlashMask forward: dynamic + static shared memory over the 227 KB limit");
  }
  auto kernel = &fwd_kernel<FwdMainloop<Traits, kLoopFor<Traits::kHeadDim>>, Mask, FwdEpilogue<Traits>,
                            TileScheduler<Traits::kBlockM, Traits::kBlockN, kMasked, Mask::kIsFlashMask>>;
  constexpr int smem = Traits::kSmemBytes;
  set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  // The grid the config chose: one CTA per SM (persistent; at most one per tile), all SMs for a
  // stream-K tail.
  const dim3 grid(unsigned(config.grid));
  kernel<<<grid, Traits::kThreads, smem, stream>>>(args);
}

template <typename Traits>
void launch_fwd(const FwdParams& p, const Sm90FwdConfig& config, cudaStream_t stream) {
  constexpr int kM = Traits::kBlockM, kN = Traits::kBlockN;
  if (p.has_flashmask) {
    // FlashMask on top of causal or of no mask (the policy reads p.has_window itself); its
    // tiles are uneven either way. Only on the base tiles (128 rows), which the heuristics choose
    // for it: at 160 registers, d = 64's 192-row tile's consumers spilled 166 bytes, and d = 256's
    // 128 x 80 tile spilled 58-74 bytes even with the low-register mask (its summaries would also
    // need 80-column blocks). At d = 256 the consumers hold 128 registers of O, and the plain
    // policy's mask spilled 138 bytes: there the low-register form reads the bounds a few columns
    // at a time.
    constexpr Sm90FwdTile kFmTile = sm90_fwd_tile(Traits::kHeadDim, false);
    if (p.fm.block_n != kN) {  // the policy reads one summary per key block of the tile
      raise_error("flash_ext: FlashMask summaries made for key blocks of " + std::to_string(p.fm.block_n) +
                  " columns; the Hopper forward's tile has " + std::to_string(kN));
    }
    if constexpr (kM == kFmTile.block_m && kN == kFmTile.block_n && Traits::kHeadDim == 256) {
      launch_fwd<Traits, FlashMaskPolicyLowRegs<kM, kN>, true>(p, config, stream);
    } else if constexpr (kM == kFmTile.block_m && kN == kFmTile.block_n) {
      launch_fwd<Traits, FlashMaskPolicy<kM, kN>, true>(p, config, stream);
    } else {
      raise_error("flash_ext: the Hopper forward runs FlashMask on its base tiles only (128 rows; 64 keys at d = 256)");
    }
  } else if (p.has_window) {
    launch_fwd<Traits, CausalLocalMask<kM, kN, true>, true>(p, config, stream);
  } else {
    launch_fwd<Traits, CausalLocalMask<kM, kN, false>, false>(p, config, stream);
  }
}

}  // namespace sm90

template <int kHeadDim, bool kIsBf16>
void run_fwd_sm90(const FwdParams& p, const Sm90FwdConfig& config, cudaStream_t stream) {
  using Element = std::conditional_t<kIsBf16, cutlass::bfloat16_t, cutlass::half_t>;
  // The tile the config chose (tuning/heuristics.h sm90_fwd_tile; docs/kernels-sm90.md: budgets).
  constexpr Sm90FwdTile kBase = sm90_fwd_tile(kHeadDim, false);
  using Base = sm90::FwdTraits<kHeadDim, kBase.block_m, kBase.block_n, kBase.stages, Element>;
  if constexpr (sm90_fwd_has_alt_tile(kHeadDim)) {
    constexpr Sm90FwdTile kAlt = sm90_fwd_tile(kHeadDim, true);
    using Alt = sm90::FwdTraits<kHeadDim, kAlt.block_m, kAlt.block_n, kAlt.stages, Element>;
    if (config.alt_tile) return sm90::launch_fwd<Alt>(p, config, stream);
  }
  sm90::launch_fwd<Base>(p, config, stream);
}

}  // namespace flash_ext
