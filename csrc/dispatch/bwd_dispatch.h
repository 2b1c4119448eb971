// Declarations of the backward launchers, one instantiation per (head dim, dtype) in
// csrc/instantiations/bwd_sm80_*.cu, and the tile table that both the launcher and the torch
// layer (which sizes the deterministic dQ buffer by the key-block count) read. No CUTLASS types.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>

#include "common/bwd_params.h"

namespace flash_ext {

// FlashAttention-2 backward (mma.sync): D = rowsum(dO * O), then dK, dV, dQ (see
// docs/kernels-sm80-bwd.md). Expects dq_accum zeroed.
template <int kHeadDim, bool kIsBf16>
void run_bwd_sm80(BwdParams& params, cudaStream_t stream);

// Hopper backward (wgmma + TMA, docs/kernels-sm90-bwd.md), head dims 64 and 128, no varlen, no
// deterministic mode. Expects dq_accum zeroed, p.dsum and p.lse_log2 pointing at
// (batch, heads_q, seqlen_q_padded) fp32 buffers, seqlen_q_padded a multiple of kBwdSm90PadRows.
template <int kHeadDim, bool kIsBf16>
void run_bwd_sm90(BwdParams& params, cudaStream_t stream);
constexpr int kBwdSm90PadRows = 128;

// Tile of the main backward kernel: query rows x key rows per CTA, and warps.
struct BwdTile {
  int block_m, block_n, warps;
};

// big_smem: the device allows more than the 99 KB per block of sm86/sm89 (sm80: 163 KB,
// sm90: 227 KB). The reasoning per row is in docs/kernels-sm80-bwd.md.
constexpr BwdTile bwd_sm80_tile(int kernel_head_dim, bool big_smem) {
  switch (kernel_head_dim) {
    case 32: return {64, 128, 8};
    case 64: return {64, 128, 8};
    case 96: return big_smem ? BwdTile{64, 128, 8} : BwdTile{64, 64, 8};
    case 128: return big_smem ? BwdTile{64, 128, 8} : BwdTile{64, 64, 8};
    case 192: return big_smem ? BwdTile{64, 64, 8} : BwdTile{32, 64, 4};
    default: return big_smem ? BwdTile{64, 64, 8} : BwdTile{32, 32, 4};  // 256
  }
}

// Shared memory of the main kernel: Q, dO (block_m x d), K, V (block_n x d), P, dS
// (block_m x block_n), all in the 2-byte input dtype.
constexpr int bwd_sm80_smem_bytes(int kernel_head_dim, BwdTile t) {
  return (2 * t.block_m * kernel_head_dim + 2 * t.block_n * kernel_head_dim + 2 * t.block_m * t.block_n) * 2;
}

// The tile the launcher picks on the current device. FLASH_EXT_BWD_SMALL_TILE=1 forces the
// 99 KB (sm86/sm89) tiles on any device, so that tests can cover them on an A100 / H100.
inline BwdTile bwd_sm80_pick_tile(int kernel_head_dim) {
  const char* force_small = std::getenv("FLASH_EXT_BWD_SMALL_TILE");
  if (force_small != nullptr && force_small[0] == '1') return bwd_sm80_tile(kernel_head_dim, false);
  int device = 0, bytes = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  const BwdTile big = bwd_sm80_tile(kernel_head_dim, true);
  return bytes >= bwd_sm80_smem_bytes(kernel_head_dim, big) ? big : bwd_sm80_tile(kernel_head_dim, false);
}

}  // namespace flash_ext
