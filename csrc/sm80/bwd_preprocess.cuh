// First kernel of the sm80 backward: D = rowsum(dO * O) in fp32, one value per (batch, head,
// query row), stored with lse's layout (p.dsum). The main kernel reads it as D_i in
// dS = P * (dP - D).
#pragma once
#include <cute/tensor.hpp>

#include "common/bwd_params.h"
#include "common/seqlen.h"
#include "sm80/bwd_gmem.h"

namespace flash_ext::sm80 {

// A warp per row, a lane per 8 columns of the real head dim; kNWarps * 4 rows per CTA.
template <int kNWarps, typename Element>
__global__ void __launch_bounds__(kNWarps * 32) bwd_preprocess_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kRowsPerWarp = 4;
  constexpr int kVec = 8;  // 16 bytes
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const SeqInfo seq(p, batch);
  const BwdSeqOffsets off(p, batch);
  const Element* o_base = static_cast<const Element*>(p.o) + seq.o_offset + head * p.o_head_stride;
  const Element* do_base = static_cast<const Element*>(p.dout) + off.do_offset + head * p.do_head_stride;
  float* dsum = p.dsum + seq.lse_offset + head * p.lse_head_stride;

  const int row0 = (blockIdx.x * kNWarps + warp) * kRowsPerWarp;
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = row0 + r;
    if (row >= seq.seqlen_q) break;  // uniform over the warp
    const Element* o_row = o_base + int64_t(row) * p.o_row_stride;
    const Element* do_row = do_base + int64_t(row) * p.do_row_stride;
    float acc = 0.f;
    for (int c = lane * kVec; c < p.head_dim; c += 32 * kVec) {
      const uint4 a = *reinterpret_cast<const uint4*>(o_row + c);
      const uint4 b = *reinterpret_cast<const uint4*>(do_row + c);
      const Element* ea = reinterpret_cast<const Element*>(&a);
      const Element* eb = reinterpret_cast<const Element*>(&b);
      CUTE_UNROLL
      for (int i = 0; i < kVec; ++i) acc += float(ea[i]) * float(eb[i]);
    }
    CUTE_UNROLL
    for (int s = 16; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffff, acc, s);
    if (lane == 0) dsum[row] = acc;
  }
}

}  // namespace flash_ext::sm80
