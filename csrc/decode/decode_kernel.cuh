// Flash-Decoding (the seeds; docs/design-flash-decoding.md): a few query tokens per sequence
// against a long KV cache, on the sm80 path (mma.sync, ldmatrix, cp.async), for every sm80+ GPU.
//
// Grid (row blocks x splits, KV heads, batch). A CTA is one warp and owns one KV head of one
// sequence: its 16 rows are the packed (query token, query head of that KV head) pairs, so K and
// V are read once per KV head, not once per query head (GQA packing by index: any seqlen_q,
// causal and local windows keep working). The keys of the sequence are cut into num_splits
// equal runs of 64-key blocks, one per CTA, so that a batch with few KV heads still fills the
// GPU; each split writes its normalized output and lse (fp32) and split_combine_kernel merges
// them by log-sum-exp. With one split the CTA writes the output itself.
//
// The loop is the sm80 forward's: K of the next block streams in while this block's softmax
// and P V run, V of this block while Q K^T runs. At ~36 KB of shared memory (d = 128) six CTAs
// share an SM, ~6 blocks of 16 KB in flight per SM, several times what HBM's latency needs.
#pragma once
#include <cute/tensor.hpp>

#include "common/combine.h"
#include "common/copy.h"
#include "common/fragment.h"
#include "common/rotary.h"
#include "common/softmax.h"
#include "decode/decode_params.h"
#include "sm80/gemm.h"
#include "sm80/kernel_traits.h"

