// Stream-K tail of the Hopper forward without a mask (persistent grid, static walk).
//
// G CTAs walking T equal tiles with a static stride take ceil(T / G) waves; when the last one is
// partial (R = T mod G tiles), G - R SMs idle through it (the benchmark's 2048 tiles of 128 rows
// on 132 SMs: 15.5 waves, 3% of the call; one wave of 48 tiles: 64%). Here the first T - R tiles
// are walked whole and the key blocks of the last R, flattened tile by tile (W = R x key blocks),
// are split evenly over all G CTAs: CTA c runs blocks [c W / G, (c + 1) W / G) as its work items
// after its whole tiles. With R < G and W >= G each range is non-empty and shorter than a tile,
// so it is one or two pieces (the end of one tile, the start of the next).
// A piece parks its partial state (O unnormalized, row max, row sum; fp32, each thread's values
// in its accumulator order) in a workspace slot of its own; the last piece of a tile to arrive
// (a counter per tile and consumer warpgroup) merges every piece of the tile, in CTA order, so
// the result does not depend on which piece came last, and then runs the tile's usual epilogue.
// Launch side: sm90/fwd_launch.cuh (when, workspace); the walk: sm90/tile_scheduler.h.
#pragma once
#include <cmath>
#include <cute/tensor.hpp>

#include "common/combine.h"
#include "common/softmax.h"
#include "params.h"
#include "sm90/warpgroup.h"

namespace flash_ext::sm90 {

struct StreamKTail {
  int dp_tiles;     // tiles walked whole; the tail tiles follow
  int tail_blocks;  // W: key blocks of the tail tiles, flattened
  int n_blocks;     // key blocks per tile (no mask: every tile sees all keys)
  int ctas;         // G

  __device__ __forceinline__ StreamKTail(const FwdParams& p, int num_tiles, int key_blocks, int grid)
      : dp_tiles(p.sm90_dp_tiles), tail_blocks((num_tiles - p.sm90_dp_tiles) * key_blocks), n_blocks(key_blocks),
        ctas(grid) {}

  // First flattened tail block of CTA c (c = G: W). The host keeps W * G below 2^31.
  __device__ __forceinline__ int begin(int c) const { return int(unsigned(c) * unsigned(tail_blocks) / unsigned(ctas)); }
  // The CTA whose range holds flattened block b: the last c with begin(c) <= b.
  __device__ __forceinline__ int owner(int b) const {
    return int((unsigned(b + 1) * unsigned(ctas) - 1u) / unsigned(tail_blocks));
  }
  // Which of its (at most two) pieces CTA c runs on tail tile tt.
  __device__ __forceinline__ int piece_of(int c, int tt) const { return begin(c) / n_blocks == tt ? 0 : 1; }

