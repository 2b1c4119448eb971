// Epilogue of the Hopper forward: normalizes a tile's O, stores it and lse.
//
// O goes through shared memory and a TMA store for fixed-length batches: each consumer
// warpgroup stages its 64 rows in its own shared-memory tile, or at d = 256 (no room for one
// beside Q and the K/V rings: kernel_traits.h) in its own slab of Q, and its first thread issues
// the store. Varlen batches (a 64-row box would write into the next sequence's rows) and
// p.sm90_tma_store_o off stage O the same way where the tile has its own O tile, and the
// warpgroup's threads copy it out in 16-byte chunks, a row's chunks from consecutive threads
// (whole 32-byte sectors); the register store, each thread's value pairs straight to global
// memory, took ~4,600 cycles per tile against ~1,400 with the TMA store (trace, H200 d 128:
// docs/perf-notes.md, Session 36). At d = 256 without the TMA store, O goes from registers.
// lse is stored from registers.
#pragma once
#include <cstring>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "params.h"
#include "sm90/fwd_args.h"
#include "sm90/fwd_trace.h"
#include "sm90/kernel_traits.h"
#include "sm90/warpgroup.h"

namespace flash_ext::sm90 {

template <typename Traits>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kWGs = Traits::kConsumerWGs;
  using Args = FwdArgs<Traits>;

  const Args& args;
  const bool tma_store_o;  // O through shared memory and a TMA store
  // d = 256: O is staged in the warpgroup's slab of Q, so the slab is released to the producer
  // by the store's issuing thread once the store has read it, not by every consumer thread
  // after the tile's last S (the mainloop's q_to_epilogue).
  const bool o_in_q;

  __device__ __forceinline__ FwdEpilogue(const Args& a, bool varlen)
      : args(a), tma_store_o(a.p.sm90_tma_store_o && !varlen), o_in_q(!Traits::kHasSmemO && tma_store_o) {}

  // Thread 0, at the kernel's start.
  __device__ __forceinline__ void prefetch_descriptors() const {
    if (tma_store_o) cute::prefetch_tma_descriptor(args.tma_o.get_tma_descriptor());
  }

  // A consumer warpgroup's side, across tiles. Named barrier Traits::kBarrierWarpgroup + w syncs
  // warpgroup w's 128 threads. Declared before the mainloop's consumer state and started after it
  // (start()), the order in which the kernel this shell was cut from computed these values: the
  // generated code depends on it. At the kernel's end, store_pending && leader: the last store
  // may still read shared memory, which must outlive it (the shell waits for it).
  struct Consumer {
    typename Traits::SharedStorage& ss;
    int consumer_wg;
    bool leader;  // the warpgroup's first thread issues its stores
    int barrier;
    bool store_pending = false;  // this warpgroup's previous store may still read its tile

    __device__ __forceinline__ explicit Consumer(typename Traits::SharedStorage& storage) : ss(storage) {}
    __device__ __forceinline__ void start(int mma_tid, int wg) {
      consumer_wg = wg;
      leader = mma_tid % 128 == 0;
      barrier = Traits::kBarrierWarpgroup + wg;
    }

    // Work item w is a piece whose tile another one stores: where O would have been staged in
    // this warpgroup's slab of Q, the slab goes back to the producer here.
    __device__ __forceinline__ void skip(const FwdEpilogue& epi, const FwdTile& w) const {
      if (epi.o_in_q && w.n_min < w.n_max) {
        named_barrier_sync(barrier, 128);
        if (leader) Barrier::arrive(&ss.barrier_q_empty[consumer_wg]);
      }
    }

    // Warpgroup (tid / 128)'s 64 staged rows of O (SmemLayoutO at `base`) to global memory: each
    // 16-byte chunk (8 columns, contiguous under the swizzle, as stage_rows writes them) read from
    // shared memory and stored if its row exists (rows_q, row 0) and its columns are < head_dim (a
    // multiple of 8). Consecutive threads take a row's consecutive chunks.
    __device__ __forceinline__ void copy_rows_out(const FwdParams& p, const FwdTile& w, uint32_t base, int tid) const {
      using Layout = typename Traits::SmemLayoutO;
      constexpr auto swizzle = get_swizzle_portion(Layout{});
      constexpr auto offsets = get_nonswizzle_portion(Layout{});
      constexpr int kChunks = kHeadDim / 8;  // per row
      static_assert((64 * kChunks) % 128 == 0, "whole passes of the warpgroup");
      const int t = tid % 128, row_base = 64 * (tid / 128);
      Element* o_tile = static_cast<Element*>(p.o) + w.seq.o_offset + w.head * p.o_head_stride +
                        int64_t(w.row0) * p.o_row_stride;
      CUTE_UNROLL
      for (int i = t; i < 64 * kChunks; i += 128) {
        const int r = i / kChunks, c = 8 * (i % kChunks);
        const uint4 v = ld_shared_v4(swizzle(base + uint32_t(offsets(r, c)) * uint32_t(sizeof(Element))));
        const int row = row_base + r;  // within the tile
        if (row < w.rows_q && row >= -w.row0 && c < p.head_dim) {
          *reinterpret_cast<uint4*>(o_tile + row * p.o_row_stride + c) = v;
        }
      }
    }

