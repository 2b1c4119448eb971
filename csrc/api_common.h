// Helpers shared by the torch-facing files (flash_api.cpp, flash_bwd_api.cpp): which head dims
// this build has kernels for, the 16-byte row alignment the kernels' vector loads need, and what
// the TMA (Hopper) kernels need of the strides.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "params.h"

#ifndef FLASH_EXT_BUILD_INFO
#define FLASH_EXT_BUILD_INFO "unknown"
#endif

namespace flash_ext {

// Smallest sm80-family kernel head dim >= d in this build (FLASH_EXT_HEADDIMS); other sizes run
// in the next larger kernel, whose loads zero-fill and whose stores skip the extra columns.
inline int sm80_kernel_head_dim(int d, const char* direction) {
  constexpr int kDims[] = {
#ifdef FLASH_EXT_HDIM_32
      32,
#endif
#ifdef FLASH_EXT_HDIM_64
      64,
#endif
#ifdef FLASH_EXT_HDIM_96
      96,
#endif
#ifdef FLASH_EXT_HDIM_128
      128,
#endif
#ifdef FLASH_EXT_HDIM_192
      192,
#endif
#ifdef FLASH_EXT_HDIM_256
      256,
#endif
      0};  // sentinel
  for (int kd : kDims) {
    if (kd >= d) return kd;
  }
  TORCH_CHECK(false, "flash_ext: no ", direction, " kernel for head dim ", d, " in this build (",
              FLASH_EXT_BUILD_INFO, "); rebuild with FLASH_EXT_HEADDIMS covering it");
  return 0;
}

inline void check_rows_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, "flash_ext: ", name, " must have a contiguous last dimension");
  for (int i = 0; i < t.dim() - 1; ++i) {
    TORCH_CHECK(t.stride(i) % 8 == 0, "flash_ext: ", name,
                " strides must be multiples of 8 elements (16-byte aligned rows); got ", t.strides());
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "flash_ext: ", name,
              " must be 16-byte aligned");
}

// TMA tensor maps need non-empty extents and non-zero strides (broadcast tensors with stride 0
// and calls without keys go to the sm80 kernel, which handles both).
inline bool tma_compatible(const FwdParams& p) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const bool keys = varlen ? (p.total_k > 0 && p.total_q > 0) : p.seqlen_k > 0;
  const bool batch_strides = varlen || p.batch == 1 ||
                             (p.q_batch_stride > 0 && p.k_batch_stride > 0 && p.v_batch_stride > 0);
  return keys && batch_strides && p.q_row_stride > 0 && p.k_row_stride > 0 && p.v_row_stride > 0 &&
         (p.heads_q == 1 || p.q_head_stride > 0) && (p.heads_kv == 1 || (p.k_head_stride > 0 && p.v_head_stride > 0));
}

}  // namespace flash_ext
