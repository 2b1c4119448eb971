// Tile shapes, thread layouts and shared-memory layouts of the sm80 (FlashAttention-2) kernels.
// The choice per head dim, with its budget, is in docs/kernels-sm80.md.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace flash_ext::sm80 {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename Element_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;

  // Split-Q: warps tile the M (query) dimension only, so each warp owns whole rows of S and O
  // and never exchanges data with another warp inside the key loop.
  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                   SM80_16x8x16_F32F16F16F32_TN, SM80_16x8x16_F32BF16BF16F32_TN>;
  using TiledMma = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, _16>>;
  static_assert(kBlockM % (16 * kNWarps) == 0);

  // Shared memory rows are swizzled in 64-element (128-byte) groups so that ldmatrix and the
  // 16-byte cp.async writes are free of bank conflicts.
  static constexpr int kSmemRowChunk = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kSmemRowChunk == 64 ? 3 : 2;
  using SmemAtom = decltype(composition(
      Swizzle<kSwizzleBits, 3, 3>{},
      Layout<Shape<_8, Int<kSmemRowChunk>>, Stride<Int<kSmemRowChunk>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V seen as V^T (head dim x keys): the B operand of O += P V.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutO = SmemLayoutQ;

  static constexpr int kSmemQElems = cosize_v<SmemLayoutQ>;
  static constexpr int kSmemKVElems = cosize_v<SmemLayoutKV>;
  static constexpr int kSmemBytes = (kSmemQElems + 2 * kSmemKVElems) * sizeof(Element);  // Q, K, V (O reuses Q)

  // smem -> registers: ldmatrix (transposing for V^T).
  using S2RCopyQK = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using S2RCopyVt = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  // registers -> smem for the output tile.
  using R2SCopyO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // global <-> smem: 16-byte vectors, a row chunk spread over consecutive threads (coalesced).
  static constexpr int kVec = 16 / sizeof(Element);
  static constexpr int kThreadsPerRow = kSmemRowChunk / kVec;
  static_assert(kNThreads % kThreadsPerRow == 0);
  using GmemTiledCopy = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<uint128_t>, Element>{},
      Layout<Shape<Int<kNThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>{},
      Layout<Shape<_1, Int<kVec>>>{}));
};

}  // namespace flash_ext::sm80
