// Declarations of the backward launchers, one explicit instantiation per (head dim, dtype) in
// csrc/instantiations/bwd_*.cu (kernel translation units). The host picks one through
// dispatch/paths.cpp; the sm80 tile table is in tuning/heuristics.h (the host sizes the deterministic
// dQ buffer by its key-block count). No CUTLASS or torch types here.
#pragma once
#include <cuda_runtime.h>

#include "tuning/heuristics.h"
#include "params.h"

namespace flash_ext {

// FlashAttention-2 backward (mma.sync): D = rowsum(dO * O), then dK, dV, dQ (see
// docs/kernels-sm80-bwd.md). Expects dq_accum zeroed.
template <int kHeadDim, bool kIsBf16>
void run_bwd_sm80(BwdParams& params, cudaStream_t stream);

// Hopper backward (wgmma + TMA, docs/kernels-sm90-bwd.md), head dims 64, 128 and 256, fixed-length
// and varlen, no deterministic mode. Expects p.dsum and p.lse_log2 pointing at (batch, heads_q,
// seqlen_q_padded) fp32 buffers, seqlen_q_padded a multiple of kBwdSm90PadRows; varlen: (heads_q,
// seqlen_q_padded) with seqlen_q_padded = round_up(total_q + kBwdSm90PadRows * batch, kBwdSm90PadRows).
template <int kHeadDim, bool kIsBf16>
void run_bwd_sm90(BwdParams& params, cudaStream_t stream);
constexpr int kBwdSm90PadRows = 128;
// Key-block size of the Hopper backward's tile for a kernel head dim (sm90/bwd_launch.cuh checks
// its traits against it): FlashMask's key-block summaries are made for this block size.
constexpr int sm90_bwd_block_n(int kernel_head_dim) { return kernel_head_dim <= 128 ? 128 : 64; }
// Query rows per step of its loop (the GQA schedule's work estimate, tuning/heuristics.cpp).
constexpr int sm90_bwd_block_m(int kernel_head_dim) { return kernel_head_dim <= 64 ? 128 : 64; }

}  // namespace flash_ext
