// Plain parameter structs of the kernels: FwdParams (forward) and BwdParams (backward, the
// forward's fields plus gradients and work buffers). Filled by the torch-facing layer
// (csrc/api/params_fill.cpp, the ops) and read by the kernels. No torch or CUTLASS types here:
// kernel translation units include this file only. How a call is scheduled (tile, grid, ...) is
// not a problem parameter: it lives in the host's config (csrc/tuning/heuristics.h), except
// the resolved fields the kernels read, grouped below.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/flashmask.h"

namespace flash_ext {

struct FwdParams {
  // Tensors, laid out (batch, seqlen, heads, headdim) or, for varlen, (total_tokens, heads, headdim).
  // The last dimension is contiguous; every other stride is honoured (in elements).
  const void* __restrict__ q;
  const void* __restrict__ k;
  const void* __restrict__ v;
  void* __restrict__ o;
  float* __restrict__ lse;  // (batch, heads, seqlen_q) or varlen (heads, total_q); natural log

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  // lse element (b, h, row) is at lse[b * lse_batch_stride + h * lse_head_stride + row] when not
  // varlen; for varlen the batch offset is cu_seqlens_q[b] instead.
  int64_t lse_batch_stride, lse_head_stride;

  int batch;
  int heads_q, heads_kv;  // heads_q % heads_kv == 0 (MQA/GQA: kv head = q head / (heads_q / heads_kv))
  int seqlen_q, seqlen_k;  // non-varlen sizes; for varlen, the max sizes (grid extent)
  int head_dim;            // actual head dim (multiple of 8, <= the kernel's kHeadDim)
  int total_q, total_k;    // varlen: rows of the packed q and k tensors (the TMA tensor extents)

  // varlen: sequence b has rows [cu_seqlens_q[b], cu_seqlens_q[b+1]); nullptr when not varlen.
  const int* __restrict__ cu_seqlens_q;
  const int* __restrict__ cu_seqlens_k;
  // varlen, optional (forward only): sequence b uses only its first seqused_k[b] keys (of the
  // cu_seqlens_k[b+1] - cu_seqlens_k[b] it has); the mask aligns to that length. nullptr: all.
  const int* __restrict__ seqused_k;

  float softmax_scale;       // usually 1/sqrt(head_dim)
  float softmax_scale_log2;  // softmax_scale * log2(e), or softcap-adjusted (see common/softmax.h)
  float softcap;             // 0 = off; else S = softcap * tanh(S * softmax_scale / softcap)

  // Local (sliding-window) attention: query row i (aligned bottom-right, i.e. shifted by
  // seqlen_k - seqlen_q) sees keys in [i - window_left, i + window_right]; -1 = unbounded.
  // Causal is window_right = 0. has_window selects the masked kernel variant.
  int window_left, window_right;
  bool has_window;

  bool is_bf16;

  // Attention dropout (common/dropout.h). dropout_p > 0 selects the sm80 kernels' dropout
  // variants; the Hopper paths do not implement it and test `dropout_p > 0.f` to fall back.
  // Element (row, col) of P is dropped iff its Philox word < dropout_threshold; kept elements
  // are scaled by dropout_scale = 1 / (1 - p) (0 when p == 1). seed/offset: the rng state.
  float dropout_p;
  float dropout_scale;
  uint32_t dropout_threshold;
  uint64_t dropout_seed, dropout_offset;

  // ---- Resolved launch schedule of the Hopper forward, written by the host launch ----
  // Chosen per call as Sm90FwdConfig (csrc/tuning/heuristics.h; the reasons: heuristics.cpp),
  // copied here by write_sm90_fwd_schedule; the kernel reads them. Zero for every other path.
  // Each field keeps the 8-byte slot of its own (alignas) and the offset within it that the
  // kernels were tuned and checked with, so that their SASS differs from before only in
  // parameter offsets (ptxas pairs constant loads of fields that share a slot).
  //
  // Ping-pong of the consumer warpgroups' GEMMs: 1 on, the turn passed right after a
  // warpgroup's GEMM issue and carried on across tiles; 0 off. (2, re-synchronised at every
  // tile, is no longer chosen by the host.)
  int sm90_pingpong;
  // O through shared memory and a TMA store (fixed-length batches whose out a tensor map can
  // describe); else the register epilogue.
  alignas(8) bool sm90_tma_store_o;
  // Lazy rescaling of the output (common/softmax.h); always on (the host sets true).
  alignas(8) bool sm90_lazy_rescale;
  // Head sections of the causal/local tile order (sm90/fwd_kernel.cuh TileScheduler): the first
  // sm90_section_big sections hold sm90_section_big_hb (head, batch) pairs, the rest
  // sm90_section_hb (balanced: the two differ by one K/V head's query heads).
  alignas(8) int sm90_section_hb;
  int sm90_section_big;
  alignas(8) int sm90_section_big_hb;
  // Rows (a multiple of 64) by which the first query tile starts before row 0 (causal tiles
  // aligned to end at seqlen_q).
  alignas(8) int sm90_row_shift;
  // Persistent grid under a causal/local mask: a zero-initialised int32 on the device from which
  // CTAs claim tiles (allocated per call by the op); nullptr otherwise.
  alignas(8) int* tile_counter;
  // Stream-K tail (sm90/stream_k.h; no mask): tiles [sm90_dp_tiles, number of tiles) are cut
  // along the keys over all CTAs, whose static walk then runs up to index sm90_work_end (= the
  // number of tiles, and sm90_dp_tiles too, when the tail is walked whole); sm90_sk_count
  // (zeroed per call) and sm90_sk_partial hold the pieces' arrival counters and partial states.
  alignas(8) int sm90_dp_tiles;
  alignas(8) int sm90_work_end;
  alignas(8) int* sm90_sk_count;
  float* sm90_sk_partial;

