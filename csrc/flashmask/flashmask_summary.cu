// Kernel A of FlashMask: normalized bounds and key-block summaries (flashmask_summary.h; the
// normalization and layout are those of common/flashmask.h and docs/design-flashmask.md 2.1).
// A thread per column: it reads the column's c values, clamps them into [0, R], orders each
// interval, canonicalizes an empty one to (R, R) and writes (ls, le - ls, us, ue - us); columns
// past the sequence's end up to the next multiple of 128 are padding, (0, R, R, 0). Then each
// group of block_n columns reduces its (s, e) values to the two summary halves.
#include <cuda_runtime.h>

#include "flashmask/flashmask_summary.h"

namespace flash_ext {
namespace {

constexpr int kChunk = 128;  // columns per CTA, one per thread

// The eight reductions of a summary: skip half (max ls, min le, max us, min ue), full half
// (min ls, max le, min us, max ue).
struct Summary {
  int4 skip, full;
};

__device__ __forceinline__ Summary warp_summary(int ls, int le, int us, int ue) {
  constexpr unsigned kAll = 0xffffffffu;
  Summary s;
  s.skip = make_int4(__reduce_max_sync(kAll, ls), __reduce_min_sync(kAll, le), __reduce_max_sync(kAll, us),
                     __reduce_min_sync(kAll, ue));
  s.full = make_int4(__reduce_min_sync(kAll, ls), __reduce_max_sync(kAll, le), __reduce_min_sync(kAll, us),
                     __reduce_max_sync(kAll, ue));
  return s;
}

__device__ __forceinline__ void combine(Summary& a, const Summary& b) {
  a.skip = make_int4(max(a.skip.x, b.skip.x), min(a.skip.y, b.skip.y), max(a.skip.z, b.skip.z),
                     min(a.skip.w, b.skip.w));
  a.full = make_int4(min(a.full.x, b.full.x), max(a.full.y, b.full.y), min(a.full.z, b.full.z),
                     max(a.full.w, b.full.w));
}

// Rows of column j the mask keeps (fixed length): [r0, seqlen_q) with r0 the causal rule's first
// row (bottom-right aligned) or 0, less the normalized intervals [ls, le) and [us, ue) (empty ones
// are (R, R), past every row).
__device__ __forceinline__ unsigned visible_rows(const FlashMaskSummaryArgs& a, int j, int ls, int le, int us, int ue) {
  const int sq = a.seqlen_q;
  const int r0 = a.causal ? min(max(j - (a.seqlen_k - sq), 0), sq) : 0;
  auto overlap = [&](int lo, int hi) { return max(0, min(hi, sq) - max(lo, r0)); };
  const int both = overlap(max(ls, us), min(le, ue));
  return unsigned(sq - r0 - overlap(ls, le) - overlap(us, ue) + both);
}

__global__ void __launch_bounds__(kChunk) flashmask_summary_kernel(const __grid_constant__ FlashMaskSummaryArgs a) {
  const int chunk = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const bool varlen = a.cu_seqlens_k != nullptr;
  const int k_start = varlen ? a.cu_seqlens_k[batch] : 0;
  const int len = varlen ? a.cu_seqlens_k[batch + 1] - k_start : a.seqlen_k;
  if (chunk * kChunk >= len) return;  // the whole CTA: past this sequence's columns
  const int j = chunk * kChunk + int(threadIdx.x);
  const int R = a.layout.empty_row;

  int ls = 0, le = R, us = R, ue = R;  // padding column: LT covers every row
  if (j < len) {
    const int* src = a.bounds + (varlen ? int64_t(k_start) * a.col_stride : int64_t(batch) * a.batch_stride) +
                     int64_t(head) * a.head_stride + int64_t(j) * a.col_stride;
    auto value = [&](int i) { return min(max(src[i], 0), R); };
    if (a.causal) {
      ls = value(0);
      le = a.c == 2 ? value(1) : R;
      us = ue = R;
    } else if (a.c == 2) {
      ls = value(0);
      le = R;
      us = 0;
      ue = value(1);
    } else {
      ls = value(0);
      le = value(1);
      us = value(2);
      ue = value(3);
    }
    le = max(le, ls);
    ue = max(ue, us);
    if (ls == le) ls = le = R;
    if (us == ue) us = ue = R;
  }
  const FlashMaskView& v = a.layout;
  a.nb[int64_t(head) * v.nb_head_stride + fm_col0(v, a.cu_seqlens_k, batch) + j] = make_int4(ls, le - ls, us, ue - us);
  if (a.visible_pairs != nullptr) {  // fixed length only: one add per CTA
    const unsigned kept = j < len ? visible_rows(a, j, ls, le, us, ue) : 0u;
    const unsigned long long cta = __reduce_add_sync(0xffffffffu, kept);
    __shared__ unsigned long long warp_kept[kChunk / 32];
    if (threadIdx.x % 32 == 0) warp_kept[threadIdx.x / 32] = cta;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long sum = 0;
      for (int w = 0; w < kChunk / 32; ++w) sum += warp_kept[w];
      atomicAdd(a.visible_pairs, sum);
      if (a.bwd_longest_first != nullptr) {
        atomicAdd(a.visible_sq, double(sum) * double(sum));
        __threadfence();  // this CTA's adds before its arrival
        if (atomicAdd(a.ctas_done, 1u) == gridDim.x * gridDim.y * gridDim.z - 1) {
          __threadfence();
          const unsigned long long pairs = atomicAdd(a.visible_pairs, 0ull);  // every CTA's adds
          const double sq = atomicAdd(a.visible_sq, 0.0);
          *a.bwd_longest_first =
              (long long)pairs < a.lpt_below && a.lpt_imbalance * sq > double(pairs) * double(pairs) ? 1 : 0;
        }
      }
    }
  }

  // Summaries: per warp, then the warps of one key block (block_n / 32 of them) together.
  __shared__ Summary warp_sums[kChunk / 32];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const Summary s = warp_summary(ls, le, us, ue);
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();
  const int warps_per_block = v.block_n / 32, blocks_per_chunk = kChunk / v.block_n;
  const int t = int(threadIdx.x);
  if (t >= blocks_per_chunk) return;
  Summary out = warp_sums[t * warps_per_block];
  for (int w = 1; w < warps_per_block; ++w) combine(out, warp_sums[t * warps_per_block + w]);
  const int n = chunk * blocks_per_chunk + t;  // key block within the sequence
  // Varlen: only the sequence's own blocks (the slots after them belong to the next sequence).
  if (varlen && n * v.block_n >= len) return;
  const int64_t slot = 2 * (int64_t(head) * v.kbs_head_stride + fm_blk0(v, a.cu_seqlens_k, batch) + n);
  a.kbs[slot] = out.skip;
  a.kbs[slot + 1] = out.full;
}

}  // namespace

void launch_flashmask_summary(const FlashMaskSummaryArgs& args, cudaStream_t stream) {
  if (args.batch == 0 || args.heads == 0 || args.seqlen_k <= 0) return;
  const dim3 grid((args.seqlen_k + kChunk - 1) / kChunk, args.heads, args.batch);
  flashmask_summary_kernel<<<grid, kChunk, 0, stream>>>(args);
}

}  // namespace flash_ext
