// Merging partial attention states by log-sum-exp: the states of one query row over several key
// ranges, computed apart (the Hopper forward's stream-K pieces of a tile, Flash-Decoding's
// splits of the keys), into the state over all of them.
//
// A row's partial state over key range i comes in one of two forms:
//   (O_i, m_i, l_i)  O_i = sum_j exp(s_j - m_i) v_j (unnormalized), l_i = sum_j exp(s_j - m_i),
//                    m_i the range's max score or any value near it (OnlineSoftmax's state);
//   (O_i, lse_i)     O_i normalized, lse_i = m_i + ln l_i (what a kernel writes out).
// With m = max_i m_i and w_i = exp(m_i - m), 0 for a range with no visible key (m_i = -inf):
//   l = sum_i w_i l_i,   O = sum_i w_i O_i   (still unnormalized: O / l at the end).
// In the lse form, with m = max_i lse_i: O = sum_i w_i O_i / sum_i w_i, lse = m + ln sum_i w_i.
// Scores s are in the units OnlineSoftmax keeps (before scale_log2), exponentials exp2 of
// differences times scale_log2; lse is natural-log. The parts are added in a fixed order, so
// the result does not depend on which part was computed first.
#pragma once
#include <cmath>

namespace flash_ext::combine {

// w_i: the weight of a part whose max is m_part against the merged max m.
__device__ __forceinline__ float part_weight(float m_part, float m, float scale_log2) {
  return m_part == -INFINITY ? 0.f : exp2f((m_part - m) * scale_log2);
}

// The (O, m, l) form, one thread's kRows rows: every part's max first (see_max), then each part
// added in turn (add: returns w_i, by which the caller adds the part's O_i to its O).
template <int kRows>
struct RowStates {
  float m[kRows], l[kRows];

  __device__ __forceinline__ void begin_max() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) m[r] = -INFINITY;
  }
  __device__ __forceinline__ void see_max(int r, float m_part) { m[r] = fmaxf(m[r], m_part); }
  __device__ __forceinline__ void begin_sum() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) l[r] = 0.f;
  }
  __device__ __forceinline__ float add(int r, float m_part, float l_part, float scale_log2) {
    const float w = part_weight(m_part, m[r], scale_log2);
    l[r] += w * l_part;
    return w;
  }
};

// The (O, lse) form: w_i of a part against the parts' largest lse, and the merged lse from the
// sum of the weights (-inf where no part saw a key).
__device__ __forceinline__ float lse_part_weight(float lse_part, float lse_max) {
  return part_weight(lse_part, lse_max, float(M_LOG2E));
}
__device__ __forceinline__ float merged_lse(float lse_max, float weight_sum) {
  return weight_sum > 0.f ? lse_max + logf(weight_sum) : -INFINITY;
}

}  // namespace flash_ext::combine