namespace flash_ext::decode {

using namespace cute;

template <int kHeadDim, typename Element>
using DecodeTraits = sm80::FwdTraits<kHeadDim, kDecodeBlockM, kDecodeBlockN, 1, Element>;

// Tokens in the cache of sequence b before this call's append.
__device__ __forceinline__ int decode_cached_len(const DecodeParams& p, int b) {
  return p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.cache_seqlen;
}

// Keys of sequence b (never past the cache's capacity: slots there are never read).
__device__ __forceinline__ int decode_seqlen_k(const DecodeParams& p, int b) {
  return max(0, min(decode_cached_len(p, b) + p.seqlen_new, p.capacity));
}

// The key slots [lo, hi) that query token t sees in a sequence of L keys whose first `start`
// slots are padding (bottom-right aligned).
struct KeyRange {
  int lo, hi;
};
__device__ __forceinline__ KeyRange visible_keys(const DecodeParams& p, int L, int start, int t) {
  const int pos = t + L - p.seqlen_q;
  KeyRange r{start, L};
  if (p.window_right >= 0) r.hi = min(r.hi, pos + p.window_right + 1);
  if (p.window_left >= 0) r.lo = max(r.lo, pos - p.window_left);
  return r;
}

// Address of key slot `key` of sequence b in a cache (rows `row_stride` apart): a row of the
// sequence's own cache row, or of a page of the block table; null for a page outside the table
// (the load then zero-fills).
template <typename Element>
__device__ __forceinline__ const Element* key_row(const DecodeParams& p, const Element* base, int64_t batch_stride,
                                                  int64_t row_stride, int cache_row, int batch, int key) {
  if (p.block_table == nullptr) return base + cache_row * batch_stride + int64_t(key) * row_stride;
  const int page = p.block_table[batch * p.block_table_batch_stride + key / p.page_size];
  if (page < 0 || page >= p.num_pages) return nullptr;
  return base + page * batch_stride + int64_t(key % p.page_size) * row_stride;
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads) decode_kernel(const __grid_constant__ DecodeParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kChunks = kHeadDim / 8;  // 16-byte vectors per row

  extern __shared__ __align__(128) char smem_raw[];

  const int m_blocks = (p.packed_rows + kBlockM - 1) / kBlockM;
  const int m_block = blockIdx.x % m_blocks;
  const int split = blockIdx.x / m_blocks;
  const int head_kv = blockIdx.y;
  const int batch = blockIdx.z;
  const int tid = threadIdx.x;

  const int L = decode_seqlen_k(p, batch);
  const int start = p.cache_leftpad != nullptr ? p.cache_leftpad[batch] : 0;
  const int row0 = m_block * kBlockM;
  const int rows = min(kBlockM, p.packed_rows - row0);  // valid rows of this tile
  // The rows' tokens are non-decreasing and so are both ends of their key ranges: the tile
  // needs the keys [first.lo, last.hi), and every row sees all of [last.lo, first.hi).
  const KeyRange first = visible_keys(p, L, start, row0 / p.group);
  const KeyRange last = visible_keys(p, L, start, (row0 + rows - 1) / p.group);
  const int n_lo = first.lo / kBlockN;
  const int n_hi = last.hi > first.lo ? (last.hi + kBlockN - 1) / kBlockN : n_lo;
  const int per_split = (n_hi - n_lo + p.num_splits - 1) / p.num_splits;
  const int n_begin = n_lo + split * per_split;
  const int n_end = min(n_hi, n_begin + per_split);
  auto needs_mask = [&](int n_block) {
    return n_block * kBlockN < last.lo || (n_block + 1) * kBlockN > first.hi;
  };

  const Element* q_base = static_cast<const Element*>(p.q) + batch * p.q_batch_stride;
  const int cache_row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[batch] : batch;
  const Element* k_base = static_cast<const Element*>(p.k) + head_kv * p.k_head_stride;
  const Element* v_base = static_cast<const Element*>(p.v) + head_kv * p.v_head_stride;
  // Packed row -> (token, query head).
  auto row_token = [&](int r) { return (row0 + r) / p.group; };
  auto row_head = [&](int r) { return head_kv * p.group + (row0 + r) % p.group; };

  // Shared memory: Q | K | V; the output tile reuses Q's space.
  Element* smem = reinterpret_cast<Element*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem + Traits::kSmemQElems), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + int(Traits::kSmemKVElems), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});

  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tKVc = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Key block n of K or V into shared memory, row by row (each row's own slot address: paged or
  // not); slots past L and columns past head_dim are zero-filled.
  auto load_block = [&](auto& dst, const Element* base, int64_t batch_stride, int64_t row_stride, int n_block) {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(dst); ++m) {
      const int key = n_block * kBlockN + get<0>(tKVc(0, m, 0));
      const Element* row = key < L ? key_row(p, base, batch_stride, row_stride, cache_row, batch, key) : nullptr;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(dst); ++k) {
        const int col = get<1>(tKVc(0, m, k));
        const bool ok = row != nullptr && col < p.head_dim;
        cp_async_16_zfill(&dst(0, m, k), ok ? row + col : base, ok);
      }
    }
  };
  auto load_k = [&](int n_block) { load_block(tKsK, k_base, p.k_batch_stride, p.k_row_stride, n_block); };
  auto load_v = [&](int n_block) { load_block(tVsV, v_base, p.v_batch_stride, p.v_row_stride, n_block); };

  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt);
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rows = make_tensor(cS.data(), acc_as_rows_cols(cS.layout()));

  auto s2r_q = make_tiled_copy_A(typename Traits::S2RCopyQK{}, mma);
  auto s2r_k = make_tiled_copy_B(typename Traits::S2RCopyQK{}, mma);
  auto s2r_v = make_tiled_copy_B(typename Traits::S2RCopyVt{}, mma);
  Tensor tSsQ = s2r_q.get_thread_slice(tid).partition_S(sQ);
  Tensor tSsK = s2r_k.get_thread_slice(tid).partition_S(sK);
  Tensor tOsVt = s2r_v.get_thread_slice(tid).partition_S(sVt);

  Tensor o_rows = make_tensor(acc_o.data(), acc_as_rows_cols(acc_o.layout()));
  constexpr int kRows = decltype(size<0>(o_rows))::value;
  OnlineSoftmax<kRows> softmax;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    softmax.row_max[r] = -INFINITY;
    softmax.row_sum[r] = 0.f;
  }
  clear(acc_o);

  const bool use_softcap = p.softcap > 0.f;
  const float scale_log2 = p.softmax_scale_log2;

  // Each of this thread's rows' visible keys (for the blocks that need the elementwise mask),
  // and with ALiBi its slope (in score units) and query position.
  KeyRange row_keys[kRows];
  float row_slope[kRows];
  int row_pos[kRows];
  const bool use_alibi = p.alibi_slopes != nullptr;
  const float alibi_unit = use_softcap ? 1.f : 1.f / p.softmax_scale;  // scores are unscaled without softcap
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(cS_rows(r, 0));
    row_keys[r] = visible_keys(p, L, start, row_token(row));
    row_pos[r] = row_token(row) + L - p.seqlen_q;
    row_slope[r] = use_alibi && row < rows ? p.alibi_slopes[batch * p.alibi_batch_stride + row_head(row)] * alibi_unit : 0.f;
  }

  auto step = [&](int n_block, auto is_first) {
    constexpr bool kFirst = decltype(is_first)::value;
    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    cp_async_wait<0>();
    __syncthreads();  // K[n_block] (and Q) landed; the previous V is no longer read
    load_v(n_block);
    cp_async_fence();

    sm80::gemm_ss(mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, s2r_q, s2r_k, tid);
    if (use_softcap) apply_softcap(acc_s, p.softmax_scale / p.softcap, p.softcap);
    Tensor scores = make_tensor(acc_s.data(), acc_as_rows_cols(acc_s.layout()));
    if (use_alibi) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) {
          const int key = n_block * kBlockN + get<1>(cS_rows(r, c));
          scores(r, c) -= row_slope[r] * float(abs(row_pos[r] - key));
        }
      }
    }
    if (needs_mask(n_block)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) {
          const int key = n_block * kBlockN + get<1>(cS_rows(r, c));
          if (key < row_keys[r].lo || key >= row_keys[r].hi) scores(r, c) = -INFINITY;
        }
      }
    }

    cp_async_wait<0>();
    __syncthreads();  // V[n_block] landed; K is no longer read
    if (n_block > n_begin) {
      load_k(n_block - 1);
      cp_async_fence();
    }

    softmax.template update<kFirst>(scores, o_rows, scale_log2);
    Tensor rP = make_tensor_like<Element>(acc_s);
    convert_into(rP, acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_mma_a(rP.layout()));
    sm80::gemm_rs(mma, acc_o, tOrP, tOrVt, tOsVt, s2r_v, tid);
  };

  if (n_begin < n_end) {
    // Q: the tile's packed rows, gathered by (token, head); padded rows and columns are zeros.
    // With rotary, the rotated chunks go through registers (fp32 math, rounded as FA2 does).
    const int cached = decode_cached_len(p, batch);
    for (int i = tid; i < kBlockM * kChunks; i += Traits::kNThreads) {
      const int r = i / kChunks, col = (i % kChunks) * 8;
      const bool ok = r < rows && col < p.head_dim;
      const Element* q_row = q_base + int64_t(row_token(r)) * p.q_row_stride + int64_t(row_head(r)) * p.q_head_stride;
      if (ok && col < p.rotary_dim) {
        const int pos = cached + (p.rotary_per_token ? row_token(r) : 0);
        const Element* cos_row = static_cast<const Element*>(p.rotary_cos) + int64_t(pos) * p.rotary_row_stride;
        const Element* sin_row = static_cast<const Element*>(p.rotary_sin) + int64_t(pos) * p.rotary_row_stride;
        *reinterpret_cast<uint4*>(&sQ(r, col)) =
            rotary_chunk(q_row, col, p.rotary_dim, p.rotary_interleaved, cos_row, sin_row);
      } else {
        cp_async_16_zfill(&sQ(r, col), ok ? q_row + col : q_base, ok);
      }
    }
    load_k(n_end - 1);
    cp_async_fence();
    step(n_end - 1, cute::true_type{});
    for (int n_block = n_end - 2; n_block >= n_begin; --n_block) step(n_block, cute::false_type{});
  }
  // else: this split (or the whole tile) sees no key; it writes zeros and lse = -inf.

  float lse[kRows];
  softmax.finalize(o_rows, scale_log2, lse);
  Tensor cO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO_rows = make_tensor(cO.data(), acc_as_rows_cols(cO.layout()));
  // lse, and the partials' rows, are (batch, heads_q, seqlen_q) in that order.
  auto lse_row = [&](int r) { return (int64_t(batch) * p.heads_q + row_head(r)) * p.seqlen_q + row_token(r); };

  if (p.num_splits > 1) {
    // This split's normalized output and lse in fp32, merged by split_combine_kernel.
    const int64_t split_rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(cO_rows(r, 0));
      if (row >= rows) continue;
      const int64_t out_row = split * split_rows + lse_row(row);
      float* dst = p.o_partial + out_row * kHeadDim;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rows); ++c) dst[get<1>(cO_rows(r, c))] = o_rows(r, c);
      if (get<1>(cO_rows(r, 0)) == 0) p.lse_partial[out_row] = lse[r];
    }
    return;
  }

  // One split: O through shared memory, then 16-byte stores to each row's (token, head).
  Tensor rO = make_tensor_like<Element>(acc_o);
  convert_into(rO, acc_o);
  auto r2s = make_tiled_copy_C(typename Traits::R2SCopyO{}, mma);
  auto r2s_thr = r2s.get_thread_slice(tid);
  __syncthreads();  // every warp is done with sQ and sV
  copy(r2s, r2s_thr.retile_S(rO), r2s_thr.partition_D(sO));
  __syncthreads();
  Element* o_base = static_cast<Element*>(p.out) + batch * p.o_batch_stride;
  for (int i = tid; i < kBlockM * kChunks; i += Traits::kNThreads) {
    const int r = i / kChunks, col = (i % kChunks) * 8;
    if (r < rows && col < p.head_dim) {
      Element* dst = o_base + int64_t(row_token(r)) * p.o_row_stride + int64_t(row_head(r)) * p.o_head_stride + col;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&sO(r, col));
    }
  }
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(cO_rows(r, 0));
    if (row < rows && get<1>(cO_rows(r, 0)) == 0) p.lse[lse_row(row)] = lse[r];
  }
}

