// The testing ops of FlashMask's helper kernels (csrc/flashmask/), each alone: flashmask_summary
// (kernel A's normalized bounds and key-block summaries, in exactly the layout the kernels read:
// common/flashmask.h), flashmask_kept_pairs (its counts) and flashmask_fwd_tiles (the Hopper
// forward's tile table), so that tests compare them with Python transcriptions.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "api/errors.h"
#include "api/flashmask.h"
#include "flashmask/flashmask_fwd_tiles.h"

namespace flash_ext {
namespace {

// nb: int32 (hm, cols, 4); kbs: int32 (hm, blocks, 2, 4), with cols = varlen ? total_k + 128 batch :
// batch * round_up(seqlen_k, 128) and blocks = varlen ? total_k / block_n + batch + 1 :
// batch * round_up(seqlen_k, 128) / block_n. seqlen_q: the query rows (varlen: the longest
// sequence's); seqlen_k: the key columns (varlen: at least the longest sequence's).
std::tuple<at::Tensor, at::Tensor> flashmask_summary(const at::Tensor& startend_row_indices, int64_t seqlen_q,
                                                     int64_t seqlen_k, const std::optional<at::Tensor>& cu_seqlens_k,
                                                     bool causal, int64_t block_n) {
  const at::Tensor& b = startend_row_indices;
  const bool varlen = cu_seqlens_k.has_value();
  check_flashmask_bounds(b, varlen, causal);
  FLASH_EXT_CHECK(seqlen_q >= 0 && seqlen_q <= (int64_t(1) << 30) && seqlen_k >= 0 && seqlen_k <= (int64_t(1) << 30),
                  "flash_ext: seqlen_q and seqlen_k must be in [0, 2^30]");
  if (varlen) {
    const at::Tensor& ck = *cu_seqlens_k;
    FLASH_EXT_CHECK(ck.scalar_type() == at::kInt && ck.dim() == 1 && ck.numel() >= 1 && ck.is_contiguous() &&
                        ck.device() == b.device(),
                    "flash_ext: cu_seqlens_k must be a contiguous 1-D int32 tensor on the bounds' device");
    FLASH_EXT_CHECK(ck.numel() - 1 <= 65535, "flash_ext: batch must be <= 65535");
  } else {
    FLASH_EXT_CHECK(b.size(2) == seqlen_k, "flash_ext: startend_row_indices has ", b.size(2),
                    " columns; seqlen_k is ", seqlen_k);
  }
  const c10::cuda::CUDAGuard guard(b.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(b.get_device()).stream();
  const FlashMaskSummary s = make_flashmask_summary(b, cu_seqlens_k, seqlen_q, seqlen_k, causal, int(block_n),
                                                    /*group=*/1, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {s.nb, s.kbs};
}

// Kernel A's count of the (row, column) pairs fixed-length bounds keep, summed over mask heads
// and batch rows (what the Hopper forward's tile order compares with p.fm.one_section_below), as
// an int64 (1,) tensor, and the sum over (128-column chunk, mask head, batch row) of the chunk's
// count squared, a float64 (1,) tensor, and the Hopper backward's CTA order that kernel A's last
// CTA chose from them (1: longest first in one section, 0: the 3-D grid's), an int32 (1,) tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor> flashmask_kept_pairs(const at::Tensor& startend_row_indices, int64_t seqlen_q, int64_t seqlen_k,
                                bool causal) {
  const at::Tensor& b = startend_row_indices;
  check_flashmask_bounds(b, false, causal);
  FLASH_EXT_CHECK(seqlen_q >= 0 && seqlen_q < (int64_t(1) << 26) && b.size(2) == seqlen_k,
                  "flash_ext: seqlen_q must be in [0, 2^26) and startend_row_indices must have seqlen_k columns");
  const c10::cuda::CUDAGuard guard(b.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(b.get_device()).stream();
  const double* sum_sq_at = nullptr;
  const FlashMaskSummary s = make_flashmask_summary(b, std::nullopt, seqlen_q, seqlen_k, causal, /*block_n=*/128,
                                                    /*group=*/1, stream, FmCountFor::kBwdOrder, &sum_sq_at);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor out = at::empty({1}, b.options().dtype(at::kLong));
  at::Tensor sum_sq = at::empty({1}, b.options().dtype(at::kDouble));
  at::Tensor longest_first = at::empty({1}, b.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), s.view.visible_pairs, sizeof(unsigned long long),
                                 cudaMemcpyDeviceToDevice, stream));
  C10_CUDA_CHECK(cudaMemcpyAsync(sum_sq.data_ptr(), sum_sq_at, sizeof(double), cudaMemcpyDeviceToDevice, stream));
  C10_CUDA_CHECK(cudaMemcpyAsync(longest_first.data_ptr(), s.view.bwd_longest_first, sizeof(int),
                                 cudaMemcpyDeviceToDevice, stream));
  return {out, sum_sq, longest_first};
}

// The Hopper forward's tile table (flashmask/flashmask_fwd_tiles.h) of fixed-length bounds, for
// query blocks of block_m rows and key blocks of block_n columns: range int32 (hm, batch, query
// blocks, 2) and order int32 (hm, batch, query blocks).
std::tuple<at::Tensor, at::Tensor> flashmask_fwd_tiles(const at::Tensor& startend_row_indices, int64_t seqlen_q,
                                                       int64_t seqlen_k, bool causal, int64_t block_m, int64_t block_n) {
  const at::Tensor& b = startend_row_indices;
  check_flashmask_bounds(b, false, causal);
  FLASH_EXT_CHECK(seqlen_q > 0 && seqlen_q <= (int64_t(1) << 30) && b.size(2) == seqlen_k,
                  "flash_ext: seqlen_q must be in (0, 2^30] and startend_row_indices must have seqlen_k columns");
  FLASH_EXT_CHECK(block_m > 0 && block_m % 64 == 0 && (seqlen_q + block_m - 1) / block_m <= kFmFwdTilesMaxBlocks,
                  "flash_ext: block_m must be a positive multiple of 64 with at most ", kFmFwdTilesMaxBlocks,
                  " query blocks; got ", block_m);
  const c10::cuda::CUDAGuard guard(b.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(b.get_device()).stream();
  const FlashMaskSummary s = make_flashmask_summary(b, std::nullopt, seqlen_q, seqlen_k, causal, int(block_n),
                                                    /*group=*/1, stream, FmCountFor::kNothing, nullptr, int(block_m));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {s.fwd_range.clone(), s.fwd_order.clone()};
}

}  // namespace
}  // namespace flash_ext

TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  m.def(
      "flashmask_summary(Tensor startend_row_indices, int seqlen_q, int seqlen_k, Tensor? cu_seqlens_k, "
      "bool causal, int block_n) -> (Tensor nb, Tensor kbs)");
  m.def(
      "flashmask_kept_pairs(Tensor startend_row_indices, int seqlen_q, int seqlen_k, bool causal) -> (Tensor pairs, "
      "Tensor sum_sq, Tensor longest_first)");
  m.def(
      "flashmask_fwd_tiles(Tensor startend_row_indices, int seqlen_q, int seqlen_k, bool causal, int block_m, "
      "int block_n) -> (Tensor range, Tensor order)");
}

TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) {
  m.impl("flashmask_summary", &flash_ext::flashmask_summary);
  m.impl("flashmask_kept_pairs", &flash_ext::flashmask_kept_pairs);
  m.impl("flashmask_fwd_tiles", &flash_ext::flashmask_fwd_tiles);
}
