// The compiled variants of the sm80 backward's main kernel, one launch function each.
//
// A variant is a tile (the big one, or the small one of sm86/sm89: dispatch/bwd_dispatch.h), a way
// to feed the query blocks (kPrefetch: bwd_kernel_v2, else bwd_kernel), a window mask or none,
// dropout or none, ALiBi or none. run_bwd_sm80 (sm80/bwd_launch.cuh) picks one at run time and calls its
// launch_bwd_main; the definitions are in sm80/bwd_main_launch.cuh, explicitly instantiated in
// the generated file of the head dim and dtype (csrc/instantiations/bwd_sm80_hdim*_*.cu, beside
// run_bwd_sm80). This header declares them without the kernels' code.
#pragma once
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "common/bwd_params.h"
#include "dispatch/bwd_dispatch.h"
#include "sm80/bwd_kernel_traits.h"

namespace flash_ext::sm80 {

// Head dims whose small tile differs from the big one (tools' instantiation table lists the
// small-tile variants for these only; bwd_launch.cuh checks the tile table agrees).
constexpr bool bwd_has_small_tile(int kernel_head_dim) { return kernel_head_dim > 64; }

template <int kHeadDim, bool kIsBf16, bool kBigTile>
struct BwdTraitsFor {
  static constexpr BwdTile kTile = bwd_sm80_tile(kHeadDim, kBigTile);
  using Element = std::conditional_t<kIsBf16, cutlass::bfloat16_t, cutlass::half_t>;
  using type = BwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.warps, Element>;
  static_assert(type::kSmemBytes == bwd_sm80_smem_bytes(kHeadDim, kTile));
};

// Grid (key blocks, heads_q, batch) of bwd_kernel (kPrefetch false) or bwd_kernel_v2 (true).
// kAlibi: the ALiBi variant (compiled windowed and dropout-free only).
template <int kHeadDim, bool kIsBf16, bool kBigTile, bool kPrefetch, bool kHasWindow, bool kDropout,
          bool kAlibi = false>
void launch_bwd_main(BwdParams& p, cudaStream_t stream);

}  // namespace flash_ext::sm80
