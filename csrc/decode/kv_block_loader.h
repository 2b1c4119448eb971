// The decode kernel's copies of K and V key blocks into its shared-memory ring
// (decode/decode_kernel.cuh), contiguous or paged, and the staging of a paged cache's page numbers.
//
// Each thread copies its rows of a block, each row from its own slot address: rows past the
// sequence's keys, rows on a page outside [0, num_pages) and columns past head_dim are zero-filled.
// Paged caches: a block's page numbers (at most kPagesPerBlock) are copied from the block table
// into a shared-memory slot by cp.async, in the cp.async group of the block kStages - 1 blocks
// earlier. The ring's wait for that earlier block (and the barrier after it) then makes them
// visible to every thread exactly when the block's own copies are issued: no copy's address waits
// on a block-table load issued less than a full ring earlier, and each page number is read from
// global memory once per CTA, not once per thread.
#pragma once
#include <cute/tensor.hpp>

#include "common/copy.h"
#include "decode/decode_params.h"

namespace flash_ext::decode {

// cp.async of 4 bytes (through L1) with zero fill: copies when `pred`, else writes 4 zero bytes.
__device__ __forceinline__ void cp_async_4_zfill(void* smem_dst, const void* gmem_src, bool pred) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(pred ? 4 : 0));
}

template <typename Traits>
struct KvBlockLoader {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kPagesPerBlock = Traits::kPagesPerBlock;
  static constexpr int kPageSlots = Traits::kPageSlots;
  using Coords = decltype(typename Traits::GmemTiledCopy{}.get_thread_slice(0).partition_S(
      cute::make_identity_tensor(cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{})));

  const DecodeParams& p;
  Coords coords;      // (vector, row pass, column pass) -> (key row, column) of this thread
  int L;              // keys of the sequence: slots from L on are never read
  int cache_row;      // contiguous caches: the sequence's cache row
  const int* table;   // paged: the sequence's block-table row (else null)
  bool page_pow2;
  int page_shift;
  int* page_slots;    // shared: kPageSlots x kPagesPerBlock page numbers

  // page_shift: log2(page_size) where it is a power of two (the kernel's __ffs).
  __device__ KvBlockLoader(const DecodeParams& params, int tid, int seqlen_k, int batch, int shift, int* slots)
      : p(params),
        coords(typename Traits::GmemTiledCopy{}.get_thread_slice(tid).partition_S(
            cute::make_identity_tensor(cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}))),
        L(seqlen_k),
        cache_row(params.cache_batch_idx != nullptr ? params.cache_batch_idx[batch] : batch),
        table(params.block_table != nullptr ? params.block_table + int64_t(batch) * params.block_table_batch_stride
                                            : nullptr),
        page_pow2((params.page_size & (params.page_size - 1)) == 0),
        page_shift(shift),
        page_slots(slots) {}

  __device__ bool paged() const { return table != nullptr; }
  __device__ int page_index(int key) const { return page_pow2 ? key >> page_shift : key / p.page_size; }
  __device__ int in_page(int key) const { return page_pow2 ? key & (p.page_size - 1) : key % p.page_size; }

  // Paged: entry i (< kPagesPerBlock) of block n_block's page numbers into `slot`, as part of the
  // calling thread's current cp.async group. Pages that start past the sequence's keys are
  // staged as 0 and never used (their rows are past L); all others lie inside the table's row.
  __device__ void stage_page(int slot, int n_block, int i) const {
    const int page = page_index(n_block * kBlockN) + i;
    const bool used = int64_t(page) * p.page_size < L;
    cp_async_4_zfill(page_slots + slot * kPagesPerBlock + i, used ? table + page : table, used);
  }
  // The page numbers of block n_block into `slot`, by the first kPagesPerBlock threads.
  __device__ void stage_pages(int slot, int n_block, int tid) const {
    if (paged() && tid < kPagesPerBlock) stage_page(slot, n_block, tid);
  }

  // K or V of block n_block into dst (the thread's partition of a ring slot); paged caches take
  // the page numbers from `slot` (staged by stage_pages, landed and synchronised).
  template <typename Dst>
  __device__ void load_rows(Dst dst, const Element* base, int64_t batch_stride, int64_t row_stride, int n_block,
                            int slot) const {
    const int* pages = page_slots + slot * kPagesPerBlock;
    const int first_page = paged() ? page_index(n_block * kBlockN) : 0;
    CUTE_UNROLL
    for (int m = 0; m < cute::size<1>(dst); ++m) {
      const int key = n_block * kBlockN + cute::get<0>(coords(0, m, 0));
      const Element* row = nullptr;
      if (key < L) {
        if (!paged()) {
          row = base + cache_row * batch_stride + int64_t(key) * row_stride;
        } else {
          const int page = pages[page_index(key) - first_page];
          if (page >= 0 && page < p.num_pages) row = base + page * batch_stride + int64_t(in_page(key)) * row_stride;
        }
      }
      CUTE_UNROLL
      for (int k = 0; k < cute::size<2>(dst); ++k) {
        const int col = cute::get<1>(coords(0, m, k));
        const bool ok = row != nullptr && col < p.head_dim;
        cp_async_16_zfill(&dst(0, m, k), ok ? row + col : base, ok);
      }
    }
  }
};

}  // namespace flash_ext::decode
