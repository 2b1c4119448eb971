// Mask policies of the Hopper forward. A policy is built per tile from the params and the tile
// (its sequence's lengths; head and batch for masks that differ by them) and answers: which key
// blocks the tile's rows see (key_block_range_rows), which one to visit after key block n
// (next_block), whether a key block needs the elementwise mask (needs_mask_rows), and the mask
// itself on a score fragment (apply_rows). The mainloop walks n_max - 1, next_block(...), ...
// while >= n_min; n_min and n_max - 1 are visited. Producer and consumers call the same methods
// on the same data, so they walk the same blocks without synchronising.
#pragma once
#include "common/flashmask.h"
#include "common/mask.h"
#include "params.h"
#include "sm90/fwd_args.h"

namespace flash_ext::sm90 {

// Causal / local windows (and the seqlen_k edge): common/mask.h's BlockMask. kHasWindow false:
// no mask but the seqlen_k edge. Every block of [n_min, n_max) is visited.
template <int kBlockM, int kBlockN, bool kHasWindow>
struct CausalLocalMask : BlockMask<kBlockM, kBlockN, kHasWindow> {
  // The block visited after n is always n - 1 (the producer names V's block from it).
  static constexpr bool kVisitsEveryBlock = true;
  static constexpr bool kIsFlashMask = false;  // the tile scheduler reads no p.fm

  __device__ __forceinline__ CausalLocalMask(const FwdParams& p, const SeqInfo& seq, int /*head*/, int /*batch*/)
      : BlockMask<kBlockM, kBlockN, kHasWindow>(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right) {}

  __device__ __forceinline__ int next_block(int /*row0*/, int n, int /*n_min*/) const { return n - 1; }
};

// FlashMask (common/flashmask.h, docs/design-flashmask.md 4.1) on top of the causal rule (or of
// no mask: p.has_window false) and the seqlen_k edge. A key block's class for the tile's rows
// [row0, min(row0 + kBlockM, seqlen_q)) comes from the key-block summaries, made for this
// kernel's kBlockN (the launch checks): kFmSkip blocks are never visited (the range's ends are
// shrunk past them, next_block jumps over them), kFmPartial ones get the interval test per score
// after the usual mask. Each side computes a block's class from the summaries (two 16-byte loads
// that hit L1/L2) instead of having it handed from producer to consumers; with kCacheClass the
// class last computed is kept, so that a consumer computes it once per visited block (in the
// walk's next_block) instead of three times (next_block, needs_mask_rows, apply_rows), which cost
// instructions on every visited block (docs/perf-notes.md, "where the Hopper FlashMask kernels
// lose to varlen on the same documents"). Tiles start at row 0 (no row shift). Rows are the query
// rows of the sequence.
template <int kBlockM, int kBlockN, bool kCacheClass = true>
struct FlashMaskPolicy : BlockMask<kBlockM, kBlockN, true> {
  using Base = BlockMask<kBlockM, kBlockN, true>;
  static constexpr bool kVisitsEveryBlock = false;
  static constexpr bool kIsFlashMask = true;  // the tile scheduler may drop its sections (p.fm)

  const int4* nb;   // this tile's (mask head, batch row): normalized bounds of column 0
  const int4* kbs;  // its summary pair of key block 0 (of kBlockN columns)
  mutable int cached_n = -1, cached_class = kFmFull;  // kCacheClass: the class last computed

  __device__ __forceinline__ FlashMaskPolicy(const FwdParams& p, const SeqInfo& seq, int head, int batch)
      : Base(seq.seqlen_q, seq.seqlen_k, p.has_window ? p.window_left : -1, p.has_window ? p.window_right : -1) {
    const int64_t g = head / p.fm.group;
    nb = p.fm.nb + g * p.fm.nb_head_stride + fm_col0(p.fm, p.cu_seqlens_k, batch);
    kbs = p.fm.kbs + 2 * (g * p.fm.kbs_head_stride + fm_blk0(p.fm, p.cu_seqlens_k, batch));
  }

  // Class of key block n for the tile's rows, by the intervals alone.
  __device__ __forceinline__ int block_class(int row0, int n) const {
    if constexpr (kCacheClass) {
      if (n == cached_n) return cached_class;
    }
    const int c = fm_classify(__ldg(kbs + 2 * n), __ldg(kbs + 2 * n + 1), row0, min(row0 + kBlockM, this->seqlen_q));
    if constexpr (kCacheClass) {
      cached_n = n;
      cached_class = c;
    }
    return c;
  }

