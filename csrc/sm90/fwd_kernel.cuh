// Hopper forward (FlashAttention-3 design): warp-specialized, TMA + wgmma. This shell composes
// four parts, each a template parameter, and holds no algorithm of its own:
//   Mainloop   loads and multiplies: produce() (the producer thread's TMA loads over its work
//              items) and a Consumer whose mma() leaves a tile's online-softmax state and O
//              accumulator (sm90/fwd_mainloop.h: bf16/fp16, two loop orders)
//   Mask       built per tile: visible key blocks, the next one to visit, which need the
//              elementwise mask, the mask itself (sm90/fwd_mask.h: causal/local, FlashMask)
//   Epilogue   what becomes of a tile's state: O and lse stored (sm90/fwd_epilogue.h)
//   Scheduler  which work item a CTA takes next: tiles, stream-K pieces (sm90/tile_scheduler.h)
// CTA = one producer warpgroup (its first thread issues the loads) + kConsumerWGs consumer
// warpgroups (64 query rows each); both roles walk the same work items in the same order.
// A new part goes beside today's and is chosen where the launch names the kernel
// (sm90/fwd_launch.cuh): e.g. a split-KV decode epilogue with the same Consumer interface
// (store(), skip()) writing partial O and lse for common/combine.h; an FP8 mainloop with
// produce() and Consumer::mma().
// Some statements below keep an order or a form only because the generated code of the
// single-function kernel this was cut from depends on it (SASS byte-identical; see the notes).
#pragma once
// wgmma tile widths such as 176 are behind this switch in CuTe; it must precede every CuTe include.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "common/seqlen.h"
#include "params.h"
#include "sm90/fwd_args.h"
#include "sm90/fwd_epilogue.h"
#include "sm90/fwd_mainloop.h"
#include "sm90/fwd_mask.h"
#include "sm90/fwd_trace.h"
#include "sm90/kernel_traits.h"
#include "sm90/tile_scheduler.h"
#include "sm90/warpgroup.h"

namespace flash_ext::sm90 {

template <typename Mainloop, typename Mask, typename Epilogue, typename Scheduler>
__global__ void __launch_bounds__(Mainloop::Traits::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdArgs<typename Mainloop::Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Traits = typename Mainloop::Traits;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const FwdParams& p = args.p;
  Scheduler scheduler(p);
  const int warp_group = threadIdx.x / 128;  // 0: producer
  const bool varlen = p.cu_seqlens_q != nullptr;
  scheduler.claim_from(p.tile_counter);
  const Epilogue epilogue(args, varlen);

  if (threadIdx.x == 0) {
    Mainloop::prefetch_descriptors(args);
    epilogue.prefetch_descriptors();
    Mainloop::init_barriers(ss, epilogue.o_in_q);
    scheduler.init_barriers(ss, Traits::kMmaThreads);
  }
  Mainloop mainloop(ss, args, warp_group, varlen, epilogue.o_in_q);
  cutlass::arch::fence_barrier_init();
  __syncthreads();
  FLASH_EXT_TRACE(if (threadIdx.x == 0) trace::cta_stamp(p.sm90_trace, 0);)

  const int row_shift = p.sm90_row_shift;
  // Tile w.tile's coordinates, sequence and visible key blocks; false where it has no query row
  // (varlen). (The sequence is built twice, as the code this shell was cut from did: the
  // generated code depends on it.)
  auto tile_work = [&](FwdTile& w) {
    scheduler.tile(w.tile, w.m_block, w.head, w.batch);
    w.seq = SeqInfo(p, w.batch);
    w.seq = SeqInfo(p, w.batch);
    w.row0 = w.m_block * Traits::kBlockM - row_shift;
    w.row_shift = row_shift;
    if (w.row0 >= w.seq.seqlen_q) return false;
    const typename Mask::ForWarps range_mask(p, w.seq, w.head, w.batch);
    range_mask.key_block_range_rows(w.row0, w.n_min, w.n_max);
    if constexpr (!Mask::kVisitsEveryBlock) {
      // Every lane loads the same count: the redux makes that visible (a uniform register, so the
      // loop's control stays uniform where it walks n - 1).
      w.dense_walk = __reduce_max_sync(0xffffffffu, int(range_mask.range_dense(w.row0, w.n_min, w.n_max)));
    }
    return true;
  };
  const int work_end = scheduler.work_end();

  if (warp_group == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x != 0) return;
    trace::Role trace(p, 0, true);
    mainloop.template produce<Mask>(scheduler, work_end, row_shift, trace);
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int mma_tid = threadIdx.x - 128;
  typename Epilogue::Consumer out(ss);
  TileRing ring(ss);
  typename Mainloop::Consumer consumer(mainloop, mma_tid, warp_group);
  out.start(mma_tid, warp_group - 1);
  auto acc_o = consumer.make_acc_o();
  auto o_rows = consumer.o_rows(acc_o);  // the same registers by (row, col)
  consumer.begin();
  trace::Role trace(p, warp_group, mma_tid % 128 == 0);
  for (int t = scheduler.consumer_first(ring); t < work_end; t = scheduler.consumer_next(ring, t)) {
    FwdTile w;
    if (!scheduler.piece(t, w)) continue;
    if (!tile_work(w)) continue;
    scheduler.clip_to_piece(t, w);
    w.rows_q = w.seq.seqlen_q - w.row0;  // a tile without keys still stores O = 0 and lse = -inf
    const typename Mask::ForWarps mask(p, w.seq, w.head, w.batch);  // the consumers' policy
    trace.begin_tile(trace::kTileTop, w.tile, w.n_max - w.n_min);
    typename Mainloop::Consumer::Softmax softmax;
    consumer.mma(mainloop, w, mask, softmax, acc_o, o_rows, trace);
    // A stream-K piece parks its partial state; the tile's last piece merges them all and goes on
    // to the epilogue with the whole tile's state.
    if (!scheduler.template last_piece<Traits::kConsumerWGs>(t, consumer.wg, mma_tid % 128, softmax, o_rows,
                                                             consumer.scale_log2, out.barrier)) {
      out.skip(epilogue, w);
      continue;
    }
    out.store(epilogue, w, softmax, acc_o, o_rows, consumer, trace);
  }
  consumer.finish();
  // Shared memory must outlive the last O store's reads of it. (In a member function, this test
  // compiled differently.)
  if (out.store_pending && out.leader) tma_store_wait<0>();
  // The CTA's end: after every consumer warpgroup (named barrier 15, unused elsewhere).
  FLASH_EXT_TRACE(named_barrier_sync(15, Traits::kMmaThreads);
                  if (mma_tid == 0) trace::cta_stamp(p.sm90_trace, 1);)
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace flash_ext::sm90
