// api/checks.h.
#include "api/checks.h"

#include <cmath>
#include <cstdint>

#include "api/errors.h"

namespace flash_ext {
namespace {

void check_cu_seqlens(const at::Tensor& q, const at::Tensor& cq, const at::Tensor& ck, int64_t max_seqlen_q,
                      int64_t max_seqlen_k) {
  FLASH_EXT_CHECK(cq.scalar_type() == at::kInt && ck.scalar_type() == at::kInt, "flash_ext: cu_seqlens must be int32");
  FLASH_EXT_CHECK(cq.dim() == 1 && ck.dim() == 1 && cq.numel() == ck.numel() && cq.numel() >= 1,
                  "flash_ext: cu_seqlens_q and cu_seqlens_k must be 1-D of the same length batch + 1");
  FLASH_EXT_CHECK(cq.device() == q.device() && ck.device() == q.device(),
                  "flash_ext: cu_seqlens must be on q's device");
  FLASH_EXT_CHECK(cq.is_contiguous() && ck.is_contiguous(), "flash_ext: cu_seqlens must be contiguous");
  FLASH_EXT_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, "flash_ext: max_seqlen must be >= 0");
}

}  // namespace

void check_rows_aligned(const at::Tensor& t, const char* name) {
  FLASH_EXT_CHECK(t.stride(-1) == 1, "flash_ext: ", name, " must have a contiguous last dimension");
  for (int i = 0; i < t.dim() - 1; ++i) {
    FLASH_EXT_CHECK(t.stride(i) % 8 == 0, "flash_ext: ", name,
                    " strides must be multiples of 8 elements (16-byte aligned rows); got ", t.strides());
  }
  FLASH_EXT_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "flash_ext: ", name,
                  " must be 16-byte aligned");
}

void check_seqused_k(const at::Tensor& seqused_k, const at::Tensor& q, const AttnShape& s) {
  FLASH_EXT_CHECK(s.varlen, "flash_ext: seqused_k needs varlen inputs (cu_seqlens_q and cu_seqlens_k)");
  FLASH_EXT_CHECK(seqused_k.scalar_type() == at::kInt, "flash_ext: seqused_k must be int32; got ",
                  seqused_k.scalar_type());
  FLASH_EXT_CHECK(seqused_k.dim() == 1 && seqused_k.size(0) == s.batch, "flash_ext: seqused_k must have shape (batch,) = (",
                  s.batch, ",); got ", seqused_k.sizes());
  FLASH_EXT_CHECK(seqused_k.device() == q.device(), "flash_ext: seqused_k must be on q's device");
  FLASH_EXT_CHECK(seqused_k.is_contiguous(), "flash_ext: seqused_k must be contiguous");
}

void set_alibi_params(FwdParams& p, const at::Tensor& slopes, const at::Tensor& q, const AttnShape& s,
                      double dropout_p) {
  FLASH_EXT_CHECK(slopes.scalar_type() == at::kFloat, "flash_ext: alibi_slopes must be float32; got ",
                  slopes.scalar_type());
  FLASH_EXT_CHECK((slopes.dim() == 1 && slopes.size(0) == s.heads_q) ||
                      (slopes.dim() == 2 && slopes.size(0) == s.batch && slopes.size(1) == s.heads_q),
                  "flash_ext: alibi_slopes must have shape (heads_q,) = (", s.heads_q, ",) or (batch, heads_q) = (",
                  s.batch, ", ", s.heads_q, "); got ", slopes.sizes());
  FLASH_EXT_CHECK(slopes.device() == q.device(), "flash_ext: alibi_slopes must be on q's device");
  FLASH_EXT_CHECK(slopes.stride(-1) == 1, "flash_ext: alibi_slopes must be contiguous in its last dim");
  FLASH_EXT_CHECK(!(dropout_p > 0), "flash_ext: alibi_slopes together with dropout_p > 0 is not supported");
  p.alibi_slopes = slopes.data_ptr<float>();
  p.alibi_batch_stride = slopes.dim() == 2 ? slopes.stride(0) : 0;
  p.has_window = true;
}