  // The usual range, then its ends moved past skipped blocks (an empty range if all are). The
  // range's summaries are prefetched into L1 (each warp's lanes a block each), so that the
  // walk's next_block and the masks read them there instead of paying an L2 round trip per block
  // in the producer's and the consumers' loop headers.
  __device__ __forceinline__ void key_block_range_rows(int row0, int& n_min, int& n_max) const {
    Base::key_block_range_rows(row0, n_min, n_max);
    for (int b = n_min + int(threadIdx.x % 32); b < n_max; b += 32) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(kbs + 2 * b));
    }
    while (n_max > n_min && block_class(row0, n_max - 1) == kFmSkip) --n_max;
    while (n_min < n_max && block_class(row0, n_min) == kFmSkip) ++n_min;
  }

  // The next block below n that is not skipped; n_min (not skipped) stops the scan, and below
  // it the result is n_min - 1 (the walk's end).
  __device__ __forceinline__ int next_block(int row0, int n, int n_min) const {
    for (--n; n > n_min && block_class(row0, n) == kFmSkip; --n) {}
    return n;
  }

  __device__ __forceinline__ bool needs_mask_rows(int row0, int n) const {
    return Base::needs_mask_rows(row0, n) || block_class(row0, n) == kFmPartial;
  }

  // The usual mask, then for a partial block the interval test per score: each column's bounds
  // once per thread (__ldg, through L1), tested against the thread's rows. Columns at or past
  // seqlen_k are masked by the usual rule already (and have no bounds to read there).
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_rows(TensorS& scores, const TensorC& coords, int row0, int n) const {
    using namespace cute;
    Base::apply_rows(scores, coords, row0, n);
    if (block_class(row0, n) != kFmPartial) return;
    const int col0 = n * kBlockN;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) {
      const int col = col0 + get<1>(coords(0, c));
      if (col >= this->seqlen_k) continue;
      const int4 bounds = __ldg(nb + col);
      CUTE_UNROLL
      for (int r = 0; r < size<0>(scores); ++r) {
        if (fm_masked(bounds, row0 + get<0>(coords(r, 0)))) scores(r, c) = -INFINITY;
      }
    }
  }
};

// FlashMaskPolicy for consumers short of registers (d = 256: O alone takes 128 per thread). The
// plain apply_rows loads all of a thread's columns' bounds (16 int4 at kBlockN = 64), which ptxas
// issued together and spilled for; here they are read 4 columns per turn of a rolled loop and
// reduced at once to one bit per (row, column), and the scores are masked from those bits: at
// most 16 registers of bounds in flight, kBlockN / 4 L1 loads per partial block as before. It
// keeps no class cache (two more registers).
template <int kBlockM, int kBlockN>
struct FlashMaskPolicyLowRegs : FlashMaskPolicy<kBlockM, kBlockN, false> {
  using Policy = FlashMaskPolicy<kBlockM, kBlockN, false>;
  using Policy::Policy;

  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_rows(TensorS& scores, const TensorC& coords, int row0, int n) const {
    using namespace cute;
    constexpr int kRows = decltype(size<0>(scores))::value;
    constexpr int kCols = decltype(size<1>(scores))::value;
    constexpr int kTurn = 4;  // columns per turn
    static_assert(kCols <= 32 && kCols % kTurn == 0, "one 32-bit word of column bits per row");
    Policy::Base::apply_rows(scores, coords, row0, n);
    if (this->block_class(row0, n) != kFmPartial) return;
    const int col0 = n * kBlockN;
    uint32_t bits[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) bits[r] = 0u;
#pragma unroll 1
    for (int c0 = 0; c0 < kCols; c0 += kTurn) {
      CUTE_UNROLL
      for (int i = 0; i < kTurn; ++i) {
        const int col = col0 + get<1>(coords(0, c0 + i));
        if (col >= this->seqlen_k) continue;  // masked by the usual rule; no bounds there
        const int4 bounds = __ldg(this->nb + col);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          bits[r] |= uint32_t(fm_masked(bounds, row0 + get<0>(coords(r, 0)))) << (c0 + i);
        }
      }
    }
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (bits[r] & (1u << c)) scores(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace flash_ext::sm90