    // Normalizes O (acc_o, and o_rows: the same registers by (row, col); the accumulator of
    // mainloop consumer `acc`) by softmax's row sums and stores O (rows < seqlen, cols < head_dim)
    // and lse.
    template <typename Softmax, typename AccO, typename ORows, typename Acc>
    __device__ __forceinline__ void store(const FwdEpilogue& epi, const FwdTile& w, Softmax& softmax, AccO& acc_o,
                                          ORows& o_rows, const Acc& acc, const trace::Role& trace) {
      const FwdParams& p = epi.args.p;
      constexpr int kRows = Acc::kRows;
      const int row0 = w.row0;
      const int rows_q = w.rows_q;
      float lse[kRows];
      softmax.finalize(o_rows, acc.scale_log2, lse);
      const int64_t q_row0 = row0;
      bool o_stored = false;
      // Staged in the slab of Q only where this tile loaded one (a tile without keys loads none,
      // and its slab may already hold the next tile's Q); without the TMA store only in O's own
      // tile (the slab goes back to the producer before the epilogue).
      if (epi.tma_store_o ? (Traits::kHasSmemO || w.n_min < w.n_max) : Traits::kHasSmemO) {
        if (epi.o_in_q) {
          // Every warp of the warpgroup is past its last S = Q K^T before the slab is overwritten.
          named_barrier_sync(barrier, 128);
        } else if (store_pending) {  // the previous tile's store must have read sO before it is rewritten
          if (leader && epi.tma_store_o) tma_store_wait<0>();
          named_barrier_sync(barrier, 128);
        }
        // Coordinates and shared-memory addresses from an opaque thread index: computed from
        // mma_tid they are loop-invariant, and the compiler kept all of them live across the main
        // loop (300-560 bytes of spills at d = 128).
        const int tid = opaque(acc.mma_tid);
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
        // values (16 bytes) stay contiguous under the 64- and 128-byte swizzles. (One 32-bit
        // store per value pair took ~230 more instructions per thread per tile.)
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
        if (!epi.tma_store_o) {
          if constexpr (Traits::kHasSmemO) {
            named_barrier_sync(barrier, 128);
            copy_rows_out(p, w, cute::cast_smem_ptr_to_uint(stage_ptr), tid);
          }
          store_pending = true;  // the next tile's staging waits for every thread's reads
        } else {
          fence_smem_for_async_proxy();
          named_barrier_sync(barrier, 128);
          // A box wholly before row 0 (the first tile of a causal call aligned to the end) is not
          // stored: the TMA unit clips rows past the end but faults on a negative start row.
          const int o_box = w.m_block * kWGs + wg - w.row_shift / 64;
          if (leader) {
            if (o_box >= 0) {
              // The tensor map has O's real extents: rows >= seqlen_q and columns >= head_dim are
              // clipped by the TMA unit.
              const Args& args = epi.args;
              Tensor sO = make_tensor(make_smem_ptr(stage_ptr), typename Traits::SmemLayoutOStage{});
              Tensor mO = args.tma_o.get_tma_tensor(args.shape_q)(_, _, w.head, w.batch);
              Tensor gO = local_tile(mO, Shape<_64, Int<kHeadDim>>{}, make_coord(o_box, _0{}));
              auto [tOgO, tOsO] = tma_partition(args.tma_o, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
              copy(args.tma_o, tOsO, tOgO);
              tma_store_arrive();
            }
            if (epi.o_in_q) {  // the slab goes back to the producer once the store has read it
              tma_store_wait<0>();
              Barrier::arrive(&ss.barrier_q_empty[consumer_wg]);
            }
          }
          store_pending = !epi.o_in_q;
        }
        o_stored = true;
      }
      if (!o_stored) {
        Element* o_tile = static_cast<Element*>(p.o) + w.seq.o_offset + w.head * p.o_head_stride + q_row0 * p.o_row_stride;
        CUTE_UNROLL
        for (int i = 0; i < size(acc_o); i += 2) {  // values i, i+1 are adjacent columns of one row
          const int row = get<0>(acc.cO(i)), col = get<1>(acc.cO(i));
          if (row < rows_q && row >= -row0 && col < p.head_dim) {
            cutlass::Array<Element, 2> pair;
            pair[0] = Element(acc_o(i));
            pair[1] = Element(acc_o(i + 1));
            *reinterpret_cast<cutlass::Array<Element, 2>*>(o_tile + row * p.o_row_stride + col) = pair;
          }
        }
      }
      if (get<1>(acc.cO_rows(0, 0)) == 0) {
        float* lse_out = p.lse + w.seq.lse_offset + w.head * p.lse_head_stride + q_row0;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int row = get<0>(acc.cO_rows(r, 0));
          if (row < rows_q && row >= -row0) lse_out[row] = lse[r];
        }
      }
      trace.mark(trace::kStored);
    }
  };
};

}  // namespace flash_ext::sm90
