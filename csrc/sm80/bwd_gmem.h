// Global memory of the sm80 backward beyond the forward's tensors: where dO, the fp32 dQ
// accumulator, dK and dV start for a sequence, the 4-byte cp.async that stages lse and D, and
// the 64-bit dQ accumulation.
#pragma once
#include <cstdint>

#include "common/bwd_params.h"

namespace flash_ext::sm80 {

// Element offsets of row 0 of sequence `batch` in the backward-only tensors (SeqInfo has the
// forward's).
struct BwdSeqOffsets {
  int64_t do_offset, dqa_offset, dk_offset, dv_offset;

  __device__ __forceinline__ BwdSeqOffsets(const BwdParams& p, int batch) {
    if (p.cu_seqlens_q != nullptr) {
      const int64_t q_start = p.cu_seqlens_q[batch];
      const int64_t k_start = p.cu_seqlens_k[batch];
      do_offset = q_start * p.do_row_stride;
      dqa_offset = q_start * p.dqa_row_stride;
      dk_offset = k_start * p.dk_row_stride;
      dv_offset = k_start * p.dv_row_stride;
    } else {
      do_offset = int64_t(batch) * p.do_batch_stride;
      dqa_offset = int64_t(batch) * p.dqa_batch_stride;
      dk_offset = int64_t(batch) * p.dk_batch_stride;
      dv_offset = int64_t(batch) * p.dv_batch_stride;
    }
  }
};

// cp.async of one fp32 (4 bytes), zero-filled when !pred (the source is then not read).
__device__ __forceinline__ void cp_async_4_zfill(void* smem_dst, const void* gmem_src, bool pred) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes));
}

// dst[0..1] += (a, b) (atomic mode) or dst[0..1] = (a, b) (deterministic: own slice). dst is
// 8-byte aligned (even column, even row strides: the accumulator is contiguous with d % 8 == 0).
// On sm_90 one 64-bit vector atomic (red.global.add.v2.f32); sm_80 has only scalar ones.
__device__ __forceinline__ void dq_accumulate2(float* dst, float a, float b, bool deterministic) {
  if (deterministic) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
  }
}

}  // namespace flash_ext::sm80
