// Launch of the sm80 backward: the preprocess kernel (D = rowsum(dO * O)), then the main kernel
// variant for the tile of bwd_sm80_tile (dispatch/bwd_dispatch.h; reasoning in
// docs/kernels-sm80-bwd.md), the feed (p.variant), the mask and dropout. dq_accum must be zeroed
// by the caller. The main kernels are compiled elsewhere (sm80/bwd_main_launch.h).
#pragma once
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <string>

#include "dispatch/bwd_dispatch.h"
#include "error.h"
#include "sm80/bwd_main_launch.h"
#include "sm80/bwd_preprocess.cuh"

namespace flash_ext {

namespace sm80 {

// FlashMask's contract with the kernels, checked before any launch: no dropout (the dropout
// variants have no FlashMask mode), and summaries made for the key-block size of the tile the
// kernel will run (the CTA reads summary n_block of key block n_block).
inline void check_bwd_flashmask(const BwdParams& p, int kernel_block_n) {
  if (p.dropout_p > 0.f) raise_error("flash_ext: FlashMask backward: dropout_p must be 0");
  if (p.fm.block_n != kernel_block_n) {
    raise_error("flash_ext: FlashMask backward: key-block summaries made for block_n = " +
                std::to_string(p.fm.block_n) + ", the sm80 backward kernel uses " +
                std::to_string(kernel_block_n));
  }
}

// Masked / unmasked, dropout / no dropout, ALiBi (separate kernels: the ones without dropout
// or ALiBi are unchanged). FlashMask runs in the windowed, dropout-free variant, also when its window is
// (-1, -1) (non-causal FlashMask): the window then bounds nothing.
template <int kHeadDim, bool kIsBf16, bool kBigTile, bool kPrefetch>
void launch_bwd_main_by_mask(BwdParams& p, cudaStream_t stream) {
  if (p.alibi_slopes != nullptr) {  // the op rejects ALiBi with dropout
    launch_bwd_main<kHeadDim, kIsBf16, kBigTile, kPrefetch, true, false, true>(p, stream);
  } else if (p.has_flashmask) {
    launch_bwd_main<kHeadDim, kIsBf16, kBigTile, kPrefetch, true, false>(p, stream);
  } else if (p.dropout_p > 0.f) {
    if (p.has_window) {
      launch_bwd_main<kHeadDim, kIsBf16, kBigTile, kPrefetch, true, true>(p, stream);
    } else {
      launch_bwd_main<kHeadDim, kIsBf16, kBigTile, kPrefetch, false, true>(p, stream);
    }
  } else if (p.has_window) {
    launch_bwd_main<kHeadDim, kIsBf16, kBigTile, kPrefetch, true, false>(p, stream);
  } else {
    launch_bwd_main<kHeadDim, kIsBf16, kBigTile, kPrefetch, false, false>(p, stream);
  }
}

// Variant 2 (double-buffered Q/dO/lse/D, bwd_kernel_v2) when its shared memory fits the device's
// opt-in limit, else the default kernel. Same tile, so the same key-block count (the
// deterministic dQ slices) either way.
template <int kHeadDim, bool kIsBf16>
void launch_bwd_main_big_tile(BwdParams& p, cudaStream_t stream) {
  using Big = typename BwdTraitsFor<kHeadDim, kIsBf16, true>::type;
  if (p.variant == 2) {
    int device = 0, optin = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (Big::kSmemBytesV2 <= optin) {
      launch_bwd_main_by_mask<kHeadDim, kIsBf16, true, true>(p, stream);
      return;
    }
  }
  launch_bwd_main_by_mask<kHeadDim, kIsBf16, true, false>(p, stream);
}

}  // namespace sm80

// The key-block size (kBlockN) of the sm80 backward kernel that run_bwd_sm80 launches for this
// head dim on the current device: the block_n FlashMask's summaries must be made for.
inline int bwd_sm80_flashmask_block_n(int kernel_head_dim) {
  const BwdTile big = bwd_sm80_tile(kernel_head_dim, true);
  const BwdTile small = bwd_sm80_tile(kernel_head_dim, false);
  const bool one_config = big.block_m == small.block_m && big.block_n == small.block_n && big.warps == small.warps;
  return one_config ? big.block_n : bwd_sm80_pick_tile(kernel_head_dim).block_n;
}

template <int kHeadDim, bool kIsBf16>
void run_bwd_sm80(BwdParams& p, cudaStream_t stream) {
  using Element = std::conditional_t<kIsBf16, cutlass::bfloat16_t, cutlass::half_t>;
  if (p.batch == 0 || p.heads_q == 0) return;
  if (p.has_flashmask) sm80::check_bwd_flashmask(p, bwd_sm80_flashmask_block_n(kHeadDim));

  if (p.seqlen_q > 0) {
    constexpr int kPreWarps = 8, kPreRows = kPreWarps * 4;
    const dim3 grid((p.seqlen_q + kPreRows - 1) / kPreRows, p.heads_q, p.batch);
    sm80::bwd_preprocess_kernel<kPreWarps, Element><<<grid, kPreWarps * 32, 0, stream>>>(p);
  }
  if (p.seqlen_k == 0) return;  // no key rows: dK, dV are empty and dQ stays 0

  constexpr BwdTile kBig = bwd_sm80_tile(kHeadDim, true);
  constexpr BwdTile kSmall = bwd_sm80_tile(kHeadDim, false);
  constexpr bool kOneConfig =
      kBig.block_m == kSmall.block_m && kBig.block_n == kSmall.block_n && kBig.warps == kSmall.warps;
  static_assert(kOneConfig == !sm80::bwd_has_small_tile(kHeadDim),
                "the instantiation table (bwd_has_small_tile) must match bwd_sm80_tile");
  // Variant 2 is compiled for the big tile only (which is also the only tile of d = 32, 64);
  // the small (sm86/sm89 or FLASH_EXT_BWD_SMALL_TILE=1) tiles always use the default kernel.
  if constexpr (kOneConfig) {
    sm80::launch_bwd_main_big_tile<kHeadDim, kIsBf16>(p, stream);
  } else {
    static_assert(sm80::BwdTraitsFor<kHeadDim, kIsBf16, false>::type::kSmemBytes <= 99 * 1024);
    const BwdTile t = bwd_sm80_pick_tile(kHeadDim);
    if (t.block_m == kBig.block_m && t.block_n == kBig.block_n && t.warps == kBig.warps) {
      sm80::launch_bwd_main_big_tile<kHeadDim, kIsBf16>(p, stream);
    } else {
      sm80::launch_bwd_main_by_mask<kHeadDim, kIsBf16, false, false>(p, stream);
    }
  }
}

}  // namespace flash_ext
