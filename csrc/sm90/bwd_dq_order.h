// The Hopper backward's deterministic mode (BwdParams::dq_semaphore; docs/kernels-sm90-bwd.md).
//
// Every key-block CTA adds its dQ contribution to a query block's dq_accum tile with fp32
// reductions; unordered, the sums differ from run to run in their last bits. In deterministic mode
// the CTAs that see query block m add to its tile one at a time, in descending key-block order:
// one int per (batch, head, query block) counts the CTAs that have added, and the CTA of key block
// n waits (in its order warp, below) until it reads n_max(m) - n, n_max(m) being the last key block that sees m. The grid
// launches a head's key blocks in descending order, so a CTA only ever waits for CTAs launched
// before it (no deadlock however few CTAs are resident), and under a causal mask a higher key
// block starts at a later query block, reaches m in fewer steps and is usually done with it when
// the lower one arrives (FlashAttention-3 orders its deterministic backward the same way).
// Causal / local / full masks only: their visible key blocks of a query block are one interval.
#pragma once
#include "sm90/warpgroup.h"

namespace flash_ext::sm90 {

// Named barriers between the consumer warpgroups and the order warp (1: the consumers' dS one).
// Ready: the order warp arrives once the count says it is this CTA's turn at the step's query
// block; the consumers wait on it before their reductions. Added: the consumers arrive after
// issuing their reductions (without waiting); the order warp waits on it, then counts the CTA in.
constexpr int kBarrierDqReady = 2;
constexpr int kBarrierDqAdded = 3;
constexpr int kDqOrderWarpThreads = 32;

// The number of CTAs that add to query block m_block's tile before key block n_block's: those of
// key blocks (n_block, n_max]. A key block n sees m_block when its first visible query row
// (n * kBlockN - shift - window_right, BlockMask::query_block_range) is below (m_block + 1) * kBlockM;
// the upper end of its range only grows with n, so every key block from n_block to that one sees it.
template <int kBlockM, int kBlockN, bool kHasWindow>
__device__ __forceinline__ int dq_order_predecessors(int m_block, int n_block, int n_blocks, int seqlen_q, int seqlen_k,
                                                     int window_right) {
  int n_max = n_blocks - 1;
  if constexpr (kHasWindow) {
    if (window_right >= 0) {
      const int end = (m_block + 1) * kBlockM + (seqlen_k - seqlen_q) + window_right;  // > 0: n_block sees m_block
      n_max = min(n_max, (end - 1) / kBlockN);
    }
  }
  return n_max - n_block;
}

// The order warp (warp 1 of the producer warpgroup, otherwise idle): for each query block the
// consumers visit, in their order, lane 0 polls the count (acquire) until this CTA's turn, then the
// warp lets the consumers reduce, waits until they have issued their reductions, and lane 0 counts
// the CTA in (the fence orders the consumers' reductions, joined by the barrier, before the add).
// The poll and the fence run here, beside the consumers' GEMMs, and not on their path: with both
// on consumer thread 0 they cost +25-47% per call (measured: docs/perf-notes.md).
template <int kBlockM, int kBlockN, bool kHasWindow, int kMmaThreads>
__device__ __forceinline__ void dq_order_warp(int* sem, int m_first, int m_end, int n_block, int n_blocks, int seqlen_q,
                                              int seqlen_k, int window_right) {
  const bool leader = threadIdx.x % 32 == 0;
  for (int m_block = m_first; m_block < m_end; ++m_block) {
    if (leader) {
      const int before = dq_order_predecessors<kBlockM, kBlockN, kHasWindow>(m_block, n_block, n_blocks, seqlen_q,
                                                                             seqlen_k, window_right);
      int seen;
      do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem + m_block) : "memory");
      } while (seen != before);
    }
    __syncwarp();
    named_barrier_arrive(kBarrierDqReady, kMmaThreads + kDqOrderWarpThreads);
    named_barrier_sync(kBarrierDqAdded, kMmaThreads + kDqOrderWarpThreads);
    if (leader) {
      __threadfence();
      asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem + m_block) : "memory");
    }
    __syncwarp();
  }
}

// Consumers: wait for this CTA's turn at the step's query block ...
template <int kMmaThreads>
__device__ __forceinline__ void dq_order_wait_turn() {
  named_barrier_sync(kBarrierDqReady, kMmaThreads + kDqOrderWarpThreads);
}

// ... and, once every consumer thread has issued its reductions, tell the order warp (no wait).
template <int kMmaThreads>
__device__ __forceinline__ void dq_order_added() {
  named_barrier_arrive(kBarrierDqAdded, kMmaThreads + kDqOrderWarpThreads);
}

}  // namespace flash_ext::sm90
