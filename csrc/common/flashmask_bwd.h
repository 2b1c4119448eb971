// FlashMask in a backward CTA that owns one key block (sm80/bwd_kernel.cuh; design
// docs/design-flashmask.md 3.2). The key block never changes over the CTA's life, so every query
// block of the loop is classified from the same summary (common/flashmask.h): skipped blocks are
// never loaded nor computed, full ones get only the usual causal / seqlen_k mask, partial ones
// also the per-column interval test.
//
// In the sm80 backward the summary is re-read (two 16-byte read-only loads, L1 hits after the
// first) at each classification, and its address recomputed from the kernel parameters, rather
// than held in registers over the loop: its big tiles already run at 255 registers with spills,
// and every windowed call (causal training included) would carry those live values. The Hopper
// backward stages the pair in shared memory once per CTA and classifies from there (the
// `summary` overloads).
#pragma once
#include <cute/tensor.hpp>
#include <cmath>

#include "common/flashmask.h"
#include "params.h"

namespace flash_ext {

// kEnabled false: an empty shell (every call folds to the no-mask answer), so that the variants
// FlashMask does not run on (no window, or dropout) compile exactly as before.
template <int kBlockM, int kBlockN, bool kEnabled>
struct FlashMaskKeyBlock {
  // Nothing but the kernel parameters (constant bank) and the CTA's indices: the addresses are
  // recomputed where used, so a windowed call without FlashMask holds no extra live value.
  const FwdParams& p;
  int head, batch, n_block;
  int seqlen_q;         // of this sequence: the last query block ends there, not at a block edge

  __device__ __forceinline__ FlashMaskKeyBlock(const FwdParams& p_, int head_, int batch_,
                                               int n_block_, int seqlen_q_)
      : p(p_), head(head_), batch(batch_), n_block(n_block_), seqlen_q(seqlen_q_) {}

  __device__ __forceinline__ bool on() const { return kEnabled && p.has_flashmask; }
  // The key block's summary pair, and the bounds of its column 0.
  __device__ __forceinline__ const int4* kbs() const {
    const FlashMaskView& v = p.fm;
    return v.kbs + 2 * ((head / v.group) * v.kbs_head_stride + fm_blk0(v, p.cu_seqlens_k, batch) + n_block);
  }
  __device__ __forceinline__ const int4* nb() const {
    const FlashMaskView& v = p.fm;
    return v.nb + (head / v.group) * v.nb_head_stride + fm_col0(v, p.cu_seqlens_k, batch) +
           int64_t(n_block) * kBlockN;
  }

  // kFmSkip / kFmFull / kFmPartial for query block m_block (callers test on() first).
  __device__ __forceinline__ int classify(int m_block) const {
    const int r0 = m_block * kBlockM;
    const int4* s = kbs();
    return fm_classify(__ldg(s), __ldg(s + 1), r0, min(r0 + kBlockM, seqlen_q));
  }

  // The first query block >= m_block and < m_max that FlashMask does not skip, else m_max. The
  // same value in every thread (the summary and arguments are CTA-uniform), so loops on it stay
  // uniform and their barriers safe.
  __device__ __forceinline__ int next_visible(int m_block, int m_max) const {
    if constexpr (kEnabled) {
      if (on()) {
        while (m_block < m_max && classify(m_block) == kFmSkip) ++m_block;
      }
    }
    return m_block;
  }

  // next_visible and partial with the key block's summary pair read from `summary` (the Hopper
  // backward stages it in shared memory once per CTA: each classification is then two shared
  // loads and the compares, not the address arithmetic (a division by the mask group) and two
  // global loads that made the FlashMask backward execute 18% more instructions than the causal
  // one with nothing masked beyond causal; docs/perf-notes.md, "where the Hopper FlashMask
  // kernels lose to varlen on the same documents").
  __device__ __forceinline__ int classify_with(const int4* summary, int m_block) const {
    const int r0 = m_block * kBlockM;
    return fm_classify(summary[0], summary[1], r0, min(r0 + kBlockM, seqlen_q));
  }
  __device__ __forceinline__ int next_visible(int m_block, int m_max, const int4* summary) const {
    if constexpr (kEnabled) {
      if (on()) {
        while (m_block < m_max && classify_with(summary, m_block) == kFmSkip) ++m_block;
      }
    }
    return m_block;
  }
  __device__ __forceinline__ bool partial(int m_block, const int4* summary) const {
    if constexpr (kEnabled) {
      return on() && classify_with(summary, m_block) == kFmPartial;
    } else {
      return false;
    }
  }

  // True when query block m_block needs the per-column test.
  __device__ __forceinline__ bool partial(int m_block) const {
    if constexpr (kEnabled) {
      return on() && classify(m_block) == kFmPartial;
    } else {
      return false;
    }
  }

  // Masked scores of a (query rows, key columns) tile of query block m_block to -inf. `scores`
  // and `coords` as BlockMask::apply takes them (coords: (row, col) in the kBlockM x kBlockN tile).
  // One 16-byte read-only load per column the thread holds: the block's bounds (kBlockN x 16
  // bytes) stay in L1 over the loop. Columns past seqlen_k read the padding entries the layout
  // keeps after every sequence (masked in every row, like the usual seqlen_k mask already did).
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(TensorS& scores, const TensorC& coords, int m_block) const {
    using namespace cute;
    if constexpr (kEnabled) {
      const int row0 = m_block * kBlockM;
      const int4* bounds = nb();
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const int4 b = __ldg(bounds + get<1>(coords(0, c)));
        CUTE_UNROLL
        for (int r = 0; r < size<0>(scores); ++r) {
          if (fm_masked(b, row0 + get<0>(coords(r, 0)))) scores(r, c) = -INFINITY;
        }
      }
    }
  }
};

}  // namespace flash_ext
