// The problem of one decode call (flash_ext::fwd_kvcache): a few query tokens per sequence
// against a KV cache, for the split-KV decode kernel (decode/decode_kernel.cuh). Plain data, no
// CUTLASS or torch types: the host fills it (ops_kvcache.cpp), the kernels read it.
#pragma once
#include <cstdint>

namespace flash_ext {

struct DecodeParams {
  // q (batch, seqlen_q, heads_q, head_dim); k/v cache (batch, capacity, heads_kv, head_dim);
  // out like q; lse (batch, heads_q, seqlen_q) fp32, contiguous. Strides in elements.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  int batch = 0, seqlen_q = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  int group = 1;        // heads_q / heads_kv: the query heads that share a KV head
  int packed_rows = 0;  // group * seqlen_q: the rows of one KV head's tile (row p = token p / group,
                        // query head head_kv * group + p % group)
  int capacity = 0;     // cache rows per sequence

  // Keys of sequence b: slots [leftpad_b, L_b), L_b = L0_b + seqlen_new, L0_b = cache_seqlens[b]
  // (or cache_seqlen for every sequence when that is null: the host resolves "full" to the
  // capacity), leftpad_b = cache_leftpad[b] or 0. Query token t sits at slot t + L_b - seqlen_q
  // (FlashAttention's bottom-right alignment); positions are absolute slots.
  const int* cache_seqlens = nullptr;
  int cache_seqlen = 0;
  int seqlen_new = 0;
  const int* cache_leftpad = nullptr;
  // Cache row of sequence b: cache_batch_idx[b] (or b). Paged (block_table != null): slot n of
  // sequence b is row n % page_size of page block_table[b * block_table_batch_stride + n /
  // page_size], pages k_batch_stride / v_batch_stride apart; a page outside [0, num_pages) is
  // never read (its rows load as zeros).
  const int* cache_batch_idx = nullptr;
  const int* block_table = nullptr;
  int64_t block_table_batch_stride = 0;
  int page_size = 0;
  int num_pages = 0;

  // Rotary embedding of q (the new k is rotated by the append kernel): the first rotary_dim
  // columns, at position L0_b + t (rotary_per_token: causal or local) or L0_b, with the cos / sin
  // tables (seqlen_ro, rotary_dim / 2) of q's dtype; interleaved pairs (2i, 2i+1), else (i, i +
  // rotary_dim / 2).
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t rotary_row_stride = 0;
  int rotary_dim = 0;
  bool rotary_interleaved = true;
  bool rotary_per_token = false;

  // ALiBi: score -= slope * |key position - query position|, slope = alibi_slopes[b *
  // alibi_batch_stride + head] (fp32; batch stride 0 for (heads_q,) slopes).
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;

  float softmax_scale = 0.f;
  float softmax_scale_log2 = 0.f;  // softmax_scale * log2(e), or log2(e) with softcap
  float softcap = 0.f;             // > 0: s <- softcap * tanh(s * softmax_scale / softcap)
  // Visible keys of token t at position i: [i - window_left, i + window_right], -1 = unbounded
  // on that side (causal: window_right = 0).
  int window_left = -1, window_right = -1;

  // Split-KV: num_splits CTAs share each (sequence, KV head, row block) tile; with more than
  // one, each writes its normalized fp32 output and lse to the partials and counts itself in the
  // tile's arrival counter, and the last to arrive merges them (decode/split_merge.h).
  // o_partial (num_splits, batch, heads_q, seqlen_q, kernel head dim), lse_partial (num_splits,
  // batch, heads_q, seqlen_q); split_arrivals (batch, heads_kv, row blocks), 0 before the launch
  // and left at 0 by it.
  int num_splits = 1;
  float* o_partial = nullptr;
  float* lse_partial = nullptr;
  int* split_arrivals = nullptr;

