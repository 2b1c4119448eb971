// Launch of the sm80 backward: the preprocess kernel (D = rowsum(dO * O)), then the main kernel
// with the tile of bwd_sm80_tile (dispatch/bwd_dispatch.h; reasoning in
// docs/kernels-sm80-bwd.md), masked or unmasked variant. dq_accum must be zeroed by the caller.
#pragma once
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "dispatch/bwd_dispatch.h"
#include "sm80/bwd_kernel.cuh"

namespace flash_ext {

namespace sm80 {

template <typename Traits, bool kHasWindow, bool kDropout>
void launch_bwd_main(BwdParams& p, cudaStream_t stream) {
  auto kernel = &bwd_kernel<Traits, kHasWindow, kDropout>;
  constexpr int smem = Traits::kSmemBytes;
  if constexpr (smem > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  }
  const dim3 grid((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.heads_q, p.batch);
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
}

// Masked / unmasked, and dropout / no dropout (separate kernels: the ones without dropout are
// unchanged).
template <typename Traits>
void launch_bwd_main(BwdParams& p, cudaStream_t stream) {
  if (p.dropout_p > 0.f) {
    if (p.has_window) {
      launch_bwd_main<Traits, true, true>(p, stream);
    } else {
      launch_bwd_main<Traits, false, true>(p, stream);
    }
  } else if (p.has_window) {
    launch_bwd_main<Traits, true, false>(p, stream);
  } else {
    launch_bwd_main<Traits, false, false>(p, stream);
  }
}

template <typename Traits, bool kHasWindow, bool kDropout>
void launch_bwd_main_v2(BwdParams& p, cudaStream_t stream) {
  auto kernel = &bwd_kernel_v2<Traits, kHasWindow, kDropout>;
  constexpr int smem = Traits::kSmemBytesV2;
  if constexpr (smem > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  }
  const dim3 grid((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.heads_q, p.batch);
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
}

// Variant 2 (double-buffered Q/dO/lse/D, see bwd_kernel_v2) when its shared memory fits the
// device's opt-in limit, else the default kernel. Same tile, so the same key-block count (the
// deterministic dQ slices) either way.
template <typename Traits>
void launch_bwd_main_v2_or_v1(BwdParams& p, cudaStream_t stream) {
  int device = 0, optin = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (Traits::kSmemBytesV2 > optin) {
    launch_bwd_main<Traits>(p, stream);
  } else if (p.dropout_p > 0.f) {
    if (p.has_window) {
      launch_bwd_main_v2<Traits, true, true>(p, stream);
    } else {
      launch_bwd_main_v2<Traits, false, true>(p, stream);
    }
  } else if (p.has_window) {
    launch_bwd_main_v2<Traits, true, false>(p, stream);
  } else {
    launch_bwd_main_v2<Traits, false, false>(p, stream);
  }
}

}  // namespace sm80

template <int kHeadDim, bool kIsBf16>
void run_bwd_sm80(BwdParams& p, cudaStream_t stream) {
  using Element = std::conditional_t<kIsBf16, cutlass::bfloat16_t, cutlass::half_t>;
  if (p.batch == 0 || p.heads_q == 0) return;

  if (p.seqlen_q > 0) {
    constexpr int kPreWarps = 8, kPreRows = kPreWarps * 4;
    const dim3 grid((p.seqlen_q + kPreRows - 1) / kPreRows, p.heads_q, p.batch);
    sm80::bwd_preprocess_kernel<kPreWarps, Element><<<grid, kPreWarps * 32, 0, stream>>>(p);
  }
  if (p.seqlen_k == 0) return;  // no key rows: dK, dV are empty and dQ stays 0

  constexpr BwdTile kBig = bwd_sm80_tile(kHeadDim, true);
  constexpr BwdTile kSmall = bwd_sm80_tile(kHeadDim, false);
  using Big = sm80::BwdTraits<kHeadDim, kBig.block_m, kBig.block_n, kBig.warps, Element>;
  static_assert(Big::kSmemBytes == bwd_sm80_smem_bytes(kHeadDim, kBig));
  constexpr bool kOneConfig =
      kBig.block_m == kSmall.block_m && kBig.block_n == kSmall.block_n && kBig.warps == kSmall.warps;
  // Variant 2 is compiled for the big tile only (which is also the only tile of d = 32, 64);
  // the small (sm86/sm89 or FLASH_EXT_BWD_SMALL_TILE=1) tiles always use the default kernel.
  if constexpr (kOneConfig) {
    if (p.variant == 2) {
      sm80::launch_bwd_main_v2_or_v1<Big>(p, stream);
    } else {
      sm80::launch_bwd_main<Big>(p, stream);
    }
  } else {
    using Small = sm80::BwdTraits<kHeadDim, kSmall.block_m, kSmall.block_n, kSmall.warps, Element>;
    static_assert(Small::kSmemBytes == bwd_sm80_smem_bytes(kHeadDim, kSmall));
    static_assert(Small::kSmemBytes <= 99 * 1024);
    const BwdTile t = bwd_sm80_pick_tile(kHeadDim);
    if (t.block_m == kBig.block_m && t.block_n == kBig.block_n && t.warps == kBig.warps) {
      if (p.variant == 2) {
        sm80::launch_bwd_main_v2_or_v1<Big>(p, stream);
      } else {
        sm80::launch_bwd_main<Big>(p, stream);
      }
    } else {
      sm80::launch_bwd_main<Small>(p, stream);
    }
  }
}

}  // namespace flash_ext
