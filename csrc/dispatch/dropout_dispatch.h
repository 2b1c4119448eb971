// Declaration of the dropout-mask launcher (csrc/dropout_mask.cu), used by the
// flash_ext::dropout_mask op in ops_dropout.cpp. No CUTLASS or torch types.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace flash_ext {

// keep[b, h, i, j] (bool, contiguous (batch, heads, seqlen_q, seqlen_k)) = whether element (i, j)
// of head h of sequence b is kept by the kernels' dropout (common/dropout.h): its Philox word is
// >= threshold (threshold = floor(p * 2^32 + 0.5); 2^32 for p = 1 keeps nothing).
void launch_dropout_mask(bool* keep, uint64_t seed, uint64_t offset, uint64_t threshold, int batch,
                         int heads, int seqlen_q, int seqlen_k, cudaStream_t stream);

}  // namespace flash_ext
