// FlashMask's tile table for the Hopper forward (flashmask_fwd_tiles.h): a warp per query block
// finds its range and walk length from the key-block summaries' skip halves (32 blocks per ballot),
// then a CTA per (mask head, batch row) orders its query blocks (flashmask_fwd_order_kernel).
#include <climits>

#include "flashmask/flashmask_fwd_tiles.h"

namespace flash_ext {
namespace {

constexpr int kWarps = 4;  // query blocks per CTA of the range kernel

__global__ void __launch_bounds__(kWarps * 32) flashmask_fwd_range_kernel(const __grid_constant__ FlashMaskFwdTilesArgs a) {
  const int lane = int(threadIdx.x) % 32;
  const int m = int(blockIdx.x) * kWarps + int(threadIdx.x) / 32;
  if (m >= a.m_blocks) return;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int row0 = m * a.block_m, r1 = min(row0 + a.block_m, a.seqlen_q);
  // The causal range (common/mask.h BlockMask::key_block_range_rows with the window (-1, 0), or no
  // window): every block up to the one holding the last row's diagonal column.
  const int lo = 0;
  int hi = (a.seqlen_k + a.block_n - 1) / a.block_n;
  if (a.causal) {
    const int last_col = r1 - 1 + (a.seqlen_k - a.seqlen_q);
    hi = min(hi, last_col < 0 ? 0 : last_col / a.block_n + 1);
  }
  const int4* s = a.kbs + 2 * (int64_t(head) * a.kbs_head_stride + int64_t(batch) * a.blocks_per_batch);
  int first = INT_MAX, last = -1, count = 0;
  for (int base = lo; base < hi; base += 32) {
    const int n = base + lane;
    const unsigned kept = __ballot_sync(0xffffffffu, n < hi && !fm_skips(__ldg(s + 2 * n), row0, r1));
    count += __popc(kept);
    if (kept != 0u) {
      if (first == INT_MAX) first = base + __ffs(kept) - 1;
      last = base + 31 - __clz(kept);
    }
  }
  if (lane == 0) {
    const int64_t i = (int64_t(head) * a.batch + batch) * a.m_blocks + m;
    a.range[i] = count > 0 ? make_int2(first, last + 1) : make_int2(lo, lo);
    a.counts[i] = count;
  }
}

// The order: query blocks grouped by their walk's first key block (a document's tiles share it),
// the groups by their longest walk (descending; ties: the later group first), and within a group
// the later query block first (the longer walk where walks end at the diagonal). CTAs running at
// once then still work on one group's key blocks (a document's K / V stay in L2), while the
// longest groups go first and the last group's short walks fill the tail. (Sorted by walk length
// alone, the tiles of different documents interleaved: on the H100 the causal document's
// per-block pace fell by a third, more than the tail it saved; docs/perf-notes.md, Session 33.)
__global__ void __launch_bounds__(1024) flashmask_fwd_order_kernel(const __grid_constant__ FlashMaskFwdTilesArgs a) {
  __shared__ int first[kFmFwdTilesMaxBlocks];   // the walk's first key block, then -1 - it
  __shared__ int longest[kFmFwdTilesMaxBlocks];  // its walk's length, then its group's longest
  const int64_t base = (int64_t(blockIdx.x) * a.batch + blockIdx.y) * a.m_blocks;
  const int M = a.m_blocks;
  for (int i = threadIdx.x; i < M; i += blockDim.x) {
    first[i] = a.range[base + i].x;
    longest[i] = a.counts[base + i];
  }
  __syncthreads();
  int group_longest[kFmFwdTilesMaxBlocks / 1024];  // this thread's query blocks' groups
  for (int m = threadIdx.x, k = 0; m < M; m += blockDim.x, ++k) {
    int g = 0;
    for (int j = 0; j < M; ++j) g = first[j] == first[m] ? max(g, longest[j]) : g;
    group_longest[k] = g;
  }
  __syncthreads();
  for (int m = threadIdx.x, k = 0; m < M; m += blockDim.x, ++k) longest[m] = group_longest[k];
  __syncthreads();
  for (int m = threadIdx.x; m < M; m += blockDim.x) {
    const int g = longest[m], f = first[m];
    int rank = 0;
    for (int j = 0; j < M; ++j) {
      const int gj = longest[j], fj = first[j];
      rank += gj > g || (gj == g && (fj > f || (fj == f && j > m)));
    }
    a.order[base + rank] = m;
  }
}

}  // namespace

void launch_flashmask_fwd_tiles(const FlashMaskFwdTilesArgs& args, cudaStream_t stream) {
  if (args.m_blocks <= 0 || args.heads == 0 || args.batch == 0) return;
  const dim3 grid_range((args.m_blocks + kWarps - 1) / kWarps, args.heads, args.batch);
  flashmask_fwd_range_kernel<<<grid_range, kWarps * 32, 0, stream>>>(args);
  const int threads = args.m_blocks >= 1024 ? 1024 : (args.m_blocks + 31) / 32 * 32;
  flashmask_fwd_order_kernel<<<dim3(args.heads, args.batch), threads, 0, stream>>>(args);
}

}  // namespace flash_ext
