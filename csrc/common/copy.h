// Predicated global <-> shared copies in 16-byte vectors. Rows past the sequence end and columns
// past the head dim are zero-filled in shared memory (so padding never injects NaN into P V) and
// never stored to global memory.
#pragma once
#include <cute/tensor.hpp>

namespace flash_ext {

// cp.async with zero fill: copies 16 bytes when `pred`, else writes 16 zero bytes.
__device__ __forceinline__ void cp_async_16_zfill(void* smem_dst, const void* gmem_src, bool pred) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes));
}

// gmem -> smem tile load. src/dst are (VEC, CPY_M, CPY_K) partitions of a GmemTiledCopy and
// coords the matching partition of an identity tensor; rows >= max_rows or cols >= max_cols are
// zero-filled: with a source size of 0, cp.async reads nothing, so the (out of range) address
// of a predicated-off vector is never dereferenced.
template <typename TensorG, typename TensorS, typename TensorC>
__device__ __forceinline__ void load_tile_async(const TensorG& src, TensorS& dst, const TensorC& coords,
                                                int max_rows, int max_cols) {
  using namespace cute;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const bool row_ok = get<0>(coords(0, m, 0)) < max_rows;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      const bool ok = row_ok && get<1>(coords(0, m, k)) < max_cols;
      cp_async_16_zfill(&dst(0, m, k), &src(0, m, k), ok);
    }
  }
}

// smem -> gmem tile store of the rows < max_rows and columns < max_cols.
template <typename TensorS, typename TensorG, typename TensorC>
__device__ __forceinline__ void store_tile(const TensorS& src, TensorG& dst, const TensorC& coords,
                                           int max_rows, int max_cols) {
  using namespace cute;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coords(0, m, 0)) >= max_rows) continue;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      if (get<1>(coords(0, m, k)) < max_cols) {
        *reinterpret_cast<uint4*>(&dst(0, m, k)) = *reinterpret_cast<const uint4*>(&src(0, m, k));
      }
    }
  }
}

}  // namespace flash_ext
