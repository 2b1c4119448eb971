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

  using ForWarps = CausalLocalMask;  // the consumers' policy (see FlashMaskPolicyWarps)

  __device__ __forceinline__ int next_block(int /*row0*/, int n, int /*n_min*/) const { return n - 1; }
};

// FlashMask (common/flashmask.h, docs/design-flashmask.md 4.1) on top of the causal rule (or of
// no mask: p.has_window false) and the seqlen_k edge. A key block's class for the tile's rows
// [row0, min(row0 + kBlockM, seqlen_q)) comes from the key-block summaries, made for this
// kernel's kBlockN (the launch checks): kFmSkip blocks are never visited (the range's ends are
// shrunk past them, next_block jumps over them), kFmPartial ones get the interval test per score
// after the usual mask. Each side computes a block's class from the summaries instead of having
// it handed from producer to consumers: this policy is the producer's (one thread: a block at a
// time, two 16-byte loads that hit L1/L2; with kCacheClass the class last computed is kept), and
// ForWarps (FlashMaskPolicyWarps, below) the consumers', which classify 32 blocks per ballot. The
// masks (apply_rows, apply_partial) are the consumers' only: they stage bounds per warp (full
// warps); the producer never masks.
// Tiles start at row 0 (no row shift). Rows are the query rows of the sequence.
template <int kBlockM, int kBlockN>
struct FlashMaskPolicyWarps;
template <typename Policy>
struct WarpRange;

template <int kBlockM, int kBlockN, bool kCacheClass = true>
struct FlashMaskPolicy : BlockMask<kBlockM, kBlockN, true> {
  using Base = BlockMask<kBlockM, kBlockN, true>;
  static constexpr bool kVisitsEveryBlock = false;
  static constexpr bool kIsFlashMask = true;  // the tile scheduler may drop its sections (p.fm)
  static constexpr int kStaticSmemBytes = 8 * kBlockN * int(sizeof(int4));  // stage_columns' slots
  using ForWarps = FlashMaskPolicyWarps<kBlockM, kBlockN>;

  const int4* nb;   // this tile's (mask head, batch row): normalized bounds of column 0
  const int4* kbs;  // its summary pair of key block 0 (of kBlockN columns)
  // Its query blocks' ranges in the tile table (flashmask/flashmask_fwd_tiles.h), or nullptr
  // (varlen, or no table): then the range is found by scanning the summaries.
  const int2* ranges = nullptr;
  const int* counts = nullptr;  // the table's counts of kept blocks, beside `ranges`
  mutable int cached_n = -1, cached_class = kFmFull;  // kCacheClass: the class last computed

  __device__ __forceinline__ FlashMaskPolicy(const FwdParams& p, const SeqInfo& seq, int head, int batch)
      : Base(seq.seqlen_q, seq.seqlen_k, p.has_window ? p.window_left : -1, p.has_window ? p.window_right : -1) {
    const int64_t g = head / p.fm.group;
    nb = p.fm.nb + g * p.fm.nb_head_stride + fm_col0(p.fm, p.cu_seqlens_k, batch);
    kbs = p.fm.kbs + 2 * (g * p.fm.kbs_head_stride + fm_blk0(p.fm, p.cu_seqlens_k, batch));
    if (p.fm.fwd_range != nullptr) {
      ranges = p.fm.fwd_range + (g * p.batch + batch) * p.fm.fwd_m_blocks;
      counts = p.fm.fwd_count + (g * p.batch + batch) * p.fm.fwd_m_blocks;
    }
  }

