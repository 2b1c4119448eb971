// Host side of the Hopper forward: TMA descriptors (built through CUTLASS, which reaches
// cuTensorMapEncodeTiled via the runtime's driver entry point, so nothing links libcuda), the
// tile configuration per head dim (docs/kernels-sm90.md) and the launch.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cutlass/numeric_types.h>

#include "dispatch/fwd_dispatch.h"
#include "sm90/fwd_kernel.cuh"

namespace flash_ext {

namespace sm90 {

// Main-loop order per head dim (fwd_kernel.cuh kLoop*; one kernel each, measured on an H100,
// docs/perf-notes.md sessions 6, 9 and 17): up to d = 192 the P V wait is pinned in the middle of
// the softmax (against the earlier orders, +0-3% at d = 64, +2-7% at d = 96, 128 and 192); d = 256
// keeps it behind the whole softmax (pv_mid read -3.5 to +6%, within this bench's noise).
template <int kHeadDim>
constexpr int kLoopFor = kHeadDim <= 192 ? kLoopPvMid : kLoopOverlap;

template <typename Traits, bool kHasWindow>
void launch_fwd(FwdParams& p, cudaStream_t stream) {
  using Args = FwdArgs<Traits>;
  using Element = typename Traits::Element;
  const bool varlen = p.cu_seqlens_q != nullptr;
  Args args;
  args.p = p;
  // Varlen tensors are one packed "batch"; a CTA offsets its TMA coordinates by cu_seqlens.
  args.shape_q = make_shape(varlen ? p.total_q : p.seqlen_q, p.head_dim, p.heads_q, varlen ? 1 : p.batch);
  args.shape_k = make_shape(varlen ? p.total_k : p.seqlen_k, p.head_dim, p.heads_kv, varlen ? 1 : p.batch);
  auto gtensor = [&](const void* ptr, auto shape, int64_t row, int64_t head, int64_t batch) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), shape,
                       make_stride(row, _1{}, head, varlen ? int64_t(0) : batch));
  };
  args.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.q, args.shape_q, p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                             typename Traits::SmemLayoutQSlab{}, Shape<_64, Int<Traits::kHeadDim>>{}, _1{});
  args.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.k, args.shape_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                             take<0, 2>(typename Traits::SmemLayoutKV{}),
                             Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{});
  args.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gtensor(p.v, args.shape_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride),
                             take<0, 2>(typename Traits::SmemLayoutKV{}),
                             Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{});
  // O through shared memory and a TMA store (FLASH_EXT_SM90_TMA_STORE, default on; staged in its
  // own buffer, or at d = 256 in Q's: kernel_traits.h) where the batch is not varlen (a box would
  // cross into the next sequence) and the tensor map can describe out (as tma_compatible checks
  // q, k, v).
  const bool o_tma_ok = p.o_row_stride > 0 && (p.heads_q == 1 || p.o_head_stride > 0) &&
                        (p.batch == 1 || p.o_batch_stride > 0);
  args.p.sm90_tma_store_o = p.sm90_tma_store_o && !varlen && o_tma_ok;
  if (args.p.sm90_tma_store_o) {
    // Built on O's real shape (q's): the store clips rows >= seqlen_q and columns >= head_dim.
    auto g_o = make_tensor(make_gmem_ptr(static_cast<Element*>(p.o)), args.shape_q,
                           make_stride(p.o_row_stride, _1{}, p.o_head_stride, p.o_batch_stride));
    args.tma_o = make_tma_copy(SM90_TMA_STORE{}, g_o, typename Traits::SmemLayoutOStage{},
                               Shape<_64, Int<Traits::kHeadDim>>{}, _1{});
  }

  auto kernel = &fwd_kernel<FwdMainloop<Traits, kLoopFor<Traits::kHeadDim>>,
                            CausalLocalMask<Traits::kBlockM, Traits::kBlockN, kHasWindow>, FwdEpilogue<Traits>,
                            TileScheduler<Traits::kBlockM, Traits::kBlockN, kHasWindow>>;
  constexpr int smem = Traits::kSmemBytes;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  // Persistent (one CTA per SM) unless p.sm90_persistent == 0 (-1 auto, 0 off, 1 on). Without a
  // mask CTAs walk the tiles with a static stride; under a causal/local mask, whose tiles differ
  // in length, they claim tiles from p.tile_counter (a zeroed int32 that flash_api.cpp allocates
  // for this case; a static round-robin lost 30-40%: docs/perf-notes.md). Without a counter a
  // masked call runs one CTA per tile, where the hardware balances.
  const int64_t tiles = int64_t((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM) * p.heads_q * p.batch;
  const bool persistent = p.sm90_persistent != 0 && (!kHasWindow || p.tile_counter != nullptr);
  args.p.tile_counter = kHasWindow && persistent ? p.tile_counter : nullptr;
  const int sms = p.num_sms, l2_bytes = p.l2_bytes;  // of the current device (flash_api.cpp)
  // Longest-first order under masks, in sections of (head, batch) pairs whose K/V fit in half
  // the L2 (TileScheduler); query heads sharing a K/V head (GQA) count once. Without the
  // sections (FLASH_EXT_SM90_HEAD_SECTIONS=0) one section holds every pair.
  const int heads_batches = p.heads_q * p.batch;
  const int group = p.heads_q / p.heads_kv;
  // Only where the plain order would need much HBM bandwidth (p.sm90_head_sections 1 and 3;
  // 2: always). It runs the tiles of a wave on min(K/V heads x batch, SMs) K/V streams, each
  // read by the CTAs on that head in step (neighbouring query blocks re-read a K/V block within
  // a block-time): a CTA reads 2 * sizeof(Element) bytes of K/V per 4 * kBlockM FLOPs, so at
  // ~4.5 TFLOP/s per SM the streams need streams * 4.5e12 * sizeof(Element) / (2 * kBlockM)
  // bytes/s from HBM. Sections where that exceeds a quarter of the device's bandwidth. Under a
  // sustained load the H100 runs at its 700 W cap, and HBM traffic costs clock: d = 256 causal 4k
  // (32 streams, ~1.1 TB/s estimated) read 655 MB from HBM per call without sections, 208 MB
  // with them, and ran at 1.52 vs 1.67 GHz, +4% (d = 128 causal 8k: +4%; session 7,
  // docs/perf-notes.md). Below that (16 streams: d = 256 causal 8k, 16k rows) the plain order's
  // HBM traffic is small and its single longest-first order has the shortest tail.
  const int64_t kv_streams = std::min<int64_t>(int64_t(p.heads_kv) * p.batch, sms);
  const double stream_bytes_per_s = 4.5e12 * sizeof(Element) / (2.0 * Traits::kBlockM);
  const bool bandwidth_bound = p.dram_bytes_per_s > 0
                                   ? kv_streams * stream_bytes_per_s > 0.25 * p.dram_bytes_per_s
                                   : 2 * heads_batches >= sms;  // no bandwidth reported: the H200's old threshold
  int units = heads_batches / group, sections = 1;  // units: (K/V head, batch) pairs
  if (kHasWindow && (p.sm90_head_sections == 2 || (p.sm90_head_sections != 0 && bandwidth_bound))) {
    const int64_t kv_head_bytes = std::max<int64_t>(1, int64_t(p.seqlen_k) * p.head_dim * 2 * int64_t(sizeof(Element)));
    const int max_units = int(std::max<int64_t>(1, std::min<int64_t>(units, int64_t(l2_bytes / 2) / kv_head_bytes)));
    sections = (units + max_units - 1) / max_units;
    if (p.sm90_head_sections == 3) {  // uneven: full sections, the last one smaller
      args.p.sm90_section_big = sections - 1;
      args.p.sm90_section_big_hb = max_units * group;
      args.p.sm90_section_hb = (units - (sections - 1) * max_units) * group;
      sections = 0;
    }
  }
  if (sections > 0) {  // balanced: the first units % sections sections get one K/V head more
    args.p.sm90_section_hb = units / sections * group;
    args.p.sm90_section_big = units % sections;
    args.p.sm90_section_big_hb = args.p.sm90_section_hb + group;
  }
  // Causal tiles (no left window) aligned to end at seqlen_q: with a seqlen_q that is no multiple
  // of kBlockM (the 192-row tile: 2k = 10 2/3 tiles) the padding rows, which cost a whole
  // warpgroup's GEMMs, then sit in the first tile, which sees the fewest key blocks, instead of
  // the last, which sees them all; and tile ends meet key-block ends more often (the 192 x 128
  // tile's computed / visible scores at s = 2k / 4k: 1.18 / 1.13 from row 0, 1.12 / 1.06 aligned
  // to the end). A multiple of 64 rows, so Q and O boxes of 64 rows stay whole: boxes wholly
  // before row 0 are filled with zeros by the TMA load and not stored (a TMA store with a
  // negative start row faults: illegal instruction). Fixed-length batches only (a varlen box
  // before row 0 would read the previous sequence).
  const int m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const bool align_end = kHasWindow && p.sm90_align_end && !varlen && p.window_left < 0 && p.window_right >= 0;
  args.p.sm90_row_shift = align_end ? (m_blocks * Traits::kBlockM - p.seqlen_q) / 64 * 64 : 0;
  // Ping-pong by default except at d = 256 without a mask (FlashAttention-4 has it off at d = 256
  // too): its GEMMs are long and its softmax (80 columns) short, and on an H100 turning it off
  // gained 0-9% there (s = 1k-16k; causal within +-4%: kept on). The turn passes right after
  // the issue (a late hand-over, once S is done, won and lost by 0.3-3% in four H100 runs:
  // docs/perf-notes.md sessions 6-7). FLASH_EXT_SM90_PINGPONG forces a mode.
  if (p.sm90_pingpong < 0) args.p.sm90_pingpong = Traits::kHeadDim == 256 && !kHasWindow ? 0 : 1;
  // Stream-K tail (sm90/stream_k.h): without a mask, on the persistent grid, the last partial
  // wave's R tiles are cut along the keys over all SMs. Structural bounds: R < G (tiles mod G),
  // W = R x key blocks >= G (every CTA's range non-empty), W x G < 2^31 (32-bit index math),
  // fixed-length batches (every tile sees the same keys). Auto (p.sm90_stream_k -1) runs it where
  // the key blocks an SM would idle through in the last wave, key_blocks x (G - R) / G, exceed
  // its cost: about 10 key blocks' time (the pieces' extra Q loads, pipeline fills, the park and
  // the merge; the call is longer by the memset) plus 0.3 per piece merged into a tile (~G / R
  // pieces each; the merge reads them one after the other). Fitted to one H100 run
  // (docs/perf-notes.md session 13): even at 7.8 idle blocks, +1-2% at 15, +11% at 19, 2.8x for
  // one tile of 157 key blocks; 1k-token calls with 3-4 idle blocks lost 17-49%.
  const int key_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const int64_t tail = persistent ? tiles % sms : 0;
  const int64_t tail_blocks = tail * key_blocks;
  bool stream_k = !kHasWindow && persistent && !varlen && p.sm90_stream_k != 0 && p.alloc_workspace != nullptr &&
                  tail > 0 && tail_blocks >= sms && tail_blocks * sms < (int64_t(1) << 31);
  if (p.sm90_stream_k < 0 && stream_k) {
    const double idle_blocks = double(key_blocks) * double(sms - tail) / sms;
    stream_k = idle_blocks >= 10.0 + 0.3 * double(sms) / double(tail);
  }
  if (stream_k) {
    // Counters (one per tail tile and consumer warpgroup, zeroed here), then the partial states:
    // per CTA two pieces x consumer warpgroups x 128 threads x (O's kHeadDim / 2 floats + 4).
    const size_t count_bytes = (size_t(tail) * Traits::kConsumerWGs * sizeof(int) + 255) / 256 * 256;
    const size_t partial_bytes = size_t(sms) * 2 * Traits::kConsumerWGs * 128 * (Traits::kHeadDim / 2 + 4) * sizeof(float);
    char* ws = static_cast<char*>(p.alloc_workspace(p.alloc_ctx, count_bytes + partial_bytes));
    args.p.sm90_sk_count = reinterpret_cast<int*>(ws);
    args.p.sm90_sk_partial = reinterpret_cast<float*>(ws + count_bytes);
    stream_k = cudaMemsetAsync(args.p.sm90_sk_count, 0, count_bytes, stream) == cudaSuccess;
  }
  args.p.sm90_dp_tiles = int(stream_k ? tiles - tail : tiles);
  args.p.sm90_work_end = int(stream_k ? tiles - tail + 2 * sms : tiles);
  const dim3 grid(unsigned(stream_k ? sms : persistent ? std::min<int64_t>(tiles, sms) : tiles));
  kernel<<<grid, Traits::kThreads, smem, stream>>>(args);
}

