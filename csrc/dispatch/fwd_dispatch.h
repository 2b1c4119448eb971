// Declarations of the forward launchers, one instantiation per (head dim, dtype) in
// csrc/instantiations/. flash_api.cpp includes this (no CUTLASS types here).
#pragma once
#include <cuda_runtime.h>
#include "params.h"

namespace flash_ext {

// FlashAttention-2 kernel (mma.sync); built for sm_80 and, to run on Hopper, sm_90a.
template <int kHeadDim, bool kIsBf16>
void run_fwd_sm80(FwdParams& params, cudaStream_t stream);

}  // namespace flash_ext

namespace flash_ext {

// FlashAttention-3 style kernel (TMA, wgmma, warp specialization); sm_90a only.
template <int kHeadDim, bool kIsBf16>
void run_fwd_sm90(FwdParams& params, cudaStream_t stream);

}  // namespace flash_ext
