// Where sequence `batch` starts and how long it is, for padded batches and for varlen
// (cu_seqlens) batches alike. Kernels index global memory only through this.
#pragma once
#include <cstdint>
#include "params.h"

namespace flash_ext {

struct SeqInfo {
  int seqlen_q, seqlen_k;
  int64_t q_offset, k_offset, v_offset, o_offset;  // element offsets of row 0 of this sequence
  int64_t lse_offset;                               // element offset of (batch, head 0, row 0)

  SeqInfo() = default;
  __device__ __forceinline__ SeqInfo(const FwdParams& p, int batch) {
    if (p.cu_seqlens_q != nullptr) {
      const int q_start = p.cu_seqlens_q[batch];
      const int k_start = p.cu_seqlens_k[batch];
      seqlen_q = p.cu_seqlens_q[batch + 1] - q_start;
      // seqused_k: only the first seqused_k[batch] keys of the sequence take part.
      seqlen_k = p.seqused_k != nullptr ? p.seqused_k[batch] : p.cu_seqlens_k[batch + 1] - k_start;
      q_offset = int64_t(q_start) * p.q_row_stride;
      o_offset = int64_t(q_start) * p.o_row_stride;
      k_offset = int64_t(k_start) * p.k_row_stride;
      v_offset = int64_t(k_start) * p.v_row_stride;
      lse_offset = q_start;  // lse is (heads, total_q)
    } else {
      seqlen_q = p.seqlen_q;
      seqlen_k = p.seqlen_k;
      q_offset = int64_t(batch) * p.q_batch_stride;
      o_offset = int64_t(batch) * p.o_batch_stride;
      k_offset = int64_t(batch) * p.k_batch_stride;
      v_offset = int64_t(batch) * p.v_batch_stride;
      lse_offset = int64_t(batch) * p.lse_batch_stride;
    }
  }
};

}  // namespace flash_ext
