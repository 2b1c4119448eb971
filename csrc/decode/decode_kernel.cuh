// Flash-Decoding (the seeds; docs/design-flash-decoding.md): a few query tokens per sequence
// against a long KV cache, on the sm80 path (mma.sync, ldmatrix, cp.async), for every sm80+ GPU.
//
// Grid (row blocks x splits, KV heads, batch). A CTA owns one KV head of one sequence: its 16
// rows are the packed (query token, query head of that KV head) pairs, so K and V are read once
// per KV head, not once per query head (GQA packing by index: any seqlen_q, causal and local
// windows keep working). The keys of the sequence are cut into num_splits equal runs of key
// blocks, one per CTA, so that a batch with few KV heads still fills the GPU; each split writes
// its normalized output and lse (fp32), and the split that finishes last merges them by
// log-sum-exp (decode/split_merge.h). With one split the CTA writes the output itself.
//
// A CTA has 4 warps (2 at d = 256, whose blocks are 32 keys); each warp takes 16 keys of every
// block with its own online softmax, and the warps merge once through shared memory at the end.
// Blocks stream through a ring of kStages (K, V) slots with cp.async, kStages - 1 blocks in flight
// while one is computed; Q's fragments stay in registers up to d = 128. The shallow ring (2) takes
// 68 KB at d = 128: 3 CTAs per SM on an H100, for grids that fill the GPU; the deep ones (4: 132
// KB, 6: 196 KB) run one CTA per SM with 3 or 5 blocks in flight, for small grids (few sequences
// and KV heads). A paged cache's page numbers are staged a full ring ahead (decode/kv_block_loader.h).
#pragma once
#include <cute/tensor.hpp>

#include "common/combine.h"
#include "common/copy.h"
#include "common/fragment.h"
#include "common/pdl.h"
#include "common/rotary.h"
#include "common/softmax.h"
#include "decode/decode_params.h"
#include "decode/decode_traits.h"
#include "decode/kv_block_loader.h"
#include "decode/split_merge.h"
#include "sm80/gemm.h"

