// The C++ ops' input checks, written once for both directions: devices, dtypes, shapes, head
// dim, heads, scalars, 16-byte row alignment, cu_seqlens. The Python layer
// (flash_ext/_validation.py) checks the same things first with friendlier messages; these
// guard the ops when they are called directly. They read sizes and strides only (no sync).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "params.h"

namespace flash_ext {

// The tensors of one call: dout and lse only for the backward (nullptr in the forward).
struct AttnTensors {
  const at::Tensor& q;
  const at::Tensor& k;
  const at::Tensor& v;
  const at::Tensor& out;
  const at::Tensor* dout = nullptr;
  const at::Tensor* lse = nullptr;
};

// What the checks established about the problem.
struct AttnShape {
  bool varlen = false;
  bool is_bf16 = false;
  int64_t batch = 0;
  int64_t seqlen_q = 0, seqlen_k = 0;  // varlen: max_seqlen_q / max_seqlen_k
  int64_t total_q = 0, total_k = 0;    // varlen: rows of the packed q and k
  int heads_q = 0, heads_kv = 0, head_dim = 0;
};

AttnShape check_attention_inputs(const AttnTensors& t, const std::optional<at::Tensor>& cu_seqlens_q,
                                 const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                                 int64_t max_seqlen_k, double softmax_scale, double softcap,
                                 int64_t window_left, int64_t window_right);

// seqused_k (forward only, varlen only): int32 (batch,), contiguous, on q's device. Its values
// (0 <= seqused_k[b] <= the sequence's key count) are the caller's promise: not read here (no sync).
void check_seqused_k(const at::Tensor& seqused_k, const at::Tensor& q, const AttnShape& s);

// ALiBi slopes: float32 (heads_q,) or (batch, heads_q), last dim contiguous, on q's device; not
// with dropout (no kernel variant has both). Then sets p's ALiBi fields and has_window (the ALiBi
// kernels are windowed variants; an unbounded window bounds nothing).
void set_alibi_params(FwdParams& p, const at::Tensor& slopes, const at::Tensor& q, const AttnShape& s,
                      double dropout_p);

// The kernels' vector loads and stores need a contiguous last dimension, every other stride a
// multiple of 8 elements (16-byte aligned rows) and a 16-byte aligned base.
void check_rows_aligned(const at::Tensor& t, const char* name);

}  // namespace flash_ext
