// Tiles, shared-memory layouts, MMAs and pipelines of the Hopper forward (see docs/kernels-sm90.md).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

namespace flash_ext::sm90 {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, typename Element_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;   // 64 rows per consumer warpgroup
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;   // K and V ring depth
  static constexpr int kConsumerWGs = kBlockM / 64;
  static constexpr int kMmaThreads = kConsumerWGs * 128;
  static constexpr int kThreads = kMmaThreads + 128;  // + one producer warpgroup
  // Named barriers (0 is __syncthreads'; 15: the CTA's end in trace builds): consumer warpgroup
  // w's ping-pong turn (kBarrierTurn + w), its own 128 threads (kBarrierWarpgroup + w: the
  // epilogue's O staging, the stream-K vote), its vote on rescaling O (kBarrierRescale + w).
  static constexpr int kBarrierTurn = 1;
  static constexpr int kBarrierWarpgroup = 1 + kConsumerWGs;
  static constexpr int kBarrierRescale = 1 + 2 * kConsumerWGs;
  // setmaxnreg: the producer gives its registers to the consumers (sum * 128 <= 64K).
  static constexpr int kProducerRegs = kConsumerWGs == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;

  // Split-Q by warpgroup: consumer warpgroup w owns query rows [64w, 64w + 64).
  using AtomLayout = Layout<Shape<Int<kConsumerWGs>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));

  // 128-byte swizzled rows when the head dim allows it (the TMA box and the wgmma descriptors
  // agree on it), else 64-byte.
  using SmemAtom = std::conditional_t<kHeadDim % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                                      GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // One consumer warpgroup's 64 rows of Q inside SmemLayoutQ (the TMA box of a Q load): each
  // warpgroup's rows are loaded and released on their own barriers, so the next tile's rows of
  // warpgroup 0 load while warpgroup 1 still reads its rows of the current tile.
  using SmemLayoutQSlab = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<_64, Int<kHeadDim>>{}, Stride<_1, Int<kBlockM>>{})));
  // Offset (elements) of warpgroup w's slab: 64 rows are 8 whole swizzle atoms along M, so the
  // swizzle phase of every slab is the same.
  static constexpr int kQSlabElems = 64 * decltype(size<1>(SmemAtom{}))::value;
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T (head dim x keys x stages), the MN-major B operand of O += P V.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));

  // O tile of one consumer warpgroup (64 rows), staged in shared memory for the TMA store; the
  // same swizzled atom as Q, so the 64 x kHeadDim box matches the tensor map like Q's does.
  using SmemLayoutO = decltype(tile_to_shape(SmemAtom{}, Shape<_64, Int<kHeadDim>>{}));

  // The epilogue stages O in shared memory for a TMA store. Where a separate O buffer fits beside
  // Q and the K/V rings (d <= 192) each warpgroup has its own. At d = 256 (Q + K + V take 192 or
  // 224 KB, O would need 64 KB more) a warpgroup stages its O in its own slab of Q, which is free
  // after the tile's last S; the slab goes back to the producer for the next tile's Q only once
  // the store has read it. That holds the next Q load back by the epilogue, but the register
  // epilogue it replaces took ~13k cycles per tile at d = 256 (docs/perf-notes.md, "d = 256's
  // epilogue through Q's buffer").
  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr int kSmemQKVBytes = (cosize_v<SmemLayoutQ> + 2 * cosize_v<SmemLayoutKV>) * int(sizeof(Element));
  static constexpr int kSmemOBytes = kConsumerWGs * cosize_v<SmemLayoutO> * int(sizeof(Element));
  static constexpr bool kHasSmemO = kSmemQKVBytes + kSmemOBytes + 1024 <= kSmemLimit;  // + barriers
  // The shared-memory layout of one warpgroup's staged O tile (the TMA store's box).
  using SmemLayoutOStage = std::conditional_t<kHasSmemO, SmemLayoutO, SmemLayoutQSlab>;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename cutlass::PipelineState<kStages>;

  template <bool kHas, int = 0>
  struct OStorage {
    alignas(1024) cute::array_aligned<Element, kConsumerWGs * cosize_v<SmemLayoutO>> o;
  };
  template <int kDummy>
  struct OStorage<false, kDummy> {};

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    OStorage<kHasSmemO> o;  // one SmemLayoutO tile per consumer warpgroup
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
    uint64_t barrier_q[kConsumerWGs];        // warpgroup w's Q rows loaded (TMA bytes)
    // Warpgroup w done with its rows: its 128 threads' arrivals, or where O is staged in the slab
    // (d = 256) its first thread's, once the O store has read the slab.
    uint64_t barrier_q_empty[kConsumerWGs];
    // Dynamic tile scheduler: the producer thread hands claimed tile indices to the consumers
    // through this 2-slot ring (full: the producer's arrival; empty: every consumer thread's).
    int tile_slot[2];
    uint64_t tile_full[2];
    uint64_t tile_empty[2];
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemLimit, "shared memory over the 227 KB an sm90 CTA may use");
  static constexpr uint32_t kTmaBytesQSlab = 64 * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);
};

}  // namespace flash_ext::sm90
