// The torch-facing layer: input checks, FwdParams, dispatch by architecture / head dim / dtype,
// and the torch.library op registrations of the forward (the backward: flash_bwd_api.cpp).
#include <Python.h>
#include <ATen/ATen.h>
#include <ATen/core/Generator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>

#include "dispatch/dropout_dispatch.h"
#include "dispatch/fwd_dispatch.h"
#include "api_common.h"
#include "params.h"
#include "sm90/fwd_trace.h"

#ifndef FLASH_EXT_BUILD_INFO
#define FLASH_EXT_BUILD_INFO "unknown"
#endif

// Importing flash_ext._C registers the ops below; the module itself has no Python functions.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

namespace flash_ext {
namespace {

template <bool kIsBf16>
void run_fwd_sm80_hdim(FwdParams& p, int kd, cudaStream_t stream) {
  switch (kd) {
#ifdef FLASH_EXT_HDIM_32
    case 32: return run_fwd_sm80<32, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_64
    case 64: return run_fwd_sm80<64, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_96
    case 96: return run_fwd_sm80<96, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_128
    case 128: return run_fwd_sm80<128, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_192
    case 192: return run_fwd_sm80<192, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_256
    case 256: return run_fwd_sm80<256, kIsBf16>(p, stream);
#endif
    default: FLASH_EXT_CHECK(false, "flash_ext: no kernel for head dim ", kd);
  }
}

#ifdef FLASH_EXT_SM90A
// Head dims of the Hopper kernels in this build, ascending; 0 = none fits.
int kernel_head_dim_sm90(int d) {
  constexpr int kDims[] = {
#ifdef FLASH_EXT_HDIM_64
      64,
#endif
#ifdef FLASH_EXT_HDIM_96
      96,
#endif
#ifdef FLASH_EXT_HDIM_128
      128,
#endif
#ifdef FLASH_EXT_HDIM_192
      192,
#endif
#ifdef FLASH_EXT_HDIM_256
      256,
#endif
      0};
  for (int kd : kDims) {
    if (kd >= d) return kd;
  }
  return 0;
}

template <bool kIsBf16>
void run_fwd_sm90_hdim(FwdParams& p, int kd, cudaStream_t stream) {
  switch (kd) {
#ifdef FLASH_EXT_HDIM_64
    case 64: return run_fwd_sm90<64, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_96
    case 96: return run_fwd_sm90<96, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_128
    case 128: return run_fwd_sm90<128, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_192
    case 192: return run_fwd_sm90<192, kIsBf16>(p, stream);
#endif
#ifdef FLASH_EXT_HDIM_256
    case 256: return run_fwd_sm90<256, kIsBf16>(p, stream);
#endif
    default: FLASH_EXT_CHECK(false, "flash_ext: no sm90 kernel for head dim ", kd);
  }
}
#endif  // FLASH_EXT_SM90A

// Which forward implementation runs: FLASH_EXT_FWD_PATH=sm80 or sm90 forces one (tests and
// benchmarks compare the two on one GPU); the default picks the Hopper kernel on sm90 devices
// when this build has it for the head dim, else the sm80 kernel (which runs on sm80 and newer).
// Dropout exists only in the sm80 kernel: dropout_p > 0 always runs it.
enum class FwdPath { kSm80, kSm90 };

FwdPath choose_fwd_path(const FwdParams& p, int device) {
  const int major = device_info(device).major;
  const std::string forced = env_choice("FLASH_EXT_FWD_PATH", {"auto", "sm80", "sm90"});
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
  sm90_ok = major == 9 && kernel_head_dim_sm90(p.head_dim) != 0 && (p.is_bf16 ? bf16_ok : fp16_ok) &&
            tma_compatible(p) && !(p.dropout_p > 0.f);
#endif
  if (forced == "sm90") {
    FLASH_EXT_CHECK(sm90_ok, "flash_ext: FLASH_EXT_FWD_PATH=sm90 needs an sm90 GPU and a build with 90a in ",
                "FLASH_EXT_ARCHS covering head dim ", p.head_dim, " and dropout_p = 0 (", FLASH_EXT_BUILD_INFO, ")");
    return FwdPath::kSm90;
  }
  if (forced == "sm80") return FwdPath::kSm80;
  return sm90_ok ? FwdPath::kSm90 : FwdPath::kSm80;
}

void run_fwd(FwdParams& p, FwdPath path, cudaStream_t stream) {
#ifdef FLASH_EXT_SM90A
  if (path == FwdPath::kSm90) {
    const int kd = kernel_head_dim_sm90(p.head_dim);
    if (p.is_bf16) {
#ifdef FLASH_EXT_BF16
      run_fwd_sm90_hdim<true>(p, kd, stream);
#endif
    } else {
#ifdef FLASH_EXT_FP16
      run_fwd_sm90_hdim<false>(p, kd, stream);
#endif
    }
    return;
  }
#else
  (void)path;
#endif
  const int kd = sm80_kernel_head_dim(p.head_dim, "forward");
  if (p.is_bf16) {
#ifdef FLASH_EXT_BF16
    run_fwd_sm80_hdim<true>(p, kd, stream);
#else
    FLASH_EXT_CHECK(false, "flash_ext: this build has no bf16 kernels (", FLASH_EXT_BUILD_INFO, ")");
#endif
  } else {
#ifdef FLASH_EXT_FP16
    run_fwd_sm80_hdim<false>(p, kd, stream);
#else
    FLASH_EXT_CHECK(false, "flash_ext: this build has no fp16 kernels (", FLASH_EXT_BUILD_INFO, ")");
#endif
  }
}

#ifdef FLASH_EXT_SM90_TRACE
// A trace build's timeline buffer (sm90/fwd_trace.h, tools/trace_fwd.py): while set, every
// Hopper forward writes its timeline into it. The caller keeps the tensor alive until it unsets
// it (None).
int64_t* g_sm90_trace = nullptr;
void sm90_trace_buffer(const std::optional<at::Tensor>& buf) {
  if (!buf.has_value()) {
    g_sm90_trace = nullptr;
    return;
  }
  FLASH_EXT_CHECK(buf->is_cuda() && buf->scalar_type() == at::kLong && buf->is_contiguous() &&
                      buf->numel() >= sm90::trace::kTraceWords,
                  "flash_ext: the trace buffer must be a contiguous int64 CUDA tensor of at least ",
                  sm90::trace::kTraceWords, " elements");
  g_sm90_trace = buf->data_ptr<int64_t>();
}
#endif

// Checks the inputs (again: the Python layer gives friendlier messages first) and fills the
// parameters. Returns the lse tensor to write.
at::Tensor prepare_fwd(FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& out, const std::optional<at::Tensor>& cu_seqlens_q,
                       const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                       int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left,
                       int64_t window_right, double softcap, double dropout_p,
                       const std::optional<at::Tensor>& rng_state) {
  const bool varlen = cu_seqlens_q.has_value();
  FLASH_EXT_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
              "flash_ext: give both cu_seqlens_q and cu_seqlens_k, or neither");
  FLASH_EXT_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda() && out.is_cuda(), "flash_ext: tensors must be on a CUDA device");
  FLASH_EXT_CHECK(k.device() == q.device() && v.device() == q.device() && out.device() == q.device(),
              "flash_ext: q, k, v and out must be on the same device");
  const auto dtype = q.scalar_type();
  FLASH_EXT_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "flash_ext: only fp16 and bf16 are supported");
  FLASH_EXT_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && out.scalar_type() == dtype,
              "flash_ext: q, k, v and out must have the same dtype");
  const int expect_dim = varlen ? 3 : 4;
  FLASH_EXT_CHECK(q.dim() == expect_dim && k.dim() == expect_dim && v.dim() == expect_dim,
              "flash_ext: q, k, v must be ", expect_dim, "-D");
  FLASH_EXT_CHECK(k.sizes() == v.sizes(), "flash_ext: k and v must have the same shape");
  FLASH_EXT_CHECK(out.sizes() == q.sizes(), "flash_ext: out must have q's shape");
  const int d = q.size(-1);
  FLASH_EXT_CHECK(k.size(-1) == d, "flash_ext: q, k, v must have the same head dim");
  FLASH_EXT_CHECK(d % 8 == 0 && d > 0 && d <= 256, "flash_ext: head dim must be a multiple of 8 in [8, 256] at the op level; got ", d);
  const int hq = q.size(-2), hkv = k.size(-2);
  FLASH_EXT_CHECK(hkv > 0 && hq % hkv == 0, "flash_ext: heads of q (", hq, ") must be a multiple of heads of k/v (", hkv, ")");
  FLASH_EXT_CHECK(softmax_scale > 0 && std::isfinite(softmax_scale), "flash_ext: softmax_scale must be positive and finite");
  FLASH_EXT_CHECK(softcap >= 0, "flash_ext: softcap must be >= 0");
  FLASH_EXT_CHECK(window_left >= -1 && window_right >= -1, "flash_ext: window sizes must be >= -1");
  check_rows_aligned(q, "q");
  check_rows_aligned(k, "k");
  check_rows_aligned(v, "v");
  check_rows_aligned(out, "out");

  p = FwdParams{};
