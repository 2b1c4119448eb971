// The autograd formula of flash_ext::fwd, the one differentiable op, as its Autograd-key kernel
// in C++: the autograd engine calls the backward without entering Python (a Python formula cost
// about as much host time per step as SDPA's whole step). The forward redispatches below
// autograd to the op; the backward calls flash_ext::bwd through the dispatcher, so that
// torch.compile's AOTAutograd, which runs this formula on traced tensors, records both ops.
//
// What the formula keeps (tests/test_autograd*.py, tests/test_training_gpu.py):
// - lse is non-differentiable (returned detached), and a gradient autograd does not have stays
//   undefined (no zero tensors filled per backward); a missing gradient of out becomes zeros only
//   when bwd runs;
// - a call with nothing to compute (no query row or no key) gets zero gradients, no launch;
// - bwd gets the forward's deterministic, dropout_p, rng_state, startend_row_indices (FlashMask's
//   bounds) and alibi_slopes, the tensors saved with the others;
// - one gradient slot per op argument (18): q, k, v get theirs, the others none;
// - seqused_k is forward only: a call that would record a graph with it raises before any launch;
// - dout is made what the ops read in place (last dim contiguous, other strides and the storage
//   offset multiples of 8 elements), copied only when it is not.
// tests/stand_in_ops.py registers the same formula in Python for CPU runs without the build.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "api/errors.h"

namespace flash_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

// The ops' C++ signatures (schemas in ops_fwd.cpp and ops_bwd.cpp).
using FwdSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const OptTensor&, const OptTensor&, int64_t, int64_t, double,
                                                  bool, int64_t, int64_t, double, double, const OptTensor&, bool,
                                                  const OptTensor&, const OptTensor&, const OptTensor&);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const OptTensor&, const OptTensor&, int64_t, int64_t, double, bool, int64_t, int64_t, double, bool, double,
    const OptTensor&, const OptTensor&, const OptTensor&);

const c10::TypedOperatorHandle<FwdSig>& fwd_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flash_ext::fwd", "").typed<FwdSig>();
  return op;
}

const c10::TypedOperatorHandle<BwdSig>& bwd_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("flash_ext::bwd", "").typed<BwdSig>();
  return op;
}

constexpr int64_t kAlign = 8;  // elements: 16-byte rows in fp16/bf16

// Whether the ops can read t in place. Sizes and strides may be symbolic (torch.compile with
// dynamic shapes): the comparisons then guard, as the Python layer's do. A symbolic storage
// offset is not checked (the op checks the data pointer's alignment itself).
bool rows_aligned(const at::Tensor& t) {
  const auto strides = t.sym_strides();
  if (strides.empty() || strides.back() != 1) return false;
  if (const auto offset = t.sym_storage_offset().maybe_as_int(); offset && *offset % kAlign != 0) return false;
  for (size_t i = 0; i + 1 < strides.size(); ++i) {
    if (strides[i] % kAlign != 0) return false;
  }
  return true;
}

at::Tensor aligned(const at::Tensor& t) { return rows_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous); }

// No query row, or no key at all: every gradient is zero and nothing is launched.
bool nothing_to_do(const at::Tensor& q, const at::Tensor& k, bool varlen, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  if (varlen) return q.sym_size(0) == 0 || max_seqlen_q == 0 || k.sym_size(0) == 0 || max_seqlen_k == 0;
  return q.sym_size(0) == 0 || q.sym_size(1) == 0 || k.sym_size(1) == 0;
}

