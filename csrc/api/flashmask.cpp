// api/flashmask.h.
#include "api/flashmask.h"

#include <ATen/ATen.h>
#include <algorithm>
#include <cmath>
#include <c10/cuda/CUDAException.h>

#include "api/errors.h"
#include "flashmask/flashmask_fwd_tiles.h"
#include "flashmask/flashmask_summary.h"

namespace flash_ext {
namespace {

constexpr int64_t kFmChunk = 128;  // nb's column padding and R's rounding (common/flashmask.h)

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

void check_flashmask_bounds(const at::Tensor& bounds, bool varlen, bool causal) {
  FLASH_EXT_CHECK(bounds.is_cuda(), "flash_ext: startend_row_indices must be a CUDA tensor");
  FLASH_EXT_CHECK(bounds.scalar_type() == at::kInt, "flash_ext: startend_row_indices must be int32; got ",
                  bounds.scalar_type());
  FLASH_EXT_CHECK(bounds.dim() == (varlen ? 3 : 4), "flash_ext: startend_row_indices must be ",
                  varlen ? "(heads, total_k, C) with cu_seqlens" : "(batch, heads, seqlen_k, C)", "; got shape ",
                  bounds.sizes());
  const int64_t c = bounds.size(-1);
  if (causal) {
    FLASH_EXT_CHECK(c == 1 || c == 2, "flash_ext: with causal=True startend_row_indices needs C = 1 (LTS) or ",
                    "2 (LTS, LTE) values per column; got C = ", c);
  } else {
    FLASH_EXT_CHECK(c == 2 || c == 4, "flash_ext: with causal=False startend_row_indices needs C = 2 (LTS, UTE) ",
                    "or 4 (LTS, LTE, UTS, UTE) values per column; got C = ", c);
  }
  FLASH_EXT_CHECK(bounds.stride(-1) == 1 || c == 1,
                  "flash_ext: startend_row_indices must have a contiguous last dimension; got strides ",
                  bounds.strides());
  FLASH_EXT_CHECK(bounds.size(-3) <= 65535 && (varlen || bounds.size(0) <= 65535),
                  "flash_ext: startend_row_indices: batch and heads must be <= 65535");
}

void check_flashmask_inputs(const at::Tensor& bounds, const at::Tensor& q, const AttnShape& s, bool causal,
                            int64_t window_left, int64_t window_right, double dropout_p) {
  check_flashmask_bounds(bounds, s.varlen, causal);
  FLASH_EXT_CHECK(bounds.device() == q.device(), "flash_ext: startend_row_indices must be on q's device (",
                  q.device(), "); got ", bounds.device());
  const int64_t hm = bounds.size(-3);
  FLASH_EXT_CHECK(hm == 1 || hm == s.heads_kv, "flash_ext: startend_row_indices has ", hm,
                  " heads; it needs 1 or heads_kv = ", s.heads_kv);
  if (s.varlen) {
    FLASH_EXT_CHECK(bounds.size(1) == s.total_k, "flash_ext: startend_row_indices must be (heads, total_k, C) ",
                    "with total_k = ", s.total_k, " (k's rows); got shape ", bounds.sizes());
  } else {
    FLASH_EXT_CHECK(bounds.size(0) == s.batch && bounds.size(2) == s.seqlen_k,
                    "flash_ext: startend_row_indices must be (batch, heads, seqlen_k, C) with batch = ", s.batch,
                    " and seqlen_k = ", s.seqlen_k, "; got shape ", bounds.sizes());
  }
  FLASH_EXT_CHECK(dropout_p == 0.0, "flash_ext: startend_row_indices does not support dropout (dropout_p = ",
                  dropout_p, ")");
  FLASH_EXT_CHECK(window_left == -1 && (window_right == -1 || (causal && window_right == 0)),
                  "flash_ext: startend_row_indices takes no window (window_size must be (-1, -1)); got (",
                  window_left, ", ", window_right, ")");
}

FlashMaskSummary make_flashmask_summary(const at::Tensor& bounds, const std::optional<at::Tensor>& cu_seqlens_k,
                                        int64_t seqlen_q, int64_t seqlen_k, bool causal, int block_n, int group,
                                        cudaStream_t stream, FmCountFor count_for, const double** sum_sq_out,
                                        int fwd_tiles_block_m) {
  FLASH_EXT_CHECK(block_n == 32 || block_n == 64 || block_n == 128,
                  "flash_ext: FlashMask summaries are made for key blocks of 32, 64 or 128 columns; got ", block_n);
  const bool varlen = cu_seqlens_k.has_value();
  const int64_t hm = bounds.size(-3);
  const int64_t batch = varlen ? cu_seqlens_k->numel() - 1 : bounds.size(0);
  const int64_t total_k = varlen ? bounds.size(1) : 0;
  FlashMaskView v{};
  v.block_n = block_n;
  v.group = group;
  v.empty_row = int(round_up(seqlen_q, kFmChunk));
  v.sk_pad = varlen ? 0 : int(round_up(seqlen_k, kFmChunk));
  v.blocks_per_batch = varlen ? 0 : v.sk_pad / block_n;
  const int64_t cols = varlen ? total_k + kFmChunk * batch : batch * v.sk_pad;
  const int64_t blocks = varlen ? total_k / block_n + batch + 1 : batch * v.blocks_per_batch;
  v.nb_head_stride = cols;
  v.kbs_head_stride = blocks;
  // The kernels index both in int32 (common/flashmask_tile.h).
  FLASH_EXT_CHECK(hm * cols < (int64_t(1) << 31) && 2 * hm * blocks < (int64_t(1) << 31),
                  "flash_ext: startend_row_indices: too many columns for FlashMask's int32 indices");

  // One allocation: nb (4 int32 per column), then kbs (8 per block), then (counting, fixed length)
  // the counters: kept pairs (u64), their sum of squares (f64), CTAs done (u32), the backward's
  // order (i32); all 16-byte aligned.
  const bool count_visible = count_for != FmCountFor::kNothing && !varlen;
  const int64_t nb_ints = hm * cols * 4, kbs_ints = hm * blocks * 8;
  // The Hopper forward's tile table (fixed length): range (2 int32), order and count (1 each) per
  // (mask head, batch row, query block), after the counters.
  const int64_t fwd_m_blocks = fwd_tiles_block_m > 0 ? (seqlen_q + fwd_tiles_block_m - 1) / fwd_tiles_block_m : 0;
  const bool fwd_tiles = !varlen && fwd_m_blocks > 0 && fwd_m_blocks <= kFmFwdTilesMaxBlocks;
  const int64_t tiles = fwd_tiles ? hm * batch * fwd_m_blocks : 0;
  const int64_t counter_ints = count_visible ? 8 : 0;
  const at::Tensor buf = at::empty({nb_ints + kbs_ints + counter_ints + 4 * tiles}, bounds.options().dtype(at::kInt));
  FlashMaskSummary out;
  out.nb = buf.narrow(0, 0, nb_ints).view({hm, cols, 4});
  out.kbs = buf.narrow(0, nb_ints, kbs_ints).view({hm, blocks, 2, 4});
  int4* nb = reinterpret_cast<int4*>(out.nb.data_ptr<int>());
  int4* kbs = reinterpret_cast<int4*>(out.kbs.data_ptr<int>());
  v.nb = nb;
  v.kbs = kbs;
  FlashMaskSummaryArgs a{};
  if (count_visible) {
    int* counters = buf.data_ptr<int>() + nb_ints + kbs_ints;
    C10_CUDA_CHECK(cudaMemsetAsync(counters, 0, 8 * sizeof(int), stream));  // 0.0 is all zero bits
    a.visible_pairs = reinterpret_cast<unsigned long long*>(counters);
    v.visible_pairs = a.visible_pairs;
    // The pairs the plain causal rule keeps (bottom-right aligned), over mask heads and batch rows:
    // column j keeps sq - clamp(j - shift, 0, sq) rows, sq for j < shift, then one fewer per column.
    const double sq = double(seqlen_q), sk = double(seqlen_k), shift = sk - sq;
    const double j0 = std::clamp(shift, 0.0, sk), j1 = std::clamp(shift + sq, 0.0, sk), n = j1 - j0;
    const double t0 = j0 - shift, t1 = j1 - 1 - shift;  // j - shift over the diagonal's columns
    const double causal_unit = j0 * sq + (n > 0 ? n * sq - (t0 + t1) * n / 2 : 0.0);  // per (mask head, batch row)
    if (count_for == FmCountFor::kFwdSections) {
      // One section below 40% of causal's pairs: the causal document and sliding window masks of
      // the bench keep 23-26% of causal's pairs, shared question 53%, prefix LM 106%.
      v.one_section_below = (long long)(0.4 * causal_unit * double(hm) * double(batch));
    } else {
      // Longest first in one section below 80% of causal's pairs where the 128-column chunks'
      // counts vary by a coefficient of variation over 0.4 (n * sum of squares / sum^2 > 1.16):
      // the bench's causal document (0.26 of causal's pairs, CV 0.60) and shared question (0.53,
      // 1.34) gained 3-5% there on an H100 at 8k-16k; prefix LM (1.06) lost 5% and the sliding
      // window (0.23, CV 0.10-0.21: even walks) 1.5%, so they keep the 3-D grid's order.
      a.visible_sq = reinterpret_cast<double*>(counters + 2);
      a.ctas_done = reinterpret_cast<unsigned*>(counters + 4);
      a.bwd_longest_first = counters + 5;
      a.lpt_below = (long long)(0.8 * causal_unit * double(hm) * double(batch));
      a.lpt_imbalance = double(hm) * double(batch) * std::ceil(sk / double(kFmChunk)) / (1.0 + 0.4 * 0.4);
      v.bwd_longest_first = a.bwd_longest_first;
      if (sum_sq_out != nullptr) *sum_sq_out = a.visible_sq;
    }
  }
  out.view = v;

  a.bounds = bounds.data_ptr<int>();
  a.batch_stride = varlen ? 0 : bounds.stride(0);
  a.head_stride = bounds.stride(-3);
  a.col_stride = bounds.stride(-2);
  a.c = int(bounds.size(-1));
  a.causal = causal;
  a.batch = int(batch);
  a.heads = int(hm);
  a.seqlen_k = int(seqlen_k);
  a.cu_seqlens_k = varlen ? cu_seqlens_k->data_ptr<int>() : nullptr;
  a.nb = nb;
  a.kbs = kbs;
  a.layout = v;
  a.seqlen_q = int(seqlen_q);
  launch_flashmask_summary(a, stream);
  if (fwd_tiles) {
    int* table = buf.data_ptr<int>() + nb_ints + kbs_ints + counter_ints;
    FlashMaskFwdTilesArgs t{};
    t.kbs = kbs;
    t.kbs_head_stride = v.kbs_head_stride;
    t.blocks_per_batch = v.blocks_per_batch;
    t.heads = int(hm);
    t.batch = int(batch);
    t.seqlen_q = int(seqlen_q);
    t.seqlen_k = int(seqlen_k);
    t.causal = causal;
    t.block_m = fwd_tiles_block_m;
    t.block_n = block_n;
    t.m_blocks = int(fwd_m_blocks);
    t.range = reinterpret_cast<int2*>(table);
    t.order = table + 2 * tiles;
    t.counts = table + 3 * tiles;
    launch_flashmask_fwd_tiles(t, stream);
    out.view.fwd_range = t.range;
    out.view.fwd_order = t.order;
    out.view.fwd_count = t.counts;
    out.view.fwd_m_blocks = t.m_blocks;
    out.fwd_range = buf.narrow(0, nb_ints + kbs_ints + counter_ints, 2 * tiles).view({hm, batch, fwd_m_blocks, 2});
    out.fwd_order = buf.narrow(0, nb_ints + kbs_ints + counter_ints + 2 * tiles, tiles).view({hm, batch, fwd_m_blocks});
  }
  return out;
}

FlashMaskSummary set_flashmask_params(FwdParams& p, const at::Tensor& bounds, const AttnShape& s,
                                      const std::optional<at::Tensor>& cu_seqlens_k, bool causal, int block_n,
                                      cudaStream_t stream, FmCountFor count_for, int fwd_tiles_block_m) {
  const int hm = int(bounds.size(-3));
  FlashMaskSummary fm = make_flashmask_summary(bounds, s.varlen ? cu_seqlens_k : std::nullopt, s.seqlen_q,
                                               s.seqlen_k, causal, block_n, s.heads_q / hm, stream, count_for,
                                               nullptr, fwd_tiles_block_m);
  p.has_flashmask = true;
  p.fm = fm.view;
  p.has_window = true;  // the windowed kernel variants run FlashMask (window (-1, -1) or causal)
  return fm;
}

}  // namespace flash_ext