#ifdef FLASH_EXT_SM90_TRACE
  p.sm90_trace = g_sm90_trace;
#endif
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
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
  set_dropout_params(p, dropout_p, rng_state);
  // Hopper forward switches (README, docs/kernels-sm90.md), for A/B runs and tests.
  const std::string pingpong = env_choice("FLASH_EXT_SM90_PINGPONG", {"0", "1", "tile"});
  p.sm90_pingpong = pingpong == "0" ? 0 : pingpong == "tile" ? 2 : pingpong == "1" ? 1 : -1;
  const std::string persistent = env_choice("FLASH_EXT_SM90_PERSISTENT", {"auto", "0", "1"});
  p.sm90_persistent = persistent == "0" ? 0 : persistent == "1" ? 1 : -1;
  p.sm90_tma_store_o = env_choice("FLASH_EXT_SM90_TMA_STORE", {"0", "1"}) != "0";
  const std::string fwd_tile = env_choice("FLASH_EXT_SM90_FWD_TILE", {"auto", "base", "alt"});
  p.sm90_fwd_tile = fwd_tile == "base" ? 0 : fwd_tile == "alt" ? 1 : -1;
  p.sm90_lazy_rescale = env_choice("FLASH_EXT_SM90_LAZY_RESCALE", {"0", "1"}) != "0";
  const std::string sections = env_choice("FLASH_EXT_SM90_HEAD_SECTIONS", {"0", "1", "always", "uneven"});
  p.sm90_head_sections = sections == "0" ? 0 : sections == "always" ? 2 : sections == "uneven" ? 3 : 1;
  p.sm90_section_hb = p.sm90_section_big = p.sm90_section_big_hb = 0;  // set by the Hopper launch
  p.sm90_align_end = env_choice("FLASH_EXT_SM90_ALIGN_END", {"0", "1"}) != "0";
  p.sm90_row_shift = 0;  // set by the Hopper launch
  p.tile_counter = nullptr;  // set in launch() when the Hopper kernel's dynamic scheduler runs
  const std::string stream_k = env_choice("FLASH_EXT_SM90_STREAM_K", {"auto", "0", "1"});
  p.sm90_stream_k = stream_k == "0" ? 0 : stream_k == "1" ? 1 : -1;
  p.sm90_dp_tiles = p.sm90_work_end = 0;  // set by the Hopper launch
  p.sm90_sk_count = nullptr;
  p.sm90_sk_partial = nullptr;
  p.alloc_workspace = nullptr;  // set in launch()
  p.alloc_ctx = nullptr;

  at::Tensor lse;
  const int r = varlen ? 0 : 1;  // index of the seqlen dim
  p.q_row_stride = q.stride(r);
  p.q_head_stride = q.stride(r + 1);
  p.k_row_stride = k.stride(r);
  p.k_head_stride = k.stride(r + 1);
  p.v_row_stride = v.stride(r);
  p.v_head_stride = v.stride(r + 1);
  p.o_row_stride = out.stride(r);
  p.o_head_stride = out.stride(r + 1);
  if (varlen) {
    const auto& cq = *cu_seqlens_q;
    const auto& ck = *cu_seqlens_k;
    FLASH_EXT_CHECK(cq.scalar_type() == at::kInt && ck.scalar_type() == at::kInt, "flash_ext: cu_seqlens must be int32");
    FLASH_EXT_CHECK(cq.dim() == 1 && ck.dim() == 1 && cq.numel() == ck.numel() && cq.numel() >= 1,
                "flash_ext: cu_seqlens_q and cu_seqlens_k must be 1-D of the same length batch + 1");
    FLASH_EXT_CHECK(cq.device() == q.device() && ck.device() == q.device(), "flash_ext: cu_seqlens must be on q's device");
    FLASH_EXT_CHECK(cq.is_contiguous() && ck.is_contiguous(), "flash_ext: cu_seqlens must be contiguous");
    FLASH_EXT_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, "flash_ext: max_seqlen must be >= 0");
    p.batch = cq.numel() - 1;
    p.seqlen_q = int(max_seqlen_q);
    p.seqlen_k = int(max_seqlen_k);
    p.cu_seqlens_q = cq.data_ptr<int>();
    p.cu_seqlens_k = ck.data_ptr<int>();
    const int64_t total_q = q.size(0);
    p.total_q = int(total_q);
    p.total_k = int(k.size(0));
    lse = at::empty({hq, total_q}, q.options().dtype(at::kFloat));
    p.lse_batch_stride = 0;
    p.lse_head_stride = total_q;
  } else {
    FLASH_EXT_CHECK(k.size(0) == q.size(0), "flash_ext: q and k/v must have the same batch size");
    p.batch = q.size(0);
    p.seqlen_q = q.size(1);
    p.seqlen_k = k.size(1);
    p.q_batch_stride = q.stride(0);
    p.k_batch_stride = k.stride(0);
    p.v_batch_stride = v.stride(0);
    p.o_batch_stride = out.stride(0);
    lse = at::empty({p.batch, hq, p.seqlen_q}, q.options().dtype(at::kFloat));
    p.lse_batch_stride = int64_t(hq) * p.seqlen_q;
    p.lse_head_stride = p.seqlen_q;
  }
  FLASH_EXT_CHECK(p.batch <= 65535 && hq <= 65535, "flash_ext: batch and heads must be <= 65535");
  p.lse = lse.data_ptr<float>();
  return lse;
}