template <typename Traits>
void launch_fwd(FwdParams& p, cudaStream_t stream) {
  if (p.has_window) {
    launch_fwd<Traits, true>(p, stream);
  } else {
    launch_fwd<Traits, false>(p, stream);
  }
}

}  // namespace sm90

template <int kHeadDim, bool kIsBf16>
void run_fwd_sm90(FwdParams& p, cudaStream_t stream) {
  using Element = std::conditional_t<kIsBf16, cutlass::bfloat16_t, cutlass::half_t>;
  using sm90::FwdTraits;
  // (head dim, kBlockM, kBlockN, stages): see docs/kernels-sm90.md for the budget.
  // d = 64 and d = 256 have two tiles each; FLASH_EXT_SM90_FWD_TILE=base|alt forces one
  // (p.sm90_fwd_tile 0 / 1; -1 auto). The larger tiles (d = 64: 192 x 128, three consumer
  // warpgroups; d = 256: 128 x 80) are 3-14% faster from s = 2k on (docs/perf-notes.md), but a
  // 192-row tile pads a 1k causal row block by 2/3 of its longest tile: auto takes them for
  // seqlen_q >= 2k, and at 1k without a mask. d = 256 without a mask keeps 128 x 64 up to 2k
  // (session 14: even at 1k-1.5k, +1-3% at 2k in three A/B runs, where 80-key blocks compute
  // 2080 columns for 2048).
  const bool alt_auto = kHeadDim == 256 && !p.has_window
                            ? p.seqlen_q > 2048
                            : (p.seqlen_q >= 2048 || (!p.has_window && p.seqlen_q >= 1024));
  const bool alt = p.sm90_fwd_tile > 0 || (p.sm90_fwd_tile < 0 && alt_auto);
  if constexpr (kHeadDim <= 64) {
    if (alt) {
      sm90::launch_fwd<FwdTraits<kHeadDim, 192, 128, 2, Element>>(p, stream);
    } else {
      sm90::launch_fwd<FwdTraits<kHeadDim, 128, 128, 2, Element>>(p, stream);
    }
  } else if constexpr (kHeadDim <= 128) {
    // 128 x 176 (FlashAttention-3's tile) and Q as a register operand were measured too
    // (docs/perf-notes.md): no win, so 128 x 128 with Q in shared memory.
    sm90::launch_fwd<FwdTraits<kHeadDim, 128, 128, 2, Element>>(p, stream);
  } else if constexpr (kHeadDim == 256) {
    if (alt) {
      sm90::launch_fwd<FwdTraits<kHeadDim, 128, 80, 2, Element>>(p, stream);
    } else {
      sm90::launch_fwd<FwdTraits<kHeadDim, 128, 64, 2, Element>>(p, stream);
    }
  } else {
    sm90::launch_fwd<FwdTraits<kHeadDim, 128, 64, 2, Element>>(p, stream);
  }
}

}  // namespace flash_ext
