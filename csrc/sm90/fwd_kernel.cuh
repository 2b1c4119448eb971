// Hopper forward (FlashAttention-3 design): warp-specialized, TMA + wgmma.
//
// CTA = one producer warpgroup + kConsumerWGs consumer warpgroups (64 query rows each).
// The producer's first thread issues TMA loads: Q once, then K and V of each visible key block
// into kStages-deep shared-memory rings guarded by mbarrier pipelines. Consumers run
// S = Q K^T (wgmma, both operands in shared memory), the mask and the online softmax in
// registers, then O += P V (wgmma with P from registers), releasing each stage as soon as the
// GEMM that read it has completed. setmaxnreg hands the producer's registers to the consumers.
// Epilogue: O through shared memory (its own tile, or at d = 256 the warpgroup's slab of Q) and a
// TMA store for fixed-length batches, else (varlen) from registers. Tiles: a static walk, or
// (persistent grid under a causal/local mask) claimed from a global counter by the producer
// thread and handed to the consumers through shared memory.
#pragma once
// wgmma tile widths such as 176 are behind this switch in CuTe; it must precede every CuTe include.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "common/fragment.h"
#include "common/mask.h"
#include "common/seqlen.h"
#include "common/softmax.h"
#include "params.h"
#include "sm90/kernel_traits.h"
#include "sm90/fwd_trace.h"
#include "sm90/stream_k.h"

namespace flash_ext::sm90 {

// Main-loop orders of the consumers (a template parameter of the kernel, fixed per head dim by the
// launch: sm90/fwd_launch.cuh kLoopFor; docs/kernels-sm90.md). Both issue S of block j and P V of
// block j + 1 in one turn, wait for S only, and run the softmax of block j while P V runs.
// kLoopOverlap: the wait for P V and the rescale of O sit in a branch on a warpgroup vote
// (bar.red) after the whole softmax, which keeps ptxas from hoisting the wait above it.
// kLoopPvMid: the wait for P V is pinned after the exponentials of the first half of the rows
// (FlashAttention-4's sm90 kernel has it there by its schedule), O is rescaled after the
// softmax on a per-warp vote, and P is packed to 16 bits while the second half's exponentials run.
// A compile-time order: as a runtime value (until session 9) its branches made ptxas copy the 32
// registers of P at the loop's back edge, on each warpgroup's critical chain. (kLoopPvFirst, which
// waited for both GEMMs before the softmax, ran d = 64 from session 6 to 16.)
constexpr int kLoopOverlap = 0, kLoopPvMid = 1;

using namespace cute;

// Everything the kernel needs, passed by value as a __grid_constant__ parameter: the plain
// params and the TMA descriptors built on the host.
template <typename Traits>
struct FwdArgs {
  using Element = typename Traits::Element;
  using TensorShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;  // (rows, d, heads, batch)
  using TensorStride = cute::Stride<int64_t, _1, int64_t, int64_t>;
  using GTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                       TensorShape{}, TensorStride{}));
  using GTensorO = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)),
                                        TensorShape{}, TensorStride{}));
  // One consumer warpgroup's 64 rows of Q per load (SmemLayoutQSlab).
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, typename Traits::SmemLayoutQSlab{},
                                      Shape<_64, Int<Traits::kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{},
                                       take<0, 2>(typename Traits::SmemLayoutKV{}),
                                       Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{}));
  // One consumer warpgroup's 64 rows of O; built on the host only when p.sm90_tma_store_o.
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GTensorO{}, typename Traits::SmemLayoutOStage{},
                                     Shape<_64, Int<Traits::kHeadDim>>{}, _1{}));
  FwdParams p;
  TmaQ tma_q;
  TmaKV tma_k, tma_v;
  TmaO tma_o;
  TensorShape shape_q, shape_k;  // O has q's shape
};

// Issues one warpgroup GEMM (all k-slices) as one wgmma batch, without waiting for it.
// kZeroInit overwrites acc; kRegA: A comes from registers (P), not a shared-memory descriptor.
template <bool kZeroInit, bool kRegA, typename TiledMma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void warpgroup_gemm_issue(TiledMma& mma, TA& a, const TB& b, TC& acc) {
  warpgroup_fence_operand(acc);
  if constexpr (kRegA) warpgroup_fence_operand(a);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
  if constexpr (kRegA) warpgroup_fence_operand(a);
}