// Merges the splits of every (batch, query head, token) row: one warp per row. The lanes read the
// splits' lse values 32 at a time (max, then weights into shared memory), then every lane adds
// its columns of each split's part, in split order (deterministic); those loads do not depend on
// one another, so they overlap instead of paying one L2 round trip per split.
constexpr int kCombineWarps = 4;
constexpr int kMaxSplits = 128;  // tuning/heuristics.cpp's cap

template <int kHeadDim, typename Element>
__global__ void __launch_bounds__(32 * kCombineWarps) split_combine_kernel(const __grid_constant__ DecodeParams p) {
  constexpr int kCols = kHeadDim / 32;  // columns per lane
  __shared__ float weights[kCombineWarps][kMaxSplits];
  const int64_t split_rows = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kCombineWarps + warp;
  if (row >= split_rows) return;
  const int splits = min(p.num_splits, kMaxSplits);

  float lse_max = -INFINITY;
  for (int s = lane; s < splits; s += 32) lse_max = fmaxf(lse_max, p.lse_partial[s * split_rows + row]);
  CUTE_UNROLL
  for (int o = 16; o > 0; o /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffff, lse_max, o));
  float weight_sum = 0.f;
  for (int s = lane; s < splits; s += 32) {
    const float w = combine::lse_part_weight(p.lse_partial[s * split_rows + row], lse_max);
    weights[warp][s] = w;
    weight_sum += w;
  }
  CUTE_UNROLL
  for (int o = 16; o > 0; o /= 2) weight_sum += __shfl_xor_sync(0xffffffff, weight_sum, o);
  __syncwarp();

  float acc[kCols];
  CUTE_UNROLL
  for (int j = 0; j < kCols; ++j) acc[j] = 0.f;
  const float* part = p.o_partial + row * kHeadDim + lane;
  const int64_t split_stride = split_rows * kHeadDim;
#pragma unroll 4
  for (int s = 0; s < splits; ++s) {
    const float w = weights[warp][s];  // 0 for an empty split, whose part is 0
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) acc[j] += w * part[s * split_stride + 32 * j];
  }
  const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
  const int t = int(row % p.seqlen_q);
  const int head = int((row / p.seqlen_q) % p.heads_q);
  const int batch = int(row / (int64_t(p.seqlen_q) * p.heads_q));
  Element* dst = static_cast<Element*>(p.out) + batch * p.o_batch_stride + int64_t(t) * p.o_row_stride +
                 int64_t(head) * p.o_head_stride;
  CUTE_UNROLL
  for (int j = 0; j < kCols; ++j) {
    const int col = lane + 32 * j;
    if (col < p.head_dim) dst[col] = Element(acc[j] * inv);
  }
  if (lane == 0) p.lse[row] = combine::merged_lse(lse_max, weight_sum);
}

}  // namespace flash_ext::decode
