// Definition of launch_bwd_main (declared in sm80/bwd_main_launch.h): included by the generated
// files that instantiate the variants, never by the dispatching launcher.
#pragma once
#include "common/kernel_smem.h"
#include <cuda_runtime.h>

#include <string>

#include "error.h"

#include "sm80/bwd_kernel.cuh"
#include "sm80/bwd_main_launch.h"

namespace flash_ext::sm80 {

template <int kHeadDim, bool kIsBf16, bool kBigTile, bool kPrefetch, bool kHasWindow, bool kDropout, bool kAlibi>
void launch_bwd_main(BwdParams& p, cudaStream_t stream) {
  using Traits = typename BwdTraitsFor<kHeadDim, kIsBf16, kBigTile>::type;
  static_assert(kBigTile || !kPrefetch, "bwd_kernel_v2 is compiled for the big tile only");
  auto kernel = [] {  // (a plain ?: would instantiate both kernels)
    if constexpr (kPrefetch) {
      return &bwd_kernel_v2<Traits, kHasWindow, kDropout, kAlibi>;
    } else {
      return &bwd_kernel<Traits, kHasWindow, kDropout, kAlibi>;
    }
  }();
  // The kernel reads summary n_block for key block n_block, and only these variants have the
  // FlashMask mode (run_bwd_sm80 checks both before the preprocess; this is the last word).
  if (p.has_flashmask && (!kHasWindow || kDropout || p.fm.block_n != Traits::kBlockN)) {
    raise_error("flash_ext: FlashMask backward: summaries for block_n " + std::to_string(p.fm.block_n) +
                " reached a kernel variant with kBlockN " + std::to_string(Traits::kBlockN) +
                (kHasWindow && !kDropout ? "" : " and no FlashMask mode"));
  }
  constexpr int smem = kPrefetch ? Traits::kSmemBytesV2 : Traits::kSmemBytes;
  if constexpr (smem > 48 * 1024) {
    set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  }
  const dim3 grid((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.heads_q, p.batch);
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
}

}  // namespace flash_ext::sm80
