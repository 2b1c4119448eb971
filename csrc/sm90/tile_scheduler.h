// Device side of the Hopper forward's tile scheduler: which work item a CTA takes next, in what
// order, and what a work item is. A tile is (query block, head, batch); without a mask a work
// item past p.sm90_dp_tiles is a stream-K piece of a tail tile (sm90/stream_k.h). The host side
// (grid, sections, stream-K bounds, the tile counter) is in sm90/fwd_launch.cuh.
//
// With a persistent grid (one CTA per SM) a CTA's next tile's loads overlap its current tile's
// epilogue.
// Static walk: a CTA takes tiles blockIdx.x, + gridDim.x, ...: the persistent grid without a
// mask (equal tiles), and one CTA per tile (the hardware balances uneven tiles).
// Dynamic (persistent grid under a causal/local mask, p.tile_counter set): a CTA's first tile is
// blockIdx.x; then its producer thread claims gridDim.x + atomicAdd(tile_counter, 1) (the counter
// starts at 0, so every tile is taken exactly once and each CTA's last claim is >= num_tiles; the
// last claim of all resets it to 0)
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
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "params.h"
#include "sm90/fwd_args.h"
#include "sm90/stream_k.h"
#include "sm90/warpgroup.h"

namespace flash_ext::sm90 {

// One thread's end of the dynamic scheduler's ring (SharedStorage::tile_slot, tile_full,
// tile_empty): the k-th tile index a CTA walks goes through slot k % 2. The producer thread
// waits until every consumer thread has read the slot's previous index; consumers wait for the
// producer's arrival.
template <typename Storage>
struct TileRing {
  Storage& ss;
  int k = 0;  // indices this thread has pushed (the producer) or popped (a consumer)

  __device__ __forceinline__ explicit TileRing(Storage& storage) : ss(storage) {}

  __device__ __forceinline__ void push(int t) { push_at(k++, t); }
  __device__ __forceinline__ int pop() { return pop_at(k++); }

  __device__ __forceinline__ void push_at(int k, int t) {
    using Barrier = cutlass::arch::ClusterBarrier;
    const int slot = k & 1;
    if (k >= 2) Barrier::wait(&ss.tile_empty[slot], ((k >> 1) - 1) & 1);
    st_shared_b32(cute::cast_smem_ptr_to_uint(&ss.tile_slot[slot]), uint32_t(t));
    Barrier::arrive(&ss.tile_full[slot]);  // release: the slot write is visible to the waiters
  }
  __device__ __forceinline__ int pop_at(int k) {
    using Barrier = cutlass::arch::ClusterBarrier;
    const int slot = k & 1;
    Barrier::wait(&ss.tile_full[slot], (k >> 1) & 1);
    // Every lane reads the same index; redux.sync makes that visible to the compiler (a uniform
    // register, as for blockIdx-derived tile indices).
    const int t = __reduce_max_sync(0xffffffffu, int(ld_shared_b32(cute::cast_smem_ptr_to_uint(&ss.tile_slot[slot]))));
    Barrier::arrive(&ss.tile_empty[slot]);
    return t;
  }
};

// kMasked: a causal/local mask makes tiles uneven: longest first, claimed dynamically where the
// launch set p.tile_counter. Else equal tiles: the static walk, with a stream-K tail where the
// launch set one (p.sm90_dp_tiles < the number of tiles).
// kSparseSections (FlashMask): where kernel A's count of the pairs the mask keeps is below
// p.fm.one_section_below, one section of every (head, batch) pair instead of the host's L2
// sections (the count is on the GPU; the host cannot read it without a sync); and, with the tile
// table (p.fm.fwd_order), a (head, batch)'s tiles in the table's order (a document's tiles
// together, the longest document first).
template <int kBlockM, int kBlockN, bool kMasked, bool kSparseSections = false>
struct TileScheduler {
  int num_m_blocks, heads, num_tiles;
  // The section sizes are read from the kernel parameters (constant bank) where they are used:
  // kept in registers, they made the 160-register 192-row d = 64 kernel spill.
  const FwdParams& p;
  bool dynamic = false;  // tiles claimed from a counter (and handed on through a TileRing)
  // kSparseSections: kernel A's count is under p.fm.one_section_below. Read once per thread at
  // the kernel's start, where the load's latency hides under the setup (per tile it sat in front
  // of every tile's first GEMM).
  bool one_section = false;

