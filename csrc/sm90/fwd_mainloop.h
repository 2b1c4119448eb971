// Mainloop of the Hopper forward (bf16/fp16): the producer's TMA loads of Q, K and V, and the
// consumers' loop over a tile's key blocks (S = Q K^T, mask, online softmax, O += P V).
//
// CTA = one producer warpgroup + kConsumerWGs consumer warpgroups (64 query rows each). The
// producer's first thread issues TMA loads: Q once per tile, then K and V of each key block to
// run into kStages-deep shared-memory rings guarded by mbarrier pipelines. Consumers run
// S = Q K^T (wgmma, both operands in shared memory), the mask and the online softmax in
// registers, then O += P V (wgmma with P from registers), releasing each stage as soon as the
// GEMM that read it has completed. setmaxnreg (in the kernel shell) hands the producer's
// registers to the consumers.
#pragma once
#include <utility>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/fragment.h"
#include "common/softmax.h"
#include "params.h"
#include "sm90/fwd_args.h"
#include "sm90/fwd_trace.h"
#include "sm90/kernel_traits.h"
#include "sm90/tile_scheduler.h"
#include "sm90/warpgroup.h"

namespace flash_ext::sm90 {

// Main-loop orders of the consumers (fixed per head dim by the launch: sm90/fwd_launch.cuh
// kLoopFor; docs/kernels-sm90.md). Both issue S of block j and P V of block j + 1 in one turn,
// wait for S only, and run the softmax of block j while P V runs.
// kLoopOverlap: the wait for P V and the rescale of O sit in a branch on a warpgroup vote
// (bar.red) after the whole softmax, which keeps ptxas from hoisting the wait above it.
// kLoopPvMid: the wait for P V is pinned after the exponentials of the first half of the rows
// (FlashAttention-4's sm90 kernel has it there by its schedule), O is rescaled after the
// softmax on a per-warp vote, and P is packed to 16 bits while the second half's exponentials run.
// A compile-time order: as a runtime value its branches made ptxas copy the 32 registers of P
// at the loop's back edge, on each warpgroup's critical chain.
constexpr int kLoopOverlap = 0, kLoopPvMid = 1;

template <typename Traits_, int kLoop>
struct FwdMainloop {
  using Traits = Traits_;
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kWGs = Traits::kConsumerWGs;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  using SharedStorage = typename Traits::SharedStorage;
  using Args = FwdArgs<Traits>;
  using TiledMmaQK = typename Traits::TiledMmaQK;
  using TiledMmaPV = typename Traits::TiledMmaPV;
  template <typename Layout>
  using SmemTensor = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), Layout{}));

  SharedStorage& ss;
  const Args& args;
  const bool varlen;
  // The epilogue stages O in the warpgroup's slab of Q (d = 256), so it gives the slab back to
  // the producer once its store has read it, not the consumers after the tile's last S.
  const bool q_to_epilogue;
  Pipeline pipeline_k, pipeline_v;

  // Thread 0, at the kernel's start.
  __device__ __forceinline__ static void prefetch_descriptors(const Args& args) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
  }
  // Q full (TMA) and Q empty (consumers done with a tile's Q) per consumer warpgroup; K and V
  // each have a full/empty ring (the pipelines) that runs on across tiles.
  __device__ __forceinline__ static void init_barriers(SharedStorage& ss, bool q_to_epilogue) {
    for (int w = 0; w < kWGs; ++w) {
      Barrier::init(&ss.barrier_q[w], 1);
      Barrier::init(&ss.barrier_q_empty[w], q_to_epilogue ? 1 : 128);
    }
  }

  // The K and V pipelines' parameters for this thread's role. (Filled in place: returned by value
  // from a function, the generated code differed.)
  struct PipelineParams : Pipeline::Params {
    __device__ __forceinline__ explicit PipelineParams(int warp_group) {
      this->role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
      this->is_leader = threadIdx.x == 0;
      this->num_consumers = Traits::kMmaThreads;
      this->transaction_bytes = Traits::kTmaBytesKV;
    }
  };
  // Every thread; thread 0 initialises the K and V pipelines' barriers here.
  __device__ __forceinline__ FwdMainloop(SharedStorage& storage, const Args& a, int warp_group, bool is_varlen,
                                         bool q_slab_to_epilogue)
      : FwdMainloop(storage, a, is_varlen, q_slab_to_epilogue, PipelineParams(warp_group)) {}
  __device__ __forceinline__ FwdMainloop(SharedStorage& storage, const Args& a, bool is_varlen, bool q_slab_to_epilogue,
                                         const typename Pipeline::Params& pipe_params)
      : ss(storage), args(a), varlen(is_varlen), q_to_epilogue(q_slab_to_epilogue),
        pipeline_k(storage.pipeline_k, pipe_params, Shape<_1, _1, _1>{}),
        pipeline_v(storage.pipeline_v, pipe_params, Shape<_1, _1, _1>{}) {}

  // ---------------------------------------------------------------- producer
  // The producer warpgroup's first thread: its walk over the scheduler's work items and each
  // tile's loads. K and V of a key block go to the same stage of their rings: K's state runs one
  // block ahead of V's within a tile and both end a tile equal, so one state carries over (the
  // producer runs at 24 registers). The walk is here, not in the shell, with plain locals: the
  // loop-carried write state must be the walking function's own local for the generated code to
  // stay as it was.
  template <typename Mask, typename Scheduler>
  __device__ __forceinline__ void produce(const Scheduler& scheduler, int work_end, int row_shift, trace::Role& trace) {
    const FwdParams& p = args.p;
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    int q_loads = 0;
    TileRing ring(ss);
    // Tile (m_block, head, batch)'s sequence and visible key blocks; false where it has no query
    // row (varlen).
    auto tile_work = [&](int m_block, int head, int batch, SeqInfo& seq, int& n_min, int& n_max) {
      seq = SeqInfo(p, batch);
      const int row0 = m_block * kBlockM - row_shift;
      if (row0 >= seq.seqlen_q) return false;
      Mask(p, seq, head, batch).key_block_range_rows(row0, n_min, n_max);
      return true;
    };
    for (int t = scheduler.producer_first(ring); t < work_end; t = scheduler.producer_next(ring, t)) {
      int tile = t, n_lo = 0, n_hi = 0;
      if (!scheduler.piece(t, tile, n_lo, n_hi)) continue;
      int m_block, head, batch, n_min = 0, n_max = 0;
      scheduler.tile(tile, m_block, head, batch);
      SeqInfo seq(p, batch);
      if (!tile_work(m_block, head, batch, seq, n_min, n_max)) continue;
      scheduler.clip_to_piece(t, n_lo, n_hi, n_min, n_max);
      if (n_min >= n_max) continue;
      trace.begin_tile(trace::kProdTop, tile, n_max - n_min);
      Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKV{});
      Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutKV{});
      const int head_kv = head / (p.heads_q / p.heads_kv);
      const int q_start = varlen ? p.cu_seqlens_q[batch] : 0;
      const int k_start = varlen ? p.cu_seqlens_k[batch] : 0;
      const int b = varlen ? 0 : batch;
      Tensor mQ = domain_offset(make_coord(q_start, _0{}),
                                args.tma_q.get_tma_tensor(args.shape_q)(_, _, head, b));
      Tensor mK = domain_offset(make_coord(k_start, _0{}),
                                args.tma_k.get_tma_tensor(args.shape_k)(_, _, head_kv, b));
      Tensor mV = domain_offset(make_coord(k_start, _0{}),
                                args.tma_v.get_tma_tensor(args.shape_k)(_, _, head_kv, b));
      Tensor gQ = local_tile(mQ, Shape<_64, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (64, d, 64-row blocks)
      Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
      Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
      auto [tKgK, tKsK] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

      // K of the first block goes out before waiting for the previous tile's Q to be released.
      // Then each warpgroup's 64 rows of Q, as soon as that warpgroup is done with its rows of
      // the previous tile (warpgroup 0 finishes first: ping-pong runs it half a turn ahead).
      int n_block = n_max - 1;
      pipeline_k.producer_acquire(write);
      copy(args.tma_k.with(*pipeline_k.producer_get_barrier(write)), tKgK(_, n_block), tKsK(_, write.index()));
      trace.mark(trace::kProdFirstK);
      CUTE_UNROLL
      for (int wg = 0; wg < kWGs; ++wg) {
        if (q_loads > 0) Barrier::wait(&ss.barrier_q_empty[wg], (q_loads - 1) & 1);
        Barrier::arrive_and_expect_tx(&ss.barrier_q[wg], Traits::kTmaBytesQSlab);
        Tensor sQw = make_tensor(make_smem_ptr(ss.q.data() + wg * Traits::kQSlabElems), typename Traits::SmemLayoutQSlab{});
        auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQw), group_modes<0, 2>(gQ));
        copy(args.tma_q.with(ss.barrier_q[wg]), tQgQ(_, m_block * kWGs + wg - row_shift / 64), tQsQ);
      }
      ++q_loads;
      trace.mark(trace::kProdQ);
      // K one block ahead of V: the consumers use K_n together with V_{n+1} (S_n beside
      // P_{n+1} V_{n+1}), so K_n goes out before V_{n+1}, and K's next load waits only for the
      // S GEMM that frees its stage, not also for the P V GEMM behind it (loading K_n and V_n
      // together held K back by that GEMM: even at d <= 128, +0-5% at d = 256).
      PipelineState write_v = write;
      ++write;
      if constexpr (Mask::kVisitsEveryBlock) {
        // Every block down to n_min (as next_block below, that form changed these kernels' code).
        for (--n_block; n_block >= n_min; --n_block) {
          pipeline_k.producer_acquire(write);
          copy(args.tma_k.with(*pipeline_k.producer_get_barrier(write)), tKgK(_, n_block), tKsK(_, write.index()));
          ++write;
          pipeline_v.producer_acquire(write_v);
          copy(args.tma_v.with(*pipeline_v.producer_get_barrier(write_v)), tVgV(_, n_block + 1), tVsV(_, write_v.index()));
          ++write_v;
        }
      } else {
        // The mask's blocks (next_block, as the consumers walk them; n_min is visited); V's is the one before.
        const Mask mask(p, seq, head, batch);
        const int row0 = m_block * kBlockM - row_shift;
        for (int n_prev = n_block; (n_block = mask.next_block(row0, n_block, n_min)) >= n_min; n_prev = n_block) {
          pipeline_k.producer_acquire(write);
          copy(args.tma_k.with(*pipeline_k.producer_get_barrier(write)), tKgK(_, n_block), tKsK(_, write.index()));
          ++write;
          pipeline_v.producer_acquire(write_v);
          copy(args.tma_v.with(*pipeline_v.producer_get_barrier(write_v)), tVgV(_, n_prev), tVsV(_, write_v.index()));
          ++write_v;
        }
      }
      pipeline_v.producer_acquire(write_v);
      copy(args.tma_v.with(*pipeline_v.producer_get_barrier(write_v)), tVgV(_, n_min), tVsV(_, write_v.index()));
      trace.mark(trace::kProdLastV);
    }
  }

  // ---------------------------------------------------------------- consumers
  // A consumer thread, across tiles: its MMA partitions, the coordinates of its accumulator
  // values (that the mask and the epilogue use) and the K/V read states. The members' order and
  // where they are computed (initializer list, then the body) follow the order in which the
  // single-function kernel computed them: the generated code depends on it, as it does on the
  // reversed declaration of read_v, read_k and on mma()'s local copies of them.
  struct Consumer {
    using SQ = SmemTensor<typename Traits::SmemLayoutQ>;
    using SKV = SmemTensor<typename Traits::SmemLayoutKV>;
    using SVt = SmemTensor<typename Traits::SmemLayoutVt>;
    using ThrQK = decltype(TiledMmaQK{}.get_thread_slice(0));
    using ThrPV = decltype(TiledMmaPV{}.get_thread_slice(0));
    using AccS = decltype(partition_fragment_C(TiledMmaQK{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
    using AccO = decltype(partition_fragment_C(TiledMmaPV{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using CoordS = decltype(std::declval<ThrQK&>().partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
    using CoordO = decltype(std::declval<ThrPV&>().partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
    template <typename T>
    using RowsCols = decltype(make_tensor(std::declval<T&>().data(), gmma_acc_as_rows_cols(std::declval<T&>().layout())));
    static constexpr int kRows = decltype(size<0>(std::declval<RowsCols<AccO>&>()))::value;
    using Softmax = OnlineSoftmax<kRows>;

    const int mma_tid;  // 0 .. kMmaThreads - 1
    TiledMmaQK mma_qk;
    TiledMmaPV mma_pv;
    ThrQK thr_qk;
    ThrPV thr_pv;
    decltype(std::declval<ThrQK&>().partition_fragment_A(std::declval<SQ&>())) tSrQ;
    decltype(std::declval<ThrQK&>().partition_fragment_B(std::declval<SKV&>())) tSrK;
    decltype(std::declval<ThrPV&>().partition_fragment_B(std::declval<SVt&>())) tOrV;
    CoordS cS;
    RowsCols<CoordS> cS_rows;
    CoordO cO;
    RowsCols<CoordO> cO_rows;
    const float scale_log2;
    const bool use_softcap;
    // Lazy rescaling (common/softmax.h): a row's max moves only when a block's max exceeds it by
    // more than 8 in log2 units (p.sm90_lazy_rescale; 0: whenever it grows).
    const float rescale_slack_log2;
    // Ping-pong (two consumer warpgroups): a warpgroup issues its GEMMs only in its turn and then
    // hands the turn over, so one warpgroup's softmax runs under the other's GEMMs. Turns are
    // named barriers: warpgroup w syncs on barrier 1 + w; the other arrives on it.
    // With three consumer warpgroups (d = 64's 192-row tile) the turn goes round: 0 -> 1 -> 2 -> 0.
    // Every warpgroup takes the same number of turns per tile (one per key block, plus one), so
    // the rotation carries on across tiles (p.sm90_pingpong 1): warpgroup 0 issues the next
    // tile's first S = Q K^T right after the last warpgroup's last P V, under that warpgroup's
    // epilogue. p.sm90_pingpong 2 re-synchronises the warpgroups at every tile (turn 0 to
    // warpgroup 0 after every warpgroup's epilogue), 0 turns ping-pong off.
    bool pingpong, pp_carry, pp_per_tile;
    int wg;  // this thread's consumer warpgroup
    int rescale_barrier;  // warpgroup wg's vote on rescaling O (kLoopOverlap only)
    PipelineState read_v, read_k;
    int q_loads = 0;

    __device__ __forceinline__ Consumer(const FwdMainloop& mainloop, int tid, int warp_group)
        : mma_tid(tid), thr_qk(mma_qk.get_thread_slice(tid)), thr_pv(mma_pv.get_thread_slice(tid)),
          // Q's wgmma descriptors depend only on the warpgroup (its 64-row slab of Q).
          // Partitioned from a warp-uniform warpgroup index (redux.sync), they are uniform-register
          // values that the S = Q K^T issue uses directly; from mma_tid they sat in 16 vector
          // registers, moved to uniform registers by an R2UR before each of the 8 wgmma of every
          // S GEMM.
          tSrQ(mma_qk.get_thread_slice(__reduce_max_sync(0xffffffffu, tid / 128) * 128)
                   .partition_fragment_A(make_tensor(make_smem_ptr(mainloop.ss.q.data()), typename Traits::SmemLayoutQ{}))),
          tSrK(thr_qk.partition_fragment_B(
              make_tensor(make_smem_ptr(mainloop.ss.k.data()), typename Traits::SmemLayoutKV{}))),
          tOrV(thr_pv.partition_fragment_B(
              make_tensor(make_smem_ptr(mainloop.ss.v.data()), typename Traits::SmemLayoutVt{}))),
          cS(thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}))),
          cS_rows(make_tensor(cS.data(), gmma_acc_as_rows_cols(cS.layout()))),
          cO(thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}))),
          cO_rows(make_tensor(cO.data(), gmma_acc_as_rows_cols(cO.layout()))),
          scale_log2(mainloop.args.p.softmax_scale_log2),
          use_softcap(mainloop.args.p.softcap > 0.f),
          rescale_slack_log2(mainloop.args.p.sm90_lazy_rescale ? 8.f : 0.f) {
      const int mode = mainloop.args.p.sm90_pingpong;  // read once, before the stores below
      pingpong = kWGs >= 2 && mode != 0;
      pp_carry = pingpong && mode == 1;
      pp_per_tile = pingpong && !pp_carry;
      wg = warp_group - 1;
      rescale_barrier = Traits::kBarrierRescale + wg;
    }

    // The output accumulator (the caller's: the epilogue and the stream-K merge read it too), and
    // its (row, col) view.
    __device__ __forceinline__ AccO make_acc_o() const {
      return partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    }
    __device__ __forceinline__ static RowsCols<AccO> o_rows(AccO& acc_o) {
      return make_tensor(acc_o.data(), gmma_acc_as_rows_cols(acc_o.layout()));
    }

    // Warpgroup 0 goes first; with p.sm90_pingpong 1 the turn then carries on across tiles.
    __device__ __forceinline__ void begin() const {
      if (pp_carry && wg == kWGs - 1) named_barrier_arrive(Traits::kBarrierTurn, 256);
    }
    __device__ __forceinline__ void finish() const {
      if (pp_carry && wg == 0) named_barrier_sync(Traits::kBarrierTurn, 256);  // the last hand-over
    }
    __device__ __forceinline__ void turn_begin() const {
      if (pingpong) named_barrier_sync(Traits::kBarrierTurn + wg, 256);
    }
    __device__ __forceinline__ void turn_end() const {
      if (pingpong) named_barrier_arrive(Traits::kBarrierTurn + (wg + 1) % kWGs, 256);
    }

    // One work item: the online softmax (begun here) and O over the key blocks of
    // [w.n_min, w.n_max) that the mask visits (mask.next_block), from the last one down. Intra-warpgroup overlap (FlashAttention-3, algorithm 2): the
    // softmax of block j runs while the tensor cores compute O += P_{j+1} V_{j+1}; the output is
    // rescaled once that GEMM is done.
    template <typename Mask, typename ORows>
    __device__ __forceinline__ void mma(FwdMainloop& ml, const FwdTile& w, const Mask& mask, Softmax& softmax,
                                        AccO& acc_o, ORows& o_rows, const trace::Role& trace) {
      const FwdParams& p = ml.args.p;
      auto& ss = ml.ss;
      auto& pipeline_k = ml.pipeline_k;
      auto& pipeline_v = ml.pipeline_v;
      PipelineState read_k = this->read_k, read_v = this->read_v;  // written back at the end
      const int& n_min = w.n_min;  // a reference: release_q_after captures it, as the kernel did
      const int n_max = w.n_max, row0 = w.row0;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        softmax.row_max[r] = -INFINITY;
        softmax.row_sum[r] = 0.f;
      }
      clear(acc_o);
      if (n_min < n_max) {
        if (pp_per_tile && wg == kWGs - 1) named_barrier_arrive(Traits::kBarrierTurn, 256);  // warpgroup 0 goes first
        Barrier::wait(&ss.barrier_q[wg], q_loads & 1);
        trace.mark(trace::kQReady);
        // This warpgroup's rows of Q are free for the next tile once its last S = Q K^T is done.
        // At d = 256 the slab is released after the main loop instead (below), which keeps a
        // runtime test out of the loop (it cost 5-15 instructions there).
        auto release_q_after = [&](int n) __attribute__((always_inline)) {
          if constexpr (Traits::kHasSmemO) {
            if (n == n_min) Barrier::arrive(&ss.barrier_q_empty[wg]);
          }
        };
        Tensor rP = make_tensor<Element>(partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{}).layout());
        Tensor tOrP = make_tensor(rP.data(), gmma_acc_as_rs_a(rP.layout()));
        float correction[kRows];

        auto scores_to_probs = [&](auto& acc_s, int n_block, auto is_first, auto const&... hook) __attribute__((always_inline)) {
          if (use_softcap) apply_softcap(acc_s, p.softmax_scale / p.softcap, p.softcap);
          Tensor scores = make_tensor(acc_s.data(), gmma_acc_as_rows_cols(acc_s.layout()));
          if (mask.needs_mask_rows(row0, n_block)) mask.apply_rows(scores, cS_rows, row0, n_block);
          if constexpr (sizeof...(hook) == 0) {
            softmax.template update_scores<decltype(is_first)::value, 4>(scores, scale_log2, correction, rescale_slack_log2);
          } else {
            softmax.template update_scores_split<decltype(is_first)::value, 4>(scores, scale_log2, correction, rescale_slack_log2, hook...);
          }
        };

        int n_block = n_max - 1;
        {
          Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
          pipeline_k.consumer_wait(read_k);
          turn_begin();
          warpgroup_gemm_issue<true, false>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), acc_s);
          turn_end();
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_s);
          trace.mark(trace::kFirstS);
          pipeline_k.consumer_release(read_k);
          ++read_k;
          release_q_after(n_block);
          scores_to_probs(acc_s, n_block, cute::true_type{});
          convert_into(rP, acc_s);
        }
        // A mask that skips blocks (FlashMask) walks to the block after this one while this one's
        // GEMMs run: its walk (the window's bits, a redux) is a chain of dependent instructions
        // that, in the loop's header, sat between the softmax and the next GEMMs' issue (ncu,
        // nothing masked beyond causal: ~9% of the loop's stall samples). Its K and V come next
        // from the pipeline whatever their index, and n_min is always visited, so only the mask
        // needs the index, after S. Every-block masks keep n - 1 in the header.
        // A range that skips no block (w.dense_walk: the tile table's count fills it) walks n - 1
        // with no walk at all.
        constexpr bool kWalkAhead = !Mask::kVisitsEveryBlock;
        int n_next = 0;
        auto advance = [&](int n) __attribute__((always_inline)) {
          if constexpr (kWalkAhead) {
            return w.dense_walk ? n - 1 : n_next;
          } else {
            return mask.next_block(row0, n, n_min);
          }
        };
        for (n_block = mask.next_block(row0, n_block, n_min); n_block >= n_min; n_block = advance(n_block)) {
          Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
          pipeline_k.consumer_wait(read_k);
          pipeline_v.consumer_wait(read_v);
          turn_begin();
          warpgroup_gemm_issue<true, false>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), acc_s);
          warpgroup_gemm_issue<false, true>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
          turn_end();
          if constexpr (kWalkAhead) {
            if (!w.dense_walk) n_next = mask.next_block(row0, n_block, n_min);
          }
          warpgroup_wait<1>();  // S of this block is ready; P V of the previous one is in flight
          warpgroup_fence_operand(acc_s);
          pipeline_k.consumer_release(read_k);
          ++read_k;
          release_q_after(n_block);
          if constexpr (kLoop == kLoopPvMid) {
            // The P V wait, after the first half of the rows' exponentials: a branch on their sum
            // keeps ptxas from hoisting it above them (a plain wait went above the whole softmax),
            // and the sum is never the pattern 0xffffffff (a NaN result of an operation is the
            // canonical 0x7fffffff: CUDA C++ Programming Guide, floating-point appendix), so every
            // thread of the warpgroup takes it: the wait is .sync.aligned. The unconditional wait
            // after it keeps ptxas from sinking the wait below the second half, so that P can be
            // packed while those exponentials run (docs/perf-notes.md, "the P V wait in the middle
            // of the softmax").
            scores_to_probs(acc_s, n_block, cute::false_type{}, [&](float sum) __attribute__((always_inline)) {
              if (__float_as_uint(sum) != 0xffffffffu) warpgroup_wait<0>();
              warpgroup_wait<0>();
            });
            warpgroup_fence_operand(acc_o);
            pipeline_v.consumer_release(read_v);
            ++read_v;
            // P before the rescale's branch, so that ptxas packs it as the exponentials come (after
            // the branch it packed all 32 registers at the end of the softmax, on the critical path).
            // The rescale holds no wgmma wait, so a per-warp vote suffices.
            convert_into(rP, acc_s);
            if (__any_sync(0xffffffffu, softmax.needs_rescale(correction))) softmax.rescale(o_rows, correction);
            continue;
          }
          scores_to_probs(acc_s, n_block, cute::false_type{});
          // The wait for P V comes after the softmax in the source, but ptxas, which sees no
          // dependency between them, hoisted it above the softmax (SASS: WARPGROUP.DEPBAR right
          // after the row max), so the softmax ran after P V instead of under it. A wait inside a
          // branch on the softmax's own result (does any row of the warpgroup need its O
          // rescaled?) stays below the softmax, and the unconditional wait after it stays below the
          // branch. The vote is warpgroup-wide (bar.red): with a per-warp vote, warps of one
          // warpgroup executed different wgmma.wait_group instructions (compute-sanitizer
          // synccheck: "mismatching warpgroup instruction pc between warps").
          if (named_barrier_any(softmax.needs_rescale(correction), rescale_barrier, 128)) {
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_o);
            softmax.rescale(o_rows, correction);
          }
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_o);
          pipeline_v.consumer_release(read_v);
          ++read_v;
          convert_into(rP, acc_s);
        }
        ++q_loads;
        trace.mark(trace::kLoopDone);
        pipeline_v.consumer_wait(read_v);
        turn_begin();
        warpgroup_gemm_issue<false, true>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
        turn_end();
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        trace.mark(trace::kLastPV);
        pipeline_v.consumer_release(read_v);
        ++read_v;
        // d = 256 with the register epilogue (varlen, or p.sm90_tma_store_o off): the slab of Q
        // goes back here, after the last P V rather than the last S.
        if constexpr (!Traits::kHasSmemO) {
          if (!ml.q_to_epilogue) Barrier::arrive(&ss.barrier_q_empty[wg]);
        }
        if (pp_per_tile && wg == 0) named_barrier_sync(Traits::kBarrierTurn, 256);  // the last hand-over
      }
      this->read_k = read_k;
      this->read_v = read_v;
    }
  };
};

}  // namespace flash_ext::sm90