  // FlashMask (common/flashmask.h): column-wise interval masks on top of causal (has_window with
  // window_right = 0) or no mask. fm holds the normalized bounds and the key-block summaries made
  // for this direction's kBlockN. false / zero for every other call.
  alignas(8) bool has_flashmask;
  FlashMaskView fm;

  // ALiBi (common/alibi.h): fp32 slopes, slope of (b, h) at alibi_slopes[b * alibi_batch_stride
  // + h] (stride 0 for (heads_q,) slopes); nullptr = off. Runs in the windowed sm80 kernels.
  const float* __restrict__ alibi_slopes;
  int64_t alibi_batch_stride;
#ifdef FLASH_EXT_SM90_TRACE
  // The timeline buffer of a trace build (sm90/fwd_trace.h; nullptr: no trace). Only in builds
  // with FLASH_EXT_SM90_TRACE=1, which setup.py defines for every file alike.
  int64_t* sm90_trace;
#endif
};

// Parameters of the backward pass: the forward's fields (q, k, v, o, lse, strides, seqlens,
// scale, softcap, window, dropout) plus the gradients and the fp32 work buffers. Filled by
// csrc/ops_bwd.cpp; see docs/kernels-sm80-bwd.md.
struct BwdParams : FwdParams {
  // dO, laid out like o (batch, seqlen_q, heads_q, head_dim) or varlen (total_q, heads_q, head_dim).
  const void* __restrict__ dout;
  int64_t do_batch_stride, do_row_stride, do_head_stride;

  // D = rowsum(dO * O) in fp32, same layout and strides as lse (written by the preprocess kernel).
  float* __restrict__ dsum;

  // fp32 dQ accumulator (batch, seqlen_q, heads_q, head_dim) or varlen (total_q, heads_q, head_dim),
  // zero-initialized by the caller. Atomic mode (dq_split_stride == 0): every key block adds its
  // contribution with fp32 atomics. Deterministic mode: key block n writes its contribution with
  // plain stores into slice n (at dq_accum + n * dq_split_stride); the caller sums the slices.
  // sm80: already multiplied by softmax_scale (the Hopper kernels' tiles are not: their dQ convert
  // kernel multiplies).
  float* __restrict__ dq_accum;
  int64_t dqa_batch_stride, dqa_row_stride, dqa_head_stride;
  int64_t dq_split_stride;

  // dK and dV in the input dtype: (batch, seqlen_k, heads, head_dim) or varlen (total_k, heads,
  // head_dim). With heads_q == heads_kv, or the Hopper backward's group loop (sm90_gqa_loop),
  // heads = heads_kv and these are the final gradients; otherwise, for GQA/MQA, heads = heads_q:
  // expanded buffers indexed by the query head that the caller sums over each group.
  void* __restrict__ dk;
  void* __restrict__ dv;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

  // Hopper backward only: lse * log2(e) and D in (batch, heads_q, seqlen_q_padded) buffers
  // (p.dsum then points at the padded D), written by its preprocess kernel. Varlen: (heads_q,
  // seqlen_q_padded), seqlen_q_padded = round_up(total_q + 128 * batch, 128), sequence b's rows
  // from sm90::varlen_padded_row0 (sm90/bwd_pre_post_kernels.cuh); dq_accum likewise per head.
  float* __restrict__ lse_log2;
  int seqlen_q_padded;
  // Hopper backward only: dq_accum is instead (batch, heads_q, seqlen_q_padded / kBlockM) tiles of
  // kBlockM x kernel-head-dim floats, each in the consumer threads' fragment order (see
  // dq_accum_slot in sm90/bwd_pre_post_kernels.cuh), zeroed by the preprocess kernel; the dQ convert kernel
  // writes dq (input dtype, laid out like q) from it.
  void* __restrict__ dq;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;

  bool deterministic;
  // Hopper backward, GQA/MQA: true runs one CTA per (key block, KV head, batch) that walks its
  // group's query heads and writes dk / dv as (.., heads_kv, d) directly; false one CTA per query
  // head into expanded (.., heads_q, d) buffers. Chosen by the host (tuning/heuristics.h
  // choose_sm90_bwd_gqa_loop). Sits in the padding before `variant`: no field moves.
  bool sm90_gqa_loop;

  // sm80 main-kernel variant: 2 = bwd_kernel_v2 (double-buffered Q/dO, the default; falls back
  // to 1 where it is not compiled or does not fit), 1 = bwd_kernel. Resolved by the host from the
  // tuning overrides (csrc/tuning/overrides.h).
  int variant;
  // Hopper backward, fixed length: > 0 launches the 1-D longest-first grid with sections of this
  // many (head, batch) units (sm90/bwd_tile_order.h; tuning/heuristics.h
  // choose_sm90_bwd_lpt_section), 0 the 3-D grid. After `variant`: no field moves.
  int sm90_lpt_section;
  // Hopper backward, deterministic: one zeroed int per 64 padded query rows of each (batch, head),
  // counting the key blocks that have added to the query block's dq_accum tile
  // (sm90/bwd_dq_order.h); nullptr otherwise. Last: no field moves.
  int* __restrict__ dq_semaphore;
};

}  // namespace flash_ext
