// Hopper backward (the FlashAttention-2 dQ/dK/dV algorithm on wgmma + TMA, warp-specialized).
//
// Three kernels (docs/kernels-sm90-bwd.md); the preprocess and dQ convert kernels are in
// sm90/bwd_pre_post_kernels.cuh:
//   bwd_kernel             one CTA per (key block, head, batch): a producer warp loads K, V once
//                          and streams Q, dO, lse, D of every query block that sees the key
//                          block through a kStages ring (TMA, mbarriers); two consumer
//                          warpgroups, 64 keys each, compute per query block
//                            S^T = K Q^T, P^T = exp2(S^T * scale * log2e - lse)   (wgmma SS)
//                            dP^T = V dO^T                                         (wgmma SS)
//                            dV += P^T dO                                          (wgmma RS)
//                            dS^T = P^T * (dP^T - D)   (the scale: on dK, dQ at the end)
//                            dK += dS^T Q                                          (wgmma RS)
//                            dQ_i += dS K (dS through shared memory, fp32 atomics) (wgmma SS)
//                          dK and dV stay in registers until the end. GQA/MQA, varlen and
//                          deterministic variants: the template parameters below.
#pragma once
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>
#include <cmath>

#include "common/bwd_params.h"
#include "common/fragment.h"
#include "common/mask.h"
#include "common/seqlen.h"
#include "common/softmax.h"
#include "sm90/bwd_args.h"
#include "sm90/bwd_dq_order.h"
#include "sm90/bwd_flashmask.h"
#include "sm90/bwd_kernel_traits.h"
#include "sm90/bwd_pre_post_kernels.cuh"
#include "sm90/bwd_tile_order.h"
#include "common/pdl.h"
#include "sm90/warpgroup.h"

