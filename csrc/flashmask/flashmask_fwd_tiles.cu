// FlashMask's tile table for the Hopper forward (flashmask_fwd_tiles.h): a warp per query block
// finds its range and walk length from the key-block summaries' skip halves (32 blocks per ballot),
// then a CTA per (mask head, batch row) ranks its query blocks by walk length.
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

__global__ void __launch_bounds__(1024) flashmask_fwd_order_kernel(const __grid_constant__ FlashMaskFwdTilesArgs a) {
  __shared__ int counts[kFmFwdTilesMaxBlocks];
  const int64_t base = (int64_t(blockIdx.x) * a.batch + blockIdx.y) * a.m_blocks;
  const int M = a.m_blocks;
  for (int i = threadIdx.x; i < M; i += blockDim.x) counts[i] = a.counts[base + i];
  __syncthreads();
  for (int m = threadIdx.x; m < M; m += blockDim.x) {
    const int c = counts[m];
    int rank = 0;
    for (int j = 0; j < M; ++j) {
      const int cj = counts[j];
      rank += cj > c || (cj == c && j > m);
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
