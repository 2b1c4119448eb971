// Causal / local (sliding window) masking: which key blocks a query block visits (block
// skipping), which of those need an elementwise mask, and the elementwise mask itself.
//
// Query row i (0-based within its sequence) sees key j iff
//     i + shift - window_left <= j <= i + shift + window_right,  shift = seqlen_k - seqlen_q
// (bottom-right alignment; a negative window bound means unbounded on that side), and j < seqlen_k.
// Causal is window_right = 0.
#pragma once
#include <cute/tensor.hpp>
#include <climits>
#include <cmath>

namespace flash_ext {

template <int kBlockM, int kBlockN, bool kHasWindow>
struct BlockMask {
  int seqlen_q, seqlen_k, window_left, window_right;

  __device__ __forceinline__ BlockMask(int sq, int sk, int wl, int wr)
      : seqlen_q(sq), seqlen_k(sk), window_left(wl), window_right(wr) {}

  // Key blocks [n_min, n_max) intersect the visible region of query block m_block. Blocks
  // outside are never loaded nor computed.
  __device__ __forceinline__ void key_block_range(int m_block, int& n_min, int& n_max) const {
    key_block_range_rows(m_block * kBlockM, n_min, n_max);
  }
  // The same for the kBlockM rows from row0 on (row0 may be negative: the Hopper forward's causal
  // tiles that start before row 0, sm90/fwd_kernel.cuh; rows < 0 exist in no output).
  __device__ __forceinline__ void key_block_range_rows(int row0, int& n_min, int& n_max) const {
    n_max = (seqlen_k + kBlockN - 1) / kBlockN;
    n_min = 0;
    if constexpr (kHasWindow) {
      const int shift = seqlen_k - seqlen_q;
      const int last_row = min(row0 + kBlockM, seqlen_q) - 1;
      if (window_right >= 0) {
        const int last_col = last_row + shift + window_right;  // may be negative
        n_max = min(n_max, last_col < 0 ? 0 : last_col / kBlockN + 1);
      }
      if (window_left >= 0) {
        const int first_col = row0 + shift - window_left;
        n_min = max(0, first_col < 0 ? 0 : first_col / kBlockN);
      }
    }
  }

  // The transpose, for the backward: query blocks [m_min, m_max) that see some key of key block
  // n_block. The first row that sees a key of the block is first_col - shift - window_right, the
  // last one last_col - shift + window_left.
  __device__ __forceinline__ void query_block_range(int n_block, int& m_min, int& m_max) const {
    m_min = 0;
    m_max = (seqlen_q + kBlockM - 1) / kBlockM;
    if constexpr (kHasWindow) {
      const int shift = seqlen_k - seqlen_q;
      const int first_col = n_block * kBlockN;
      const int last_col = min((n_block + 1) * kBlockN, seqlen_k) - 1;
      if (window_right >= 0) {
        const int first_row = first_col - shift - window_right;
        m_min = first_row <= 0 ? 0 : first_row / kBlockM;
      }
      if (window_left >= 0) {
        const int last_row = last_col - shift + window_left;
        m_max = min(m_max, last_row < 0 ? 0 : last_row / kBlockM + 1);
      }
    }
  }

  // True when some element of block (m_block, n_block) is masked: the seqlen_k edge or a window
  // boundary crosses it. Interior blocks skip the elementwise mask entirely.
  __device__ __forceinline__ bool needs_mask(int m_block, int n_block) const {
    return needs_mask_rows(m_block * kBlockM, n_block);
  }
  __device__ __forceinline__ bool needs_mask_rows(int row0, int n_block) const {
    if ((n_block + 1) * kBlockN > seqlen_k) return true;
    if constexpr (kHasWindow) {
      const int shift = seqlen_k - seqlen_q;
      const int first_row = row0, last_row = first_row + kBlockM - 1;
      const int first_col = n_block * kBlockN, last_col = first_col + kBlockN - 1;
      if (window_right >= 0 && last_col > first_row + shift + window_right) return true;
      if (window_left >= 0 && first_col < last_row + shift - window_left) return true;
    }
    return false;
  }

