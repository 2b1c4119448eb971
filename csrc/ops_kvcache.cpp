// The KV-cache ops (docs/design-flash-decoding.md 3.2; their contract is written out in
// flash_ext/ops.py): flash_ext::kvcache_append writes new tokens into the caches (the only op
// that mutates them), flash_ext::fwd_kvcache attends over them with the split-KV decode kernel.
// The Python layer (flash_ext/kvcache.py, _validation.check_kvcache_inputs) checks every input
// first with friendlier messages; the checks here guard direct calls (sizes and strides only,
// no device values, so no sync).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "api/checks.h"
#include "api/errors.h"
#include "api/workspace.h"
#include "device_info.h"
#include "dispatch/decode_dispatch.h"
#include "dispatch/kernel_table.h"
#include "tuning/heuristics.h"

namespace flash_ext {
namespace {

using OptTensor = std::optional<at::Tensor>;

void check_index(const OptTensor& t, const char* name, const at::Tensor& q, int64_t batch) {
  if (!t.has_value()) return;
  FLASH_EXT_CHECK(t->scalar_type() == at::kInt, "flash_ext: ", name, " must be int32, got ", t->scalar_type());
  FLASH_EXT_CHECK(t->device() == q.device(), "flash_ext: ", name, " must be on ", q.device(), ", got ", t->device());
  FLASH_EXT_CHECK(t->dim() == 1 && t->size(0) == batch && t->is_contiguous(), "flash_ext: ", name,
                  " must be a contiguous (batch,) = (", batch, ",) tensor, got ", t->sizes());
}

// The caches and the addressing arguments both ops share; returns the capacity per sequence.
struct CacheLayout {
  int64_t capacity = 0, page_size = 0, num_pages = 0;
};
CacheLayout check_caches(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t batch,
                         const OptTensor& cache_seqlens, const OptTensor& cache_batch_idx, const OptTensor& cache_leftpad,
                         const OptTensor& block_table) {
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    const char* name = t == &k_cache ? "k_cache" : "v_cache";
    FLASH_EXT_CHECK(t->device() == q.device(), "flash_ext: ", name, " must be on ", q.device(), ", got ", t->device());
    FLASH_EXT_CHECK(t->scalar_type() == q.scalar_type(), "flash_ext: ", name, " must be ", q.scalar_type(), ", got ",
                    t->scalar_type());
    FLASH_EXT_CHECK(t->dim() == 4, "flash_ext: ", name, " must be 4-D, got ", t->sizes());
    check_rows_aligned(*t, name);
  }
  FLASH_EXT_CHECK(k_cache.sizes() == v_cache.sizes(), "flash_ext: k_cache and v_cache must have one shape, got ",
                  k_cache.sizes(), " and ", v_cache.sizes());
  check_index(cache_seqlens, "cache_seqlens", q, batch);
  check_index(cache_batch_idx, "cache_batch_idx", q, batch);
  check_index(cache_leftpad, "cache_leftpad", q, batch);
  CacheLayout c;
  if (block_table.has_value()) {
    FLASH_EXT_CHECK(!cache_batch_idx.has_value(), "flash_ext: cache_batch_idx cannot be combined with block_table");
    FLASH_EXT_CHECK(block_table->scalar_type() == at::kInt && block_table->device() == q.device() &&
                        block_table->dim() == 2 && block_table->size(0) == batch && block_table->stride(1) == 1,
                    "flash_ext: block_table must be an int32 (batch, max_pages) tensor on ", q.device(),
                    " with contiguous rows, got ", block_table->sizes());
    c.page_size = k_cache.size(1);
    c.num_pages = k_cache.size(0);
    FLASH_EXT_CHECK(c.page_size % 16 == 0, "flash_ext: the page size must be a multiple of 16, got ", c.page_size);
    c.capacity = block_table->size(1) * c.page_size;
  } else {
    FLASH_EXT_CHECK(k_cache.size(0) >= batch || cache_batch_idx.has_value(), "flash_ext: k_cache has ",
                    k_cache.size(0), " rows for a batch of ", batch);
    c.capacity = k_cache.size(1);
  }
  FLASH_EXT_CHECK(c.capacity < (int64_t(1) << 31), "flash_ext: the cache capacity must be below 2^31 slots");
  return c;
}

// The rotary tables: returns rotary_dim (0 without them).
int check_rotary(const OptTensor& cos, const OptTensor& sin, const at::Tensor& q, int64_t head_dim) {
  FLASH_EXT_CHECK(cos.has_value() == sin.has_value(), "flash_ext: give both rotary_cos and rotary_sin, or neither");
  if (!cos.has_value()) return 0;
  for (const OptTensor* t : {&cos, &sin}) {
    FLASH_EXT_CHECK((*t)->scalar_type() == q.scalar_type() && (*t)->device() == q.device() && (*t)->dim() == 2 &&
                        (*t)->stride(1) == 1,
                    "flash_ext: rotary_cos / rotary_sin must be 2-D ", q.scalar_type(), " tensors on ", q.device(),
                    " with contiguous rows, got ", (*t)->sizes());
  }
  FLASH_EXT_CHECK(cos->sizes() == sin->sizes() && cos->strides() == sin->strides(),
                  "flash_ext: rotary_cos and rotary_sin must have one shape and layout");
  const int64_t rd = 2 * cos->size(1);
  FLASH_EXT_CHECK(rd % 16 == 0 && rd <= head_dim, "flash_ext: the rotary dim (2 x rotary_cos.size(1) = ", rd,
                  ") must be a multiple of 16 and at most the head dim ", head_dim);
  return int(rd);
}

void kvcache_append(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                    const OptTensor& rotary_cos, const OptTensor& rotary_sin, const OptTensor& cache_seqlens,
                    int64_t cache_seqlen, const OptTensor& cache_batch_idx, const OptTensor& cache_leftpad,
                    const OptTensor& block_table, bool rotary_interleaved) {
  FLASH_EXT_CHECK(k.is_cuda() && (k.scalar_type() == at::kHalf || k.scalar_type() == at::kBFloat16),
                  "flash_ext: k must be a float16 or bfloat16 CUDA tensor, got ", k.scalar_type(), " on ", k.device());
  FLASH_EXT_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() &&
                      v.device() == k.device(),
                  "flash_ext: k and v must be (batch, seqlen_new, heads_kv, head_dim) tensors of one shape, dtype "
                  "and device, got ", k.sizes(), " and ", v.sizes());
  check_rows_aligned(k, "k");
  check_rows_aligned(v, "v");
  const int64_t batch = k.size(0);
  const CacheLayout c = check_caches(k, k_cache, v_cache, batch, cache_seqlens, cache_batch_idx, cache_leftpad, block_table);
  FLASH_EXT_CHECK(k_cache.size(2) == k.size(2) && k_cache.size(3) == k.size(3), "flash_ext: k ", k.sizes(),
                  " does not match the cache ", k_cache.sizes());
  FLASH_EXT_CHECK(k.size(3) % 8 == 0 && k.size(3) <= 256, "flash_ext: the head dim must be a multiple of 8 and at "
                  "most 256, got ", k.size(3));
  FLASH_EXT_CHECK(cache_seqlens.has_value() || cache_seqlen >= 0,
                  "flash_ext: kvcache_append needs cache_seqlens or cache_seqlen >= 0");
  FLASH_EXT_CHECK(cache_seqlens.has_value() || cache_seqlen + k.size(1) <= c.capacity, "flash_ext: cache_seqlen (",
                  cache_seqlen, ") + ", k.size(1), " new tokens exceed the cache capacity ", c.capacity);
  const int rd = check_rotary(rotary_cos, rotary_sin, k, k.size(3));
  FLASH_EXT_CHECK(rd == 0 || rotary_cos->size(0) >= c.capacity, "flash_ext: the rotary tables have ",
                  rotary_cos->size(0), " rows, fewer than the cache capacity ", c.capacity);
  if (k.numel() == 0) return;

