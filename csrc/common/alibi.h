// ALiBi (attention with linear biases), FlashAttention-2's meaning: the score of query row i and
// key j gets  - slope_h * |i + seqlen_k - seqlen_q - j|  (the distance to row i's bottom-right
// aligned diagonal), added to the scaled (and softcapped) score before the softmax; slopes are
// fp32, (heads_q,) or (batch, heads_q). Without softcap the kernels' scores are unscaled
// (softmax_scale is folded into the exponent), so the slope is divided by softmax_scale once per
// CTA (alibi_slope).
#pragma once
#include <cute/tensor.hpp>

#include "params.h"

namespace flash_ext {

// The slope of (batch, head) in the units of the kernel's scores: unscaled without softcap
// (softmax_scale is folded into the exponent), scaled with it (softcap * tanh(...) is); 0
// without ALiBi.
__device__ __forceinline__ float alibi_slope(const FwdParams& p, int batch, int head) {
  if (p.alibi_slopes == nullptr) return 0.f;
  const float slope = p.alibi_slopes[batch * p.alibi_batch_stride + head];
  return p.softcap > 0.f ? slope : slope / p.softmax_scale;
}

// scores: a (rows, cols) view of a query-major score fragment, coords the same view of an
// identity tensor over the tile; row0 / col0: the tile's first query row and key within the
// sequence; shift = seqlen_k - seqlen_q of the sequence.
template <typename TensorS, typename TensorC>
__device__ __forceinline__ void apply_alibi(TensorS& scores, const TensorC& coords, int row0, int col0, int shift,
                                            float slope) {
  using namespace cute;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(scores); ++r) {
    const int diag = row0 + get<0>(coords(r, 0)) + shift - col0;  // the diagonal's column in the tile
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) {
      scores(r, c) -= slope * float(abs(diag - get<1>(coords(0, c))));
    }
  }
}

}  // namespace flash_ext