AttnShape check_attention_inputs(const AttnTensors& t, const std::optional<at::Tensor>& cu_seqlens_q,
                                 const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                                 int64_t max_seqlen_k, double softmax_scale, double softcap,
                                 int64_t window_left, int64_t window_right) {
  const at::Tensor &q = t.q, &k = t.k, &v = t.v, &out = t.out;
  const bool bwd = t.dout != nullptr;
  AttnShape s;
  s.varlen = cu_seqlens_q.has_value();
  FLASH_EXT_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
                  "flash_ext: give both cu_seqlens_q and cu_seqlens_k, or neither");

  // Devices and dtypes.
  bool on_cuda = q.is_cuda() && k.is_cuda() && v.is_cuda() && out.is_cuda();
  bool same_device = k.device() == q.device() && v.device() == q.device() && out.device() == q.device();
  if (bwd) {
    on_cuda = on_cuda && t.dout->is_cuda() && t.lse->is_cuda();
    same_device = same_device && t.dout->device() == q.device() && t.lse->device() == q.device();
  }
  FLASH_EXT_CHECK(on_cuda, "flash_ext: tensors must be on a CUDA device");
  FLASH_EXT_CHECK(same_device, "flash_ext: ", bwd ? "dout, q, k, v, out and lse" : "q, k, v and out",
                  " must be on the same device");
  const auto dtype = q.scalar_type();
  FLASH_EXT_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "flash_ext: only fp16 and bf16 are supported");
  FLASH_EXT_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && out.scalar_type() == dtype &&
                      (!bwd || t.dout->scalar_type() == dtype),
                  "flash_ext: ", bwd ? "q, k, v, out and dout" : "q, k, v and out", " must have the same dtype");
  if (bwd) FLASH_EXT_CHECK(t.lse->scalar_type() == at::kFloat, "flash_ext: lse must be float32");
  s.is_bf16 = dtype == at::kBFloat16;

  // Shapes.
  const int expect_dim = s.varlen ? 3 : 4;
  FLASH_EXT_CHECK(q.dim() == expect_dim && k.dim() == expect_dim && v.dim() == expect_dim,
                  "flash_ext: q, k, v must be ", expect_dim, "-D");
  FLASH_EXT_CHECK(k.sizes() == v.sizes(), "flash_ext: k and v must have the same shape");
  FLASH_EXT_CHECK(out.sizes() == q.sizes(), "flash_ext: out must have q's shape");
  if (bwd) FLASH_EXT_CHECK(t.dout->sizes() == q.sizes(), "flash_ext: dout must have q's shape");
  const int d = q.size(-1);
  FLASH_EXT_CHECK(k.size(-1) == d, "flash_ext: q, k, v must have the same head dim");
  FLASH_EXT_CHECK(d % 8 == 0 && d > 0 && d <= 256,
                  "flash_ext: head dim must be a multiple of 8 in [8, 256] at the op level; got ", d);
  const int hq = q.size(-2), hkv = k.size(-2);
  FLASH_EXT_CHECK(hkv > 0 && hq % hkv == 0, "flash_ext: heads of q (", hq, ") must be a multiple of heads of k/v (",
                  hkv, ")");
  s.heads_q = hq;
  s.heads_kv = hkv;
  s.head_dim = d;

  // Scalars.
  FLASH_EXT_CHECK(softmax_scale > 0 && std::isfinite(softmax_scale),
                  "flash_ext: softmax_scale must be positive and finite");
  FLASH_EXT_CHECK(softcap >= 0, "flash_ext: softcap must be >= 0");
  FLASH_EXT_CHECK(window_left >= -1 && window_right >= -1, "flash_ext: window sizes must be >= -1");

  // Alignment.
  check_rows_aligned(q, "q");
  check_rows_aligned(k, "k");
  check_rows_aligned(v, "v");
  check_rows_aligned(out, "out");
  if (bwd) check_rows_aligned(*t.dout, "dout");

  // Sequences: varlen (cu_seqlens) or fixed-length batches; lse (backward) laid out to match.
  if (s.varlen) {
    check_cu_seqlens(q, *cu_seqlens_q, *cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    s.batch = cu_seqlens_q->numel() - 1;
    s.seqlen_q = max_seqlen_q;
    s.seqlen_k = max_seqlen_k;
    s.total_q = q.size(0);
    s.total_k = k.size(0);
    if (bwd) {
      const at::Tensor& lse = *t.lse;
      FLASH_EXT_CHECK(lse.dim() == 2 && lse.size(0) == hq && lse.size(1) == s.total_q,
                      "flash_ext: lse must be (heads_q, total_q) = (", hq, ", ", s.total_q, ") for varlen; got ",
                      lse.sizes());
    }
  } else {
    FLASH_EXT_CHECK(k.size(0) == q.size(0), "flash_ext: q and k/v must have the same batch size");
    s.batch = q.size(0);
    s.seqlen_q = q.size(1);
    s.seqlen_k = k.size(1);
    if (bwd) {
      const at::Tensor& lse = *t.lse;
      FLASH_EXT_CHECK(lse.dim() == 3 && lse.size(0) == s.batch && lse.size(1) == hq && lse.size(2) == s.seqlen_q,
                      "flash_ext: lse must be (batch, heads_q, seqlen_q); got ", lse.sizes());
    }
  }
  FLASH_EXT_CHECK(s.batch <= 65535 && hq <= 65535, "flash_ext: batch and heads must be <= 65535");
  return s;
}

}  // namespace flash_ext