OptTensor optional_of(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// The op's arguments by position (saved tensors, then saved_data by name).
enum Saved { kQ, kK, kV, kOut, kLse, kCuQ, kCuK, kRng, kBounds, kAlibi };

constexpr size_t kFwdArgs = 18;  // arguments of flash_ext::fwd: one gradient slot each

struct FwdFunction : public torch::autograd::Function<FwdFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left,
                               int64_t window_right, double softcap, double dropout_p, const OptTensor& rng_state,
                               bool deterministic, const OptTensor& startend_row_indices,
                               const OptTensor& alibi_slopes) {
    at::Tensor out, lse;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, lse) = fwd_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                                         rng_state, deterministic, startend_row_indices, std::nullopt,
                                         alibi_slopes);
    }
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q.value_or(at::Tensor()),
                            cu_seqlens_k.value_or(at::Tensor()), rng_state.value_or(at::Tensor()),
                            startend_row_indices.value_or(at::Tensor()), alibi_slopes.value_or(at::Tensor())});
    auto& d = ctx->saved_data;
    d["max_seqlen_q"] = max_seqlen_q;
    d["max_seqlen_k"] = max_seqlen_k;
    d["softmax_scale"] = softmax_scale;
    d["causal"] = causal;
    d["window_left"] = window_left;
    d["window_right"] = window_right;
    d["softcap"] = softcap;
    d["dropout_p"] = dropout_p;
    d["deterministic"] = deterministic;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const at::Tensor &q = s[kQ], &k = s[kK], &v = s[kV], &out = s[kOut];
    const int64_t max_seqlen_q = d.at("max_seqlen_q").toInt(), max_seqlen_k = d.at("max_seqlen_k").toInt();
    variable_list result(kFwdArgs);  // only q, k, v get gradients
    if (nothing_to_do(q, k, s[kCuQ].defined(), max_seqlen_q, max_seqlen_k)) {
      // A direct call of the op with nothing to compute (attn_fwd never makes one).
      result[0] = at::zeros_like(q);
      result[1] = at::zeros_like(k);
      result[2] = at::zeros_like(v);
      return result;
    }
    // Undefined: out does not reach the loss (lse never carries a gradient).
    const at::Tensor dout = grads[0].defined() ? aligned(grads[0]) : at::zeros_like(out, at::MemoryFormat::Contiguous);
    auto [dq, dk, dv] =
        bwd_op().call(dout, q, k, v, out, s[kLse], optional_of(s[kCuQ]), optional_of(s[kCuK]), max_seqlen_q,
                      max_seqlen_k, d.at("softmax_scale").toDouble(), d.at("causal").toBool(),
                      d.at("window_left").toInt(), d.at("window_right").toInt(), d.at("softcap").toDouble(),
                      d.at("deterministic").toBool(), d.at("dropout_p").toDouble(), optional_of(s[kRng]),
                      optional_of(s[kBounds]), optional_of(s[kAlibi]));
    result[0] = std::move(dq);
    result[1] = std::move(dk);
    result[2] = std::move(dv);
    return result;
  }
};

// flash_ext::fwd at the Autograd key. Without a graph to record (grad mode off, or no input
// that requires grad) it goes straight to the kernel: no autograd node is built.
std::tuple<at::Tensor, at::Tensor> fwd_autograd(c10::DispatchKeySet ks, const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const OptTensor& cu_seqlens_q,
                                                const OptTensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                int64_t max_seqlen_k, double softmax_scale, bool causal,
                                                int64_t window_left, int64_t window_right, double softcap,
                                                double dropout_p, const OptTensor& rng_state, bool deterministic,
                                                const OptTensor& startend_row_indices, const OptTensor& seqused_k,
                                                const OptTensor& alibi_slopes) {
  const bool record = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!record) {
    return fwd_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, q, k, v, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                               softcap, dropout_p, rng_state, deterministic, startend_row_indices, seqused_k,
                               alibi_slopes);
  }
  // No backward reads seqused_k: refuse rather than return gradients of the wrong problem.
  FLASH_EXT_CHECK(!seqused_k.has_value(),
                  "flash_ext: seqused_k / block_table: forward only (no backward); q, k or v requires grad. "
                  "Call it under torch.no_grad() or with inputs that do not require grad");
  const variable_list r =
      FwdFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         window_left, window_right, softcap, dropout_p, rng_state, deterministic,
                         startend_row_indices, alibi_slopes);
  // lse leaves detached: no gradient flows through it. (Not mark_non_differentiable: compiled
  // autograd refuses C++ nodes that have non-differentiable outputs.)
  return {r[0], r[1].detach()};
}

}  // namespace
}  // namespace flash_ext

TORCH_LIBRARY_IMPL(flash_ext, Autograd, m) { m.impl("fwd", &flash_ext::fwd_autograd); }