  __device__ __forceinline__ explicit TileScheduler(const FwdParams& params)
      : num_m_blocks((params.seqlen_q + kBlockM - 1) / kBlockM), heads(params.heads_q),
        num_tiles(num_m_blocks * params.heads_q * params.batch), p(params) {
    if constexpr (kSparseSections) {
      one_section = p.fm.visible_pairs != nullptr && (long long)__ldg(p.fm.visible_pairs) < p.fm.one_section_below;
    }
  }
  // Under a mask, claims tiles from `counter` (p.tile_counter, which the launch sets for a
  // persistent grid); else, or without one, the static walk.
  __device__ __forceinline__ void claim_from(const int* counter) { dynamic = kMasked && counter != nullptr; }

  // Thread 0, at the kernel's start.
  template <typename Storage>
  __device__ __forceinline__ void init_barriers(Storage& ss, int consumer_threads) const {
    if (dynamic) {
      for (int slot = 0; slot < 2; ++slot) {
        cutlass::arch::ClusterTransactionBarrier::init(&ss.tile_full[slot], 1);
        cutlass::arch::ClusterTransactionBarrier::init(&ss.tile_empty[slot], consumer_threads);
      }
    }
  }

  // Work items run from first_*() while below work_end(), each next one from next_*(t). The
  // producer thread claims the dynamic scheduler's tiles and pushes them to its ring (the final,
  // out-of-range index too, which tells the consumers to stop); the consumers pop them.
  // Without a mask the static walk runs on past the tiles walked whole into this CTA's stream-K
  // pieces of the tail tiles (the launch sets p.sm90_work_end).
  __device__ __forceinline__ int work_end() const { return kMasked ? num_tiles : p.sm90_work_end; }
  template <typename Ring>
  __device__ __forceinline__ int producer_first(Ring& ring) const {
    if (dynamic) ring.push(int(blockIdx.x));
    return int(blockIdx.x);
  }
  // Dynamic: called once the current tile's loads are issued. The atomic's round trip (~0.5 us)
  // hides under the wait for a free K/V stage, which the producer, kStages blocks ahead of the
  // consumers, would spend anyway. redux.sync (a no-op over one lane) puts the claimed index in a
  // uniform register, so the tile decode and TMA coordinates stay on the uniform datapath as
  // blockIdx-derived ones do; from a plain register they spilled (228 bytes at 24 registers,
  // inside the K/V loop).
  template <typename Ring>
  __device__ __forceinline__ int producer_next(Ring& ring, int t) const {
    if (!dynamic) return t + int(gridDim.x);
    const int claimed = atomicAdd(p.tile_counter, 1);
    // Each CTA claims until it draws an index >= num_tiles, so a launch makes num_tiles claims in
    // all: the one that drew num_tiles - 1 is the last, and sets the counter back to 0 for the
    // next launch (the host keeps one counter per stream and zeroes it only once: api/workspace.h).
    if (claimed == num_tiles - 1) atomicExch(p.tile_counter, 0);
    t = __reduce_max_sync(1u, int(gridDim.x) + claimed);
    ring.push(t);
    return t;
  }
  template <typename Ring>
  __device__ __forceinline__ int consumer_first(Ring& ring) const {
    return dynamic ? ring.pop() : int(blockIdx.x);
  }
  template <typename Ring>
  __device__ __forceinline__ int consumer_next(Ring& ring, int t) const {
    return dynamic ? ring.pop() : t + int(gridDim.x);
  }