void launch(FwdParams& p, const at::Tensor& q) {
  if (p.batch == 0 || p.seqlen_q == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  // The Hopper kernel's persistent grid under a causal/local mask claims tiles from a counter
  // that starts at zero on every call (sm90/fwd_kernel.cuh, TileScheduler). Allocated on the
  // current stream: when it is freed below, the caching allocator hands it out again only to
  // work ordered after this launch. Zeroed with cudaMemsetAsync: at::zeros' fill costs ~50 us of
  // host time per call (docs/bench/h200-2026-11-22-host-overhead.txt).
  const DeviceInfo& dev = device_info(q.get_device());
  p.num_sms = dev.sms;
  p.l2_bytes = dev.l2_bytes;
  p.dram_bytes_per_s = dev.dram_bytes_per_s;
  const FwdPath path = choose_fwd_path(p, q.get_device());
  at::Tensor tile_counter;
  if (p.has_window && p.sm90_persistent != 0 && path == FwdPath::kSm90) {
    tile_counter = at::empty({1}, q.options().dtype(at::kInt));
    p.tile_counter = tile_counter.data_ptr<int>();
    C10_CUDA_CHECK(cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream));
  }
  // Workspace on request of the launch (the Hopper stream-K tail), freed on return like the
  // counter above: stream-ordered reuse keeps it valid for this launch.
  struct Workspace {
    at::TensorOptions options;
    at::Tensor buffer;
  } workspace{q.options().dtype(at::kByte), {}};
  p.alloc_ctx = &workspace;
  p.alloc_workspace = [](void* ctx, size_t bytes) -> void* {
    auto& w = *static_cast<Workspace*>(ctx);
    w.buffer = at::empty({int64_t(bytes)}, w.options);
    return w.buffer.data_ptr();
  };
  run_fwd(p, path, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::optional<at::Tensor>& cu_seqlens_q,
                                       const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                                       int64_t max_seqlen_k, double softmax_scale, bool causal,
                                       int64_t window_left, int64_t window_right, double softcap,
                                       double dropout_p, const std::optional<at::Tensor>& rng_state) {
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  FwdParams p;
  at::Tensor lse = prepare_fwd(p, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                               rng_state);
  launch(p, q);
  return {out, lse};
}

at::Tensor fwd_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                   const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
                   int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
                   int64_t window_left, int64_t window_right, double softcap, double dropout_p,
                   const std::optional<at::Tensor>& rng_state) {
  FwdParams p;
  at::Tensor lse = prepare_fwd(p, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                               rng_state);
  launch(p, q);
  return lse;
}

