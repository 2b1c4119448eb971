// The device buffers a Hopper forward config asks for (tuning/heuristics.h Sm90FwdConfig), allocated
// per call from PyTorch's caching allocator on the current stream: the tile counter of the
// dynamic scheduler and the stream-K workspace. Freed when the returned holder goes out of
// scope after the launch: the allocator hands the memory out again only to work ordered after
// it on the same stream. Zeroed with cudaMemsetAsync (at::zeros' fill costs ~50 us of host time
// per call). Kernels never allocate; nothing here synchronises, so calls can be captured in
// CUDA graphs.
#pragma once
#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include "tuning/heuristics.h"
#include "params.h"

namespace flash_ext {

struct Sm90FwdBuffers {
  at::Tensor tile_counter;  // int32, zeroed
  at::Tensor workspace;     // stream-K: arrival counters (zeroed), then partial states
};

// Allocates what `c` asks for and points p.tile_counter, p.sm90_sk_count and p.sm90_sk_partial
// at it (nullptr where `c` asks for nothing).
Sm90FwdBuffers allocate_sm90_fwd_buffers(const Sm90FwdConfig& c, FwdParams& p, const at::TensorOptions& options,
                                         cudaStream_t stream);

}  // namespace flash_ext
