// FlashMask (docs/design-flashmask.md): column-wise interval masks. For key column j the caller
// gives query-row bounds; the kernels read them in a normalized form, two intervals per column,
//     row i of column j is masked  iff  ls <= i < le  or  us <= i < ue   (plus the causal rule),
// stored as int4 (ls, le - ls, us, ue - us) so that each test is one unsigned compare. An empty
// interval is (R, 0) with R = seqlen_q rounded up to a multiple of 128 (>= every block's end).
//
// Per key block of the consuming kernel's kBlockN, a summary of its columns (two int4):
//     skip half: (max ls, min le, max us, min ue)     full half: (min ls, max le, min us, max ue)
// from which a (query block, key block) pair is classified without reading the columns
// (fm_classify). Columns past the end of a sequence (padding) are (0, R, R, 0): masked in every
// row, so a block holding them is never "full".
//
// Layout of both arrays (written by csrc/flashmask/flashmask_summary.cu, read by the kernels),
// mask head g, batch row b, column j / key block n:
//     nb [g * nb_head_stride  + col0(b) + j]          col0(b) = varlen ? cu_k[b] + 128 b : b * sk_pad
//     kbs[2 * (g * kbs_head_stride + blk0(b) + n) + {0: skip half, 1: full half}]
//                                                     blk0(b) = varlen ? cu_k[b] / block_n + b
//                                                                      : b * blocks_per_batch
// sk_pad = seqlen_k rounded up to 128 (non-varlen); blocks_per_batch = sk_pad / block_n. In the
// varlen layout each sequence is followed by >= 128 padding columns and >= 1 spare block slot,
// so no scan over the batch is needed. Nothing here is larger than O(seqlen).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FLASH_EXT_HD __host__ __device__ __forceinline__
#else
#define FLASH_EXT_HD inline
#include <vector_types.h>
#endif

namespace flash_ext {

// What FwdParams / BwdParams carry for a FlashMask call (p.has_flashmask).
struct FlashMaskView {
  const int4* nb;          // normalized bounds, one int4 per column
  const int4* kbs;         // key-block summaries, two int4 per block (skip half, full half)
  int64_t nb_head_stride;  // int4 entries per mask head
  int64_t kbs_head_stride; // summary pairs per mask head
  int sk_pad;              // non-varlen: columns per batch row in nb (multiple of 128)
  int blocks_per_batch;    // non-varlen: summary pairs per batch row
  int block_n;             // the key-block size the summaries were made for
  int group;               // query heads per mask head: mask head = query head / group
  int empty_row;           // R: the start of an empty interval
  // Fixed-length Hopper forward only (else nullptr / 0): the number of (query row, key column)
  // pairs the mask keeps, summed over mask heads and batch rows (kernel A adds it up), and the
  // count below which the forward's tile order takes one section instead of the host's L2
  // sections (sm90/tile_scheduler.h): a sparse mask's tiles stream few K/V blocks, so the
  // sections buy little there and their tail costs ~10% (docs/perf-notes.md, "the FlashMask
  // forward's sections").
  const unsigned long long* visible_pairs;
  long long one_section_below;
  // Fixed-length Hopper backward only (else nullptr): 1 where its CTAs run longest first in one
  // section, 0 where they keep the 3-D grid's order, as kernel A's last CTA decided from its
  // counts (flashmask/flashmask_summary.h; read by sm90/bwd_tile_order.h).
  const int* bwd_longest_first;
  // Fixed-length Hopper forward only (else nullptr): the tile table of
  // flashmask/flashmask_fwd_tiles.h, (mask head, batch row, query block) each: the tiles' order
  // (a document's tiles together, the longest document first) and each query block's key-block
  // range. fwd_m_blocks: query blocks per
  // (mask head, batch row), of the forward tile's rows.
  const int* fwd_order;
  const int2* fwd_range;
  // Each query block's count of kept key blocks (the range kernel's; equal to the range's length
  // where the range has no skipped block: the forward then walks it as n - 1).
  const int* fwd_count;
  int fwd_m_blocks;
};

enum FmBlockClass : int { kFmSkip = 0, kFmFull = 1, kFmPartial = 2 };

// Summary layout offsets (see the header comment).
FLASH_EXT_HD int64_t fm_col0(const FlashMaskView& v, const int* cu_seqlens_k, int batch) {
  return cu_seqlens_k != nullptr ? int64_t(cu_seqlens_k[batch]) + 128 * int64_t(batch)
                                 : int64_t(batch) * v.sk_pad;
}
FLASH_EXT_HD int64_t fm_blk0(const FlashMaskView& v, const int* cu_seqlens_k, int batch) {
  return cu_seqlens_k != nullptr ? int64_t(cu_seqlens_k[batch] / v.block_n) + batch
                                 : int64_t(batch) * v.blocks_per_batch;
}

// The skip test alone (the summary's skip half: x = ls_max, y = le_min, z = us_max, w = ue_min):
// the lower-triangle interval covers the rows, or the upper one does, or the upper then the lower
// one, touching. The forward's range ends need no more.
FLASH_EXT_HD bool fm_skips(int4 skip, int r0, int r1) {
  return (skip.x <= r0 && skip.y >= r1) || (skip.z <= r0 && skip.w >= r1) ||
         (skip.z <= r0 && skip.x <= skip.w && skip.y >= r1);
}

// Class of the pair (query rows [r0, r1), a key block with summary halves `skip` / `full`) by the
// intervals alone (the caller adds causal and the seqlen_k edge). Sufficient tests, conservative
// towards kFmPartial: "skip" implies every entry is masked, "full" that none is.
FLASH_EXT_HD int fm_classify(int4 skip, int4 full, int r0, int r1) {
  if (fm_skips(skip, r0, r1)) return kFmSkip;
  // full: x = ls_min, y = le_max, z = us_min, w = ue_max
  const bool lt_clear = full.x >= r1 || full.y <= r0;
  const bool ut_clear = full.z >= r1 || full.w <= r0;
  return lt_clear && ut_clear ? kFmFull : kFmPartial;
}

// True when row `row` of the column whose normalized bounds are `b` is masked.
FLASH_EXT_HD bool fm_masked(int4 b, int row) {
  return unsigned(row - b.x) < unsigned(b.y) || unsigned(row - b.z) < unsigned(b.w);
}

}  // namespace flash_ext

#undef FLASH_EXT_HD
