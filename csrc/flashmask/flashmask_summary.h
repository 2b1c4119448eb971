// Kernel A of FlashMask (csrc/flashmask/flashmask_summary.cu): from the caller's bounds
// (startend_row_indices, any strides, last dim contiguous) to the normalized bounds `nb` and the
// key-block summaries `kbs` of common/flashmask.h, for one key-block size. Plain C++ here (no
// torch, no CUTLASS): the ops (csrc/api/flashmask.cpp) allocate the output and fill this.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/flashmask.h"

namespace flash_ext {

struct FlashMaskSummaryArgs {
  // Bounds: (batch, mask heads, seqlen_k, c) or varlen (mask heads, total_k, c), int32, in elements.
  const int* bounds;
  int64_t batch_stride;  // 0 for varlen (sequence b starts at column cu_seqlens_k[b])
  int64_t head_stride, col_stride;
  int c;        // values per column: 1 or 2 with causal, 2 or 4 without
  bool causal;  // which intervals the c values describe (common/flashmask.h)
  int batch, heads;  // heads: mask heads
  int seqlen_k;      // columns per batch row; varlen: the longest sequence's (the grid extent)
  const int* cu_seqlens_k;  // nullptr when not varlen
  // Output (device memory the caller owns), laid out as `layout` says (its nb / kbs are these).
  int4* nb;
  int4* kbs;
  FlashMaskView layout;
  // Fixed length: where to add the number of (row, column) pairs the mask keeps (zeroed by the
  // caller; nullptr: not counted), the query rows and whether the causal rule applies.
  unsigned long long* visible_pairs;
  int seqlen_q;
  // With visible_pairs, for the Hopper backward's CTA order (else nullptr): each CTA also adds
  // its count squared into visible_sq and counts itself in ctas_done (both zeroed by the caller);
  // the last CTA writes *bwd_longest_first = 1 where pairs < lpt_below and the 128-column
  // chunks' counts vary (lpt_imbalance * sum of squares > pairs^2), else 0.
  double* visible_sq;
  unsigned* ctas_done;
  int* bwd_longest_first;
  long long lpt_below;
  double lpt_imbalance;
};

// Queues kernel A on `stream`; allocates nothing. One CTA of 128 threads per (128-column chunk,
// mask head, batch row); layout.block_n must be 32, 64 or 128.
void launch_flashmask_summary(const FlashMaskSummaryArgs& args, cudaStream_t stream);

}  // namespace flash_ext
