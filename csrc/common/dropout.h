// Attention dropout: which elements of P are dropped, as a pure function of
//     (seed, offset, bh = batch * heads_q + head, row, col)
// (row = query position, col = key position, both within the sequence; for varlen batches
// `batch` is the sequence index). Nothing depends on tile sizes, thread layouts or the kernel
// variant, so the forward, both backward kernels, the dropout_mask op and the Python reference
// (flash_ext/_philox.py) all produce the same mask.
//
// Counter layout. One Philox4x32-10 call (common/philox.h) gives four 32-bit words for a 2 x 2
// group of elements: rows {r, r + 8} x cols {c, c + 1} with r % 16 < 8 and c even. That is
// exactly what one thread holds of an m16n8 mma.sync accumulator tile, so each thread makes one
// call per 16x8 tile and uses all four words.
//     counter = { col >> 1,
//                 (row >> 4) * 8 + (row & 7),        // the row pair {r, r + 8} of the group
//                 bh,
//                 offset & 0xffffffff }
//     key     = { seed & 0xffffffff,  (seed >> 32) + (offset >> 32)  (mod 2^32) }
//     word    = ((row >> 3) & 1) * 2 + (col & 1)     // 0..3 = x, y, z, w
// Element (row, col) is DROPPED iff word < threshold, threshold = floor(p * 2^32 + 0.5)
// (computed in double from the Python float p; p = 1 drops everything: the kernels then use
// threshold 2^32 - 1 with a keep scale of 0). Kept elements are scaled by 1 / (1 - p).
//
// seed and offset come from torch's default CUDA generator (flash_ext::rng_state op in
// csrc/ops_dropout.cpp: a fresh offset per call, so that calls differ; torch.manual_seed makes
// runs reproducible).
#pragma once
#include <cute/tensor.hpp>
#include <cstdint>

#include "common/philox.h"

namespace flash_ext {

// The words of the group holding element (row, col); also used by the dropout_mask op.
FLASH_EXT_HD Philox4 dropout_group_words(uint64_t seed, uint64_t offset, uint32_t bh, uint32_t row,
                                         uint32_t col) {
  const Philox4 ctr{col >> 1, ((row >> 4) << 3) | (row & 7u), bh, static_cast<uint32_t>(offset)};
  const uint32_t k0 = static_cast<uint32_t>(seed);
  const uint32_t k1 = static_cast<uint32_t>(seed >> 32) + static_cast<uint32_t>(offset >> 32);
  return philox4x32<10>(ctr, k0, k1);
}

struct Dropout {
  uint64_t seed, offset;
  uint32_t bh;
  uint32_t threshold;  // dropped iff word < threshold

  __device__ __forceinline__ Dropout(uint64_t seed_, uint64_t offset_, int bh_, uint32_t threshold_)
      : seed(seed_), offset(offset_), bh(uint32_t(bh_)), threshold(threshold_) {}

  // acc: an m16n8 accumulator fragment ((2 cols, 2 row halves), MMA_M, MMA_N) (value v of an
  // atom is column c + (v & 1) of row r + 8 * (v >> 1), r % 16 < 8, c even); coords: the same
  // partition of an identity tensor over the tile, giving each value's (row, col) in the tile;
  // row0, col0: the tile's first row and column in the sequence. Each dropped value x becomes
  // kDropped(x) (e.g. 0, or -x to remember the decision in the sign of P >= 0).
  template <typename TensorAcc, typename TensorC, typename Op>
  __device__ __forceinline__ void apply(TensorAcc& acc, const TensorC& coords, int row0, int col0,
                                        Op dropped) const {
    using namespace cute;
    static_assert(decltype(size<0>(acc))::value == 4, "expects m16n8 accumulator fragments");
    static_assert(decltype(rank(acc))::value == 3);
    CUTE_UNROLL
    for (int m = 0; m < size<1>(acc); ++m) {
      CUTE_UNROLL
      for (int n = 0; n < size<2>(acc); ++n) {
        const int row = row0 + get<0>(coords(0, m, n));  // r: the group's first row
        const int col = col0 + get<1>(coords(0, m, n));  // c: the group's first column (even)
        const Philox4 w = dropout_group_words(seed, offset, bh, uint32_t(row), uint32_t(col));
        if (w.x < threshold) acc(0, m, n) = dropped(acc(0, m, n));  // (r,     c)
        if (w.y < threshold) acc(1, m, n) = dropped(acc(1, m, n));  // (r,     c + 1)
        if (w.z < threshold) acc(2, m, n) = dropped(acc(2, m, n));  // (r + 8, c)
        if (w.w < threshold) acc(3, m, n) = dropped(acc(3, m, n));  // (r + 8, c + 1)
      }
    }
  }
};

}  // namespace flash_ext
