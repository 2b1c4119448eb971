// The dropout ops: flash_ext::dropout_rng_state (one attention call's Philox state) and
// flash_ext::dropout_mask (the kernels' keep mask, materialized; csrc/dropout_mask.cu).
#include <ATen/ATen.h>
#include <ATen/core/Generator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <mutex>

#include "api/errors.h"
#include "api/params_fill.h"
#include "dispatch/dropout_dispatch.h"
#include "params.h"

namespace flash_ext {
namespace {

// Dropout rng state for one attention call: [seed, offset] (int64, CPU) from the default CUDA
// generator of q's device, advancing its offset (so consecutive calls get different masks;
// torch.manual_seed makes runs reproducible). Read on the host: not usable while a CUDA graph
// is being captured.
at::Tensor dropout_rng_state(const at::Tensor& q) {
  FLASH_EXT_CHECK(q.is_cuda(), "flash_ext: dropout_rng_state needs a CUDA tensor");
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(q.get_device()));
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(4);  // one counter word per call (common/dropout.h)
  }
  FLASH_EXT_CHECK(!state.captured_, "flash_ext: attention dropout is not supported under CUDA graph capture");
  at::Tensor out = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  out.data_ptr<int64_t>()[0] = static_cast<int64_t>(state.seed_.val);
  out.data_ptr<int64_t>()[1] = static_cast<int64_t>(state.offset_.val);
  return out;
}

// The kernels' keep mask as a bool (batch, heads, seqlen_q, seqlen_k) tensor on q's device
// (testing and return_attn_probs only: O(N^2) memory). Varlen: sequence b's mask is the
// [b, :, :seqlen_q_b, :seqlen_k_b] corner (rows and columns count from each sequence's start).
at::Tensor dropout_mask(const at::Tensor& q, const at::Tensor& rng_state, int64_t batch, int64_t heads,
                        int64_t seqlen_q, int64_t seqlen_k, double dropout_p) {
  FLASH_EXT_CHECK(q.is_cuda(), "flash_ext: dropout_mask needs a CUDA tensor q (for the device)");
  FLASH_EXT_CHECK(batch >= 0 && heads >= 0 && seqlen_q >= 0 && seqlen_k >= 0, "flash_ext: dropout_mask sizes must be >= 0");
  FLASH_EXT_CHECK(batch * heads < (int64_t(1) << 32) && seqlen_q < (int64_t(1) << 31) && seqlen_k < (int64_t(1) << 31),
                  "flash_ext: dropout_mask sizes too large");
  FwdParams p{};
  set_dropout_params(p, dropout_p, rng_state);
  at::Tensor keep = at::empty({batch, heads, seqlen_q, seqlen_k}, q.options().dtype(at::kBool));
  if (keep.numel() == 0) return keep;
  if (dropout_p == 0.0) return keep.fill_(true);
  const uint64_t threshold = dropout_p >= 1.0 ? (uint64_t(1) << 32) : uint64_t(p.dropout_threshold);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  launch_dropout_mask(keep.data_ptr<bool>(), p.dropout_seed, p.dropout_offset, threshold, int(batch),
                      int(heads), int(seqlen_q), int(seqlen_k), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return keep;
}

}  // namespace
}  // namespace flash_ext

TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  // Draws from torch's CUDA generator: tagged so that compilers neither merge nor drop calls.
  m.def("dropout_rng_state(Tensor q) -> Tensor", {at::Tag::nondeterministic_seeded});
  m.def(
      "dropout_mask(Tensor q, Tensor rng_state, int batch, int heads, int seqlen_q, int seqlen_k, "
      "float dropout_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) {
  m.impl("dropout_rng_state", &flash_ext::dropout_rng_state);
  m.impl("dropout_mask", &flash_ext::dropout_mask);
}
