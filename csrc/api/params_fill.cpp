// api/params_fill.h.
#include "api/params_fill.h"

#include <cmath>

#include "api/errors.h"

namespace flash_ext {

void fill_common_params(FwdParams& p, const AttnShape& s, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const std::optional<at::Tensor>& cu_seqlens_q,
                        const std::optional<at::Tensor>& cu_seqlens_k, double softmax_scale, bool causal,
                        int64_t window_left, int64_t window_right, double softcap, double dropout_p,
                        const std::optional<at::Tensor>& rng_state) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.heads_q = s.heads_q;
  p.heads_kv = s.heads_kv;
  p.head_dim = s.head_dim;
  p.is_bf16 = s.is_bf16;
  p.softmax_scale = float(softmax_scale);
  p.softcap = float(softcap);
  p.softmax_scale_log2 = float(softcap > 0 ? M_LOG2E : softmax_scale * M_LOG2E);
  if (causal) window_right = 0;
  p.window_left = int(window_left);
  p.window_right = int(window_right);
  p.has_window = window_left >= 0 || window_right >= 0;
  set_dropout_params(p, dropout_p, rng_state);

  const int r = s.varlen ? 0 : 1;  // index of the seqlen dim
  p.q_row_stride = q.stride(r);
  p.q_head_stride = q.stride(r + 1);
  p.k_row_stride = k.stride(r);
  p.k_head_stride = k.stride(r + 1);
  p.v_row_stride = v.stride(r);
  p.v_head_stride = v.stride(r + 1);
  p.o_row_stride = out.stride(r);
  p.o_head_stride = out.stride(r + 1);
  p.batch = int(s.batch);
  p.seqlen_q = int(s.seqlen_q);
  p.seqlen_k = int(s.seqlen_k);
  if (s.varlen) {
    p.cu_seqlens_q = cu_seqlens_q->data_ptr<int>();
    p.cu_seqlens_k = cu_seqlens_k->data_ptr<int>();
    p.total_q = int(s.total_q);
    p.total_k = int(s.total_k);
    p.lse_batch_stride = 0;  // lse is (heads_q, total_q); a sequence's rows start at cu_seqlens_q[b]
    p.lse_head_stride = s.total_q;
  } else {
    p.q_batch_stride = q.stride(0);
    p.k_batch_stride = k.stride(0);
    p.v_batch_stride = v.stride(0);
    p.o_batch_stride = out.stride(0);
    p.lse_batch_stride = int64_t(s.heads_q) * s.seqlen_q;  // lse is (batch, heads_q, seqlen_q)
    p.lse_head_stride = s.seqlen_q;
  }
}

void set_dropout_params(FwdParams& p, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  FLASH_EXT_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "flash_ext: dropout_p must be in [0, 1]; got ", dropout_p);
  p.dropout_p = 0.f;
  p.dropout_scale = 1.f;
  p.dropout_threshold = 0;
  p.dropout_seed = p.dropout_offset = 0;
  if (dropout_p == 0.0) return;
  FLASH_EXT_CHECK(rng_state.has_value(), "flash_ext: dropout_p > 0 needs rng_state (from flash_ext::dropout_rng_state)");
  const at::Tensor& rs = *rng_state;
  FLASH_EXT_CHECK(rs.device().is_cpu() && rs.scalar_type() == at::kLong && rs.numel() == 2,
                  "flash_ext: rng_state must be an int64 CPU tensor of 2 elements [seed, offset]; got ",
                  rs.scalar_type(), " ", rs.sizes(), " on ", rs.device());
  const at::Tensor c = rs.contiguous();
  p.dropout_seed = static_cast<uint64_t>(c.data_ptr<int64_t>()[0]);
  p.dropout_offset = static_cast<uint64_t>(c.data_ptr<int64_t>()[1]);
  p.dropout_p = float(dropout_p);
  // Dropped iff word < floor(p * 2^32 + 0.5) (exact in double). p = 1: threshold 2^32 does not
  // fit; 2^32 - 1 with a keep scale of 0 gives the same result (nothing survives).
  const double t = std::floor(dropout_p * 4294967296.0 + 0.5);
  p.dropout_threshold = t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
  p.dropout_scale = dropout_p >= 1.0 ? 0.f : float(1.0 / (1.0 - dropout_p));
}

}  // namespace flash_ext
