// The forward ops: flash_ext::fwd, flash_ext::fwd_out (and, in trace builds, the timeline
// buffer of the Hopper forward). Checks (api/checks.h), common parameters (api/params_fill.h),
// the kernel choice (dispatch/paths.h) and the Hopper config (tuning/heuristics.h), then the launch.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <tuple>

#include "api/checks.h"
#include "api/errors.h"
#include "api/flashmask.h"
#include "api/params_fill.h"
#include "api/workspace.h"
#include "device_info.h"
#include "dispatch/fwd_dispatch.h"
#include "dispatch/paths.h"
#include "tuning/heuristics.h"
#include "params.h"
#include "sm90/fwd_trace.h"
#include "tuning/overrides.h"

namespace flash_ext {
namespace {

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

// A FlashMask call's bounds and what kernel A needs besides FwdParams.
struct FlashMaskInput {
  const at::Tensor* bounds = nullptr;  // nullptr: no FlashMask
  const std::optional<at::Tensor>* cu_seqlens_k = nullptr;
  const AttnShape* shape = nullptr;
  bool causal = false;
};

// Chooses the kernel (and, for the Hopper one, its config and buffers; for FlashMask, the key-block
// summaries for the chosen kernel's block size) and launches it.
void launch(FwdParams& p, const at::Tensor& q, const FlashMaskInput& fm_in) {
  if (p.batch == 0 || p.seqlen_q == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  const DeviceInfo& dev = device_info(q.get_device());
  const TuningOverrides overrides = tuning_overrides();
  const KernelChoice kernel = choose_fwd_kernel(p, dev, overrides);
  Sm90FwdConfig config;
  Sm90FwdBuffers buffers;  // alive until the launch is queued
  FlashMaskSummary fm;     // likewise
  if (kernel.path == KernelPath::kSm90) {
    config = choose_sm90_fwd_config(p, kernel.kernel_head_dim, dev, overrides);
    write_sm90_fwd_schedule(config, p);
    buffers = allocate_sm90_fwd_buffers(config, p, q.options(), q.get_device(), stream);
  }
  if (fm_in.bounds != nullptr) {
    const int block_n = kernel.path == KernelPath::kSm90 ? config.tile.block_n
                                                          : sm80_fwd_block_n(kernel.kernel_head_dim);
    // The Hopper forward under L2 sections: kernel A counts the kept pairs, and a sparse mask's
    // tiles drop the sections on the GPU (p.fm.one_section_below; sm90/tile_scheduler.h).
    // (Not past 2^26 query rows: kernel A sums a warp's rows in 32 bits.)
    const bool sections = kernel.path == KernelPath::kSm90 && config.section_hb < p.heads_q * p.batch &&
                          p.seqlen_q < (1 << 26) && overrides.sm90_fm_fwd_sections != 0;
    // The Hopper forward's tile table (fixed length): each tile's range and the tile order.
    const int fwd_tiles_block_m =
        kernel.path == KernelPath::kSm90 && overrides.sm90_fm_fwd_tiles != 0 ? config.tile.block_m : 0;
    fm = set_flashmask_params(p, *fm_in.bounds, *fm_in.shape, *fm_in.cu_seqlens_k, fm_in.causal, block_n, stream,
                              sections ? FmCountFor::kFwdSections : FmCountFor::kNothing, fwd_tiles_block_m);
    if (overrides.sm90_fm_fwd_sections == 1 && p.fm.visible_pairs != nullptr) {
      p.fm.one_section_below = std::numeric_limits<long long>::max();  // A/B: one section always
    }
  }
  run_fwd(kernel, p, config, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Checks, fills the parameters, launches; returns lse.
at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                   const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
                   int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
                   int64_t window_left, int64_t window_right, double softcap, double dropout_p,
                   const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& startend_row_indices,
                   const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& alibi_slopes) {
  const AttnShape s = check_attention_inputs({q, k, v, out}, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale, softcap, window_left, window_right);
  if (seqused_k.has_value()) check_seqused_k(*seqused_k, q, s);
  FlashMaskInput fm;
  if (startend_row_indices.has_value()) {
    check_flashmask_inputs(*startend_row_indices, q, s, causal, window_left, window_right, dropout_p);
    fm = {&*startend_row_indices, &cu_seqlens_k, &s, causal};
  }
  FwdParams p{};
#ifdef FLASH_EXT_SM90_TRACE
  p.sm90_trace = g_sm90_trace;
#endif
  fill_common_params(p, s, q, k, v, out, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left,
                     window_right, softcap, dropout_p, rng_state);
  p.seqused_k = seqused_k.has_value() ? seqused_k->data_ptr<int>() : nullptr;
  if (alibi_slopes.has_value()) set_alibi_params(p, *alibi_slopes, q, s, dropout_p);
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor lse = s.varlen ? at::empty({s.heads_q, s.total_q}, f32) : at::empty({s.batch, s.heads_q, s.seqlen_q}, f32);
  p.lse = lse.data_ptr<float>();
  // Routing reads it (dispatch/paths.h); the summaries are filled in once the kernel is chosen.
  p.has_flashmask = fm.bounds != nullptr;
  launch(p, q, fm);
  return lse;
}

// deterministic: read only by the backward (autograd records it with the op); the forward
// kernels do not depend on it.
std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::optional<at::Tensor>& cu_seqlens_q,
                                       const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                                       int64_t max_seqlen_k, double softmax_scale, bool causal,
                                       int64_t window_left, int64_t window_right, double softcap,
                                       double dropout_p, const std::optional<at::Tensor>& rng_state,
                                       bool deterministic, const std::optional<at::Tensor>& startend_row_indices,
                                       const std::optional<at::Tensor>& seqused_k,
                                       const std::optional<at::Tensor>& alibi_slopes) {
  (void)deterministic;
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor lse = forward(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                           causal, window_left, window_right, softcap, dropout_p, rng_state, startend_row_indices,
                           seqused_k, alibi_slopes);
  return {out, lse};
}

at::Tensor fwd_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                   const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
                   int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
                   int64_t window_left, int64_t window_right, double softcap, double dropout_p,
                   const std::optional<at::Tensor>& rng_state,
                   const std::optional<at::Tensor>& startend_row_indices, const std::optional<at::Tensor>& seqused_k,
                   const std::optional<at::Tensor>& alibi_slopes) {
  return forward(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 window_left, window_right, softcap, dropout_p, rng_state, startend_row_indices, seqused_k,
                 alibi_slopes);
}

}  // namespace
}  // namespace flash_ext

TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  // deterministic: ignored by the forward kernels, it makes the flag part of the op that autograd
  // records, so one differentiable op serves both settings. seqused_k (varlen only): sequence b
  // uses only its first seqused_k[b] keys; forward only (the autograd kernel refuses it).
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, float softmax_scale, bool causal, int window_left, int window_right, "
      "float softcap, float dropout_p=0.0, Tensor? rng_state=None, bool deterministic=False, "
      "Tensor? startend_row_indices=None, Tensor? seqused_k=None, Tensor? alibi_slopes=None) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "fwd_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, int window_left, "
      "int window_right, float softcap, float dropout_p=0.0, Tensor? rng_state=None, "
      "Tensor? startend_row_indices=None, Tensor? seqused_k=None, Tensor? alibi_slopes=None) -> Tensor");
#ifdef FLASH_EXT_SM90_TRACE
  m.def("sm90_trace_buffer(Tensor? buf) -> ()", &flash_ext::sm90_trace_buffer);
#endif
}

TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) {
  m.impl("fwd", &flash_ext::fwd);
  m.impl("fwd_out", &flash_ext::fwd_out);
}