  // The stream-K tail's bounds, built where they are used.
  __device__ __forceinline__ StreamKTail stream_k() const {
    return StreamKTail(p, num_tiles, (p.seqlen_k + kBlockN - 1) / kBlockN, int(gridDim.x));
  }
  // Work item t's tile (w.tile) and, for a stream-K piece, its key blocks (w.piece_lo, w.piece_hi);
  // false where this CTA's range has no such piece. Then clip_to_piece(t, w), once the tile's own
  // key blocks are known: a stream-K piece runs its own key blocks, not the tile's. (The
  // consumers decode into a FwdTile, the producer into plain locals: each form keeps its side's
  // generated code as it was.)
  __device__ __forceinline__ bool piece(int t, FwdTile& w) const {
    w.tile = t, w.piece_lo = 0, w.piece_hi = 0;
    if constexpr (!kMasked) {
      if (t >= p.sm90_dp_tiles && !stream_k().piece(t, blockIdx.x, w.tile, w.piece_lo, w.piece_hi)) return false;
    }
    return true;
  }
  __device__ __forceinline__ bool piece(int t, int& tile, int& n_lo, int& n_hi) const {
    if constexpr (!kMasked) {
      if (t >= p.sm90_dp_tiles && !stream_k().piece(t, blockIdx.x, tile, n_lo, n_hi)) return false;
    }
    return true;
  }
  __device__ __forceinline__ void clip_to_piece(int t, int n_lo, int n_hi, int& n_min, int& n_max) const {
    if constexpr (!kMasked) {
      if (t >= p.sm90_dp_tiles) n_min = n_lo, n_max = n_hi;
    }
  }
  __device__ __forceinline__ void clip_to_piece(int t, FwdTile& w) const {
    if constexpr (!kMasked) {
      if (t >= p.sm90_dp_tiles) w.n_min = w.piece_lo, w.n_max = w.piece_hi;
    }
  }

  // Tile t's query block, head and batch.
  __device__ __forceinline__ void tile(int t, int& m_block, int& head, int& batch) const {
    int hb;
    if (kMasked) {  // longest first, in sections
      const int big_hb = p.sm90_section_big_hb;
      int small_hb = p.sm90_section_hb, big = p.sm90_section_big;
      if constexpr (kSparseSections) {
        if (one_section) {
          small_hb = heads * p.batch;
          big = 0;
        }
      }
      const int big_tiles = big * big_hb * num_m_blocks;
      int first_hb, hb_count;
      if (t < big_tiles) {
        first_hb = t / (big_hb * num_m_blocks) * big_hb;
        hb_count = big_hb;
      } else {
        first_hb = big * big_hb + (t - big_tiles) / (small_hb * num_m_blocks) * small_hb;
        hb_count = small_hb;
      }
      const int r = t - first_hb * num_m_blocks;
      const int rank = r / hb_count;  // the rank-th tile of its (head, batch) to run
      m_block = num_m_blocks - 1 - rank;
      hb = first_hb + r % hb_count;
      if constexpr (kSparseSections) {
        // FlashMask (fixed length): the tile table's rank-th query block, not the rank-th from
        // the end (a document mask's longest walks are the ends of its documents).
        if (p.fm.fwd_order != nullptr) {
          const int h = hb % heads, b = hb / heads;
          m_block = __ldg(p.fm.fwd_order + (int64_t(h / p.fm.group) * p.batch + b) * num_m_blocks + rank);
        }
      }
    } else {
      hb = t / num_m_blocks;
      m_block = num_m_blocks - 1 - (t - hb * num_m_blocks);
    }
    head = hb % heads;
    batch = hb / heads;
  }

  // After work item t's key blocks, on consumer warpgroup wg (of kWGs; thread tid of its 128,
  // which meet at named barrier `barrier`): a stream-K piece parks its partial state, and the
  // tile's last piece merges every piece's state into softmax and o_rows. False: another piece
  // stores the tile.
  template <int kWGs, typename Softmax, typename TensorO>
  __device__ __forceinline__ bool last_piece(int t, int wg, int tid, Softmax& softmax, TensorO& o_rows,
                                             float scale_log2, int barrier) const {
    if constexpr (!kMasked) {
      if (t >= p.sm90_dp_tiles &&
          !stream_k_park_or_merge<kWGs>(stream_k(), p, t, wg, tid, softmax, o_rows, scale_log2, barrier)) {
        return false;
      }
    }
    return true;
  }
};

}  // namespace flash_ext::sm90