// Named barriers 1 and 2 order the two consumer warpgroups' GEMM issue (ping-pong).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Whether pred holds for any of the `threads` threads meeting at named barrier `id` (bar.red.or):
// a value the same in every warp of a warpgroup, for branches around warpgroup-wide instructions
// (wgmma.wait_group is .aligned: all 128 threads must execute the same one).
__device__ __forceinline__ bool named_barrier_any(bool pred, int id, int threads) {
  uint32_t result;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(result) : "r"(uint32_t(pred)), "r"(id), "r"(threads) : "memory");
  return result != 0;
}

// Tile scheduler. A tile is (query block, head, batch). With a persistent grid (one CTA per SM)
// a CTA's next tile's loads overlap its current tile's epilogue.
// Static walk: a CTA takes tiles blockIdx.x, + gridDim.x, ...: the persistent grid without a
// mask (equal tiles), and one CTA per tile (the hardware balances uneven tiles).
// Dynamic (persistent grid under a causal/local mask, p.tile_counter set): a CTA's first tile is
// blockIdx.x; then its producer thread claims gridDim.x + atomicAdd(tile_counter, 1) (the counter
// starts at 0, so every tile is taken exactly once and each CTA's last claim is >= num_tiles)
// and passes each tile, and the final out-of-range index, to the consumers through a 2-slot ring
// in shared memory. A static round-robin over uneven causal tiles lost 30-40%
// (docs/perf-notes.md): claiming balances them as the hardware does for one CTA per tile.
// Order: without a mask, consecutive tiles are the query blocks of one (head, batch), so CTAs
// running together share that head's K/V in L2. Under a causal/local mask tiles are ordered
// longest first (query block descending), so the short tiles fill the tail, within sections of
// (head, batch) pairs whose K/V fit in half the L2 (p.sm90_section_hb, set by the
// launch): longest first over all heads had every CTA of a wave on a different head at s = 2k
// (128 heads x 1 MB of K/V at d = 128, beyond the L2), so each K/V block came from HBM, ~5 TB/s
// at the tensor cores' pace. Section sizes differ by at most one K/V head's query heads (GQA: a
// section holds whole K/V heads): the first `big` sections hold big_hb pairs, the rest hb
// (launch: balanced sizes). With a full section of 12 pairs and a last one of 4 (d = 256 causal
// 2k, 64 pairs), that last section's longest tile started only once all others were claimed,
// and ran on alone: a tail of ~10% of the call.
struct TileScheduler {
  int num_m_blocks, heads, num_tiles;
  bool longest_first;
  // The section sizes are read from the kernel parameters (constant bank) where they are used:
  // kept in registers, they made the 160-register 192-row d = 64 kernel spill.
  const FwdParams& p;
  __device__ __forceinline__ TileScheduler(int m_blocks, int h, int b, bool masked, const FwdParams& params)
      : num_m_blocks(m_blocks), heads(h), num_tiles(m_blocks * h * b), longest_first(masked), p(params) {}
  __device__ __forceinline__ void tile(int t, int& m_block, int& head, int& batch) const {
    int hb;
    if (longest_first) {
      const int big_hb = p.sm90_section_big_hb, small_hb = p.sm90_section_hb;
      const int big_tiles = p.sm90_section_big * big_hb * num_m_blocks;
      int first_hb, hb_count;
      if (t < big_tiles) {
        first_hb = t / (big_hb * num_m_blocks) * big_hb;
        hb_count = big_hb;
      } else {
        first_hb = p.sm90_section_big * big_hb + (t - big_tiles) / (small_hb * num_m_blocks) * small_hb;
        hb_count = small_hb;
      }
      const int r = t - first_hb * num_m_blocks;
      m_block = num_m_blocks - 1 - r / hb_count;
      hb = first_hb + r % hb_count;
    } else {
      hb = t / num_m_blocks;
      m_block = num_m_blocks - 1 - (t - hb * num_m_blocks);
    }
    head = hb % heads;
    batch = hb / heads;
  }
};

// Helpers of the forward kernel only (bwd_kernel.cuh includes this file: keep its namespace clean).
namespace fwd_detail {

// Makes this thread's generic-proxy shared-memory writes visible to the async proxy (the TMA
// store that reads them). As cutlass::arch::fence_view_async_shared, plus a "memory" clobber so
// the compiler cannot sink the preceding st.shared below the fence.
__device__ __forceinline__ void fence_smem_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// An opaque copy of v (the compiler cannot see through it nor move it out of a loop). Values
// derived from it are computed where they are used instead of being hoisted out of the tile loop
// and kept live (or spilled) across the main loop.
__device__ __forceinline__ int opaque(int v) {
  asm volatile("" : "+r"(v));
  return v;
}

// Shared-memory accesses as volatile asm with a memory clobber: the tile ring's slot accesses stay
// between the mbarrier operations (CUTLASS's barrier asm has no memory clobber) that order them,
// and the O tile's stores stay before the proxy fence.
__device__ __forceinline__ void st_shared_b32(uint32_t smem_addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_addr), "r"(v) : "memory");
}
// Four 8 x 8 matrices of 16-bit values to shared memory: lane l gives the address of row l % 8
// of matrix l / 8 (16 contiguous bytes), and register m holds this lane's pair of matrix m
// (row l / 4, columns 2 (l % 4) and + 1): the layout of a wgmma accumulator's 8-column blocks.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t smem_addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr) : "memory");
  return v;
}

