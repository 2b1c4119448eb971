// api/workspace.h.
#include "api/workspace.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

namespace flash_ext {

Sm90FwdBuffers allocate_sm90_fwd_buffers(const Sm90FwdConfig& c, FwdParams& p, const at::TensorOptions& options,
                                         cudaStream_t stream) {
  Sm90FwdBuffers b;
  p.tile_counter = nullptr;
  p.sm90_sk_count = nullptr;
  p.sm90_sk_partial = nullptr;
  if (c.tile_counter) {
    b.tile_counter = at::empty({1}, options.dtype(at::kInt));
    p.tile_counter = b.tile_counter.data_ptr<int>();
    C10_CUDA_CHECK(cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream));
  }
  if (c.stream_k) {
    b.workspace = at::empty({int64_t(c.sk_count_bytes + c.sk_partial_bytes)}, options.dtype(at::kByte));
    char* ws = static_cast<char*>(b.workspace.data_ptr());
    p.sm90_sk_count = reinterpret_cast<int*>(ws);
    p.sm90_sk_partial = reinterpret_cast<float*>(ws + c.sk_count_bytes);
    C10_CUDA_CHECK(cudaMemsetAsync(p.sm90_sk_count, 0, c.sk_count_bytes, stream));
  }
  return b;
}

}  // namespace flash_ext
