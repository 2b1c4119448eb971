// The backward op, flash_ext::bwd: checks (api/checks.h), common parameters (api/params_fill.h),
// the kernel choice (dispatch/paths.h), the work buffers, the launch and the reduction of the
// GQA gradients. See docs/kernels-sm80-bwd.md for the buffers (dQ accumulator, GQA expansion,
// deterministic mode) and their memory cost.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "api/checks.h"
#include "api/errors.h"
#include "api/flashmask.h"
#include "api/params_fill.h"
#include "device_info.h"
#include "dispatch/bwd_dispatch.h"
#include "dispatch/paths.h"
#include "tuning/heuristics.h"
#include "params.h"
#include "tuning/overrides.h"

namespace flash_ext {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
    bool deterministic, double dropout_p, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& startend_row_indices, const std::optional<at::Tensor>& alibi_slopes) {
  const AttnShape s = check_attention_inputs({q, k, v, out, &dout, &lse_in}, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, softmax_scale, softcap, window_left,
                                             window_right);
  if (startend_row_indices.has_value()) {
    check_flashmask_inputs(*startend_row_indices, q, s, causal, window_left, window_right, dropout_p);
  }
  const bool varlen = s.varlen;
  const c10::cuda::CUDAGuard guard(q.device());
  const int kd = sm80_bwd_kernel_head_dim(s.head_dim);
  const at::Tensor lse = lse_in.contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  const int r = varlen ? 0 : 1;  // index of the seqlen dim

  BwdParams p{};
  fill_common_params(p, s, q, k, v, out, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left,
                     window_right, softcap, dropout_p, rng_state);  // dropout: the forward's mask, regenerated
  p.lse = lse.data_ptr<float>();
  p.dout = dout.data_ptr();
  p.do_row_stride = dout.stride(r);
  p.do_head_stride = dout.stride(r + 1);
  p.do_batch_stride = varlen ? 0 : dout.stride(0);
  p.deterministic = deterministic;
  const DeviceInfo& dev = device_info(q.get_device());
  const TuningOverrides overrides = tuning_overrides();
  p.variant = overrides.bwd_variant;
  p.has_flashmask = startend_row_indices.has_value();  // routing reads it; p.fm is filled below
  if (alibi_slopes.has_value()) set_alibi_params(p, *alibi_slopes, q, s, dropout_p);
  const KernelChoice kernel = choose_bwd_kernel(p, dev, overrides);
  const bool sm90 = kernel.path == KernelPath::kSm90;

  // The fp32 work buffers in one allocation (one call of the caching allocator, not three),
  // each part starting on a 256-byte boundary: D = rowsum(dO * O) and, for the Hopper kernel,
  // lse * log2(e) (both (batch, heads_q, seqlen_q rounded up), varlen (heads_q, total_q + 128 batch
  // rounded up), filled by its preprocess kernel;
  // the sm80 kernels' D is laid out like lse), then the dQ accumulator.
  // Hopper: the accumulator's tiles (BwdParams::dq, sm90/bwd_pre_post_kernels.cuh) are zeroed by its
  // preprocess kernel, and its convert kernel writes dq (laid out like q) directly.
  // sm80: the accumulator is shaped like q (contiguous) and zeroed here (cudaMemsetAsync: no fill
  // kernel's host cost). Deterministic: one slice per key block of the main kernel, summed below
  // in a fixed order.
  constexpr int64_t kPartAlign = 64;  // floats
  auto part = [](int64_t n) { return (n + kPartAlign - 1) / kPartAlign * kPartAlign; };
  std::vector<int64_t> dqa_shape;
  int64_t rows = lse.numel();  // of D (and lse * log2(e))
  if (sm90 && varlen) {
    // Per head, sequence b's rows from (cu_seqlens_q[b] + 128 b) rounded down to 128
    // (sm90::varlen_padded_row0): room for every sequence's rows rounded up to 128.
    const int64_t padded = (s.total_q + kBwdSm90PadRows * s.batch + kBwdSm90PadRows - 1) / kBwdSm90PadRows * kBwdSm90PadRows;
    if (padded > std::numeric_limits<int>::max()) {
      raise_error("flash_ext: varlen backward: total_q too large for the Hopper kernel's padded buffers");
    }
    p.seqlen_q_padded = int(padded);
    rows = s.heads_q * padded;
    dqa_shape = {s.heads_q, padded, int64_t(kernel.kernel_head_dim)};
  } else if (sm90) {
    p.seqlen_q_padded = int((s.seqlen_q + kBwdSm90PadRows - 1) / kBwdSm90PadRows * kBwdSm90PadRows);
    rows = s.batch * s.heads_q * p.seqlen_q_padded;
    dqa_shape = {s.batch, s.heads_q, p.seqlen_q_padded, int64_t(kernel.kernel_head_dim)};
  } else {
    dqa_shape.assign(q.sizes().begin(), q.sizes().end());
    if (deterministic) {
      const BwdTile tile = choose_bwd_sm80_tile(kd, dev, overrides);
      dqa_shape.insert(dqa_shape.begin(), std::max<int64_t>(1, (s.seqlen_k + tile.block_n - 1) / tile.block_n));
    }
  }
  int64_t dqa_numel = 1;
  for (const int64_t n : dqa_shape) dqa_numel *= n;
  const int64_t dsum_at = part(dqa_numel), lse_log2_at = dsum_at + part(rows);
  // Hopper, deterministic: after them, one int per 64 padded query rows (BwdParams::dq_semaphore),
  // zeroed here.
  const int64_t sem_at = lse_log2_at + part(sm90 ? rows : 0), sems = sm90 && deterministic ? rows / 64 : 0;
  const at::Tensor work = at::empty({sem_at + sems}, f32);
  float* const work_ptr = work.data_ptr<float>();
  p.dq_accum = work_ptr;
  p.dsum = work_ptr + dsum_at;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  if (sems > 0) {
    p.dq_semaphore = reinterpret_cast<int*>(work_ptr + sem_at);
    C10_CUDA_CHECK(cudaMemsetAsync(p.dq_semaphore, 0, size_t(sems) * sizeof(int), stream));
  }

  // FlashMask: the key-block summaries for the block size of the kernel that runs (the Hopper
  // backward's kBlockN, sm90/bwd_launch.cuh; or the sm80 backward's tile, as its launcher picks it:
  // sm80/bwd_launch.cuh).
  FlashMaskSummary fm;  // alive until the launch is queued
  if (startend_row_indices.has_value() && q.numel() > 0 && k.numel() > 0 && s.batch > 0) {
    const int block_n = sm90 ? sm90_bwd_block_n(kernel.kernel_head_dim) : choose_bwd_sm80_tile(kd, dev, overrides).block_n;
    // The Hopper backward's CTA order may be left to kernel A's counts (choose_sm90_bwd_lpt_section).
    const bool order_by_count = sm90 && choose_sm90_bwd_fm_order_by_count(p, kernel.kernel_head_dim, overrides);
    fm = set_flashmask_params(p, *startend_row_indices, s, cu_seqlens_k, causal, block_n, stream,
                              order_by_count ? FmCountFor::kBwdOrder : FmCountFor::kNothing);
  }

  at::Tensor dq_sm90, dq_accum;
  if (sm90) {
    p.lse_log2 = work_ptr + lse_log2_at;
    dq_sm90 = at::empty(q.sizes(), q.options());
    p.dq = dq_sm90.data_ptr();
    p.dq_batch_stride = varlen ? 0 : dq_sm90.stride(0);
    p.dq_row_stride = dq_sm90.stride(r);
    p.dq_head_stride = dq_sm90.stride(r + 1);
  } else {
    dq_accum = work.narrow(0, 0, dqa_numel).view(dqa_shape);
    if (dqa_numel > 0) C10_CUDA_CHECK(cudaMemsetAsync(work_ptr, 0, size_t(dqa_numel) * sizeof(float), stream));
    const int o = deterministic ? 1 : 0;  // dims of dq_accum are offset by the split dim
    p.dq_split_stride = deterministic ? dq_accum.stride(0) : 0;
    p.dqa_batch_stride = varlen ? 0 : dq_accum.stride(o);
    p.dqa_row_stride = dq_accum.stride(o + r);
    p.dqa_head_stride = dq_accum.stride(o + r + 1);
  }

  // dK, dV in the input dtype. GQA/MQA: the kernel writes one gradient per query head into
  // expanded (.., heads_q, d) buffers, summed over each group of heads_q / heads_kv below, unless
  // the Hopper kernel loops over the group (tuning/heuristics.h choose_sm90_bwd_gqa_loop) and
  // writes (.., heads_kv, d) directly. Expanded, both live in one buffer (dK then dV), so that one
  // reduction sums both.
  // Deterministic Hopper calls: the expand schedule on the 3-D grid (sm90/bwd_dq_order.h).
  p.sm90_gqa_loop = sm90 && !deterministic && choose_sm90_bwd_gqa_loop(p, kernel.kernel_head_dim, dev, overrides);
  p.sm90_lpt_section = sm90 && !deterministic ? choose_sm90_bwd_lpt_section(p, kernel.kernel_head_dim, p.sm90_gqa_loop, dev, overrides) : 0;
  const bool expand = s.heads_q != s.heads_kv && !p.sm90_gqa_loop;
  std::vector<int64_t> kv_shape(k.sizes().begin(), k.sizes().end());
  if (expand) kv_shape[kv_shape.size() - 2] = s.heads_q;
  std::vector<int64_t> pair_shape(kv_shape);
  pair_shape.insert(pair_shape.begin(), 2);
  at::Tensor kv_pair = expand ? at::empty(pair_shape, q.options()) : at::Tensor();
  at::Tensor dk_buf = expand ? kv_pair.select(0, 0) : at::empty(kv_shape, q.options());
  at::Tensor dv_buf = expand ? kv_pair.select(0, 1) : at::empty(kv_shape, q.options());
  if (varlen) {
    // Tokens outside every sequence (none when cu_seqlens_k[-1] == total_k) are not written.
    const size_t bytes = size_t(dk_buf.numel()) * dk_buf.element_size();
    if (bytes > 0) {
      C10_CUDA_CHECK(cudaMemsetAsync(dk_buf.data_ptr(), 0, bytes, stream));
      C10_CUDA_CHECK(cudaMemsetAsync(dv_buf.data_ptr(), 0, bytes, stream));
    }
  }
  p.dk = dk_buf.data_ptr();
  p.dv = dv_buf.data_ptr();
  p.dk_batch_stride = varlen ? 0 : dk_buf.stride(0);
  p.dk_row_stride = dk_buf.stride(r);
  p.dk_head_stride = dk_buf.stride(r + 1);
  p.dv_batch_stride = varlen ? 0 : dv_buf.stride(0);
  p.dv_row_stride = dv_buf.stride(r);
  p.dv_head_stride = dv_buf.stride(r + 1);

  const bool launched = p.batch > 0 && q.numel() > 0 && k.numel() > 0;
  if (launched) {
    run_bwd(kernel, p, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else if (!varlen) {
    dk_buf.zero_();
    dv_buf.zero_();
  }

  at::Tensor dq;
  if (sm90) {
    // Written by the Hopper kernels only when they ran (batch, heads or seqlen_q may be 0).
    dq = launched ? dq_sm90 : dq_sm90.zero_();
  } else {
    dq = (deterministic ? dq_accum.sum(0) : dq_accum).to(q.scalar_type());
  }
  at::Tensor dk = dk_buf, dv = dv_buf;
  if (expand) {
    std::vector<int64_t> grouped(pair_shape);
    grouped[grouped.size() - 2] = s.heads_kv;
    grouped.insert(grouped.end() - 1, s.heads_q / s.heads_kv);
    const at::Tensor sums = kv_pair.view(grouped).sum(-2);
    dk = sums.select(0, 0);
    dv = sums.select(0, 1);
  }
  return {dq, dk, dv};
}

}  // namespace
}  // namespace flash_ext

TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
      "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
      "int window_left, int window_right, float softcap, bool deterministic, float dropout_p=0.0, "
      "Tensor? rng_state=None, Tensor? startend_row_indices=None, Tensor? alibi_slopes=None) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) { m.impl("bwd", &flash_ext::bwd); }
