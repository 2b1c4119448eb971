// The decode kernel's compile-time shape (decode/decode_kernel.cuh): tile, warps, MMA, the
// shared-memory layouts of Q and the K/V ring, and the global -> shared copy of a key block.
#pragma once
#include <cute/tensor.hpp>

#include "decode/decode_params.h"

namespace flash_ext::decode {

using namespace cute;

// The warps of a CTA split each key block (16 keys each) and keep their own softmax state,
// merged once at the end; a ring of kStages blocks (K and V) in shared memory.
template <int kHeadDim_, typename Element_, int kStages_>
struct DecodeTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kDecodeBlockM;
  static constexpr int kBlockN = decode_block_n(kHeadDim);
  static constexpr int kWarps = kBlockN / 16;
  static constexpr int kNThreads = 32 * kWarps;
  static constexpr int kWarpKeys = kBlockN / kWarps;
  static constexpr int kStages = kStages_;
  // CTAs per SM the registers must allow: as many as shared memory holds on an H100 (ring 2: 3
  // up to kd = 128, else 2; ring 3: 2; ring 4: 1).
  static constexpr int kMinBlocksPerSm =
      kStages == kDecodeStagesShallow ? (kHeadDim <= 128 ? 3 : 2) : (kStages == kDecodeStagesMid ? 2 : 1);
  // Paged caches: page slots (decode/kv_block_loader.h) of kPagesPerBlock 16-key chunks each.
  static constexpr int kPagesPerBlock = decode_pages_per_block(kHeadDim);
  static constexpr int kPageSlots = decode_page_slots(kStages);
  static_assert(kWarpKeys == 16, "one 16-key MMA tile per warp and block");

  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, SM80_16x8x16_F32F16F16F32_TN,
                                   SM80_16x8x16_F32BF16BF16F32_TN>;
  using TiledMma = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<_1, _1, _1>>, Tile<_16, _16, _16>>;  // one warp

  static constexpr int kSmemRowChunk = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kSmemRowChunk == 64 ? 3 : 2;
  using SmemAtom = decltype(composition(Swizzle<kSwizzleBits, 3, 3>{},
                                        Layout<Shape<_8, Int<kSmemRowChunk>>, Stride<Int<kSmemRowChunk>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutVt = decltype(composition(SmemLayoutKV{},
                                            make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  static constexpr int kSmemQElems = cosize_v<SmemLayoutQ>;
  static constexpr int kSmemKVElems = cosize_v<SmemLayoutKV>;
  // Q | ring of kStages x (K, V) | page slots (numbers, first rows); the end-of-loop merge reuses the ring (fp32
  // O, max, sum per warp).
  static constexpr int kSmemPagesOffsetBytes = (kSmemQElems + kStages * 2 * kSmemKVElems) * int(sizeof(Element));
  static constexpr int kSmemBytes = kSmemPagesOffsetBytes + kPageSlots * kPagesPerBlock * 8;  // page, first row
  static_assert(kWarps * kBlockM * (kHeadDim + 8 + 2) * 4 <= kStages * 2 * kSmemKVElems * int(sizeof(Element)));  // the warps' merge
  static_assert(kBlockM * kDecodeMaxSplits * 4 <= kStages * 2 * kSmemKVElems * int(sizeof(Element)),
                "the split merge's weights fit the ring");

  using S2RCopyQK = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using S2RCopyVt = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  static constexpr int kVec = 16 / sizeof(Element);
  static constexpr int kThreadsPerRow = kSmemRowChunk / kVec;
  using GmemTiledCopy = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<uint128_t>, Element>{},
      Layout<Shape<Int<kNThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>{},
      Layout<Shape<_1, Int<kVec>>>{}));
};

}  // namespace flash_ext::decode
