// Declarations of the forward launchers, one explicit instantiation per (head dim, dtype) in
// csrc/instantiations/ (kernel translation units). The host picks one through
// dispatch/paths.cpp. No CUTLASS or torch types here.
#pragma once
#include <cuda_runtime.h>

#include "tuning/heuristics.h"
#include "params.h"

namespace flash_ext {

// The sm80 forward's key-block size for its kernel head dim (run_fwd_sm80's tiles, which
// static_assert it): the block size FlashMask's summaries are made for.
constexpr int sm80_fwd_block_n(int kernel_head_dim) { return kernel_head_dim <= 32 ? 128 : 64; }

// FlashAttention-2 kernel (mma.sync); built for sm_80 and, to run on Hopper, sm_90a.
template <int kHeadDim, bool kIsBf16>
void run_fwd_sm80(FwdParams& params, cudaStream_t stream);

// FlashAttention-3 style kernel (TMA, wgmma, warp specialization); sm_90a only. Runs the call
// as `config` says (choose_sm90_fwd_config); params carry its resolved schedule and buffers.
template <int kHeadDim, bool kIsBf16>
void run_fwd_sm90(const FwdParams& params, const Sm90FwdConfig& config, cudaStream_t stream);

}  // namespace flash_ext