// The dynamic scheduler's ring (SharedStorage::tile_slot, tile_full, tile_empty): the k-th tile
// index a CTA walks goes through slot k % 2. The producer thread waits until every consumer
// thread has read the slot's previous index; consumers wait for the producer's arrival.
template <typename Storage>
__device__ __forceinline__ void tile_ring_push(Storage& ss, int k, int t) {
  using Barrier = cutlass::arch::ClusterBarrier;
  const int slot = k & 1;
  if (k >= 2) Barrier::wait(&ss.tile_empty[slot], ((k >> 1) - 1) & 1);
  st_shared_b32(cute::cast_smem_ptr_to_uint(&ss.tile_slot[slot]), uint32_t(t));
  Barrier::arrive(&ss.tile_full[slot]);  // release: the slot write is visible to the waiters
}
template <typename Storage>
__device__ __forceinline__ int tile_ring_pop(Storage& ss, int k) {
  using Barrier = cutlass::arch::ClusterBarrier;
  const int slot = k & 1;
  Barrier::wait(&ss.tile_full[slot], (k >> 1) & 1);
  // Every lane reads the same index; redux.sync makes that visible to the compiler (a uniform
  // register, as for blockIdx-derived tile indices).
  const int t = __reduce_max_sync(0xffffffffu, int(ld_shared_b32(cute::cast_smem_ptr_to_uint(&ss.tile_slot[slot]))));
  Barrier::arrive(&ss.tile_empty[slot]);
  return t;
}

}  // namespace fwd_detail

