// The dropout mask of the attention kernels, materialized: a testing / return_attn_probs aid
// (O(batch * heads * seqlen_q * seqlen_k) memory). Evaluates the same device function as the
// kernels (dropout_group_words in common/dropout.h), one element per thread.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dropout.h"
#include "dispatch/dropout_dispatch.h"

namespace flash_ext {
namespace {

__global__ void dropout_mask_kernel(bool* __restrict__ keep, uint64_t seed, uint64_t offset,
                                    uint64_t threshold, int heads, int seqlen_q, int seqlen_k,
                                    int64_t total) {
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int col = int(idx % seqlen_k);
    const int64_t rest = idx / seqlen_k;
    const int row = int(rest % seqlen_q);
    const int64_t bh = rest / seqlen_q;  // = batch * heads + head
    const Philox4 w = dropout_group_words(seed, offset, uint32_t(bh), uint32_t(row), uint32_t(col));
    const int which = ((row >> 3) & 1) * 2 + (col & 1);
    const uint32_t word = which == 0 ? w.x : which == 1 ? w.y : which == 2 ? w.z : w.w;
    keep[idx] = uint64_t(word) >= threshold;
  }
  (void)heads;
}

}  // namespace

void launch_dropout_mask(bool* keep, uint64_t seed, uint64_t offset, uint64_t threshold, int batch,
                         int heads, int seqlen_q, int seqlen_k, cudaStream_t stream) {
  const int64_t total = int64_t(batch) * heads * seqlen_q * seqlen_k;
  if (total == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const int grid = int(blocks < 65536 ? blocks : 65536);
  dropout_mask_kernel<<<grid, kThreads, 0, stream>>>(keep, seed, offset, threshold, heads, seqlen_q,
                                                     seqlen_k, total);
}

}  // namespace flash_ext
