// FlashMask's tile table for the Hopper forward (fixed length; flashmask_fwd_tiles.cu). Per (mask
// head, batch row) and query block of the forward's tile:
//   range[q] = (n_min, n_max): the key blocks its walk spans once the skipped blocks at both ends
//              of the causal range are dropped ((lo, lo) when every block is skipped), the range
//              the kernel's policy would find by scanning the summaries (sm90/fwd_mask.h);
//   order[i] = the i-th query block to run: grouped by the walk's first key block (a document's
//              tiles), longest group first, the later block first within a group (a causal-shaped
//              mask keeps the plain causal order; flashmask_fwd_tiles.cu says why not by length).
// The forward's tile scheduler takes its tiles in `order` and both of its roles read a tile's range
// from `range`: a document mask's tiles no longer start with a scan past the documents before
// theirs, and its longest document no longer comes last (docs/perf-notes.md, Session 33).
#pragma once
#include <cuda_runtime.h>

#include "common/flashmask.h"

namespace flash_ext {

// Beyond this many query blocks per (mask head, batch row) no table is made (the order kernel
// keeps two values per query block in static shared memory); the kernels then scan as before.
constexpr int kFmFwdTilesMaxBlocks = 6144;

struct FlashMaskFwdTilesArgs {
  const int4* kbs;      // kernel A's summaries, made for block_n (layout: FlashMaskView)
  int64_t kbs_head_stride;
  int blocks_per_batch;
  int heads, batch;     // mask heads, batch rows
  int seqlen_q, seqlen_k;
  bool causal;          // the causal rule (bottom-right aligned) bounds each range from above
  int block_m, block_n;
  int m_blocks;         // ceil(seqlen_q / block_m)
  // Output, (heads, batch, m_blocks) each; counts: the walks' lengths (the order sorts by them; the
  // forward compares them with the range's length: FlashMaskView::fwd_count).
  int2* range;
  int* order;
  int* counts;
};

// Queues the two kernels of the table on `stream` (after kernel A, which wrote kbs); allocates
// nothing. m_blocks must be <= kFmFwdTilesMaxBlocks.
void launch_flashmask_fwd_tiles(const FlashMaskFwdTilesArgs& args, cudaStream_t stream);

}  // namespace flash_ext
