// FlashMask in the attention ops (docs/design-flashmask.md 9.2): the structural checks of
// startend_row_indices, and the per-call normalized bounds and key-block summaries (kernel A,
// csrc/flashmask/) that FwdParams::fm points into. Value checks (bounds within [0, seqlen_q],
// ordered intervals) are the Python layer's; kernel A clamps and orders on the device anyway.
#pragma once
#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "api/checks.h"
#include "params.h"

namespace flash_ext {

// What every user of kernel A needs of the bounds: an int32 CUDA tensor, (batch, hm, seqlen_k, C)
// or varlen (hm, total_k, C), C fitting `causal`, last dim contiguous.
void check_flashmask_bounds(const at::Tensor& bounds, bool varlen, bool causal);

// startend_row_indices of an attention call: int32 on q's device, (batch, hm, seqlen_k, C) or
// varlen (hm, total_k, C), hm in {1, heads_kv}, C in {1, 2} with causal and {2, 4} without,
// last dim contiguous; no dropout; window (-1, -1), or (-1, 0) with causal.
void check_flashmask_inputs(const at::Tensor& bounds, const at::Tensor& q, const AttnShape& s, bool causal,
                            int64_t window_left, int64_t window_right, double dropout_p);

// Kernel A's output for one key-block size: nb (hm, cols, 4) and kbs (hm, blocks, 2, 4), int32
// views of one allocation, and the view the kernels read.
struct FlashMaskSummary {
  at::Tensor nb, kbs;
  FlashMaskView view;
  // The Hopper forward's tile table (flashmask/flashmask_fwd_tiles.h), where made: range (hm,
  // batch, query blocks, 2) and order (hm, batch, query blocks), int32 views of the same allocation.
  at::Tensor fwd_range, fwd_order;
};

// Allocates (caching allocator) and queues kernel A on `stream`. seqlen_q: the query rows (varlen:
// the longest sequence's), from which R = round_up(seqlen_q, 128); seqlen_k: the columns per batch
// row (varlen: the longest sequence's; the grid covers that many). group: query heads per mask head.
// count_for (fixed length; ignored for varlen): kernel A also counts the (row, column) pairs the
// mask keeps into view.visible_pairs, for the Hopper forward under L2 sections
// (view.one_section_below: under which count its tile order drops the sections) or the Hopper
// backward's CTA order (view.bwd_longest_first, decided by kernel A's last CTA; its sum of
// squares: *sum_sq_out, for the testing op, when given). fwd_tiles_block_m > 0 (fixed length, at
// most kFmFwdTilesMaxBlocks query blocks): also the Hopper forward's tile table for query blocks of
// that many rows (view.fwd_order / fwd_range; flashmask/flashmask_fwd_tiles.h).
enum class FmCountFor { kNothing, kFwdSections, kBwdOrder };
FlashMaskSummary make_flashmask_summary(const at::Tensor& bounds, const std::optional<at::Tensor>& cu_seqlens_k,
                                        int64_t seqlen_q, int64_t seqlen_k, bool causal, int block_n, int group,
                                        cudaStream_t stream, FmCountFor count_for = FmCountFor::kNothing,
                                        const double** sum_sq_out = nullptr, int fwd_tiles_block_m = 0);

// Checks and summarizes the bounds of an attention call for a kernel of key-block size block_n
// and points p at the result (p.has_flashmask, p.fm; the windowed kernel variant: has_window).
// The returned summary owns the buffers: keep it until the launches that read them are queued.
// count_for: as make_flashmask_summary's.
FlashMaskSummary set_flashmask_params(FwdParams& p, const at::Tensor& bounds, const AttnShape& s,
                                      const std::optional<at::Tensor>& cu_seqlens_k, bool causal, int block_n,
                                      cudaStream_t stream, FmCountFor count_for = FmCountFor::kNothing,
                                      int fwd_tiles_block_m = 0);

}  // namespace flash_ext