  // Set masked scores to -inf. `scores` is a (rows, cols) view of an accumulator fragment and
  // `coords` the same view of an identity tensor over the (kBlockM, kBlockN) tile, giving each
  // element's (row, col) in the tile. The visible key range is computed once per row.
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(TensorS& scores, const TensorC& coords, int m_block,
                                        int n_block) const {
    apply_rows(scores, coords, m_block * kBlockM, n_block);
  }
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_rows(TensorS& scores, const TensorC& coords, int row0,
                                             int n_block) const {
    using namespace cute;
    const int col0 = n_block * kBlockN;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(scores); ++r) {
      int col_end = seqlen_k - col0;  // first masked column (tile coordinates), exclusive bound
      int col_begin = 0;              // first visible column
      if constexpr (kHasWindow) {
        const int row = row0 + get<0>(coords(r, 0));
        const int diag = row + seqlen_k - seqlen_q - col0;
        if (window_right >= 0) col_end = min(col_end, diag + window_right + 1);
        if (window_left >= 0) col_begin = diag - window_left;
      }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const int col = get<1>(coords(0, c));
        if (col >= col_end || col < col_begin) scores(r, c) = -INFINITY;
      }
    }
  }
};

// The same mask walked key-block-major, as the backward walks it: a CTA owns key block n_block
// and visits the query blocks [m_min, m_max) that see some of its keys. Key j is visible from
// the query rows j - shift - window_right ... j - shift + window_left (the rule above, solved
// for i), and from none when j >= seqlen_k.
template <int kBlockM, int kBlockN, bool kHasWindow>
struct KeyBlockMask {
  BlockMask<kBlockM, kBlockN, kHasWindow> mask;
  int n_block;

  __device__ __forceinline__ KeyBlockMask(int sq, int sk, int wl, int wr, int n)
      : mask(sq, sk, wl, wr), n_block(n) {}

  // Query blocks [m_min, m_max) that see some key of this key block; the others are skipped.
  __device__ __forceinline__ void query_block_range(int& m_min, int& m_max) const {
    mask.query_block_range(n_block, m_min, m_max);
  }

  // True when some element of tile (m_block, n_block) is masked.
  __device__ __forceinline__ bool needs_mask(int m_block) const { return mask.needs_mask(m_block, n_block); }

  // The elementwise mask on a score tile laid out as S (rows = queries of m_block, cols = keys),
  // with `coords` as in BlockMask::apply.
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(TensorS& scores, const TensorC& coords, int m_block) const {
    mask.apply(scores, coords, m_block, n_block);
  }

  // The elementwise mask on a tile laid out as S^T (rows = keys of this block, cols = queries of
  // m_block): `coords` gives each element's (key, query) in the (kBlockN, kBlockM) tile. The
  // visible query range is computed once per key row; a key past seqlen_k sees no query.
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply_transposed(TensorS& scores_t, const TensorC& coords,
                                                   int m_block) const {
    using namespace cute;
    const int shift = mask.seqlen_k - mask.seqlen_q;
    const int query0 = m_block * kBlockM;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(scores_t); ++r) {
      const int key = n_block * kBlockN + get<0>(coords(r, 0));
      int col_begin = 0, col_end = key < mask.seqlen_k ? INT_MAX : INT_MIN;  // visible [begin, end)
      if constexpr (kHasWindow) {
        if (mask.window_right >= 0) col_begin = key - shift - mask.window_right - query0;
        if (mask.window_left >= 0) col_end = min(col_end, key - shift + mask.window_left - query0 + 1);
      }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores_t); ++c) {
        const int col = get<1>(coords(0, c));
        if (col < col_begin || col >= col_end) scores_t(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace flash_ext