  // The summaries of blocks [n_min, n_max) into L1 (each warp's lanes a block each; the producer's
  // thread every 32nd), so that the walk's classes read them there instead of paying an L2 round
  // trip per block in the producer's and the consumers' loop headers.
  __device__ __forceinline__ void prefetch_summaries(int n_min, int n_max) const {
    for (int b = n_min + int(threadIdx.x % 32); b < n_max; b += 32) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(kbs + 2 * b));
    }
  }

  // The tile table's range of the query block at row0 (one load instead of a scan), its summaries
  // prefetched; false without a table.
  __device__ __forceinline__ bool table_range(int row0, int& n_min, int& n_max) const {
    if (ranges == nullptr) return false;
    const int2 r = __ldg(ranges + row0 / kBlockM);
    n_min = r.x;
    n_max = r.y;
    prefetch_summaries(n_min, n_max);
    return true;
  }

  // Whether the query block at row0's range [n_min, n_max) keeps every block (the tile table's
  // count fills it): its walk is then n - 1 and needs no class (next_block's bits and redux: ~30
  // instructions per block on the consumers' path). False without a table (varlen).
  __device__ __forceinline__ bool range_dense(int row0, int n_min, int n_max) const {
    return counts != nullptr && __ldg(counts + row0 / kBlockM) == n_max - n_min;
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

  // The tile table's range, or the usual range with its ends moved past skipped blocks (an empty
  // range if all are); the range's summaries prefetched.
  __device__ __forceinline__ void key_block_range_rows(int row0, int& n_min, int& n_max) const {
    if (table_range(row0, n_min, n_max)) return;
    Base::key_block_range_rows(row0, n_min, n_max);
    prefetch_summaries(n_min, n_max);
    // Two blocks per round, their skip halves loaded together: half the dependent L1 round trips
    // of one thread's walk past a long skipped run (the producer's; the consumers take ballots).
    const int r1 = min(row0 + kBlockM, this->seqlen_q);
    auto skipped = [&](int n) { return fm_skips(__ldg(kbs + 2 * n), row0, r1); };
    while (n_max - n_min >= 2) {
      const bool a = skipped(n_max - 1), b = skipped(n_max - 2);
      if (!a) break;
      --n_max;
      if (!b) break;
      --n_max;
    }
    if (n_max > n_min && skipped(n_max - 1)) --n_max;
    while (n_max - n_min >= 2) {
      const bool a = skipped(n_min), b = skipped(n_min + 1);
      if (!a) break;
      ++n_min;
      if (!b) break;
      ++n_min;
    }
    if (n_min < n_max && skipped(n_min)) ++n_min;
  }

  // key_block_range_rows for callers in full warps (the consumers): the ends move past skipped
  // blocks 32 at a time, each lane testing one block's skip half and a ballot finding the kept
  // block nearest the end, instead of one dependent L1 load per skipped block (a sliding window's
  // tile skips most of the causal range: ncu, docs/perf-notes.md "the forward's range ends").
  // The same range as key_block_range_rows, which the producer's single thread computes.
  __device__ __forceinline__ void key_block_range_rows_warps(int row0, int& n_min, int& n_max) const {
    if (table_range(row0, n_min, n_max)) return;
    Base::key_block_range_rows(row0, n_min, n_max);
    const int lane = threadIdx.x % 32, r1 = min(row0 + kBlockM, this->seqlen_q);
    auto kept = [&](int n, bool in_range) {
      return __ballot_sync(0xffffffffu, in_range && !fm_skips(__ldg(kbs + 2 * n), row0, r1));
    };
    int top = n_max;
    for (; top > n_min; top -= 32) {  // lane i tests block top - 1 - i
      const unsigned k = kept(top - 1 - lane, top - 1 - lane >= n_min);
      if (k) {
        n_max = top - (__ffs(k) - 1);
        break;
      }
    }
    if (top <= n_min) n_max = n_min;  // every block skipped
    for (int bot = n_min; bot < n_max; bot += 32) {  // lane i tests block bot + i
      const unsigned k = kept(bot + lane, bot + lane < n_max);
      if (k) {
        n_min = bot + __ffs(k) - 1;
        break;
      }
    }
    prefetch_summaries(n_min, n_max);
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

  // The usual mask, then for a partial block the interval test per score (apply_partial).
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_rows(TensorS& scores, const TensorC& coords, int row0, int n) const {
    using namespace cute;
    Base::apply_rows(scores, coords, row0, n);
    if (block_class(row0, n) == kFmPartial) apply_partial(scores, coords, row0, n);
  }

  // Key block n's column bounds in this warp's slot of shared memory (full warps only): each lane
  // loads kBlockN / 32 columns, all issued before any is used (one L2 round trip per warp and
  // partial block; the 8 warps load the same bounds), and the test reads them from the slot. Read straight from global memory instead, a
  // thread's 32 columns were loaded ~4 at a time, each round an L2 round trip: a tile whose rows
  // straddle a document's end (all of its blocks partial) ran at ~17k cycles per block, 5-7x the
  // pace (docs/perf-notes.md, Sessions 33-34). A slot per consumer warp (kBlockM = 128: 8 warps,
  // 8 x kBlockN x 16 bytes); columns at or past seqlen_k hold zeros (fm_masked: not masked; the
  // usual rule has masked them).
  __device__ __forceinline__ const int4* stage_columns(int n) const {
    static_assert(kBlockM == 128 && kBlockN % 32 == 0, "a slot per consumer warp (8), a column per lane and turn");
    constexpr int kPerLane = kBlockN / 32;
    __shared__ int4 slots[8][kBlockN];
    static_assert(sizeof(slots) == kStaticSmemBytes, "the launch's shared-memory check counts these");
    const int lane = int(threadIdx.x % 32), col0 = n * kBlockN;
    int4* slot = slots[(threadIdx.x / 32) % 8];  // consumer warps 4..11: distinct slots
    int4 v[kPerLane];
    CUTE_UNROLL
    for (int i = 0; i < kPerLane; ++i) {
      const int col = col0 + 32 * i + lane;
      v[i] = col < this->seqlen_k ? __ldg(nb + col) : make_int4(0, 0, 0, 0);
    }
    __syncwarp();  // every lane done reading the slot's previous block
    CUTE_UNROLL
    for (int i = 0; i < kPerLane; ++i) slot[32 * i + lane] = v[i];
    __syncwarp();
    return slot;
  }

  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_partial(TensorS& scores, const TensorC& coords, int row0, int n) const {
    using namespace cute;
    const int4* slot = stage_columns(n);
    // Columns at or past seqlen_k are staged as zeros, which fm_masked never masks (the usual rule
    // has masked them): no test per column, so the slot's loads are not each behind a branch.
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) {
      const int4 bounds = slot[get<1>(coords(0, c))];  // the column within the block
      CUTE_UNROLL
      for (int r = 0; r < size<0>(scores); ++r) {
        if (fm_masked(bounds, row0 + get<0>(coords(r, 0)))) scores(r, c) = -INFINITY;
      }
    }
  }

  // Key block n's column bounds (kBlockN int4: kBlockN / 8 lines of 128 bytes, a lane each; a
  // varlen sequence's columns need not start on a line, and then the block's last line is not
  // asked for) asked into L1 ahead of stage_columns (full warps). Alone (before the stage) it left the straddling
  // tiles at ~17k cycles per block, so whether the stage's loads hit L1 through it is not known;
  // it measured -4% on the causal document mask then (docs/perf-notes.md, Session 34). Issued off
  // the walk (next_block): there, the prefetch's per-lane address put the walk's block index on
  // the vector datapath (R2UR 98 -> 117).
  __device__ __forceinline__ void prefetch_columns(int n) const {
    const int lane = int(threadIdx.x % 32);
    if (lane < kBlockN / 8) asm volatile("prefetch.global.L1 [%0];" ::"l"(nb + n * kBlockN + lane * 8));
  }
  // The range's ends, where partial blocks are most likely (a document's first block; a
  // straddling tile's first block).
  __device__ __forceinline__ void prefetch_range_ends(int n_min, int n_max) const {
    if (n_max > n_min) {
      prefetch_columns(n_max - 1);
      prefetch_columns(n_min);
    }
  }
};

