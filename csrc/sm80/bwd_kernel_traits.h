// Tile shapes, MMA warp layouts and shared-memory layouts of the sm80 backward kernel.
// The configuration per head dim and its budget are in docs/kernels-sm80-bwd.md.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace flash_ext::sm80 {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename Element_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step of the loop
  static constexpr int kBlockN = kBlockN_;  // key rows owned by the CTA
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kNWarps == 4 || kNWarps == 8);

  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                   SM80_16x8x16_F32F16F16F32_TN, SM80_16x8x16_F32BF16BF16F32_TN>;
  using Atom = MMA_Atom<MmaOp>;
  // Unlike the forward, every GEMM reads both operands from shared memory, so each one may lay
  // its warps out differently. Each warp covers (16 * rows) x (16 * cols) per tile step.
  //   S = Q K^T and dP = dO V^T      (kBlockM x kBlockN): 2 x (kNWarps/2) warps
  //   dV += P^T dO, dK += dS^T Q     (kBlockN x kHeadDim): (kNWarps/2) x 2 warps
  //   dQ = dS K                      (kBlockM x kHeadDim): (kNWarps/2) x 2 warps
  static constexpr int kWarpsN_SdP = kNWarps / 2;
  static constexpr int kWarpsM_KV = kNWarps / 2;
  static constexpr int kWarpsM_dQ = kNWarps / 2;
  using TiledMmaSdP = TiledMMA<Atom, Layout<Shape<_2, Int<kWarpsN_SdP>, _1>>,
                               Tile<_32, Int<16 * kWarpsN_SdP>, _16>>;
  using TiledMmadKV = TiledMMA<Atom, Layout<Shape<Int<kWarpsM_KV>, _2, _1>>,
                               Tile<Int<16 * kWarpsM_KV>, _32, _16>>;
  using TiledMmadQ = TiledMMA<Atom, Layout<Shape<Int<kWarpsM_dQ>, _2, _1>>,
                              Tile<Int<16 * kWarpsM_dQ>, _32, _16>>;
  static_assert(kBlockM % 32 == 0 && kBlockN % (16 * kWarpsN_SdP) == 0);
  static_assert(kBlockN % (16 * kWarpsM_KV) == 0 && kHeadDim % 32 == 0);
  static_assert(kBlockM % (16 * kWarpsM_dQ) == 0);

  // Head-dim rows (Q, dO, K, V): swizzled 64- or 32-element groups, as in the forward.
  static constexpr int kSmemRowChunk = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kSmemRowChunk == 64 ? 3 : 2;
  using SmemAtom = decltype(composition(
      Swizzle<kSwizzleBits, 3, 3>{},
      Layout<Shape<_8, Int<kSmemRowChunk>>, Stride<Int<kSmemRowChunk>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Transposed views (head dim x rows): B operands read with ldmatrix.trans.
  //   Q^T for dK += dS^T Q, dO^T for dV += P^T dO, K^T for dQ = dS K.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));

  // P and dS tiles (query rows x key rows), in the input dtype. Row chunk 64 or 32 elements.
  static constexpr int kPRowChunk = kBlockN % 64 == 0 ? 64 : 32;
  static constexpr int kPSwizzleBits = kPRowChunk == 64 ? 3 : 2;
  using SmemAtomP = decltype(composition(
      Swizzle<kPSwizzleBits, 3, 3>{},
      Layout<Shape<_8, Int<kPRowChunk>>, Stride<Int<kPRowChunk>, _1>>{}));
  using SmemLayoutP = decltype(tile_to_shape(SmemAtomP{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  // P^T and dS^T (key rows x query rows): the A operands of dV and dK, read with ldmatrix.trans.
  using SmemLayoutPt = decltype(composition(
      SmemLayoutP{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));

  static constexpr int kSmemQElems = int(cosize_v<SmemLayoutQ>);
  static constexpr int kSmemKVElems = int(cosize_v<SmemLayoutKV>);
  static constexpr int kSmemPElems = int(cosize_v<SmemLayoutP>);
  // Q | dO | K | V | P | dS
  static constexpr int kSmemBytes =
      (2 * kSmemQElems + 2 * kSmemKVElems + 2 * kSmemPElems) * int(sizeof(Element));

  // Variant 2 (bwd_kernel_v2, FLASH_EXT_BWD_VARIANT=2): Q and dO double-buffered, plus lse and D
  // of the query block staged in shared memory (fp32, two buffers each):
  //   Q0 | Q1 | dO0 | dO1 | K | V | P | dS | lse0 | lse1 | D0 | D1
  // Each Q/dO buffer is a multiple of the swizzle period (8 rows x kSmemRowChunk), so buffer 1 is
  // buffer 0's layout shifted by kSmemQElems elements.
  static_assert(kSmemQElems % (8 * kSmemRowChunk) == 0);
  static constexpr int kSmemBytesV2 =
      (4 * kSmemQElems + 2 * kSmemKVElems + 2 * kSmemPElems) * int(sizeof(Element)) +
      4 * kBlockM * int(sizeof(float));
  static_assert(2 * kBlockM <= kNThreads);  // one thread per lse / D entry of a query block

  using S2RCopy = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using S2RCopyT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using R2SCopy = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // global <-> smem for head-dim rows: 16-byte vectors, a row chunk over consecutive threads.
  static constexpr int kVec = 16 / sizeof(Element);
  static constexpr int kThreadsPerRow = kSmemRowChunk / kVec;
  static_assert(kNThreads % kThreadsPerRow == 0);
  static constexpr int kCopyRows = kNThreads / kThreadsPerRow;
  static_assert(kBlockM % kCopyRows == 0 && kBlockN % kCopyRows == 0);
  using GmemTiledCopy = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<uint128_t>, Element>{},
      Layout<Shape<Int<kCopyRows>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>{},
      Layout<Shape<_1, Int<kVec>>>{}));
};

}  // namespace flash_ext::sm80
