// Tiles, shared-memory layouts, MMAs and pipeline of the Hopper backward (docs/kernels-sm90-bwd.md).
//
// A CTA owns kBlockN keys. The scores are computed transposed, S^T = K Q^T (keys x queries), so
// that P^T and dS^T are the A operands of dV += P^T dO and dK += dS^T Q. dQ = dS K reads dS back
// from shared memory; the two warpgroups split it by query rows (kBlockM = 128) or by head-dim
// columns (kBlockM = 64).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

namespace flash_ext::sm90 {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, typename Element_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per step of the loop
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kStages = kStages_;  // Q / dO / lse / D ring depth
  static constexpr int kConsumerWGs = 2;
  static constexpr int kMmaThreads = kConsumerWGs * 128;
  static constexpr int kThreads = kMmaThreads + 128;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kHeadDim % 64 == 0, "128-byte swizzled rows");

  // Two ways to share the work between the two consumer warpgroups:
  //  - split by keys (kBlockN = 128, head dims <= 128): warpgroup w owns keys [64w, 64w + 64)
  //    and their dK, dV rows; P^T and dS^T stay in registers as the A operands of dV and dK.
  //  - split by head dim (kSplitD, kBlockN = 64, head dim 256, whose dK and dV rows would not fit
  //    in one warpgroup's registers): both own all 64 keys; warpgroup w computes S^T, dP^T for
  //    queries [32w, 32w + 32) and dK, dV for head-dim columns [128w, 128w + 128), so P^T and
  //    dS^T go through shared memory.
  static constexpr bool kSplitD = kBlockN == 64;
  static_assert(kSplitD ? (kBlockM == 64 && kHeadDim == 256) : kBlockN == 128, "tile");
  // dQ = dS K: split by rows when each warpgroup can take 64 query rows, else by columns (which
  // then must be whole 64-wide swizzle atoms of K^T).
  static constexpr bool kDqSplitRows = kBlockM == 128;
  // dK of step i is issued after its dQ and retires in step i + 1, under the dQ reductions, the
  // loop's top and the next S^T (no full wgmma drain per step; its dS^T registers stay live into
  // the next step, which fits the 64-query tile's registers).
  // Split by head dim: dV and dK (shared-memory operands, no registers held) likewise.
  static constexpr bool kDkAcrossSteps = kBlockM == 64;
  static_assert(kBlockM == 128 || (kBlockM == 64 && kHeadDim % 128 == 0), "dQ split");

  using AtomSplitM = Layout<Shape<_2, _1, _1>>;
  using AtomSplitN = Layout<Shape<_1, _2, _1>>;
  // S^T = K Q^T and dP^T = V dO^T: both operands K-major in shared memory.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<_64, Int<kSplitD ? kBlockM / 2 : kBlockM>, Int<kHeadDim>>>(),
      std::conditional_t<kSplitD, AtomSplitN, AtomSplitM>{}));
  // dV += P^T dO and dK += dS^T Q, B (dO^T, Q^T) MN-major in shared memory. A from registers
  // (split by keys) or K-major in shared memory (split by head dim).
  using OpRS = decltype(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>,
                                             GMMA::Major::K, GMMA::Major::MN>());
  using OpSS = decltype(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / 2>, Int<kBlockM>>,
                                             GMMA::Major::K, GMMA::Major::MN>());
  using TiledMmaDKV = decltype(make_tiled_mma(std::conditional_t<kSplitD, OpSS, OpRS>{},
                                              std::conditional_t<kSplitD, AtomSplitN, AtomSplitM>{}));
  // dQ = dS K: dS (queries x keys) and K^T (head dim x keys) both MN-major in shared memory.
  using TiledMmaDQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<_64, Int<kDqSplitRows ? kHeadDim : kHeadDim / 2>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      std::conditional_t<kDqSplitRows, AtomSplitM, AtomSplitN>{}));

  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Q^T / dO^T (head dim x queries x stages): MN-major B operands of dK / dV.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // K^T (head dim x keys): MN-major B operand of dQ.
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS, 2 buffers, queries contiguous in both views: dS (queries x keys) is the MN-major A of dQ,
  // dS^T (keys x queries) the K-major A of dK (split by head dim). Split by keys, dS is stored
  // MN-major and dS^T is only a view to write through; split by head dim the reverse (the
  // K-major storage, like K for S = Q K^T, viewed transposed as MN-major like V^T in the forward).
  using SmemLayoutDSMn = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                                Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  using SmemLayoutDStK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kBlockM>, _2>{}));
  using SmemLayoutDS = std::conditional_t<
      kSplitD,
      decltype(composition(SmemLayoutDStK{}, make_ordered_layout(Shape<Int<kBlockM>, Int<kBlockN>, _2>{}, Step<_2, _1, _3>{}))),
      SmemLayoutDSMn>;
  using SmemLayoutDSt = std::conditional_t<
      kSplitD, SmemLayoutDStK,
      decltype(composition(SmemLayoutDSMn{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{}, Step<_2, _1, _3>{})))>;
  // P^T (keys x queries x 2), K-major A of dV; split by head dim only.
  using SmemLayoutPt = SmemLayoutDStK;
  static constexpr int kPtElems = kSplitD ? int(cosize_v<SmemLayoutPt>) : 0;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename cutlass::PipelineState<kStages>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutDSt>> ds;
    alignas(1024) cute::array_aligned<Element, kPtElems == 0 ? 1 : kPtElems> pt;
    alignas(128) float lse_log2[kStages][kBlockM];
    alignas(128) float dsum[kStages][kBlockM];
    typename Pipeline::SharedStorage pipeline_q;
    uint64_t barrier_kv;
    int4 fm_summary[2];  // FlashMask: the CTA's key-block summary pair (common/flashmask_bwd.h)
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);
  // One stage: Q and dO tiles (TMA) and the lse / D rows (bulk copies).
  static constexpr uint32_t kTmaBytesQ = 2 * kBlockM * kHeadDim * sizeof(Element) + 2 * kBlockM * sizeof(float);
};

}  // namespace flash_ext::sm90
