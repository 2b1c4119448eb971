// The Hopper backward's deterministic mode (BwdParams::dq_semaphore; docs/kernels-sm90-bwd.md).
//
// Every key-block CTA adds its dQ contribution to a query block's dq_accum tile with fp32
// reductions; unordered, the sums differ from run to run in their last bits. In deterministic mode
// the CTAs that see query block m add to its tile one at a time, in descending key-block order:
// one int per (batch, head, query block) counts the CTAs that have added, and the CTA of key block
// n waits until it reads n_max(m) - n, n_max(m) being the last key block that sees m. The grid
// launches a head's key blocks in descending order, so a CTA only ever waits for CTAs launched
// before it (no deadlock however few CTAs are resident), and under a causal mask a higher key
// block starts at a later query block, reaches m in fewer steps and is usually done with it when
// the lower one arrives (FlashAttention-3 orders its deterministic backward the same way).
// Causal / local / full masks only: their visible key blocks of a query block are one interval.
#pragma once
#include "sm90/warpgroup.h"

namespace flash_ext::sm90 {

// The named barrier of the two consumer warpgroups around the ordered reductions (1: the dS one).
constexpr int kBarrierDqOrder = 2;

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

// Consumer thread 0 waits (acquire) until `count` CTAs have added to the tile; then the two
// consumer warpgroups go on together.
template <int kMmaThreads>
__device__ __forceinline__ void dq_order_wait(const int* sem, int count, int thread) {
  if (thread == 0) {
    int seen;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
    } while (seen != count);
  }
  named_barrier_sync(kBarrierDqOrder, kMmaThreads);
}

// After every consumer thread has issued its reductions: thread 0 counts this CTA in (the fence
// orders the CTA's reductions, joined by the barrier, before the count).
template <int kMmaThreads>
__device__ __forceinline__ void dq_order_done(int* sem, int thread) {
  named_barrier_sync(kBarrierDqOrder, kMmaThreads);
  if (thread == 0) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
  }
}

}  // namespace flash_ext::sm90
