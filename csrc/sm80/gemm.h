// Warp-level GEMM steps of the sm80 kernels: ldmatrix the operands from shared memory one
// k-slice ahead of the mma.sync that consumes them, so shared-memory latency hides behind math.
#pragma once
#include <cute/tensor.hpp>

namespace flash_ext::sm80 {

using namespace cute;

// acc += A B with both operands in shared memory.
// rA/rB: register fragments (partition_fragment_A/B); sA/sB: the ldmatrix partitions of smem.
template <typename TiledMma, typename Acc, typename RA, typename RB, typename SA, typename SB,
          typename CopyA, typename CopyB>
__device__ __forceinline__ void gemm_ss(const TiledMma& mma, Acc& acc, RA& rA, RB& rB, const SA& sA,
                                        const SB& sB, const CopyA& copy_a, const CopyB& copy_b,
                                        int tid) {
  auto rA_view = copy_a.get_thread_slice(tid).retile_D(rA);
  auto rB_view = copy_b.get_thread_slice(tid).retile_D(rB);
  constexpr int kSlices = decltype(size<2>(rA))::value;
  copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < kSlices; ++k) {
    if (k + 1 < kSlices) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A B with A already in registers (P in O += P V) and B in shared memory.
template <typename TiledMma, typename Acc, typename RA, typename RB, typename SB, typename CopyB>
__device__ __forceinline__ void gemm_rs(const TiledMma& mma, Acc& acc, const RA& rA, RB& rB,
                                        const SB& sB, const CopyB& copy_b, int tid) {
  auto rB_view = copy_b.get_thread_slice(tid).retile_D(rB);
  constexpr int kSlices = decltype(size<2>(rA))::value;
  // No explicit prefetch here: with P in registers the B slices alone are the live ldmatrix
  // data, and the compiler's own scheduling spilled less than a one-ahead prefetch (ptxas -v).
  CUTE_UNROLL
  for (int k = 0; k < kSlices; ++k) {
    copy(copy_b, sB(_, _, k), rB_view(_, _, k));
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

}  // namespace flash_ext::sm80
