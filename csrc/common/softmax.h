// Online softmax with deferred normalization (FlashAttention-2, section 3.1).
//
// Per query row we keep the running max m of the scores seen so far and a running sum
// l = sum exp(s - m). Each new key block rescales l and the output accumulator by
// exp(m_old - m_new); the division by l happens once, after the last key block.
// Exponentials are exp2 with log2(e) folded into the scale: exp(x * scale) = exp2(x * scale_log2),
// so each probability costs one FFMA and one EX2.
// Rows whose keys are all masked keep m = -inf; they produce l = 0, output 0 and lse = -inf.
//
// Lazy rescaling (slack_log2 > 0, the Hopper kernel; FlashAttention-4 does the same): m may be any
// value that the scores exceed by at most a small margin, not necessarily their max, as long as l,
// the output and lse all use the same m. So a row keeps its old m while a new block's max exceeds
// it by at most slack_log2 (in log2 units: probabilities up to 2^slack_log2, harmless in fp32 and
// in the bf16/fp16 P operand), its correction is then 1, and a warpgroup whose rows all have
// correction 1 skips the output rescale (kHeadDim / 2 multiplies per thread per key block).
#pragma once
#include <cmath>
#include "common/fragment.h"

namespace flash_ext {

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];  // in score units (before scale_log2)
  float row_sum[kRows];  // partial over this thread's columns; reduced across the quad at the end

  // scores: (rows, cols) view of this thread's score fragment. Updates the running max and sum
  // and turns scores into the unnormalized probabilities exp2(s * scale_log2 - m * scale_log2).
  // correction[r] = exp(m_old - m_new) is the factor the output accumulator must be scaled by;
  // the caller applies it (rescale) when the accumulator is not in use by an in-flight GEMM.
  // kChains: independent max and sum chains per row (the Hopper kernel uses 4: a quarter of the
  // dependent latency; the sm80 kernels keep 1, where more registers meant more spills).
  // slack_log2: lazy rescaling (above); 0 moves the max whenever it grows.
  template <bool kFirstBlock, int kChains = 1, typename TensorS>
  __device__ __forceinline__ void update_scores(TensorS& scores, float scale_log2, float (&correction)[kRows],
                                                float slack_log2 = 0.f) {
    using namespace cute;
    static_assert(decltype(size<0>(scores))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float mx[kChains];
      CUTE_UNROLL
      for (int i = 0; i < kChains; ++i) mx[i] = i == 0 && !kFirstBlock ? row_max[r] : -INFINITY;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) mx[c % kChains] = fmaxf(mx[c % kChains], scores(r, c));
      CUTE_UNROLL
      for (int i = 1; i < kChains; ++i) mx[0] = fmaxf(mx[0], mx[i]);
      float m = quad_max(mx[0]);
      // Keep the old max while the new one is within the slack (with slack 0: an equal max). The
      // comparison is false for an old max of -inf.
      if constexpr (!kFirstBlock) {
        if ((m - row_max[r]) * scale_log2 <= slack_log2) m = row_max[r];
      }
      // A fully masked row so far: subtract 0 instead of -inf so that exp2 gives 0, not NaN.
      const float m_scaled = (m == -INFINITY) ? 0.f : m * scale_log2;
      // Exactly 1 where the max stays: exp2f(row_max * scale_log2 - m_scaled) is not, since the
      // compiler fuses the first product into an FFMA while m_scaled was rounded (the difference
      // is that rounding error, and ex2.approx of it is not 1), so every block rescaled O and
      // lazy rescaling skipped nothing (ncu on the H100: the rescale ran on every key block).
      correction[r] = kFirstBlock || m == row_max[r] ? 1.f : exp2f(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sums[kChains];
      CUTE_UNROLL
      for (int i = 0; i < kChains; ++i) sums[i] = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const float x = scores(r, c) * scale_log2 - m_scaled;
        const float p = exp2f(x);
        scores(r, c) = p;
        sums[c % kChains] += p;
      }
      float sum = sums[0];
      CUTE_UNROLL
      for (int i = 1; i < kChains; ++i) sum += sums[i];
      row_sum[r] = kFirstBlock ? sum : row_sum[r] * correction[r] + sum;
    }
  }

  // update_scores with every row's max before the exponentials and hook(sum) called once, after
  // the exponentials of the first half of the rows (rounded up), with the last of their sums (a
  // value that depends on all of that row's exponentials: the Hopper kernel's kLoopPvMid pins its
  // P V wait there, so that the wait sits behind those exponentials only, not behind the other
  // rows' max chains). Keep the math in sync with update_scores. The two share no helpers because
  // per-row helpers, which left update_scores' SASS as it was, moved the register allocation of
  // the unmasked kLoopPvMid kernels, whose measured SASS this keeps (docs/perf-notes.md).
  template <bool kFirstBlock, int kChains, typename TensorS, typename Hook>
  __device__ __forceinline__ void update_scores_split(TensorS& scores, float scale_log2, float (&correction)[kRows],
                                                      float slack_log2, Hook const& after_half) {
    using namespace cute;
    static_assert(decltype(size<0>(scores))::value == kRows);
    float m_scaled[kRows];
    auto update_max = [&](int r) __attribute__((always_inline)) {
      float mx[kChains];
      CUTE_UNROLL
      for (int i = 0; i < kChains; ++i) mx[i] = i == 0 && !kFirstBlock ? row_max[r] : -INFINITY;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) mx[c % kChains] = fmaxf(mx[c % kChains], scores(r, c));
      CUTE_UNROLL
      for (int i = 1; i < kChains; ++i) mx[0] = fmaxf(mx[0], mx[i]);
      float m = quad_max(mx[0]);
      // Keep the old max while the new one is within the slack (with slack 0: an equal max). The
      // comparison is false for an old max of -inf.
      if constexpr (!kFirstBlock) {
        if ((m - row_max[r]) * scale_log2 <= slack_log2) m = row_max[r];
      }
      // A fully masked row so far: subtract 0 instead of -inf so that exp2 gives 0, not NaN.
      m_scaled[r] = (m == -INFINITY) ? 0.f : m * scale_log2;
      // Exactly 1 where the max stays: exp2f(row_max * scale_log2 - m_scaled) is not, since the
      // compiler fuses the first product into an FFMA while m_scaled was rounded (the difference
      // is that rounding error, and ex2.approx of it is not 1), so every block rescaled O and
      // lazy rescaling skipped nothing (ncu on the H100: the rescale ran on every key block).
      correction[r] = kFirstBlock || m == row_max[r] ? 1.f : exp2f(row_max[r] * scale_log2 - m_scaled[r]);
      row_max[r] = m;
    };
    auto exponentials = [&](int r) __attribute__((always_inline)) {
      float sums[kChains];
      CUTE_UNROLL
      for (int i = 0; i < kChains; ++i) sums[i] = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const float x = scores(r, c) * scale_log2 - m_scaled[r];
        const float p = exp2f(x);
        scores(r, c) = p;
        sums[c % kChains] += p;
      }
      float sum = sums[0];
      CUTE_UNROLL
      for (int i = 1; i < kChains; ++i) sum += sums[i];
      row_sum[r] = kFirstBlock ? sum : row_sum[r] * correction[r] + sum;
      return sum;
    };
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) update_max(r);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = exponentials(r);
      if (r + 1 == (kRows + 1) / 2) after_half(sum);
    }
  }

  template <typename TensorO>
  __device__ __forceinline__ void rescale(TensorO& acc_o, const float (&correction)[kRows]) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) acc_o(r, c) *= correction[r];
    }
  }

  // Whether any of this thread's rows has a correction other than 1 (the caller votes on it
  // across the warpgroup whose output accumulator the rescale would touch, and skips the rescale
  // when no row moved its max).
  __device__ __forceinline__ bool needs_rescale(const float (&correction)[kRows]) const {
    bool needed = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) needed |= correction[r] != 1.f;
    return needed;
  }

  // Both steps at once, for kernels whose output accumulator is idle during the softmax.
  template <bool kFirstBlock, typename TensorS, typename TensorO>
  __device__ __forceinline__ void update(TensorS& scores, TensorO& acc_o, float scale_log2) {
    float correction[kRows];
    update_scores<kFirstBlock>(scores, scale_log2, correction);
    if constexpr (!kFirstBlock) rescale(acc_o, correction);
  }

  // Divides the output by l and returns lse = ln(sum_j exp(s_j * scale)) per row (-inf when the
  // row saw no key).
  template <typename TensorO>
  __device__ __forceinline__ void finalize(TensorO& acc_o, float scale_log2, float (&lse)[kRows]) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = !(sum > 0.f);
      const float inv = empty ? 0.f : 1.f / sum;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) acc_o(r, c) *= inv;
      lse[r] = empty ? -INFINITY : (row_max[r] * scale_log2 + __log2f(sum)) * float(M_LN2);
    }
  }
};

// Softcapping (Gemma 2 style, as FlashAttention 2.6): s <- softcap * tanh(s * scale / softcap).
// The kernel then runs the softmax with scale_log2 = log2(e).
template <typename TensorS>
__device__ __forceinline__ void apply_softcap(TensorS& scores, float pre_scale, float softcap) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(scores); ++i) scores(i) = softcap * tanhf(scores(i) * pre_scale);
}

}  // namespace flash_ext
