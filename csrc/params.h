// Plain parameter structs shared by the torch-facing layer (flash_api.cpp) and the kernels.
// No torch or CUTLASS types here: kernel translation units include this file only.
#pragma once
#include <cstddef>
#include <cstdint>

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

  // Hopper kernel: order the consumer warpgroups' GEMMs (ping-pong). -1 (default): the launch
  // picks 0 at d = 256 without a mask, else 1; 1 (FLASH_EXT_SM90_PINGPONG=1): on, the turn
  // passes right after a warpgroup's GEMM issue and the turns carry on across tiles;
  // 2 (FLASH_EXT_SM90_PINGPONG=tile): on, re-synchronised at every tile; 0: off.
  int sm90_pingpong;
  // Hopper kernel grid: -1 auto (= 1), 0 one CTA per tile, 1 persistent (static stride without a
  // mask; under a causal/local mask CTAs claim tiles from tile_counter).
  // FLASH_EXT_SM90_PERSISTENT=0/1 forces it (for measurements and tests).
  int sm90_persistent;
  // Hopper kernel: O through shared memory and a TMA store (head dims <= 192, not varlen; else
  // from registers). On by default; FLASH_EXT_SM90_TMA_STORE=0 turns it off.
  bool sm90_tma_store_o;
  // Hopper kernel tile of head dims 64 and 256 (sm90/fwd_launch.cuh): -1 auto, 0 base
  // (d = 64: 128 x 128, d = 256: 128 x 64), 1 alt (d = 64: 192 x 128, d = 256: 128 x 80).
  // FLASH_EXT_SM90_FWD_TILE=base|alt forces one (for A/B runs and tests).
  int sm90_fwd_tile;
  // Hopper kernel: lazy rescaling of the output (common/softmax.h). On by default;
  // FLASH_EXT_SM90_LAZY_RESCALE=0 rescales whenever a row's max grows (for measurements).
  bool sm90_lazy_rescale;
  // Hopper kernel under causal/local masks: longest-first tile order within sections of heads
  // whose K/V fit in half the L2 (sm90/fwd_kernel.cuh TileScheduler). 1 (default): where the
  // plain order would need much HBM bandwidth (sm90/fwd_launch.cuh); 2
  // (FLASH_EXT_SM90_HEAD_SECTIONS=always): always; 0: never, longest first over all heads.
  int sm90_head_sections;
  // Section sizes, set by the launch from the above and the L2 size: the first sm90_section_big
  // sections hold sm90_section_big_hb (head, batch) pairs, the rest sm90_section_hb (balanced:
  // the two differ by one K/V head's query heads). 3 (FLASH_EXT_SM90_HEAD_SECTIONS=uneven, for
  // measurements): as 1 with full sections and a smaller last one (the order before session 7).
  int sm90_section_hb;
  int sm90_section_big;
  int sm90_section_big_hb;
  // Hopper kernel under a causal mask (no left window, fixed-length batch): the query tiles end
  // at seqlen_q instead of starting at row 0, so the padding rows of a seqlen_q that is no
  // multiple of kBlockM fall into the shortest tile, not the longest (sm90/fwd_kernel.cuh).
  // On by default; FLASH_EXT_SM90_ALIGN_END=0 turns it off (for measurements and tests).
  bool sm90_align_end;
  // Rows (a multiple of 64) by which the first query tile starts before row 0; set by the launch.
  int sm90_row_shift;
  // Device facts the launches need, read once per device by flash_api.cpp (api_common.h
  // device_info): multiprocessors, L2 bytes, peak DRAM bandwidth (0 when not reported).
  int num_sms;
  int l2_bytes;
  double dram_bytes_per_s;
  // Hopper kernel, persistent grid under a causal/local mask: a zero-initialised int32 on the
  // device from which CTAs claim tiles (flash_api.cpp allocates it per call); nullptr otherwise.
  int* tile_counter;
  // Hopper kernel without a mask, persistent grid: the stream-K tail (sm90/stream_k.h).
  // sm90_stream_k: -1 auto (where the last wave leaves enough SMs idle), 0 off, 1 wherever it
  // can run (FLASH_EXT_SM90_STREAM_K, for measurements and tests). The launch sets the rest:
  // tiles [sm90_dp_tiles, number of tiles) are cut along the keys over all CTAs, whose static
  // walk then runs up to index sm90_work_end (= the number of tiles, and sm90_dp_tiles too, when
  // the tail is walked whole); sm90_sk_count (zeroed per call) and sm90_sk_partial hold the
  // pieces' arrival counters and partial states.
  int sm90_stream_k;
  int sm90_dp_tiles, sm90_work_end;
  int* sm90_sk_count;
  float* sm90_sk_partial;
  // Device workspace for a launch (stream-K above): alloc_workspace(alloc_ctx, bytes) returns
  // memory that stays valid for work queued on the launch's stream (flash_api.cpp: a tensor from
  // PyTorch's caching allocator). nullptr: no workspace, so no stream-K.
  void* (*alloc_workspace)(void* ctx, size_t bytes);
  void* alloc_ctx;
#ifdef FLASH_EXT_SM90_TRACE
  // The timeline buffer of a trace build (sm90/fwd_trace.h; nullptr: no trace). Only in builds
  // with FLASH_EXT_SM90_TRACE=1, which setup.py defines for every file alike.
  int64_t* sm90_trace;
#endif
};

}  // namespace flash_ext
