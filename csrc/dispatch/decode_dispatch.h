// Declarations of the decode launchers (one explicit instantiation per kernel head dim and dtype
// in csrc/instantiations/decode_*.cu) and of the KV-cache append. No CUTLASS or torch types.
#pragma once
#include <cuda_runtime.h>

#include "decode/decode_params.h"

namespace flash_ext {

// Split-KV decode (decode/decode_kernel.cuh), sm80+, with the ring p.ring_stages deep; with
// p.num_splits > 1 the caller set up p.o_partial / p.lse_partial / p.split_arrivals.
template <int kHeadDim, bool kIsBf16>
void run_decode(const DecodeParams& p, cudaStream_t stream);

// The append of new k / v tokens into the caches (decode/kvcache_append.cu).
void run_kvcache_append(const AppendParams& p, bool is_bf16, cudaStream_t stream);

}  // namespace flash_ext