template <typename Traits, bool kHasWindow, int kLoop>
__global__ void __launch_bounds__(Traits::kThreads, 1) fwd_kernel(const __grid_constant__ FwdArgs<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace fwd_detail;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const FwdParams& p = args.p;
  const TileScheduler scheduler((p.seqlen_q + kBlockM - 1) / kBlockM, p.heads_q, p.batch, kHasWindow,
                                p);
  const int warp_group = threadIdx.x / 128;  // 0: producer
  const bool varlen = p.cu_seqlens_q != nullptr;
  // Tiles claimed from p.tile_counter (only under a mask; the launch sets it for a persistent grid).
  const bool dynamic = kHasWindow && p.tile_counter != nullptr;
  // O through shared memory and a TMA store; varlen keeps the register epilogue (a 64-row box
  // would write into the next sequence's rows).
  const bool tma_store_o = p.sm90_tma_store_o && !varlen;
  // d = 256: O is staged in the warpgroup's slab of Q (kernel_traits.h), so the slab is released
  // to the producer by the store's issuing thread once the store has read it, not by every
  // consumer thread after the tile's last S.
  const bool o_in_q = !Traits::kHasSmemO && tma_store_o;

  // Barriers: Q full (TMA) and Q empty (consumers done with a tile's Q); K and V each have a
  // full/empty ring that runs on across tiles.
  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    if (tma_store_o) cute::prefetch_tma_descriptor(args.tma_o.get_tma_descriptor());
    for (int w = 0; w < Traits::kConsumerWGs; ++w) {
      Barrier::init(&ss.barrier_q[w], 1);
      Barrier::init(&ss.barrier_q_empty[w], o_in_q ? 1 : 128);
    }
    if (dynamic) {
      for (int slot = 0; slot < 2; ++slot) {
        Barrier::init(&ss.tile_full[slot], 1);
        Barrier::init(&ss.tile_empty[slot], Traits::kMmaThreads);
      }
    }
  }
  typename Pipeline::Params pipe_params;
  pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kMmaThreads;
  pipe_params.transaction_bytes = Traits::kTmaBytesKV;
  Pipeline pipeline_k(ss.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_v(ss.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();
  FLASH_EXT_TRACE(if (threadIdx.x == 0) trace::cta_stamp(p.sm90_trace, 0);)

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutVt{});

  // Query tile m_block holds rows [m_block * kBlockM - row_shift, + kBlockM): causal tiles are
  // aligned to end at seqlen_q (p.sm90_row_shift, a multiple of 64, set by the launch), so rows
  // before row 0 (no output) pad the first tile.
  const int row_shift = p.sm90_row_shift;
  // The visible key blocks of a tile; false when the tile has no query row (varlen) or no key.
  auto tile_work = [&](int m_block, int batch, SeqInfo& seq, int& n_min, int& n_max) {
    seq = SeqInfo(p, batch);
    const int row0 = m_block * kBlockM - row_shift;
    if (row0 >= seq.seqlen_q) return false;
    const BlockMask<kBlockM, kBlockN, kHasWindow> mask(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    mask.key_block_range_rows(row0, n_min, n_max);
    return true;
  };
  // Without a mask the static walk runs on past the tiles walked whole into this CTA's stream-K
  // pieces of the tail tiles (sm90/stream_k.h; the launch sets the bounds).
  const int work_end = kHasWindow ? scheduler.num_tiles : p.sm90_work_end;
  auto stream_k = [&]() {
    return StreamKTail(p, scheduler.num_tiles, (p.seqlen_k + kBlockN - 1) / kBlockN, int(gridDim.x));
  };

  if (warp_group == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x != 0) return;
    // K and V of a key block go to the same stage of their rings: K's state runs one block
    // ahead of V's within a tile and both end a tile equal, so one state carries over (the
    // producer runs at 24 registers).
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    int q_loads = 0;
    // Dynamic: the next tile is claimed once the current tile's loads are issued. The atomic's
    // round trip (~0.5 us) hides under the wait for a free K/V stage, which the producer, kStages
    // blocks ahead of the consumers, would spend anyway. redux.sync (a no-op over one lane) puts
    // the claimed index in a uniform register, so the tile decode and TMA coordinates stay on
    // the uniform datapath as blockIdx-derived ones do; from a plain register they spilled
    // (228 bytes at 24 registers, inside the K/V loop).
    int tiles_pushed = 0;
    auto next_tile = [&](int t) {
      if (!dynamic) return t + int(gridDim.x);
      t = __reduce_max_sync(1u, int(gridDim.x) + atomicAdd(p.tile_counter, 1));
      tile_ring_push(ss, tiles_pushed++, t);  // the final, out-of-range index tells consumers to stop
      return t;
    };
    if (dynamic) tile_ring_push(ss, tiles_pushed++, int(blockIdx.x));
    FLASH_EXT_TRACE(int trace_k = 0;)
    for (int t = blockIdx.x; t < work_end; t = next_tile(t)) {
      int tile = t, n_lo = 0, n_hi = 0;
      if constexpr (!kHasWindow) {
        if (t >= p.sm90_dp_tiles && !stream_k().piece(t, blockIdx.x, tile, n_lo, n_hi)) continue;
      }
      int m_block, head, batch, n_min = 0, n_max = 0;
      scheduler.tile(tile, m_block, head, batch);
      SeqInfo seq(p, batch);
      if (!tile_work(m_block, batch, seq, n_min, n_max)) continue;
      if constexpr (!kHasWindow) {
        if (t >= p.sm90_dp_tiles) n_min = n_lo, n_max = n_hi;
      }
      if (n_min >= n_max) continue;
      FLASH_EXT_TRACE(const int tk = trace_k++; trace::mark(p.sm90_trace, 0, tk, trace::kProdTop);
                      trace::value(p.sm90_trace, 0, tk, trace::kBlocks, n_max - n_min);
                      trace::value(p.sm90_trace, 0, tk, trace::kTile, tile);)
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
      FLASH_EXT_TRACE(trace::mark(p.sm90_trace, 0, tk, trace::kProdFirstK);)
      CUTE_UNROLL
      for (int w = 0; w < Traits::kConsumerWGs; ++w) {
        if (q_loads > 0) Barrier::wait(&ss.barrier_q_empty[w], (q_loads - 1) & 1);
        Barrier::arrive_and_expect_tx(&ss.barrier_q[w], Traits::kTmaBytesQSlab);
        Tensor sQw = make_tensor(make_smem_ptr(ss.q.data() + w * Traits::kQSlabElems), typename Traits::SmemLayoutQSlab{});
        auto [tQgQ, tQsQ] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQw), group_modes<0, 2>(gQ));
        copy(args.tma_q.with(ss.barrier_q[w]), tQgQ(_, m_block * Traits::kConsumerWGs + w - row_shift / 64), tQsQ);
      }
      ++q_loads;
      FLASH_EXT_TRACE(trace::mark(p.sm90_trace, 0, tk, trace::kProdQ);)
      // K one block ahead of V: the consumers use K_n together with V_{n+1} (S_n beside
      // P_{n+1} V_{n+1}), so K_n goes out before V_{n+1}, and K's next load waits only for the
      // S GEMM that frees its stage, not also for the P V GEMM behind it (loading K_n and V_n
      // together held K back by that GEMM; measured in session 10: even at d <= 128, +0-5% at
      // d = 256).
      PipelineState write_v = write;
      ++write;
      for (--n_block; n_block >= n_min; --n_block) {
        pipeline_k.producer_acquire(write);
        copy(args.tma_k.with(*pipeline_k.producer_get_barrier(write)), tKgK(_, n_block), tKsK(_, write.index()));
        ++write;
        pipeline_v.producer_acquire(write_v);
        copy(args.tma_v.with(*pipeline_v.producer_get_barrier(write_v)), tVgV(_, n_block + 1), tVsV(_, write_v.index()));
        ++write_v;
      }
      pipeline_v.producer_acquire(write_v);
      copy(args.tma_v.with(*pipeline_v.producer_get_barrier(write_v)), tVgV(_, n_min), tVsV(_, write_v.index()));
      FLASH_EXT_TRACE(trace::mark(p.sm90_trace, 0, tk, trace::kProdLastV);)
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int mma_tid = threadIdx.x - 128;
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(mma_tid);
  auto thr_pv = mma_pv.get_thread_slice(mma_tid);
  // Q's wgmma descriptors depend only on the warpgroup (its 64-row slab of Q). Partitioned from
  // a warp-uniform warpgroup index (redux.sync), they are uniform-register values that the
  // S = Q K^T issue uses directly; from mma_tid they sat in 16 vector registers, moved to uniform
  // registers by an R2UR before each of the 8 wgmma of every S GEMM.
  const int wg_first_tid = __reduce_max_sync(0xffffffffu, mma_tid / 128) * 128;
  Tensor tSrQ = mma_qk.get_thread_slice(wg_first_tid).partition_fragment_A(sQ);
  Tensor tSrK = thr_qk.partition_fragment_B(sK);
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);
  Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor o_rows = make_tensor(acc_o.data(), gmma_acc_as_rows_cols(acc_o.layout()));
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rows = make_tensor(cS.data(), gmma_acc_as_rows_cols(cS.layout()));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO_rows = make_tensor(cO.data(), gmma_acc_as_rows_cols(cO.layout()));
  constexpr int kRows = decltype(size<0>(o_rows))::value;
  const float scale_log2 = p.softmax_scale_log2;
  const bool use_softcap = p.softcap > 0.f;
  // Lazy rescaling (common/softmax.h): a row's max moves only when a block's max exceeds it by
  // more than 8 in log2 units (p.sm90_lazy_rescale; 0: whenever it grows).
  const float rescale_slack_log2 = p.sm90_lazy_rescale ? 8.f : 0.f;

  // Ping-pong (two consumer warpgroups): a warpgroup issues its GEMMs only in its turn and then
  // hands the turn over, so one warpgroup's softmax runs under the other's GEMMs. Turns are
  // named barriers: warpgroup w syncs on barrier 1 + w; the other arrives on it.
  // With three consumer warpgroups (d = 64's 192-row tile) the turn goes round: 0 -> 1 -> 2 -> 0.
  // Every warpgroup takes the same number of turns per tile (one per key block, plus one), so the
  // rotation carries on across tiles (p.sm90_pingpong 1): warpgroup 0 issues the next tile's first
  // S = Q K^T right after the last warpgroup's last P V, under that warpgroup's epilogue.
  // p.sm90_pingpong 2 re-synchronises the warpgroups at every tile (turn 0 to warpgroup 0 after
  // every warpgroup's epilogue: the behaviour before 2026-11-22), 0 turns ping-pong off.
  constexpr int kWGs = Traits::kConsumerWGs;
  const bool pingpong = kWGs >= 2 && p.sm90_pingpong != 0;
  const bool pp_carry = pingpong && p.sm90_pingpong == 1;
  const bool pp_per_tile = pingpong && !pp_carry;
  const int consumer_wg = warp_group - 1;
  auto turn_begin = [&]() { if (pingpong) named_barrier_sync(1 + consumer_wg, 256); };
  auto turn_end = [&]() { if (pingpong) named_barrier_arrive(1 + (consumer_wg + 1) % kWGs, 256); };

  // TMA-store epilogue: each warpgroup stages its 64 rows of O in its own shared-memory tile (at
  // d = 256 its slab of Q) and its first thread issues the store; named barrier 1 + kWGs + w
  // (after the ping-pong turns) syncs warpgroup w's 128 threads.
  const bool o_store_leader = mma_tid % 128 == 0;
  const int o_barrier = 1 + kWGs + consumer_wg;
  // Named barrier 1 + 2 kWGs + w: warpgroup w's vote on rescaling O (below; kLoopOverlap only).
  const int rescale_barrier = 1 + 2 * kWGs + consumer_wg;
  bool o_store_pending = false;  // this warpgroup's previous store may still read its tile

  int tiles_popped = 0;
  auto next_tile = [&](int t) { return dynamic ? tile_ring_pop(ss, tiles_popped++) : t + int(gridDim.x); };
  PipelineState read_k, read_v;
  int q_loads = 0;
  if (pp_carry && consumer_wg == kWGs - 1) named_barrier_arrive(1, 256);  // warpgroup 0 goes first
  FLASH_EXT_TRACE(int trace_k = 0; int64_t* const trace_buf = mma_tid % 128 == 0 ? p.sm90_trace : nullptr;)
  for (int t = dynamic ? tile_ring_pop(ss, tiles_popped++) : int(blockIdx.x); t < work_end; t = next_tile(t)) {
    int tile = t, n_lo = 0, n_hi = 0;
    if constexpr (!kHasWindow) {
      if (t >= p.sm90_dp_tiles && !stream_k().piece(t, blockIdx.x, tile, n_lo, n_hi)) continue;
    }
    int m_block, head, batch, n_min = 0, n_max = 0;
    scheduler.tile(tile, m_block, head, batch);
    SeqInfo seq(p, batch);
    if (!tile_work(m_block, batch, seq, n_min, n_max)) continue;
    if constexpr (!kHasWindow) {
      if (t >= p.sm90_dp_tiles) n_min = n_lo, n_max = n_hi;
    }
    const int row0 = m_block * kBlockM - row_shift;  // may be negative (first tile, aligned to the end)
    const int rows_q = seq.seqlen_q - row0;  // rows [max(0, -row0), rows_q) of the tile exist
    const BlockMask<kBlockM, kBlockN, kHasWindow> mask(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
    FLASH_EXT_TRACE(const int tk = trace_k++; const int trace_role = 1 + consumer_wg;
                    trace::mark(trace_buf, trace_role, tk, trace::kTileTop);
                    trace::value(trace_buf, trace_role, tk, trace::kBlocks, n_max - n_min);
                    trace::value(trace_buf, trace_role, tk, trace::kTile, tile);)

    OnlineSoftmax<kRows> softmax;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      softmax.row_max[r] = -INFINITY;
      softmax.row_sum[r] = 0.f;
    }
    clear(acc_o);

    // Intra-warpgroup overlap (FlashAttention-3, algorithm 2): the softmax of block j runs while
    // the tensor cores compute O += P_{j+1} V_{j+1}; the output is rescaled once that GEMM is done.
    if (n_min < n_max) {
      if (pp_per_tile && consumer_wg == kWGs - 1) named_barrier_arrive(1, 256);  // warpgroup 0 goes first
      Barrier::wait(&ss.barrier_q[consumer_wg], q_loads & 1);
      FLASH_EXT_TRACE(trace::mark(trace_buf, trace_role, tk, trace::kQReady);)
      // This warpgroup's rows of Q are free for the next tile once its last S = Q K^T is done.
      // At d = 256 the slab is released after the main loop instead (below), which keeps a
      // runtime test out of the loop (it cost 5-15 instructions there).
      auto release_q_after = [&](int n) __attribute__((always_inline)) {
        if constexpr (Traits::kHasSmemO) {
          if (n == n_min) Barrier::arrive(&ss.barrier_q_empty[consumer_wg]);
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
        FLASH_EXT_TRACE(trace::mark(trace_buf, trace_role, tk, trace::kFirstS);)
        pipeline_k.consumer_release(read_k);
        ++read_k;
        release_q_after(n_block);
        scores_to_probs(acc_s, n_block, cute::true_type{});
        convert_into(rP, acc_s);
      }
      for (--n_block; n_block >= n_min; --n_block) {
        Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
        pipeline_k.consumer_wait(read_k);
        pipeline_v.consumer_wait(read_v);
        turn_begin();
        warpgroup_gemm_issue<true, false>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), acc_s);
        warpgroup_gemm_issue<false, true>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
        turn_end();
        warpgroup_wait<1>();  // S of this block is ready; P V of the previous one is in flight
        warpgroup_fence_operand(acc_s);
        pipeline_k.consumer_release(read_k);
        ++read_k;
        release_q_after(n_block);
        if constexpr (kLoop == kLoopPvMid) {
          // The P V wait, after the first half of the rows' exponentials: a branch on their sum
          // keeps ptxas from hoisting it above them (a plain wait went above the whole softmax,
          // session 10), and the sum is never the pattern 0xffffffff (a NaN result of an
          // operation is the canonical 0x7fffffff: CUDA C++ Programming Guide, floating-point
          // appendix), so every thread of the warpgroup takes it: the wait is .sync.aligned.
          // The unconditional wait after it keeps ptxas from sinking the wait below the second
          // half, so that P can be packed while those exponentials run (docs/perf-notes.md
          // session 17).
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
      FLASH_EXT_TRACE(trace::mark(trace_buf, trace_role, tk, trace::kLoopDone);)
      pipeline_v.consumer_wait(read_v);
      turn_begin();
      warpgroup_gemm_issue<false, true>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
      turn_end();
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      FLASH_EXT_TRACE(trace::mark(trace_buf, trace_role, tk, trace::kLastPV);)
      pipeline_v.consumer_release(read_v);
      ++read_v;
      // d = 256 with the register epilogue (varlen, FLASH_EXT_SM90_TMA_STORE=0): the slab of Q
      // goes back here, after the last P V rather than the last S.
      if constexpr (!Traits::kHasSmemO) {
        if (!o_in_q) Barrier::arrive(&ss.barrier_q_empty[consumer_wg]);
      }
      if (pp_per_tile && consumer_wg == 0) named_barrier_sync(1, 256);  // the last hand-over
    }

    // A stream-K piece parks its partial state; the tile's last piece merges them all and goes on
    // to the epilogue with the whole tile's state.
    if constexpr (!kHasWindow) {
      if (t >= p.sm90_dp_tiles &&
          !stream_k_park_or_merge<kWGs>(
              stream_k(), p, t, consumer_wg, mma_tid % 128, softmax, o_rows, scale_log2,
              [&]() { named_barrier_sync(o_barrier, 128); },
              [&](bool pred) { return named_barrier_any(pred, o_barrier, 128); })) {
        if (o_in_q && n_min < n_max) {  // the parked piece's slab of Q goes back to the producer
          named_barrier_sync(o_barrier, 128);
          if (o_store_leader) Barrier::arrive(&ss.barrier_q_empty[consumer_wg]);
        }
        continue;
      }
    }

    // Epilogue: normalize, store O (rows < seqlen, cols < head_dim) and lse.
    float lse[kRows];
    softmax.finalize(o_rows, scale_log2, lse);
    const int64_t q_row0 = row0;
    bool o_stored = false;
    // Staged in the slab of Q only where this tile loaded one (a tile without keys loads none,
    // and its slab may already hold the next tile's Q).
    if (tma_store_o && (Traits::kHasSmemO || n_min < n_max)) {
      if (o_in_q) {
        // Every warp of the warpgroup is past its last S = Q K^T before the slab is overwritten.
        named_barrier_sync(o_barrier, 128);
      } else if (o_store_pending) {  // the previous tile's store must have read sO before it is rewritten
        if (o_store_leader) tma_store_wait<0>();
        named_barrier_sync(o_barrier, 128);
      }
      // Coordinates and shared-memory addresses from an opaque thread index: computed from
      // mma_tid they are loop-invariant, and the compiler kept all of them live across the main
      // loop (300-560 bytes of spills at d = 128).
      const int tid = opaque(mma_tid);
      const int wg = tid / 128;
      auto pack = [&](int i) {  // values i, i+1 are adjacent columns of one row
        cutlass::Array<Element, 2> pair;
        pair[0] = Element(acc_o(i));
        pair[1] = Element(acc_o(i + 1));
        uint32_t packed;
        static_assert(sizeof(pair) == sizeof(packed));
        memcpy(&packed, &pair, sizeof(packed));
        return packed;
      };
      // stmatrix: a thread's values 8q .. 8q + 7 are its parts of the four 8 x 8 matrices at
      // columns 16q .. 16q + 15 of its warp's 16 rows (rows 0-7 / 8-15, columns + 0 / + 8), so a
      // warp stores them with one instruction; each lane addresses one matrix row, whose 8
      // values (16 bytes) stay contiguous under the 64- and 128-byte swizzles. (One 32-bit store
      // per value pair, until session 14, took ~230 more instructions per thread per tile.)
      // 32-bit shared addresses with the tile's swizzle applied to the byte address, as the TMA
      // unit and CuTe's swizzled smem pointers do (a CuTe smem tensor here compiled to generic
      // 64-bit ST.E stores). The tiles are 1024-byte aligned, so the swizzle phase matches.
      auto stage_rows = [&](auto layout, uint32_t base, int row_offset) __attribute__((always_inline)) {
        constexpr auto swizzle = get_swizzle_portion(decltype(layout){});
        constexpr auto offsets = get_nonswizzle_portion(decltype(layout){});
        const int lane = tid % 32;
        const int srow = row_offset + 16 * ((tid % 128) / 32) + lane % 8 + 8 * ((lane / 8) % 2);
        CUTE_UNROLL
        for (int q = 0; q < kHeadDim / 16; ++q) {
          const int scol = 16 * q + 8 * (lane / 16);
          stmatrix_x4(swizzle(base + uint32_t(offsets(srow, scol)) * uint32_t(sizeof(Element))),
                      pack(8 * q), pack(8 * q + 2), pack(8 * q + 4), pack(8 * q + 6));
        }
      };
      Element* stage_ptr;
      if constexpr (Traits::kHasSmemO) {
        stage_ptr = ss.o.o.data() + wg * cosize_v<typename Traits::SmemLayoutO>;
        stage_rows(typename Traits::SmemLayoutO{}, cute::cast_smem_ptr_to_uint(stage_ptr), 0);
      } else {  // warpgroup wg's rows 64 wg .. 64 wg + 63 of Q's tile
        stage_ptr = ss.q.data() + wg * Traits::kQSlabElems;
        stage_rows(typename Traits::SmemLayoutQ{}, cute::cast_smem_ptr_to_uint(ss.q.data()), 64 * wg);
      }
      fence_smem_for_async_proxy();
      named_barrier_sync(o_barrier, 128);
      // A box wholly before row 0 (the first tile of a causal call aligned to the end) is not
      // stored: the TMA unit clips rows past the end but faults on a negative start row.
      const int o_box = m_block * Traits::kConsumerWGs + wg - row_shift / 64;
      if (o_store_leader) {
        if (o_box >= 0) {
          // The tensor map has O's real extents: rows >= seqlen_q and columns >= head_dim are
          // clipped by the TMA unit.
          Tensor sO = make_tensor(make_smem_ptr(stage_ptr), typename Traits::SmemLayoutOStage{});
          Tensor mO = args.tma_o.get_tma_tensor(args.shape_q)(_, _, head, batch);
          Tensor gO = local_tile(mO, Shape<_64, Int<kHeadDim>>{}, make_coord(o_box, _0{}));
          auto [tOgO, tOsO] = tma_partition(args.tma_o, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
          copy(args.tma_o, tOsO, tOgO);
          tma_store_arrive();
        }
        if (o_in_q) {  // the slab goes back to the producer once the store has read it
          tma_store_wait<0>();
          Barrier::arrive(&ss.barrier_q_empty[consumer_wg]);
        }
      }
      o_store_pending = !o_in_q;
      o_stored = true;
    }
    if (!o_stored) {
      Element* o_tile = static_cast<Element*>(p.o) + seq.o_offset + head * p.o_head_stride + q_row0 * p.o_row_stride;
      CUTE_UNROLL
      for (int i = 0; i < size(acc_o); i += 2) {  // values i, i+1 are adjacent columns of one row
        const int row = get<0>(cO(i)), col = get<1>(cO(i));
        if (row < rows_q && row >= -row0 && col < p.head_dim) {
          cutlass::Array<Element, 2> pair;
          pair[0] = Element(acc_o(i));
          pair[1] = Element(acc_o(i + 1));
          *reinterpret_cast<cutlass::Array<Element, 2>*>(o_tile + row * p.o_row_stride + col) = pair;
        }
      }
    }
    if (get<1>(cO_rows(0, 0)) == 0) {
      float* lse_out = p.lse + seq.lse_offset + head * p.lse_head_stride + q_row0;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(cO_rows(r, 0));
        if (row < rows_q && row >= -row0) lse_out[row] = lse[r];
      }
    }
    FLASH_EXT_TRACE(trace::mark(trace_buf, trace_role, tk, trace::kStored);)
  }
  if (pp_carry && consumer_wg == 0) named_barrier_sync(1, 256);  // the last hand-over
  // Shared memory must outlive the last store's reads of it.
  if (o_store_pending && o_store_leader) tma_store_wait<0>();
  // The CTA's end: after every consumer warpgroup (named barrier 15, unused elsewhere).
  FLASH_EXT_TRACE(named_barrier_sync(15, Traits::kMmaThreads);
                  if (mma_tid == 0) trace::cta_stamp(p.sm90_trace, 1);)
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace flash_ext::sm90
