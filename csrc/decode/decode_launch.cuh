// Launch of the decode kernel (decode/decode_kernel.cuh; with more than one split, the last split
// of each tile merges them). The host (ops_kvcache.cpp) chose the splits and set up the partials
// and the arrival counters.
#pragma once
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "common/kernel_smem.h"
#include "common/pdl.h"
#include "decode/decode_kernel.cuh"
#include "dispatch/decode_dispatch.h"

namespace flash_ext {

template <int kHeadDim, typename Element, int kStages>
void launch_decode(const DecodeParams& p, cudaStream_t stream) {
  using Traits = decode::DecodeTraits<kHeadDim, Element, kStages>;
  static_assert(Traits::kSmemBytes == decode_smem_bytes(kHeadDim, kStages), "decode_params.h's smem size is the kernel's");
  auto kernel = &decode::decode_kernel<Traits>;
  constexpr int smem = Traits::kSmemBytes;
  if constexpr (smem > 48 * 1024) {
    set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  }
  const int m_blocks = (p.packed_rows + kDecodeBlockM - 1) / kDecodeBlockM;
  const dim3 grid(m_blocks * p.num_splits, p.heads_kv, p.batch);
  if (p.pdl && kernel_has_pdl_wait(reinterpret_cast<const void*>(kernel))) {
    launch_with_pdl(kernel, grid, dim3(Traits::kNThreads), smem, stream, p);
  } else {
    kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
  }
}

template <int kHeadDim, bool kIsBf16>
void run_decode(const DecodeParams& p, cudaStream_t stream) {
  using Element = std::conditional_t<kIsBf16, cutlass::bfloat16_t, cutlass::half_t>;
  if (p.batch == 0 || p.packed_rows == 0) return;
  if (p.ring_stages == kDecodeStagesDeep) {
    launch_decode<kHeadDim, Element, kDecodeStagesDeep>(p, stream);
  } else if (p.ring_stages == kDecodeStagesMid) {
    launch_decode<kHeadDim, Element, kDecodeStagesMid>(p, stream);
  } else {
    launch_decode<kHeadDim, Element, kDecodeStagesShallow>(p, stream);
  }
}

}  // namespace flash_ext