  // Work item t >= dp_tiles of CTA c (its static walk goes on at dp_tiles + c, then + G): piece
  // j = (t - dp_tiles) / G of its range. The tile and its key blocks [n_lo, n_hi); false when
  // the range has no piece j.
  __device__ __forceinline__ bool piece(int t, int c, int& tile, int& n_lo, int& n_hi) const {
    const int j = (t - dp_tiles) / ctas;
    const int b0 = begin(c), b1 = begin(c + 1);
    const int tt = b0 / n_blocks + j;
    n_lo = max(b0 - tt * n_blocks, 0);
    n_hi = min(b1 - tt * n_blocks, n_blocks);
    tile = dp_tiles + tt;
    return n_lo < n_hi;
  }
};

// Consumer warpgroup `wg` (of kWGs; its 128 threads, tid 0..127, meet and vote at the
// warpgroup's own named barrier `barrier`) after the key blocks of work item t, a stream-K
// piece: parks this piece's state and, if it is the tile's last to arrive, merges all pieces
// into softmax and o_rows (then finalized and stored as a whole tile's; common/combine.h) and
// returns true; else returns false (the tile is not this piece's to store).
template <int kWGs, int kRows, typename TensorO>
__device__ __forceinline__ bool stream_k_park_or_merge(const StreamKTail& sk, const FwdParams& p, int t, int wg,
                                                       int tid, OnlineSoftmax<kRows>& softmax, TensorO& o_rows,
                                                       float scale_log2, int barrier) {
  using namespace cute;
  static_assert(kRows == 2, "the row max and sum of a thread's rows travel as one float4");
  constexpr int kCols = decltype(size<1>(o_rows))::value;
  static_assert(kCols % 4 == 0);
  constexpr int kVecs = kRows * kCols / 4;  // float4s of O per thread
  constexpr int kSlotVecs = (kVecs + 1) * 128;  // one warpgroup's slot: O, then (max, sum)
  const int c = blockIdx.x;
  const int j = (t - sk.dp_tiles) / sk.ctas;
  const int tt = sk.begin(c) / sk.n_blocks + j;
  // Slot of (CTA, piece, warpgroup); a thread's float4 v at [v * 128 + tid]: a warp's accesses
  // are 512 contiguous bytes.
  auto slot = [&](int cta, int piece) {
    return reinterpret_cast<float4*>(p.sm90_sk_partial) + size_t((cta * 2 + piece) * kWGs + wg) * kSlotVecs + tid;
  };
  {
    float4* mine = slot(c, j);
    CUTE_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      const int r = 4 * v / kCols, col = 4 * v % kCols;
      __stcg(mine + v * 128, make_float4(o_rows(r, col), o_rows(r, col + 1), o_rows(r, col + 2), o_rows(r, col + 3)));
    }
    __stcg(mine + kVecs * 128, make_float4(softmax.row_max[0], softmax.row_max[1], softmax.row_sum[0], softmax.row_sum[1]));
  }
  // Thread 0 counts the warpgroup's arrival, with release / acquire semantics at GPU scope: the
  // barrier orders the warpgroup's stores before its fence and acq_rel atomic (release, cumulative
  // over what the barrier made it observe), and a merging warpgroup's loads follow its own
  // thread 0's atomic (acquire) through the vote's barrier below. (__threadfence in every thread,
  // before and after, compiled to two MEMBAR.SC.GPU per thread and piece.) Predicated PTX, not a
  // branch: a branch on a per-thread value anywhere in the tile loop moves ptxas's main loop off
  // the uniform registers (docs/perf-notes.md, "the tile fold").
  named_barrier_sync(barrier, 128);
  const int first = sk.owner(tt * sk.n_blocks), last = sk.owner((tt + 1) * sk.n_blocks - 1);
  int arrived;
  asm volatile(
      "{\n .reg .pred p;\n setp.eq.u32 p, %2, 0;\n mov.b32 %0, -1;\n @p fence.acq_rel.gpu;\n"
      " @p atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n}\n"
      : "=r"(arrived) : "l"(p.sm90_sk_count + tt * kWGs + wg), "r"(tid) : "memory");
  const bool merges = arrived == last - first;
  // The vote is the same in every thread; redux.sync puts it in a uniform register. Branched on
  // as bar.red's predicate, it made ptxas move the main loop's stage indices and wgmma
  // descriptors out of the uniform registers (an R2UR before each wgmma, +31 instructions).
  if (!__reduce_max_sync(0xffffffffu, int(named_barrier_any(merges, barrier, 128)))) return false;
  // The other pieces' states, read from L2 (ld.global.cg: this SM's L1 may hold stale lines),
  // merged by log-sum-exp (common/combine.h).
  float m[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) m[r] = -INFINITY;
  for (int cta = first; cta <= last; ++cta) {
    const float4 ml = __ldcg(slot(cta, sk.piece_of(cta, tt)) + kVecs * 128);
    m[0] = fmaxf(m[0], ml.x);
    m[1] = fmaxf(m[1], ml.y);
  }
  float l[kRows] = {0.f, 0.f};
  cute::clear(o_rows);
  for (int cta = first; cta <= last; ++cta) {
    const float4* src = slot(cta, sk.piece_of(cta, tt));
    const float4 ml = __ldcg(src + kVecs * 128);
    const float mc[kRows] = {ml.x, ml.y}, lc[kRows] = {ml.z, ml.w};
    float s[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      s[r] = combine::part_weight(mc[r], m[r], scale_log2);
      l[r] += s[r] * lc[r];
    }
    CUTE_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      const int r = 4 * v / kCols, col = 4 * v % kCols;
      const float4 o = __ldcg(src + v * 128);
      o_rows(r, col) += s[r] * o.x;
      o_rows(r, col + 1) += s[r] * o.y;
      o_rows(r, col + 2) += s[r] * o.z;
      o_rows(r, col + 3) += s[r] * o.w;
    }
  }
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    softmax.row_max[r] = m[r];
    softmax.row_sum[r] = l[r];
  }
  return true;
}

}  // namespace flash_ext::sm90
