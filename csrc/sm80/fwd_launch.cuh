// Launch of the sm80 forward: tile configuration per head dim (see docs/kernels-sm80.md) and
// the masked / unmasked and dropout / no-dropout kernel variants.
#pragma once
#include "common/kernel_smem.h"
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <string>

#include "dispatch/fwd_dispatch.h"
#include "error.h"
#include "sm80/fwd_kernel.cuh"

namespace flash_ext {

namespace sm80 {

template <typename Traits, bool kHasWindow, bool kDropout, bool kAlibi = false>
void launch_fwd(FwdParams& p, cudaStream_t stream) {
  auto kernel = &fwd_kernel<Traits, kHasWindow, kDropout, kAlibi>;
  constexpr int smem = Traits::kSmemBytes;
  if constexpr (smem > 48 * 1024) {
    set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  }
  const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads_q, p.batch);
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
}

template <typename Traits>
void launch_fwd(FwdParams& p, cudaStream_t stream) {
  static_assert(Traits::kBlockN == sm80_fwd_block_n(Traits::kHeadDim),
                "FlashMask's summaries are made for sm80_fwd_block_n (dispatch/fwd_dispatch.h)");
  if (p.has_flashmask && (p.dropout_p > 0.f || !p.has_window || p.fm.block_n != Traits::kBlockN)) {
    raise_error("flash_ext: internal: a FlashMask forward needs the windowed dropout-free kernel and summaries "
                "for its key blocks of " + std::to_string(Traits::kBlockN));
  }
  // ALiBi and dropout: separate kernels, so that the ones without them are unchanged (registers,
  // speed). ALiBi runs in a windowed, dropout-free variant (the op rejects it with dropout).
  if (p.alibi_slopes != nullptr) {
    if (p.dropout_p > 0.f || !p.has_window) {
      raise_error("flash_ext: internal: an ALiBi forward needs the windowed dropout-free kernel");
    }
    launch_fwd<Traits, true, false, true>(p, stream);
  } else if (p.dropout_p > 0.f) {
    if (p.has_window) {
      launch_fwd<Traits, true, true>(p, stream);
    } else {
      launch_fwd<Traits, false, true>(p, stream);
    }
  } else if (p.has_window) {
    launch_fwd<Traits, true, false>(p, stream);
  } else {
    launch_fwd<Traits, false, false>(p, stream);
  }
}

inline int max_smem_per_block() {
  int device = 0, bytes = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return bytes;
}

}  // namespace sm80

template <int kHeadDim, bool kIsBf16>
void run_fwd_sm80(FwdParams& p, cudaStream_t stream) {
  using Element = std::conditional_t<kIsBf16, cutlass::bfloat16_t, cutlass::half_t>;
  using sm80::FwdTraits;
  if constexpr (kHeadDim <= 32) {
    sm80::launch_fwd<FwdTraits<kHeadDim, 128, 128, 4, Element>>(p, stream);
  } else if constexpr (kHeadDim <= 128) {
    sm80::launch_fwd<FwdTraits<kHeadDim, 128, 64, 4, Element>>(p, stream);
  } else if constexpr (kHeadDim <= 192) {
    sm80::launch_fwd<FwdTraits<kHeadDim, 128, 64, 8, Element>>(p, stream);
  } else {
    using Big = FwdTraits<kHeadDim, 128, 64, 8, Element>;
    // sm86/sm89 allow 99 KB of shared memory per block: use a 64-row query tile there.
    if (sm80::max_smem_per_block() >= Big::kSmemBytes) {
      sm80::launch_fwd<Big>(p, stream);
    } else {
      sm80::launch_fwd<FwdTraits<kHeadDim, 64, 64, 4, Element>>(p, stream);
    }
  }
}

}  // namespace flash_ext