// FlashMaskPolicy as the consumers use it (ForWarps): they call the policy in full warps, so the
// classes of 32 key blocks at a time are found by one summary pair per lane and three ballots
// (skipped, partial, needs the usual rule's mask), kept as bit words (CTA-uniform), and the walk (next_block) and the masks read the class from those bits:
// no load and compare chain in the step's loop header (ncu: in the FlashMask forward with nothing
// masked beyond causal, that chain cost 17% over causal; docs/perf-notes.md, "the forward's
// class window"). The range's ends: key_block_range_rows_warps. The producer keeps the serial
// FlashMaskPolicy: the same classes, so the same walk.
template <int kBlockM, int kBlockN>
struct FlashMaskPolicyWarps : FlashMaskPolicy<kBlockM, kBlockN, false> {
  using Policy = FlashMaskPolicy<kBlockM, kBlockN, false>;
  using Policy::Policy;
  using ForWarps = FlashMaskPolicyWarps;
  // Blocks [win_lo, win_lo + 32): bit i of win_skip / win_part says block win_lo + i is skipped /
  // partial (blocks below 0 count as skipped; no walk reaches them).
  // win_base: block win_lo + i needs the usual rule's mask (a window edge or the seqlen_k edge). So
  // needs_mask_rows is one bit test (computed per block, the usual rule's test and the partial
  // bit put ~14k more of the steady loop's 152k stall samples between S and the softmax than
  // causal's loop has there; ncu, nothing masked, 16k; docs/perf-notes.md, Session 34), and a
  // partial block off the diagonal skips the usual rule's pass over its scores.
  mutable int win_lo = -(1 << 30);
  mutable unsigned win_skip = 0u, win_part = 0u, win_base = 0u;

