// The KV-cache append (flash_ext::kvcache_append): each new token's k (rotated when rotary is on)
// and v, written into its slot of the cache. One thread per 16-byte chunk of a (token, KV head)
// row; a few microseconds of memory traffic, kept apart from the attention kernel so that it
// stays a pure reader (docs/design-flash-decoding.md 1.5).
#include <cutlass/numeric_types.h>

#include "common/rotary.h"
#include "dispatch/decode_dispatch.h"

namespace flash_ext {
namespace {

template <typename Element>
__global__ void __launch_bounds__(256) kvcache_append_kernel(const __grid_constant__ AppendParams p) {
  const int chunks = p.head_dim / 8;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(p.batch) * p.seqlen_new * p.heads_kv * chunks) return;
  const int col = int(i % chunks) * 8;
  i /= chunks;
  const int head = int(i % p.heads_kv);
  i /= p.heads_kv;
  const int t = int(i % p.seqlen_new);
  const int b = int(i / p.seqlen_new);
  const int cached = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.cache_seqlen;
  const int slot = cached + t;
  if (slot < 0 || slot >= p.capacity) return;  // never outside the cache (the host checks first)

  int64_t k_row, v_row;  // element offsets of the slot's row in each cache
  if (p.block_table != nullptr) {
    const int page = p.block_table[b * p.block_table_batch_stride + slot / p.page_size];
    if (page < 0 || page >= p.num_pages) return;
    k_row = page * p.kc_batch_stride + int64_t(slot % p.page_size) * p.kc_row_stride;
    v_row = page * p.vc_batch_stride + int64_t(slot % p.page_size) * p.vc_row_stride;
  } else {
    const int64_t row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    k_row = row * p.kc_batch_stride + int64_t(slot) * p.kc_row_stride;
    v_row = row * p.vc_batch_stride + int64_t(slot) * p.vc_row_stride;
  }
  Element* k_dst = static_cast<Element*>(p.k_cache) + k_row + head * p.kc_head_stride + col;
  Element* v_dst = static_cast<Element*>(p.v_cache) + v_row + head * p.vc_head_stride + col;
  const Element* k_src = static_cast<const Element*>(p.k) + b * p.k_batch_stride + int64_t(t) * p.k_row_stride +
                         head * p.k_head_stride;
  const Element* v_src = static_cast<const Element*>(p.v) + b * p.v_batch_stride + int64_t(t) * p.v_row_stride +
                         head * p.v_head_stride;
  uint4 k_val;
  if (p.rotary_dim > 0) {
    const int64_t ro = int64_t(slot) * p.rotary_row_stride;
    k_val = rotary_chunk(k_src, col, p.rotary_dim, p.rotary_interleaved,
                         static_cast<const Element*>(p.rotary_cos) + ro, static_cast<const Element*>(p.rotary_sin) + ro);
  } else {
    k_val = *reinterpret_cast<const uint4*>(k_src + col);
  }
  *reinterpret_cast<uint4*>(k_dst) = k_val;
  *reinterpret_cast<uint4*>(v_dst) = *reinterpret_cast<const uint4*>(v_src + col);
}

}  // namespace

void run_kvcache_append(const AppendParams& p, bool is_bf16, cudaStream_t stream) {
  const int64_t threads = int64_t(p.batch) * p.seqlen_new * p.heads_kv * (p.head_dim / 8);
  if (threads == 0) return;
  const unsigned blocks = unsigned((threads + 255) / 256);
  if (is_bf16) {
    kvcache_append_kernel<cutlass::bfloat16_t><<<blocks, 256, 0, stream>>>(p);
  } else {
    kvcache_append_kernel<cutlass::half_t><<<blocks, 256, 0, stream>>>(p);
  }
}

}  // namespace flash_ext
