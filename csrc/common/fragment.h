// Register-fragment views for the mma.sync m16n8k16 accumulator layout, and small warp helpers.
//
// An accumulator fragment of a TiledMMA built from the m16n8 atoms has layout
// ((2 cols, 2 row halves), MMA_M, MMA_N): a thread holds, per 16x8 tile, two adjacent columns of
// rows r and r + 8. The views below regroup it without moving data.
#pragma once
#include <cute/tensor.hpp>

namespace flash_ext {

// ((2,2), M, N) -> ((2 row halves, M) rows, (2 cols, N) cols): index scores by (row, col).
template <typename Layout>
__device__ __forceinline__ constexpr auto acc_as_rows_cols(Layout l) {
  using namespace cute;
  static_assert(rank(Layout{}) == 3 && size<0>(Layout{}) == 4);
  auto v = get<0>(l);
  return make_layout(make_layout(get<1>(v), get<1>(l)), make_layout(get<0>(v), get<2>(l)));
}

// ((2,2), M, N) accumulator of S = Q K^T -> ((2,2,2), M, N/2): the A-operand fragment of the
// next m16n8k16 MMA (P V). Two 16x8 score tiles side by side form one 16x16 A tile.
template <typename Layout>
__device__ __forceinline__ constexpr auto acc_as_mma_a(Layout l) {
  using namespace cute;
  static_assert(rank(Layout{}) == 3 && size<0>(Layout{}) == 4 && size<2>(Layout{}) % 2 == 0);
  auto split = logical_divide(l, Shape<Underscore, Underscore, _2>{});  // N -> (2, N/2)
  return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split), get<2, 1>(split));
}

// Element-wise conversion (e.g. fp32 scores -> bf16 P) into a fragment of the same size.
template <typename TensorDst, typename TensorSrc>
__device__ __forceinline__ void convert_into(TensorDst& dst, const TensorSrc& src) {
  using namespace cute;
  static_assert(decltype(size(dst))::value == decltype(size(src))::value);
  CUTE_UNROLL
  for (int i = 0; i < size(src); i += 2) {
    // pairs convert with one cvt.rn.{bf16x2,f16x2}.f32 instruction
    using To = typename TensorDst::value_type;
    dst(i) = To(src(i));
    dst(i + 1) = To(src(i + 1));
  }
}

// Reductions over the 4 threads of a quad (the threads that share a row of an m16n8 tile).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

}  // namespace flash_ext

namespace flash_ext {

// Hopper (wgmma) accumulators: a warpgroup's 64 x N tile gives each thread values
// ((2 cols, 2 row halves, N/8 column groups), MMA_M, MMA_N); rows are again shared by a quad.
// ((2,2,J), M, N) -> ((2 row halves, M) rows, ((2 cols, J), N) cols).
template <typename Layout>
__device__ __forceinline__ constexpr auto gmma_acc_as_rows_cols(Layout l) {
  using namespace cute;
  static_assert(rank(Layout{}) == 3 && rank(get<0>(Layout{})) == 3);
  auto v = get<0>(l);
  return make_layout(make_layout(get<1>(v), get<1>(l)),
                     make_layout(make_layout(get<0>(v), get<2>(v)), get<2>(l)));
}

// wgmma accumulator of S -> register A operand of the next wgmma (P V): each 16-wide k-slice is
// two adjacent 8-column groups. ((2,2,J), 1, 1) -> ((2,2,2), 1, J/2).
template <typename AccLayout>
__device__ __forceinline__ constexpr auto gmma_acc_as_rs_a(AccLayout l) {
  using namespace cute;
  static_assert(rank(AccLayout{}) == 3 && size<1>(AccLayout{}) == 1 && size<2>(AccLayout{}) == 1);
  auto v = get<0>(l);
  auto j = logical_divide(get<2>(v), Layout<_2>{});  // (2, J/2)
  return make_layout(make_layout(get<0>(v), get<1>(v), get<0>(j)), get<1>(l), get<1>(j));
}

}  // namespace flash_ext
