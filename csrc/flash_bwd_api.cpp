// The torch-facing layer of the backward pass: input checks, BwdParams, work buffers,
// dispatch by head dim / dtype, and the flash_ext::bwd op registration.
// See docs/kernels-sm80-bwd.md for the buffers (dQ accumulator, GQA expansion, deterministic
// mode) and their memory cost.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

#include "common/bwd_params.h"
#include "api_common.h"
#include "dispatch/bwd_dispatch.h"

#ifndef FLASH_EXT_BUILD_INFO
#define FLASH_EXT_BUILD_INFO "unknown"
#endif

namespace flash_ext {
namespace {

template <bool kIsBf16>
void run_bwd_sm80_hdim(BwdParams& p, int kd, cudaStream_t stream) {
  switch (kd) {
#ifdef FLASH_EXT_HDIM_32
    case 32: return run_bwd_sm80<32, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_64
    case 64: return run_bwd_sm80<64, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_96
    case 96: return run_bwd_sm80<96, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_128
    case 128: return run_bwd_sm80<128, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_192
    case 192: return run_bwd_sm80<192, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_256
    case 256: return run_bwd_sm80<256, kIsBf16>(p, stream);
#endif
    default: FLASH_EXT_CHECK(false, "flash_ext: no backward kernel for head dim ", kd);
  }
}

#ifdef FLASH_EXT_SM90A
// Head dim of the Hopper backward kernel that covers head dim d in this build; 0 = none.
int sm90_bwd_kernel_head_dim(int d) {
#ifdef FLASH_EXT_HDIM_64
  if (d <= 64) return 64;
#endif
#ifdef FLASH_EXT_HDIM_128
  if (d <= 128) return 128;
#endif
#ifdef FLASH_EXT_HDIM_256
  if (d > 192 && d <= 256) return 256;  // 136..192 keep the sm80 kernel (its 192 tile)
#endif
  return 0;
}

template <bool kIsBf16>
void run_bwd_sm90_hdim(BwdParams& p, int kd, cudaStream_t stream) {
  switch (kd) {
#ifdef FLASH_EXT_HDIM_64
    case 64: return run_bwd_sm90<64, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_128
    case 128: return run_bwd_sm90<128, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_256
    case 256: return run_bwd_sm90<256, kIsBf16>(p, stream);
#endif
    default: FLASH_EXT_CHECK(false, "flash_ext: no sm90 backward kernel for head dim ", kd);
  }
}
#endif  // FLASH_EXT_SM90A

// Which backward runs: FLASH_EXT_BWD_PATH=sm80 or sm90 forces one (tests and benchmarks compare
// the two on one GPU); the default picks the Hopper kernel on sm90 devices where it applies
// (head dims <= 128 and 193-256, fixed-length batches, deterministic=False, no dropout;
// docs/kernels-sm90-bwd.md), else
// the sm80 kernel.
enum class BwdPath { kSm80, kSm90 };

BwdPath choose_bwd_path(const BwdParams& p, int device) {
  const int major = device_info(device).major;
  const std::string forced = env_choice("FLASH_EXT_BWD_PATH", {"auto", "sm80", "sm90"});
  bool sm90_ok = false;
#ifdef FLASH_EXT_SM90A
  const bool bf16_ok =
#ifdef FLASH_EXT_BF16
      true;
#else
      false;
#endif
  const bool fp16_ok =
#ifdef FLASH_EXT_FP16
      true;
#else
      false;
#endif
  const bool dout_strides = p.do_row_stride > 0 && (p.heads_q == 1 || p.do_head_stride > 0) &&
                            (p.batch == 1 || p.do_batch_stride > 0);
  sm90_ok = major == 9 && sm90_bwd_kernel_head_dim(p.head_dim) != 0 && (p.is_bf16 ? bf16_ok : fp16_ok) &&
            p.cu_seqlens_q == nullptr && !p.deterministic && !(p.dropout_p > 0.f) && tma_compatible(p) && dout_strides;
#endif
  if (forced == "sm90") {
    FLASH_EXT_CHECK(sm90_ok, "flash_ext: FLASH_EXT_BWD_PATH=sm90 needs an sm90 GPU, a build with 90a in ",
                "FLASH_EXT_ARCHS covering head dim ", p.head_dim, " (the Hopper backward has head dims <= 128 and 193-256), ",
                "no cu_seqlens, deterministic=False and dropout_p = 0 (", FLASH_EXT_BUILD_INFO, ")");
    return BwdPath::kSm90;
  }
  if (forced == "sm80") return BwdPath::kSm80;
  return sm90_ok ? BwdPath::kSm90 : BwdPath::kSm80;
}

void run_bwd_sm90_dtype(BwdParams& p, cudaStream_t stream) {
#ifdef FLASH_EXT_SM90A
  const int kd = sm90_bwd_kernel_head_dim(p.head_dim);
  if (p.is_bf16) {
#ifdef FLASH_EXT_BF16
    return run_bwd_sm90_hdim<true>(p, kd, stream);
#endif
  } else {
#ifdef FLASH_EXT_FP16
    return run_bwd_sm90_hdim<false>(p, kd, stream);
#endif
  }
#endif
  FLASH_EXT_CHECK(false, "flash_ext: no sm90 backward kernel in this build (", FLASH_EXT_BUILD_INFO, ")");
}

void run_bwd(BwdParams& p, int kd, cudaStream_t stream) {
  if (p.is_bf16) {
#ifdef FLASH_EXT_BF16
    run_bwd_sm80_hdim<true>(p, kd, stream);
#else
    FLASH_EXT_CHECK(false, "flash_ext: this build has no bf16 kernels (", FLASH_EXT_BUILD_INFO, ")");
#endif
  } else {
#ifdef FLASH_EXT_FP16
    run_bwd_sm80_hdim<false>(p, kd, stream);
#else
    FLASH_EXT_CHECK(false, "flash_ext: this build has no fp16 kernels (", FLASH_EXT_BUILD_INFO, ")");
#endif
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
    bool deterministic, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  const bool varlen = cu_seqlens_q.has_value();
  FLASH_EXT_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
              "flash_ext: give both cu_seqlens_q and cu_seqlens_k, or neither");
  FLASH_EXT_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda() && out.is_cuda() && dout.is_cuda() && lse_in.is_cuda(),
              "flash_ext: tensors must be on a CUDA device");
  FLASH_EXT_CHECK(k.device() == q.device() && v.device() == q.device() && out.device() == q.device() &&
                  dout.device() == q.device() && lse_in.device() == q.device(),
              "flash_ext: dout, q, k, v, out and lse must be on the same device");
  const auto dtype = q.scalar_type();
  FLASH_EXT_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "flash_ext: only fp16 and bf16 are supported");
  FLASH_EXT_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && out.scalar_type() == dtype &&
                  dout.scalar_type() == dtype,
              "flash_ext: q, k, v, out and dout must have the same dtype");
  FLASH_EXT_CHECK(lse_in.scalar_type() == at::kFloat, "flash_ext: lse must be float32");
  const int expect_dim = varlen ? 3 : 4;
  FLASH_EXT_CHECK(q.dim() == expect_dim && k.dim() == expect_dim && v.dim() == expect_dim,
              "flash_ext: q, k, v must be ", expect_dim, "-D");
  FLASH_EXT_CHECK(k.sizes() == v.sizes(), "flash_ext: k and v must have the same shape");
  FLASH_EXT_CHECK(out.sizes() == q.sizes(), "flash_ext: out must have q's shape");
  FLASH_EXT_CHECK(dout.sizes() == q.sizes(), "flash_ext: dout must have q's shape");
  const int d = q.size(-1);
  FLASH_EXT_CHECK(k.size(-1) == d, "flash_ext: q, k, v must have the same head dim");
  FLASH_EXT_CHECK(d % 8 == 0 && d > 0 && d <= 256,
              "flash_ext: head dim must be a multiple of 8 in [8, 256] at the op level; got ", d);
  const int hq = q.size(-2), hkv = k.size(-2);
  FLASH_EXT_CHECK(hkv > 0 && hq % hkv == 0, "flash_ext: heads of q (", hq,
              ") must be a multiple of heads of k/v (", hkv, ")");
  FLASH_EXT_CHECK(softmax_scale > 0 && std::isfinite(softmax_scale), "flash_ext: softmax_scale must be positive and finite");
  FLASH_EXT_CHECK(softcap >= 0, "flash_ext: softcap must be >= 0");
  FLASH_EXT_CHECK(window_left >= -1 && window_right >= -1, "flash_ext: window sizes must be >= -1");
  check_rows_aligned(q, "q");
  check_rows_aligned(k, "k");
  check_rows_aligned(v, "v");
  check_rows_aligned(out, "out");
  check_rows_aligned(dout, "dout");

  const c10::cuda::CUDAGuard guard(q.device());
  const int kd = sm80_kernel_head_dim(d, "backward");
  const at::Tensor lse = lse_in.contiguous();
  const auto f32 = q.options().dtype(at::kFloat);

  BwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.heads_q = hq;
  p.heads_kv = hkv;
  p.head_dim = d;
  p.is_bf16 = dtype == at::kBFloat16;
  p.softmax_scale = float(softmax_scale);
  p.softcap = float(softcap);
  p.softmax_scale_log2 = float(softcap > 0 ? M_LOG2E : softmax_scale * M_LOG2E);
  if (causal) window_right = 0;
  p.window_left = int(window_left);
  p.window_right = int(window_right);
  p.has_window = window_left >= 0 || window_right >= 0;
  p.deterministic = deterministic;
  set_dropout_params(p, dropout_p, rng_state);  // the forward's mask, regenerated (common/dropout.h)
  {
    // The pipelined main kernel (variant 2, docs/kernels-sm80-bwd.md) is the default: 1.25-1.55x
    // faster than variant 1 on an H200. FLASH_EXT_BWD_VARIANT=1 selects the first kernel.
    p.variant = env_choice("FLASH_EXT_BWD_VARIANT", {"1", "2"}) == "1" ? 1 : 2;
  }

  const int r = varlen ? 0 : 1;  // index of the seqlen dim
  p.q_row_stride = q.stride(r);
  p.q_head_stride = q.stride(r + 1);
  p.k_row_stride = k.stride(r);
  p.k_head_stride = k.stride(r + 1);
  p.v_row_stride = v.stride(r);
  p.v_head_stride = v.stride(r + 1);
  p.o_row_stride = out.stride(r);
  p.o_head_stride = out.stride(r + 1);
  p.do_row_stride = dout.stride(r);
  p.do_head_stride = dout.stride(r + 1);

  int64_t batch, seqlen_q_max, seqlen_k_max;
  if (varlen) {
    const auto& cq = *cu_seqlens_q;
    const auto& ck = *cu_seqlens_k;
    FLASH_EXT_CHECK(cq.scalar_type() == at::kInt && ck.scalar_type() == at::kInt, "flash_ext: cu_seqlens must be int32");
    FLASH_EXT_CHECK(cq.dim() == 1 && ck.dim() == 1 && cq.numel() == ck.numel() && cq.numel() >= 1,
                "flash_ext: cu_seqlens_q and cu_seqlens_k must be 1-D of the same length batch + 1");
    FLASH_EXT_CHECK(cq.device() == q.device() && ck.device() == q.device(), "flash_ext: cu_seqlens must be on q's device");
    FLASH_EXT_CHECK(cq.is_contiguous() && ck.is_contiguous(), "flash_ext: cu_seqlens must be contiguous");
    FLASH_EXT_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, "flash_ext: max_seqlen must be >= 0");
    const int64_t total_q = q.size(0);
    FLASH_EXT_CHECK(lse.dim() == 2 && lse.size(0) == hq && lse.size(1) == total_q,
                "flash_ext: lse must be (heads_q, total_q) = (", hq, ", ", total_q, ") for varlen; got ", lse.sizes());
    batch = cq.numel() - 1;
    seqlen_q_max = max_seqlen_q;
    seqlen_k_max = max_seqlen_k;
    p.cu_seqlens_q = cq.data_ptr<int>();
    p.cu_seqlens_k = ck.data_ptr<int>();
    p.lse_batch_stride = 0;
    p.lse_head_stride = total_q;
  } else {
    FLASH_EXT_CHECK(k.size(0) == q.size(0), "flash_ext: q and k/v must have the same batch size");
    batch = q.size(0);
    seqlen_q_max = q.size(1);
    seqlen_k_max = k.size(1);
    FLASH_EXT_CHECK(lse.dim() == 3 && lse.size(0) == batch && lse.size(1) == hq && lse.size(2) == seqlen_q_max,
                "flash_ext: lse must be (batch, heads_q, seqlen_q); got ", lse.sizes());
    p.q_batch_stride = q.stride(0);
    p.k_batch_stride = k.stride(0);
    p.v_batch_stride = v.stride(0);
    p.o_batch_stride = out.stride(0);
    p.do_batch_stride = dout.stride(0);
    p.lse_batch_stride = int64_t(hq) * seqlen_q_max;
    p.lse_head_stride = seqlen_q_max;
  }
  FLASH_EXT_CHECK(batch <= 65535 && hq <= 65535, "flash_ext: batch and heads must be <= 65535");
  p.batch = int(batch);
  p.seqlen_q = int(seqlen_q_max);
  p.seqlen_k = int(seqlen_k_max);

  const BwdPath path = choose_bwd_path(p, q.get_device());
  // D = rowsum(dO * O), laid out like lse (contiguous). The Hopper kernel reads D and lse * log2(e)
  // from (batch, heads_q, seqlen_q rounded up) buffers that its preprocess kernel fills.
  at::Tensor dsum, lse_log2;
  if (path == BwdPath::kSm90) {
    p.seqlen_q_padded = int((seqlen_q_max + kBwdSm90PadRows - 1) / kBwdSm90PadRows * kBwdSm90PadRows);
    dsum = at::empty({batch, hq, p.seqlen_q_padded}, f32);
    lse_log2 = at::empty({batch, hq, p.seqlen_q_padded}, f32);
    p.lse_log2 = lse_log2.data_ptr<float>();
  } else {
    dsum = at::empty_like(lse);
  }
  p.dsum = dsum.data_ptr<float>();

  at::Tensor dq_accum, dq_sm90;
  if (path == BwdPath::kSm90) {
    // Tiles of the Hopper kernel (BwdParams::dq, sm90/bwd_kernel.cuh), zeroed by its preprocess
    // kernel; its convert kernel writes dq (laid out like q) directly.
#ifdef FLASH_EXT_SM90A
    const int64_t dqa_cols = sm90_bwd_kernel_head_dim(d);
#else
    const int64_t dqa_cols = 0;  // unreachable: choose_bwd_path picks sm90 only in 90a builds
#endif
    dq_accum = at::empty({batch, hq, p.seqlen_q_padded, dqa_cols}, f32);
    dq_sm90 = at::empty(q.sizes(), q.options());
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dq = dq_sm90.data_ptr();
    p.dq_batch_stride = dq_sm90.stride(0);
    p.dq_row_stride = dq_sm90.stride(r);
    p.dq_head_stride = dq_sm90.stride(r + 1);
  } else {
    // fp32 dQ accumulator shaped like q (contiguous), zeroed here. Deterministic: one slice per
    // key block of the main kernel, summed below in a fixed order.
    const BwdTile tile = bwd_sm80_pick_tile(kd);
    const int64_t n_splits = deterministic ? std::max<int64_t>(1, (seqlen_k_max + tile.block_n - 1) / tile.block_n) : 1;
    std::vector<int64_t> dqa_shape(q.sizes().begin(), q.sizes().end());
    if (deterministic) dqa_shape.insert(dqa_shape.begin(), n_splits);
    dq_accum = at::zeros(dqa_shape, f32);
    const int o = deterministic ? 1 : 0;  // dims of dq_accum are offset by the split dim
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dq_split_stride = deterministic ? dq_accum.stride(0) : 0;
    p.dqa_batch_stride = varlen ? 0 : dq_accum.stride(o);
    p.dqa_row_stride = dq_accum.stride(o + r);
    p.dqa_head_stride = dq_accum.stride(o + r + 1);
  }

  // dK, dV in the input dtype. GQA/MQA: the kernel writes one gradient per query head into
  // expanded (.., heads_q, d) buffers, summed over each group of heads_q / heads_kv below.
  const bool expand = hq != hkv;
  std::vector<int64_t> kv_shape(k.sizes().begin(), k.sizes().end());
  if (expand) kv_shape[kv_shape.size() - 2] = hq;
  // Varlen: tokens outside every sequence (none when cu_seqlens_k[-1] == total_k) are not written.
  at::Tensor dk_buf = varlen ? at::zeros(kv_shape, q.options()) : at::empty(kv_shape, q.options());
  at::Tensor dv_buf = varlen ? at::zeros(kv_shape, q.options()) : at::empty(kv_shape, q.options());
  p.dk = dk_buf.data_ptr();
  p.dv = dv_buf.data_ptr();
  p.dk_batch_stride = varlen ? 0 : dk_buf.stride(0);
  p.dk_row_stride = dk_buf.stride(r);
  p.dk_head_stride = dk_buf.stride(r + 1);
  p.dv_batch_stride = varlen ? 0 : dv_buf.stride(0);
  p.dv_row_stride = dv_buf.stride(r);
  p.dv_head_stride = dv_buf.stride(r + 1);

  if (p.batch > 0 && q.numel() > 0 && k.numel() > 0) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
    if (path == BwdPath::kSm90) {
      run_bwd_sm90_dtype(p, stream);
    } else {
      run_bwd(p, kd, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else if (!varlen) {
    dk_buf.zero_();
    dv_buf.zero_();
  }

  at::Tensor dq;
  if (path == BwdPath::kSm90) {
    // Written by the Hopper kernels only when they ran (batch, heads or seqlen_q may be 0).
    dq = p.batch > 0 && q.numel() > 0 && k.numel() > 0 ? dq_sm90 : dq_sm90.zero_();
  } else {
    dq = (deterministic ? dq_accum.sum(0) : dq_accum).to(dtype);
  }
  at::Tensor dk = dk_buf, dv = dv_buf;
  if (expand) {
    std::vector<int64_t> grouped(kv_shape);
    grouped[grouped.size() - 2] = hkv;
    grouped.insert(grouped.end() - 1, hq / hkv);
    dk = dk_buf.view(grouped).sum(-2);
    dv = dv_buf.view(grouped).sum(-2);
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
      "Tensor? rng_state=None) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) { m.impl("bwd", &flash_ext::bwd); }