  // Depth of the kernel's shared-memory ring of key blocks, one of kDecodeRingDepths: the shallow
  // ring (several CTAs per SM, for grids that fill the GPU) or a deep one (one CTA per SM with
  // more blocks in flight, for small grids), chosen by tuning/heuristics.cpp.
  int ring_stages = 2;
  // Launch with programmatic dependent launch (common/pdl.h; sm90+) where the kernel's code has
  // its wait (sm90+ PTX; decode_launch.cuh checks): the grid is scheduled as the kernel before it
  // drains, and waits for it before its first read.
  bool pdl = false;
};

// Rows of one decode tile (packed (token, query head) pairs) and the depths of the shared-memory
// ring; keys per block by kernel head dim kd: 64 (4 warps of 16 keys), 32 at kd = 256 (2 warps),
// so that the shallow ring fits the 99 KB of sm86 / sm89. The ring depths compiled: 2 (3 CTAs per
// SM at kd <= 128 on an H100), 3 (two CTAs per SM on an H100) and 4 (one CTA per SM; fits an
// A100's 163 KB). A ring of 6 lost to 4 in every cell of the H100 sweep (docs/perf-notes.md:
// the deeper decode ring).
constexpr int kDecodeBlockM = 16;
constexpr int kDecodeStagesShallow = 2;
constexpr int kDecodeStagesDeep = 4;
constexpr int kDecodeStagesMid = 3;
constexpr int kDecodeRingDepths[] = {kDecodeStagesShallow, kDecodeStagesMid, kDecodeStagesDeep};
constexpr int kDecodeMaxSplits = 128;
constexpr int decode_block_n(int kd) { return kd > 128 ? 32 : 64; }

// Paged caches: a key block is block_n / 16 chunks of 16 keys, each on one page (pages are
// multiples of 16 keys, and blocks start at multiples of block_n). Each chunk's page number and
// first row on its page are staged in shared memory stages - 1 blocks ahead of the block's own
// loads (decode/kv_block_loader.h), in 2 * stages - 2 slots: the ring's prologue stages the chunks
// of blocks 0 .. 2 * stages - 3 before any is read.
constexpr int decode_pages_per_block(int kd) { return decode_block_n(kd) / 16; }
constexpr int decode_page_slots(int stages) { return 2 * stages - 2; }

// Shared memory of the decode kernel of kernel head dim kd (2-byte elements) with a ring of
// `stages` blocks: Q (16 x kd), the ring of K and V blocks and the page slots (two ints a chunk); checked
// against the kernel's traits where it is compiled.
constexpr int decode_smem_bytes(int kd, int stages) {
  return (kDecodeBlockM + stages * 2 * decode_block_n(kd)) * kd * 2 +
         decode_page_slots(stages) * decode_pages_per_block(kd) * 8;
}

// The deepest compiled ring whose CTA fits `smem_optin_bytes` of shared memory (the shallow ring
// if none does: the launch then reports the error).
constexpr int decode_deepest_ring(int kd, int smem_optin_bytes) {
  int best = kDecodeStagesShallow;
  for (int stages : kDecodeRingDepths) {
    if (decode_smem_bytes(kd, stages) <= smem_optin_bytes && stages > best) best = stages;
  }
  return best;
}

}  // namespace flash_ext

namespace flash_ext {

// The append of new tokens to a KV cache (flash_ext::kvcache_append): token t of sequence b goes
// to slot L0_b + t (L0_b as in DecodeParams), k rotated first when rotary_dim > 0 (always at its
// own position L0_b + t). Cache addressing (batch index, pages) as in DecodeParams.
struct AppendParams {
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t kc_batch_stride = 0, kc_row_stride = 0, kc_head_stride = 0;  // batch = page stride when paged
  int64_t vc_batch_stride = 0, vc_row_stride = 0, vc_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int batch = 0, seqlen_new = 0, heads_kv = 0, head_dim = 0;
  int capacity = 0;
  const int* cache_seqlens = nullptr;
  int cache_seqlen = 0;
  const int* cache_batch_idx = nullptr;
  const int* block_table = nullptr;
  int64_t block_table_batch_stride = 0;
  int page_size = 0;
  int num_pages = 0;
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t rotary_row_stride = 0;
  int rotary_dim = 0;
  bool rotary_interleaved = true;
};

}  // namespace flash_ext