namespace flash_ext::sm90 {

using namespace cute;

// kGroupLoop: blockIdx.y is a KV head and the CTA walks its group's query heads (dK, dV go to the
// (.., heads_kv, d) outputs); else blockIdx.y is a query head (for GQA, dK and dV go to expanded
// (.., heads_q, d) buffers that the host sums). The group's query heads share the causal / local
// block range and FlashMask's mask head (their KV head's, or 0), so one range serves them all.
// kVarlen: blockIdx.z is a sequence of a packed batch (cu_seqlens; the TMA tensors are the packed
// tensors as one batch): its lengths replace seqlen_q / seqlen_k everywhere, its rows start at
// q_start / k_start, its padded lse / D / dq_accum rows at varlen_padded_row0. No group loop.
// kFlashMask (with kHasWindow): the kernel can run FlashMask (p.has_flashmask decides at run time);
// fixed-length FlashMask calls have an instantiation of their own, so that the causal / local
// kernels compile without its code; the varlen windowed kernel keeps both (docs/perf-notes.md).
// kDeterministic (fixed length, no FlashMask, no group loop): key blocks in descending order add
// their dQ to a tile one at a time (sm90/bwd_dq_order.h).
template <typename Traits, bool kHasWindow, bool kGroupLoop, bool kVarlen, bool kFlashMask, bool kDeterministic = false>
__global__ void __launch_bounds__(Traits::kThreads, 1) bwd_kernel(const __grid_constant__ BwdArgs<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  // dK retires in the next step (Traits::kDkAcrossSteps) except in the plain causal / local
  // kernel, which measured no gain from it (docs/perf-notes.md, Session 29).
  constexpr bool kDkAcrossSteps = Traits::kDkAcrossSteps && !(kHasWindow && !kFlashMask);

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const BwdParams& p = args.p;
  int n_block, head_y, batch;
  if constexpr (kVarlen) {
    n_block = blockIdx.x, head_y = blockIdx.y, batch = blockIdx.z;
  } else {
    bwd_tile_of_cta<kFlashMask>(p, (p.seqlen_k + kBlockN - 1) / kBlockN, kGroupLoop ? p.heads_kv : p.heads_q, n_block, head_y, batch);
    if constexpr (kDeterministic) n_block = (p.seqlen_k + kBlockN - 1) / kBlockN - 1 - n_block;  // 3-D grid, descending
  }
  // Query heads [head0, head0 + group) in turn; one (head0 = blockIdx.y) without kGroupLoop.
  const int group = kGroupLoop ? p.heads_q / p.heads_kv : 1;
  const int head0 = kGroupLoop ? head_y * group : head_y;
  const int warp_group = threadIdx.x / 128;  // 0: producer
  static_assert(!(kVarlen && kGroupLoop), "varlen runs the expand schedule only");
  static_assert(!kDeterministic || !(kVarlen || kGroupLoop || kFlashMask), "deterministic: fixed length, expand, no FlashMask");
  // Varlen: a sequence's length, loaded where it is used rather than held across the loop (spills).
  auto seq_len = [&](const int* cu) { return cu[batch + 1] - cu[batch]; };
  const int q_start = kVarlen ? p.cu_seqlens_q[batch] : 0;
  const int k_start = kVarlen ? p.cu_seqlens_k[batch] : 0;
  const int seqlen_q = kVarlen ? p.cu_seqlens_q[batch + 1] - q_start : p.seqlen_q;
  const int seqlen_k = kVarlen ? p.cu_seqlens_k[batch + 1] - k_start : p.seqlen_k;
  // A key block past the sequence's keys (the grid covers the longest): every thread leaves here.
  if (kVarlen && n_block * kBlockN >= seqlen_k) return;
  // Row of (batch, head0)'s query block 0 in the padded lse / D rows (x kHeadDim: in dq_accum),
  // computed where used.
  auto padded_row0 = [&]() -> int64_t {
    if constexpr (kVarlen) return int64_t(head0) * args.seqlen_q_padded + varlen_padded_row0(p.cu_seqlens_q, batch);
    else return (int64_t(batch) * p.heads_q + head0) * args.seqlen_q_padded;
  };
  const BlockMask<kBlockM, kBlockN, kHasWindow> mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
  int m_min, m_max;
  mask.query_block_range(n_block, m_min, m_max);
  // FlashMask (p.has_flashmask): producer and consumers both step with next_visible (no loads, no
  // GEMMs); after the first step, from the summary pair staged in shared memory below.
  static_assert(!kFlashMask || kHasWindow, "FlashMask runs in the windowed variant");
  const FlashMaskKeyBlock<kBlockM, kBlockN, kFlashMask> fm(p, head0, batch, n_block, seqlen_q);
  m_min = fm.next_visible(m_min, m_max);  // none visible: the empty range, dK = dV = 0

  if (threadIdx.x == 0) {
    pdl_launch_dependents();  // the dQ convert kernel may be scheduled once every CTA has started
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    Barrier::init(&ss.barrier_kv, 1);
    if (fm.on()) {  // read by every classification of the loops below
      ss.fm_summary[0] = __ldg(fm.kbs());
      ss.fm_summary[1] = __ldg(fm.kbs() + 1);
    }
  }
  typename Pipeline::Params pipe_params;
  pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kMmaThreads;
  pipe_params.transaction_bytes = Traits::kTmaBytesQ;
  Pipeline pipeline_q(ss.pipeline_q, pipe_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename Traits::SmemLayoutDS{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename Traits::SmemLayoutDSt{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.pt.data()), typename Traits::SmemLayoutPt{});  // kSplitD only

  if (warp_group == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if constexpr (kDeterministic) {
      // The key block and its query range again, from the 3-D grid: held live across the role
      // split, they spilled (d 64, d 128) in the order warp's share of the producer's 24 registers.
      n_block = (p.seqlen_k + kBlockN - 1) / kBlockN - 1 - int(blockIdx.x);
      BlockMask<kBlockM, kBlockN, kHasWindow>(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)
          .query_block_range(n_block, m_min, m_max);
      // The warp index made warp-uniform: with a plain compare ptxas spilled in the consumers (d 64).
      if (__shfl_sync(0xffffffff, int(threadIdx.x) / 32, 0) == 1) {
        dq_order_warp<kBlockM, kBlockN, kHasWindow, Traits::kMmaThreads>(
            p.dq_semaphore + (int64_t(blockIdx.z) * p.heads_q + blockIdx.y) * args.seqlen_q_padded / 64, m_min, m_max,
            n_block, (p.seqlen_k + kBlockN - 1) / kBlockN, p.seqlen_q, p.seqlen_k, p.window_right);
        return;
      }
    }
    if (threadIdx.x != 0 || m_min >= m_max) return;
    const int head_kv = kGroupLoop ? head_y : head0 / (p.heads_q / p.heads_kv);
    // (rows, d) of a head of the batch; varlen: of the packed tensors, from the sequence's first
    // row (rows past the sequence are the next one's, or zero-filled past the tensor's end).
    auto rows_of = [&](const auto& tma, const auto& shape, int head, int first_row) {
      if constexpr (kVarlen) {
        return domain_offset(make_coord(first_row, _0{}), tma.get_tma_tensor(shape)(_, _, head, 0));
      } else {
        return tma.get_tma_tensor(shape)(_, _, head, batch);
      }
    };
    Tensor mQ = rows_of(args.tma_q, args.shape_q, head0, q_start);
    Tensor mdO = rows_of(args.tma_do, args.shape_q, head0, q_start);
    Tensor mK = rows_of(args.tma_k, args.shape_k, head_kv, k_start);
    Tensor mV = rows_of(args.tma_v, args.shape_k, head_kv, k_start);
    Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gdO = local_tile(mdO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
    Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
    auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tdOgdO, tdOsdO] = tma_partition(args.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    auto [tKgK, tKsK] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    int64_t row_base = padded_row0();

    Barrier::arrive_and_expect_tx(&ss.barrier_kv, Traits::kTmaBytesKV);
    copy(args.tma_k.with(ss.barrier_kv), tKgK, tKsK);
    copy(args.tma_v.with(ss.barrier_kv), tVgV, tVsV);
    pdl_wait();  // lse_log2 and D come from the preprocess kernel
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    for (int g = 0; g < group; ++g) {  // one pass without kGroupLoop
      if constexpr (kGroupLoop) {
        if (g > 0) {  // the next query head: its Q and dO tiles, its lse / D rows
          const int head = head0 + g;
          Tensor gQh = local_tile(args.tma_q.get_tma_tensor(args.shape_q)(_, _, head, batch),
                                  Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
          Tensor gdOh = local_tile(args.tma_do.get_tma_tensor(args.shape_q)(_, _, head, batch),
                                   Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
          tQgQ = get<0>(tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQh)));
          tdOgdO = get<0>(tma_partition(args.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdOh)));
          row_base += args.seqlen_q_padded;
        }
      }
      for (int m_block = m_min; m_block < m_max; m_block = fm.next_visible(m_block + 1, m_max, ss.fm_summary)) {
        pipeline_q.producer_acquire(write);
        auto* bar = pipeline_q.producer_get_barrier(write);
        const int stage = write.index();
        copy(args.tma_q.with(*bar), tQgQ(_, m_block), tQsQ(_, stage));
        copy(args.tma_do.with(*bar), tdOgdO(_, m_block), tdOsdO(_, stage));
        const int64_t row = row_base + int64_t(m_block) * kBlockM;
        SM90_BULK_COPY_G2S::copy(args.lse_log2 + row, bar, &ss.lse_log2[stage][0], kBlockM * sizeof(float));
        SM90_BULK_COPY_G2S::copy(args.dsum + row, bar, &ss.dsum[stage][0], kBlockM * sizeof(float));
        ++write;
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  pdl_wait();  // the preprocess kernel zeroes dq_accum
  const int mma_tid = threadIdx.x - 128;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmaDKV mma_dkv;
  typename Traits::TiledMmaDQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(mma_tid);
  auto thr_dkv = mma_dkv.get_thread_slice(mma_tid);
  auto thr_dq = mma_dq.get_thread_slice(mma_tid);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
  Tensor tdSsdS = thr_sdp.partition_C(sdSt);  // this thread's dS^T elements in shared memory
  // Split by head dim: P^T and dS^T are read from shared memory as A operands of dV and dK.
  auto tPsPt = [&] { if constexpr (Traits::kSplitD) return thr_sdp.partition_C(sPt); else return 0; }();
  auto tdVrPt = [&] { if constexpr (Traits::kSplitD) return thr_dkv.partition_fragment_A(sPt); else return 0; }();
  auto tdKrdSt = [&] { if constexpr (Traits::kSplitD) return thr_dkv.partition_fragment_A(sdSt); else return 0; }();

  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dv);
  clear(acc_dk);
  // (key, query) of each score element in the tile.
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  Tensor cS_rows = make_tensor(cS.data(), gmma_acc_as_rows_cols(cS.layout()));

  const float scale_log2 = p.softmax_scale_log2;
  const float softmax_scale = p.softmax_scale;
  const bool use_softcap = p.softcap > 0.f;
  // With softcap, tanh(S * scale / cap) is recovered from P: S' = ln(P) + lse (see sm80 bwd).
  const float softcap_t_factor = use_softcap ? float(M_LN2) / p.softcap : 0.f;
  float* dq_base = p.dq_accum + padded_row0() * kHeadDim;
  // The next step: the next visible query block, or with kGroupLoop past the last one the first
  // of the next query head (the producer's order).
  int g = 0;
  auto next_step = [&](int m_block) {
    m_block = fm.next_visible(m_block + 1, m_max, ss.fm_summary);
    if constexpr (kGroupLoop) {
      if (m_block >= m_max && ++g < group) {
        m_block = m_min;
        dq_base += int64_t(args.seqlen_q_padded) * kHeadDim;
      }
    }
    return m_block;
  };
  // kFlashMask: the next visible block and its class are found from the CTA's runs while the
  // step's first GEMMs run (fm_next, fm_partial_next), so that no compare chain stands between the
  // S GEMM and the exponentials, or at the step's end (docs/perf-notes.md, "the class found one
  // step ahead"). The group loop's turn to the next head stays at the step's end.
  int fm_next = 0;
  const FlashMaskQueryRuns runs = FlashMaskQueryRuns::of(fm, ss.fm_summary, kBlockM);
  bool fm_partial = kFlashMask && runs.partial(m_min), fm_partial_next = false;
  auto advance = [&](int m_block) {
    if constexpr (kFlashMask) {
      if constexpr (kGroupLoop) {
        if (fm_next >= m_max && ++g < group) {
          fm_next = m_min;
          fm_partial_next = runs.partial(m_min);
          dq_base += int64_t(args.seqlen_q_padded) * kHeadDim;
        }
      }
      fm_partial = fm_partial_next;
      return fm_next;
    } else {
      return next_step(m_block);
    }
  };

  if (m_min < m_max) {
    Barrier::wait(&ss.barrier_kv, 0);
    PipelineState read, read_prev;  // kDkAcrossSteps: the stage of the step whose dK is in flight
    bool dk_in_flight = false;
    static_assert(Traits::kStages % 2 == 0, "dS^T buffer: stage parity alternates per step (FlashMask skips)");
    for (int m_block = m_min; m_block < m_max; m_block = advance(m_block)) {
      const int stage = read.index(), buf = kHasWindow || kGroupLoop ? stage & 1 : (m_block - m_min) & 1;  // per step
      pipeline_q.consumer_wait(read);
      // This step's lengths (varlen: reloaded, L1 hits, issued before the GEMMs that hide them).
      int step_sq = seqlen_q, step_sk = seqlen_k;
      if constexpr (kVarlen) {
        step_sq = seq_len(p.cu_seqlens_q);
        step_sk = seq_len(p.cu_seqlens_k);
      }
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      warpgroup_gemm_issue<true, false>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
      warpgroup_gemm_issue<true, false>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
      if constexpr (kFlashMask) {
        fm_next = runs.next_visible(m_block + 1, m_max);
        fm_partial_next = fm_next < m_max && runs.partial(fm_next);
      }
      warpgroup_wait<1>();  // S^T (and kDkAcrossSteps: the previous step's dK / dV, issued before it)
      warpgroup_fence_operand(acc_s);
      if constexpr (kDkAcrossSteps) {
        if (dk_in_flight) pipeline_q.consumer_release(read_prev);  // its dK read Q^T from that stage
      }

      // P^T = exp2(S^T * scale_log2 - lse_log2[query]).
      Tensor st = make_tensor(acc_s.data(), gmma_acc_as_rows_cols(acc_s.layout()));
      if (use_softcap) apply_softcap(acc_s, softmax_scale / p.softcap, p.softcap);
      bool boundary;
      if constexpr (kVarlen) {
        boundary = BlockMask<kBlockM, kBlockN, kHasWindow>(step_sq, step_sk, p.window_left, p.window_right)
                       .needs_mask(m_block, n_block);
      } else {
        boundary = mask.needs_mask(m_block, n_block);
      }
      if (boundary) {
        KeyBlockMask<kBlockM, kBlockN, kHasWindow>(step_sq, step_sk, p.window_left, p.window_right, n_block)
            .apply_transposed(st, cS_rows, m_block);
      }
      if constexpr (kFlashMask) {
        if (fm_partial) flashmask_apply_transposed(fm, st, cS_rows, m_block, kBlockM);
      }
      const float* lse_s = &ss.lse_log2[stage][0];
      const float* dsum_s = &ss.dsum[stage][0];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(st); ++c) {
        const float lse = lse_s[get<1>(cS_rows(0, c))];
        CUTE_UNROLL
        for (int r = 0; r < size<0>(st); ++r) st(r, c) = exp2f(st(r, c) * scale_log2 - lse);
      }
      Tensor rP = make_tensor<Element>(acc_s.layout());
      convert_into(rP, acc_s);
      if constexpr (Traits::kSplitD) {
        copy(rP, tPsPt(_, _, _, buf));  // dV reads all of P^T once both halves are there
      } else {
        Tensor tdVrP = make_tensor(rP.data(), gmma_acc_as_rs_a(rP.layout()));
        warpgroup_gemm_issue<false, true>(mma_dkv, tdVrP, tdVrdOt(_, _, _, stage), acc_dv);
      }

      // dS^T = P^T * (dP^T - D[query]) (times the softcap derivative); the softmax scale is
      // applied once to dK in the epilogue and to dQ in the convert kernel, not per element.
      warpgroup_wait<Traits::kSplitD ? 0 : 1>();
      warpgroup_fence_operand(acc_dp);
      Tensor dpt = make_tensor(acc_dp.data(), gmma_acc_as_rows_cols(acc_dp.layout()));
      CUTE_UNROLL
      for (int c = 0; c < size<1>(dpt); ++c) {
        const int q = get<1>(cS_rows(0, c));
        const float d = dsum_s[q];
        const float lse = use_softcap ? lse_s[q] : 0.f;
        CUTE_UNROLL
        for (int r = 0; r < size<0>(dpt); ++r) {
          const float pr = st(r, c);
          float ds = pr * (dpt(r, c) - d);
          if (use_softcap) {
            const float t = (__log2f(pr) + lse) * softcap_t_factor;
            ds = pr > 0.f ? ds * (1.f - t * t) : 0.f;
          }
          dpt(r, c) = ds;
        }
      }
      Tensor rdS = make_tensor<Element>(acc_dp.layout());
      convert_into(rdS, acc_dp);
      copy(rdS, tdSsdS(_, _, _, buf));
      Tensor tdKrdS = make_tensor(rdS.data(), gmma_acc_as_rs_a(rdS.layout()));
      if constexpr (!Traits::kSplitD && !kDkAcrossSteps) {
        warpgroup_gemm_issue<false, true>(mma_dkv, tdKrdS, tdKrQt(_, _, _, stage), acc_dk);
      }

      // Both warpgroups' dS^T (and P^T) in shared memory, visible to the tensor cores; then dQ = dS K
      // (and dV, dK from shared memory when split by head dim). Double-buffered: buffer buf was last
      // read by the GEMMs two steps ago, retired before the previous step's first wait.
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(1, Traits::kMmaThreads);
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      Tensor tdQrdS_buf = tdQrdS(_, _, _, buf);
      if constexpr (kDkAcrossSteps) warpgroup_gemm_issue<true, false>(mma_dq, tdQrdS_buf, tdQrKt, acc_dq);
      if constexpr (Traits::kSplitD) {
        Tensor tdVrPt_buf = tdVrPt(_, _, _, buf);
        Tensor tdKrdSt_buf = tdKrdSt(_, _, _, buf);
        warpgroup_gemm_issue<false, false>(mma_dkv, tdVrPt_buf, tdVrdOt(_, _, _, stage), acc_dv);
        warpgroup_gemm_issue<false, false>(mma_dkv, tdKrdSt_buf, tdKrQt(_, _, _, stage), acc_dk);
      } else if constexpr (kDkAcrossSteps) {
        warpgroup_gemm_issue<false, true>(mma_dkv, tdKrdS, tdKrQt(_, _, _, stage), acc_dk);
      }
      if constexpr (!kDkAcrossSteps) warpgroup_gemm_issue<true, false>(mma_dq, tdQrdS_buf, tdQrKt, acc_dq);
      if constexpr (kDkAcrossSteps) {
        warpgroup_wait<Traits::kSplitD ? 2 : 1>();  // dQ; dK (and dV) run on into the next step
        warpgroup_fence_operand(acc_dq);
        read_prev = read;
        dk_in_flight = true;
      } else {
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dq);
        pipeline_q.consumer_release(read);
      }
      ++read;

      if constexpr (kDeterministic) dq_order_wait_turn<Traits::kMmaThreads>();
      dq_accum_add<Traits>(dq_base + int64_t(m_block) * kBlockM * kHeadDim, acc_dq, mma_tid);
      if constexpr (kDeterministic) dq_order_added<Traits::kMmaThreads>();
    }
    if constexpr (kDkAcrossSteps) {
      warpgroup_wait<0>();  // the last step's dK
      warpgroup_fence_operand(acc_dk);
    }
  }

  // Epilogue: dK (times the softmax scale, which dS^T left out) and dV in the input dtype, rows
  // < seqlen_k, cols < head_dim.
  // Varlen: seqlen_k is the sequence's, so no row of the next sequence is written.
  const int rows_k = (kVarlen ? seq_len(p.cu_seqlens_k) : seqlen_k) - n_block * kBlockN;
  Tensor cKV = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // head_y: the KV head with kGroupLoop, else the query head (of the expanded buffers).
  // (Each offset written where it is used: the fixed-length kernels' code depends on the order.)
  Element* dk_tile = static_cast<Element*>(p.dk) +
                     (kVarlen ? int64_t(p.cu_seqlens_k[batch]) * p.dk_row_stride : batch * p.dk_batch_stride) +
                     head_y * p.dk_head_stride + int64_t(n_block) * kBlockN * p.dk_row_stride;
  Element* dv_tile = static_cast<Element*>(p.dv) +
                     (kVarlen ? int64_t(p.cu_seqlens_k[batch]) * p.dv_row_stride : batch * p.dv_batch_stride) +
                     head_y * p.dv_head_stride + int64_t(n_block) * kBlockN * p.dv_row_stride;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); i += 2) {
    const int row = get<0>(cKV(i)), col = get<1>(cKV(i));
    if (row < rows_k && col < p.head_dim) {
      cutlass::Array<Element, 2> k2, v2;
      k2[0] = Element(acc_dk(i) * softmax_scale);
      k2[1] = Element(acc_dk(i + 1) * softmax_scale);
      v2[0] = Element(acc_dv(i));
      v2[1] = Element(acc_dv(i + 1));
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dk_tile + row * p.dk_row_stride + col) = k2;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dv_tile + row * p.dv_row_stride + col) = v2;
    }
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace flash_ext::sm90