  AppendParams p;
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.kc_batch_stride = k_cache.stride(0);
  p.kc_row_stride = k_cache.stride(1);
  p.kc_head_stride = k_cache.stride(2);
  p.vc_batch_stride = v_cache.stride(0);
  p.vc_row_stride = v_cache.stride(1);
  p.vc_head_stride = v_cache.stride(2);
  p.k_batch_stride = k.stride(0);
  p.k_row_stride = k.stride(1);
  p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0);
  p.v_row_stride = v.stride(1);
  p.v_head_stride = v.stride(2);
  p.batch = int(batch);
  p.seqlen_new = int(k.size(1));
  p.heads_kv = int(k.size(2));
  p.head_dim = int(k.size(3));
  p.capacity = int(c.capacity);
  p.cache_seqlens = cache_seqlens.has_value() ? cache_seqlens->data_ptr<int>() : nullptr;
  p.cache_seqlen = int(cache_seqlen);
  p.cache_batch_idx = cache_batch_idx.has_value() ? cache_batch_idx->data_ptr<int>() : nullptr;
  if (block_table.has_value()) {
    p.block_table = block_table->data_ptr<int>();
    p.block_table_batch_stride = block_table->stride(0);
    p.page_size = int(c.page_size);
    p.num_pages = int(c.num_pages);
  }
  if (rd > 0) {
    p.rotary_cos = rotary_cos->data_ptr();
    p.rotary_sin = rotary_sin->data_ptr();
    p.rotary_row_stride = rotary_cos->stride(0);
    p.rotary_dim = rd;
    p.rotary_interleaved = rotary_interleaved;
  }
  const c10::cuda::CUDAGuard guard(k.device());
  run_kvcache_append(p, k.scalar_type() == at::kBFloat16, c10::cuda::getCurrentCUDAStream(k.get_device()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> fwd_kvcache(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const OptTensor& rotary_cos,
    const OptTensor& rotary_sin, const OptTensor& cache_seqlens, int64_t cache_seqlen, int64_t seqlen_new,
    const OptTensor& cache_batch_idx, const OptTensor& cache_leftpad, const OptTensor& block_table,
    const OptTensor& alibi_slopes, double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, bool rotary_interleaved, int64_t num_splits) {
  FLASH_EXT_CHECK(q.is_cuda() && (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16),
                  "flash_ext: q must be a float16 or bfloat16 CUDA tensor, got ", q.scalar_type(), " on ", q.device());
  FLASH_EXT_CHECK(q.dim() == 4, "flash_ext: q must be (batch, seqlen_q, heads_q, head_dim), got ", q.sizes());
  check_rows_aligned(q, "q");
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads_q = q.size(2), head_dim = q.size(3);
  const CacheLayout c = check_caches(q, k_cache, v_cache, batch, cache_seqlens, cache_batch_idx, cache_leftpad, block_table);
  const int64_t heads_kv = k_cache.size(2);
  FLASH_EXT_CHECK(k_cache.size(3) == head_dim, "flash_ext: the caches' head dim ", k_cache.size(3),
                  " differs from q's ", head_dim);
  FLASH_EXT_CHECK(heads_kv > 0 && heads_q % heads_kv == 0, "flash_ext: heads_q (", heads_q,
                  ") must be a multiple of the caches' heads (", heads_kv, ")");
  FLASH_EXT_CHECK(head_dim % 8 == 0 && head_dim <= 256 && head_dim > 0,
                  "flash_ext: the head dim must be a multiple of 8 and at most 256, got ", head_dim);
  FLASH_EXT_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, "flash_ext: softmax_scale must be finite and > 0");
  FLASH_EXT_CHECK(std::isfinite(softcap) && softcap >= 0, "flash_ext: softcap must be finite and >= 0 (0 = off)");
  FLASH_EXT_CHECK(window_left >= -1 && window_right >= -1, "flash_ext: window sizes must be >= -1");
  FLASH_EXT_CHECK(num_splits >= 0, "flash_ext: num_splits must be >= 0, got ", num_splits);
  FLASH_EXT_CHECK(seqlen_new >= 0, "flash_ext: seqlen_new must be >= 0");
  FLASH_EXT_CHECK(cache_seqlens.has_value() || cache_seqlen >= 0 || seqlen_new == 0,
                  "flash_ext: a full cache (no cache_seqlens, cache_seqlen -1) takes no new tokens");
  FLASH_EXT_CHECK(cache_seqlens.has_value() || cache_seqlen + seqlen_new <= c.capacity, "flash_ext: cache_seqlen (",
                  cache_seqlen, ") + seqlen_new (", seqlen_new, ") exceed the cache capacity ", c.capacity);
  const int rd = check_rotary(rotary_cos, rotary_sin, q, head_dim);
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    FLASH_EXT_CHECK(a.scalar_type() == at::kFloat && a.device() == q.device() && a.stride(-1) == 1 &&
                        ((a.dim() == 1 && a.size(0) == heads_q) ||
                         (a.dim() == 2 && a.size(0) == batch && a.size(1) == heads_q)),
                    "flash_ext: alibi_slopes must be float32 (heads_q,) or (batch, heads_q) on ", q.device(), ", got ",
                    a.sizes());
  }
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  const int kd = kernel_head_dim<Family::kDecode>(int(head_dim));
  FLASH_EXT_CHECK(kd != 0 && dtype_built(is_bf16), "flash_ext: this build has no decode kernel for head dim ",
                  head_dim, is_bf16 ? " bf16" : " fp16", "; rebuild with FLASH_EXT_HEADDIMS / FLASH_EXT_DTYPES covering it");

  at::Tensor out = at::empty({batch, seqlen_q, heads_q, head_dim}, q.options());
  at::Tensor lse = at::empty({batch, heads_q, seqlen_q}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};

  DecodeParams p;
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_batch_stride = q.stride(0);
  p.q_row_stride = q.stride(1);
  p.q_head_stride = q.stride(2);
  p.k_batch_stride = k_cache.stride(0);
  p.k_row_stride = k_cache.stride(1);
  p.k_head_stride = k_cache.stride(2);
  p.v_batch_stride = v_cache.stride(0);
  p.v_row_stride = v_cache.stride(1);
  p.v_head_stride = v_cache.stride(2);
  p.o_batch_stride = out.stride(0);
  p.o_row_stride = out.stride(1);
  p.o_head_stride = out.stride(2);
  p.batch = int(batch);
  p.seqlen_q = int(seqlen_q);
  p.heads_q = int(heads_q);
  p.heads_kv = int(heads_kv);
  p.head_dim = int(head_dim);
  p.group = int(heads_q / heads_kv);
  p.packed_rows = int(seqlen_q * p.group);
  p.capacity = int(c.capacity);
  p.cache_seqlens = cache_seqlens.has_value() ? cache_seqlens->data_ptr<int>() : nullptr;
  p.cache_seqlen = int(cache_seqlens.has_value() ? 0 : (cache_seqlen >= 0 ? cache_seqlen : c.capacity));
  p.seqlen_new = int(seqlen_new);
  p.cache_leftpad = cache_leftpad.has_value() ? cache_leftpad->data_ptr<int>() : nullptr;
  p.cache_batch_idx = cache_batch_idx.has_value() ? cache_batch_idx->data_ptr<int>() : nullptr;
  if (block_table.has_value()) {
    p.block_table = block_table->data_ptr<int>();
    p.block_table_batch_stride = block_table->stride(0);
    p.page_size = int(c.page_size);
    p.num_pages = int(c.num_pages);
  }
  if (rd > 0) {
    p.rotary_cos = rotary_cos->data_ptr();
    p.rotary_sin = rotary_sin->data_ptr();
    p.rotary_row_stride = rotary_cos->stride(0);
    p.rotary_dim = rd;
    p.rotary_interleaved = rotary_interleaved;
    p.rotary_per_token = causal || window_left >= 0 || window_right >= 0;
  }
  if (alibi_slopes.has_value()) {
    p.alibi_slopes = alibi_slopes->data_ptr<float>();
    p.alibi_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
  p.softmax_scale = float(softmax_scale);
  p.softcap = float(softcap);
  p.softmax_scale_log2 = softcap > 0 ? float(M_LOG2E) : float(softmax_scale * M_LOG2E);
  p.window_left = int(window_left);
  p.window_right = causal ? 0 : int(window_right);

  const c10::cuda::CUDAGuard guard(q.device());
  const DeviceInfo& dev = device_info(q.get_device());
  const int64_t m_blocks = (p.packed_rows + kDecodeBlockM - 1) / kDecodeBlockM;
  const int64_t ctas_per_sm = std::max<int64_t>(
      1, std::min<int64_t>(8, (dev.smem_optin_bytes + 1024) / (decode_smem_bytes(kd, kDecodeStagesShallow) + 1024)));
  const DecodeConfig config = choose_decode_config(
      int(num_splits), batch * heads_kv * m_blocks, dev.sms, int64_t(dev.sms) * ctas_per_sm,
      decode_deepest_ring(kd, int(dev.smem_optin_bytes)),
      block_table.has_value(), (c.capacity + decode_block_n(kd) - 1) / decode_block_n(kd), tuning_overrides().decode_ring,
      dev.dram_bytes_per_s);
  p.num_splits = config.splits;
  p.ring_stages = config.ring_stages;
  p.pdl = dev.major >= 9 && tuning_overrides().decode_pdl != 0;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  at::Tensor partials, arrivals;  // alive until the launch is queued
  if (p.num_splits > 1) {
    const int64_t rows = batch * heads_q * seqlen_q;
    partials = at::empty({int64_t(p.num_splits) * rows * (kd + 1)}, q.options().dtype(at::kFloat));
    p.o_partial = partials.data_ptr<float>();
    p.lse_partial = p.o_partial + int64_t(p.num_splits) * rows * kd;
    p.split_arrivals = zeroed_counters(batch * heads_kv * m_blocks, q.options(), q.get_device(), stream, arrivals);
  }
  visit_dtype(is_bf16, [&](auto bf16) {
    visit_kernel_head_dim<Family::kDecode>(kd, [&](auto d) { run_decode<decltype(d)::value, decltype(bf16)::value>(p, stream); });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

}  // namespace
}  // namespace flash_ext

TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  m.def(
      "kvcache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor? rotary_cos, "
      "Tensor? rotary_sin, Tensor? cache_seqlens, int cache_seqlen, Tensor? cache_batch_idx, "
      "Tensor? cache_leftpad, Tensor? block_table, bool rotary_interleaved) -> ()");
  m.def(
      "fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? rotary_cos, Tensor? rotary_sin, "
      "Tensor? cache_seqlens, int cache_seqlen, int seqlen_new, Tensor? cache_batch_idx, "
      "Tensor? cache_leftpad, Tensor? block_table, Tensor? alibi_slopes, float softmax_scale, bool causal, "
      "int window_left, int window_right, float softcap, bool rotary_interleaved, int num_splits) "
      "-> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) {
  m.impl("kvcache_append", &flash_ext::kvcache_append);
  m.impl("fwd_kvcache", &flash_ext::fwd_kvcache);
}