namespace flash_ext::decode {

using namespace cute;

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

// As many CTAs per SM as shared memory allows (shallow ring: 3 at d <= 128 on an H100):
// registers must not be the tighter limit.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocksPerSm)
    decode_kernel(const __grid_constant__ DecodeParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kWarps = Traits::kWarps;
  constexpr int kStages = Traits::kStages;
  constexpr int kChunks = kHeadDim / 8;  // 16-byte vectors per row
  // Q's fragments stay in registers up to d = 128; at d = 256 (O alone takes 128 registers) each
  // block reads them from shared memory again, one k-slice ahead.
  constexpr bool kQInRegisters = kHeadDim <= 128;

  extern __shared__ __align__(128) char smem_raw[];
  pdl_wait();  // launched with PDL (p.pdl): the cache, its lengths and Q may come from the kernel before

  const int m_blocks = (p.packed_rows + kBlockM - 1) / kBlockM;
  const int m_block = blockIdx.x % m_blocks;
  const int split = blockIdx.x / m_blocks;
  const int head_kv = blockIdx.y;
  const int batch = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;

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
  const int n_count = max(0, n_end - n_begin);
  auto needs_mask = [&](int n_block) {
    return n_block * kBlockN < last.lo || (n_block + 1) * kBlockN > first.hi;
  };

  const Element* q_base = static_cast<const Element*>(p.q) + batch * p.q_batch_stride;
  const Element* k_base = static_cast<const Element*>(p.k) + head_kv * p.k_head_stride;
  const Element* v_base = static_cast<const Element*>(p.v) + head_kv * p.v_head_stride;
  auto row_token = [&](int r) { return (row0 + r) / p.group; };
  auto row_head = [&](int r) { return head_kv * p.group + (row0 + r) % p.group; };

  // Shared memory: Q | stage 0 (K, V) | stage 1 (K, V) | ...
  Element* smem = reinterpret_cast<Element*>(smem_raw);
  Element* ring = smem + Traits::kSmemQElems;
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  auto sK = [&](int slot) {
    return make_tensor(make_smem_ptr(ring + slot * 2 * Traits::kSmemKVElems), typename Traits::SmemLayoutKV{});
  };
  auto sV = [&](int slot) {
    return make_tensor(make_smem_ptr(ring + (slot * 2 + 1) * Traits::kSmemKVElems), typename Traits::SmemLayoutKV{});
  };
  auto sVt = [&](int slot) {
    return make_tensor(make_smem_ptr(ring + (slot * 2 + 1) * Traits::kSmemKVElems), typename Traits::SmemLayoutVt{});
  };

  // K and V of key block n into ring slot n % kStages (decode/kv_block_loader.h); a paged cache's
  // page chunks of block n are staged in page slot n % kPageSlots (n relative to the split's
  // first block) with the copies of block n - (kStages - 1).
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  const KvBlockLoader<Traits> loader(p, tid, L, batch, __ffs(p.page_size) - 1,
                                     reinterpret_cast<int*>(smem_raw + Traits::kSmemPagesOffsetBytes));
  auto load_stage = [&](int j) {  // block j of the split
    const int slot = j % kStages, page_slot = j % Traits::kPageSlots;
    loader.load_block(gmem_thr.partition_D(sK(slot)), gmem_thr.partition_D(sV(slot)), k_base, v_base, n_begin + j,
                      page_slot);
    const int ahead = j + kStages - 1;  // its pages go with this block's group
    if (ahead < n_count) loader.stage_pages(ahead % Traits::kPageSlots, n_begin + ahead, tid);
  };

  // Each warp: S_w = Q K_w^T over its 16 keys of the block, its own online softmax, O_w += P_w V_w.
  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(lane);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor sK_w0 = local_tile(sK(0), Shape<Int<16>, Int<kHeadDim>>{}, make_coord(warp, 0));
  Tensor sVt_w0 = local_tile(sVt(0), Shape<Int<kHeadDim>, Int<16>>{}, make_coord(0, warp));
  Tensor tSrK = thr_mma.partition_fragment_B(sK_w0);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt_w0);
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<16>>{}));
  Tensor cS_rows = make_tensor(cS.data(), acc_as_rows_cols(cS.layout()));
  auto s2r_q = make_tiled_copy_A(typename Traits::S2RCopyQK{}, mma);
  auto s2r_k = make_tiled_copy_B(typename Traits::S2RCopyQK{}, mma);
  auto s2r_v = make_tiled_copy_B(typename Traits::S2RCopyVt{}, mma);

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

  auto step = [&](int slot, int n_block, auto is_first) {
    constexpr bool kFirst = decltype(is_first)::value;
    Tensor sK_w = local_tile(sK(slot), Shape<Int<16>, Int<kHeadDim>>{}, make_coord(warp, 0));
    Tensor sVt_w = local_tile(sVt(slot), Shape<Int<kHeadDim>, Int<16>>{}, make_coord(0, warp));
    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<16>>{});
    clear(acc_s);
    if constexpr (kQInRegisters) {
      sm80::gemm_rs(mma, acc_s, tSrQ, tSrK, s2r_k.get_thread_slice(lane).partition_S(sK_w), s2r_k, lane);
    } else {
      sm80::gemm_ss(mma, acc_s, tSrQ, tSrK, s2r_q.get_thread_slice(lane).partition_S(sQ),
                    s2r_k.get_thread_slice(lane).partition_S(sK_w), s2r_q, s2r_k, lane);
    }
    if (use_softcap) apply_softcap(acc_s, p.softmax_scale / p.softcap, p.softcap);
    Tensor scores = make_tensor(acc_s.data(), acc_as_rows_cols(acc_s.layout()));
    const int key0 = n_block * kBlockN + warp * 16;
    if (use_alibi) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) {
          scores(r, c) -= row_slope[r] * float(abs(row_pos[r] - (key0 + get<1>(cS_rows(r, c)))));
        }
      }
    }
    if (needs_mask(n_block)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) {
          const int key = key0 + get<1>(cS_rows(r, c));
          if (key < row_keys[r].lo || key >= row_keys[r].hi) scores(r, c) = -INFINITY;
        }
      }
    }
    softmax.template update<kFirst>(scores, o_rows, scale_log2);
    Tensor rP = make_tensor_like<Element>(acc_s);
    convert_into(rP, acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_mma_a(rP.layout()));
    sm80::gemm_rs(mma, acc_o, tOrP, tOrVt, s2r_v.get_thread_slice(lane).partition_S(sVt_w), s2r_v, lane);
  };

  if (n_count > 0) {
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
    // Paged: the pages of the ring's first kStages - 1 blocks, in one round trip with Q's loads.
    if (loader.paged()) {
      if (tid < (kStages - 1) * Traits::kPagesPerBlock && tid / Traits::kPagesPerBlock < n_count) {
        loader.stage_page(tid / Traits::kPagesPerBlock, n_begin + tid / Traits::kPagesPerBlock,
                          tid % Traits::kPagesPerBlock);
      }
      cp_async_fence();
      cp_async_wait<0>();
      __syncthreads();
    }
    // The ring's first kStages - 1 blocks (a group each; Q goes with the first unless paged).
    CUTE_UNROLL
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_count) load_stage(s);
      cp_async_fence();
    }
    for (int j = 0; j < n_count; ++j) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // block j (and Q) landed for every thread; nobody reads block j - 1 any more
      if (kQInRegisters && j == 0) {  // Q stays in registers for the whole loop
        auto s2r_q_thr = s2r_q.get_thread_slice(lane);
        copy(s2r_q, s2r_q_thr.partition_S(sQ), s2r_q_thr.retile_D(tSrQ));
      }
      if (j + kStages - 1 < n_count) load_stage(j + kStages - 1);
      cp_async_fence();
      if (j == 0) {
        step(0, n_begin, cute::true_type{});
      } else {
        step(j % kStages, n_begin + j, cute::false_type{});
      }
    }
  }

  // Merge the warps' states through shared memory (the ring is free once every warp is done):
  // per warp its rows' max and sum and its unnormalized O in fp32.
  cp_async_wait<0>();
  __syncthreads();
  float* merge = reinterpret_cast<float*>(ring);
  float* m_s = merge;                      // [warp][row]
  float* l_s = m_s + kWarps * kBlockM;     // [warp][row]
  float* o_s = l_s + kWarps * kBlockM;     // [warp][row][col], rows kOStride floats apart
  // 8 floats of padding per row: a row is 8 banks past the one above, so the fragments' float2
  // stores (4 rows x 4 column pairs per half warp) and the merge's float4 reads (a row's 32
  // contiguous floats per quarter warp) meet no bank conflict (kHeadDim floats apart: 8 rows on
  // the same 4 banks, 8-way).
  constexpr int kOStride = kHeadDim + 8;
  Tensor cO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO_rows = make_tensor(cO.data(), acc_as_rows_cols(cO.layout()));
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(cO_rows(r, 0));
    const float sum = quad_sum(softmax.row_sum[r]);
    if (get<1>(cO_rows(r, 0)) == 0) {
      m_s[warp * kBlockM + row] = softmax.row_max[r];
      l_s[warp * kBlockM + row] = sum;
    }
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o_rows); c += 2) {  // columns c and c + 1 are neighbours
      *reinterpret_cast<float2*>(o_s + (warp * kBlockM + row) * kOStride + get<1>(cO_rows(r, c))) =
          make_float2(o_rows(r, c), o_rows(r, c + 1));
    }
  }
  __syncthreads();

  // Each thread: one row, kCols of its columns in chunks of 4, a chunk every kThreadsPerOutRow x 4
  // columns (the row's threads read contiguous floats together).
  constexpr int kThreadsPerOutRow = Traits::kNThreads / kBlockM;
  constexpr int kCols = kHeadDim / kThreadsPerOutRow;
  constexpr int kChunkStride = kThreadsPerOutRow * 4;
  static_assert(kCols % 4 == 0);
  const int row = tid / kThreadsPerOutRow;
  const int col0 = (tid % kThreadsPerOutRow) * 4;
  float m = -INFINITY;
  CUTE_UNROLL
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, m_s[w * kBlockM + row]);
  float weight[kWarps], l = 0.f;
  CUTE_UNROLL
  for (int w = 0; w < kWarps; ++w) {
    weight[w] = combine::part_weight(m_s[w * kBlockM + row], m, scale_log2);
    l += weight[w] * l_s[w * kBlockM + row];
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  const float lse = l > 0.f ? (m * scale_log2 + __log2f(l)) * float(M_LN2) : -INFINITY;
  const bool row_ok = row < rows;
  const int64_t lse_row = (int64_t(batch) * p.heads_q + row_head(row)) * p.seqlen_q + row_token(row);
  // 4 columns at a time: this split's normalized output in fp32 (merged below by the split that
  // finishes last: decode/split_merge.h) or, unsplit, the output itself.
  const bool split_out = p.num_splits > 1;
  const int64_t part_row = split * (int64_t(p.batch) * p.heads_q * p.seqlen_q) + lse_row;
  Element* dst = static_cast<Element*>(p.out) + batch * p.o_batch_stride + int64_t(row_token(row)) * p.o_row_stride +
                 int64_t(row_head(row)) * p.o_head_stride;
  if (row_ok) {
    CUTE_UNROLL
    for (int c = col0; c < kHeadDim; c += kChunkStride) {
      float o[4];
      CUTE_UNROLL
      for (int w = 0; w < kWarps; ++w) {
        const float4 v = *reinterpret_cast<const float4*>(o_s + (w * kBlockM + row) * kOStride + c);
        if (w == 0) {
          o[0] = weight[w] * v.x, o[1] = weight[w] * v.y, o[2] = weight[w] * v.z, o[3] = weight[w] * v.w;
        } else {
          o[0] += weight[w] * v.x, o[1] += weight[w] * v.y, o[2] += weight[w] * v.z, o[3] += weight[w] * v.w;
        }
      }
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) o[i] *= inv;
      if (split_out) {
        *reinterpret_cast<float4*>(p.o_partial + part_row * kHeadDim + c) = make_float4(o[0], o[1], o[2], o[3]);
      } else if (c < p.head_dim) {
        uint2 packed;
        Element* e = reinterpret_cast<Element*>(&packed);
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) e[i] = Element(o[i]);
        *reinterpret_cast<uint2*>(dst + c) = packed;
      }
    }
    if (col0 == 0) {
      if (split_out) {
        p.lse_partial[part_row] = lse;
      } else {
        p.lse[lse_row] = lse;
      }
    }
  }
  if (!split_out) return;
  const int tile = (batch * p.heads_kv + head_kv) * m_blocks + m_block;
  if (!arrived_last(p, tile)) return;
  auto merged_lse_row = [&](int r) {
    return (int64_t(batch) * p.heads_q + row_head(r)) * p.seqlen_q + row_token(r);
  };
  auto out_row = [&](int r) {
    return static_cast<Element*>(p.out) + batch * p.o_batch_stride + int64_t(row_token(r)) * p.o_row_stride +
           int64_t(row_head(r)) * p.o_head_stride;
  };
  // The warps' merge area of the ring is free again: the weights go there.
  merge_tile_splits<kHeadDim, Element>(p, rows, merged_lse_row, out_row, merge, Traits::kNThreads);
  if (tid == 0) p.split_arrivals[tile] = 0;  // every split of this tile has counted: ready for the next call
}

}  // namespace flash_ext::decode