  __device__ __forceinline__ void load_window(int row0, int top) const {
    win_lo = top - 31;
    const int n = win_lo + int(threadIdx.x % 32);
    const int c = n < 0 ? kFmSkip : fm_classify(__ldg(this->kbs + 2 * n), __ldg(this->kbs + 2 * n + 1), row0,
                                                 min(row0 + kBlockM, this->seqlen_q));
    win_skip = __ballot_sync(0xffffffffu, c == kFmSkip);
    win_part = __ballot_sync(0xffffffffu, c == kFmPartial);
    win_base = __ballot_sync(0xffffffffu, n >= 0 && Policy::Base::needs_mask_rows(row0, n));
  }
  __device__ __forceinline__ bool in_window(int n) const { return unsigned(n - win_lo) < 32u; }

  __device__ __forceinline__ void key_block_range_rows(int row0, int& n_min, int& n_max) const {
    this->key_block_range_rows_warps(row0, n_min, n_max);
    this->prefetch_range_ends(n_min, n_max);
  }
  // next_block's walk on the bits: the highest kept block in [n_min, n), else n_min (visited
  // whatever its class, as in the serial walk: a stream-K piece's n_min may be skipped).
  // The result goes through redux.sync: ptxas then keeps the walk's block index, and what the
  // step derives from it (the wgmma descriptors), in uniform registers; read from the bit words
  // alone it judged the loop per-thread and built the descriptors in vector registers, moved to
  // uniform ones before every HGMMA (SASS: docs/perf-notes.md, "the forward loop's uniform
  // registers").
  __device__ __forceinline__ int next_block(int row0, int n, int n_min) const {
    return __reduce_max_sync(0xffffffffu, walk_bits(row0, n, n_min));
  }
  __device__ __forceinline__ int walk_bits(int row0, int n, int n_min) const {
    for (--n; n > n_min; n = win_lo - 1) {
      if (!in_window(n)) load_window(row0, n);
      unsigned kept = ~win_skip & (0xffffffffu >> (31 - (n - win_lo)));  // blocks win_lo..n
      if (n_min > win_lo) kept &= 0xffffffffu << (n_min - win_lo);
      if (kept) return win_lo + 31 - __clz(kept);
      if (n_min >= win_lo) return n_min;
    }
    return n;
  }
  __device__ __forceinline__ bool needs_mask_rows(int row0, int n) const {
    if (!in_window(n)) load_window(row0, n);
    return ((win_part | win_base) >> (n - win_lo)) & 1u;
  }
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_rows(TensorS& scores, const TensorC& coords, int row0, int n) const {
    if (!in_window(n)) load_window(row0, n);
    if ((win_base >> (n - win_lo)) & 1u) Policy::Base::apply_rows(scores, coords, row0, n);
    if ((win_part >> (n - win_lo)) & 1u) {
      if (n > 0) this->prefetch_columns(n - 1);  // a partial block's neighbour is often partial
      this->apply_partial(scores, coords, row0, n);
    }
  }
};

