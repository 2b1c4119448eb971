// Warpgroup building blocks of the Hopper kernels, forward and backward: a wgmma GEMM issued as
// one batch, named barriers, and small PTX helpers whose exact asm form the generated code
// depends on (memory clobbers, uniform values). Register reallocation is CUTLASS's
// cutlass::arch::warpgroup_reg_alloc / warpgroup_reg_dealloc (setmaxnreg), used as is.
#pragma once
// wgmma tile widths such as 176 are behind this switch in CuTe; it must precede every CuTe include.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
#include <cstdint>
#include <cute/tensor.hpp>

namespace flash_ext::sm90 {

// Issues one warpgroup GEMM (all k-slices) as one wgmma batch, without waiting for it.
// kZeroInit overwrites acc; kRegA: A comes from registers (P), not a shared-memory descriptor.
template <bool kZeroInit, bool kRegA, typename TiledMma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void warpgroup_gemm_issue(TiledMma& mma, TA& a, const TB& b, TC& acc) {
  using namespace cute;
  warpgroup_fence_operand(acc);
  if constexpr (kRegA) warpgroup_fence_operand(a);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
  if constexpr (kRegA) warpgroup_fence_operand(a);
}

// Named barriers: `threads` threads (a multiple of 32) meet at barrier `id` (0 is __syncthreads').
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Whether pred holds for any of the `threads` threads meeting at named barrier `id` (bar.red.or):
// a value the same in every warp of a warpgroup, for branches around warpgroup-wide instructions
// (wgmma.wait_group is .aligned: all 128 threads must execute the same one).
__device__ __forceinline__ bool named_barrier_any(bool pred, int id, int threads) {
  uint32_t result;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(result) : "r"(uint32_t(pred)), "r"(id), "r"(threads) : "memory");
  return result != 0;
}

// Makes this thread's generic-proxy shared-memory writes visible to the async proxy (a TMA
// store that reads them). As cutlass::arch::fence_view_async_shared, plus a "memory" clobber so
// the compiler cannot sink the preceding st.shared below the fence.
__device__ __forceinline__ void fence_smem_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// An opaque copy of v (the compiler cannot see through it nor move it out of a loop). Values
// derived from it are computed where they are used instead of being hoisted out of a loop and
// kept live (or spilled) across it.
__device__ __forceinline__ int opaque(int v) {
  asm volatile("" : "+r"(v));
  return v;
}

// Shared-memory accesses as volatile asm with a memory clobber: they stay where the source puts
// them relative to mbarrier operations (CUTLASS's barrier asm has no memory clobber) and fences.
__device__ __forceinline__ void st_shared_b32(uint32_t smem_addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t smem_addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr) : "memory");
  return v;
}
// 16 bytes from shared memory (an O row's 8-value chunk, fwd_epilogue.h).
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t smem_addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_addr)
               : "memory");
  return v;
}
// Four 8 x 8 matrices of 16-bit values to shared memory: lane l gives the address of row l % 8
// of matrix l / 8 (16 contiguous bytes), and register m holds this lane's pair of matrix m
// (row l / 4, columns 2 (l % 4) and + 1): the layout of a wgmma accumulator's 8-column blocks.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

}  // namespace flash_ext::sm90