std::string build_info() { return FLASH_EXT_BUILD_INFO; }

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

TORCH_LIBRARY(flash_ext, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, float dropout_p=0.0, Tensor? rng_state=None) -> (Tensor, Tensor)");
  m.def(
      "fwd_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, int window_left, "
      "int window_right, float softcap, float dropout_p=0.0, Tensor? rng_state=None) -> Tensor");
  m.def("build_info() -> str", &flash_ext::build_info);
#ifdef FLASH_EXT_SM90_TRACE
  m.def("sm90_trace_buffer(Tensor? buf) -> ()", &flash_ext::sm90_trace_buffer);
#endif
  // Draws from torch's CUDA generator: tagged so that compilers neither merge nor drop calls.
  m.def("dropout_rng_state(Tensor q) -> Tensor", {at::Tag::nondeterministic_seeded});
  m.def(
      "dropout_mask(Tensor q, Tensor rng_state, int batch, int heads, int seqlen_q, int seqlen_k, "
      "float dropout_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) {
  m.impl("fwd", &flash_ext::fwd);
  m.impl("fwd_out", &flash_ext::fwd_out);
  m.impl("dropout_rng_state", &flash_ext::dropout_rng_state);
  m.impl("dropout_mask", &flash_ext::dropout_mask);
}