// FlashMaskPolicy for consumers short of registers (d = 256: O alone takes 128 per thread). The
// plain apply_partial reads all of a thread's columns' bounds (16 int4 at kBlockN = 64) unrolled,
// which ptxas issued together and spilled for (then from global memory); here they are read from
// the warp's slot 4 columns per turn of a rolled loop and reduced at once to one bit per (row,
// column), and the scores are masked from those bits: at most 16 registers of bounds in flight.
// It keeps no class cache (two more registers).
template <int kBlockM, int kBlockN>
struct FlashMaskPolicyLowRegs : FlashMaskPolicy<kBlockM, kBlockN, false> {
  using Policy = FlashMaskPolicy<kBlockM, kBlockN, false>;
  using Policy::Policy;
  // The consumers' policy: the warps' range ends, no class window (registers).
  using ForWarps = WarpRange<FlashMaskPolicyLowRegs>;

  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_rows(TensorS& scores, const TensorC& coords, int row0, int n) const {
    using namespace cute;
    constexpr int kRows = decltype(size<0>(scores))::value;
    constexpr int kCols = decltype(size<1>(scores))::value;
    constexpr int kTurn = 4;  // columns per turn
    static_assert(kCols <= 32 && kCols % kTurn == 0, "one 32-bit word of column bits per row");
    // The usual rule's pass only where it masks something (a window edge, the diagonal, the
    // seqlen_k edge): a partial block elsewhere skips its ~150 instructions.
    if (Policy::Base::needs_mask_rows(row0, n)) Policy::Base::apply_rows(scores, coords, row0, n);
    if (this->block_class(row0, n) != kFmPartial) return;
    if (n > 0) this->prefetch_columns(n - 1);  // a partial block's neighbour is often partial
    const int4* slot = this->stage_columns(n);
    uint32_t bits[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) bits[r] = 0u;
#pragma unroll 1
    for (int c0 = 0; c0 < kCols; c0 += kTurn) {
      CUTE_UNROLL
      for (int i = 0; i < kTurn; ++i) {
        // Columns at or past seqlen_k are staged as zeros, which fm_masked never masks (the usual
        // rule has masked them): no branch per column.
        const int4 bounds = slot[get<1>(coords(0, c0 + i))];  // the column within the block
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

// A FlashMask policy with the warps' range ends (key_block_range_rows_warps) and otherwise its
// own methods: the consumers' policy where no class window is kept.
template <typename Policy>
struct WarpRange : Policy {
  using ForWarps = WarpRange;
  __device__ __forceinline__ WarpRange(const FwdParams& p, const SeqInfo& seq, int head, int batch)
      : Policy(p, seq, head, batch) {}
  __device__ __forceinline__ void key_block_range_rows(int row0, int& n_min, int& n_max) const {
    this->key_block_range_rows_warps(row0, n_min, n_max);
    this->prefetch_range_ends(n_min, n_max);
  }
};

}  // namespace flash_ext::sm90
