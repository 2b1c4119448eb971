// The decode kernel's copies of K and V key blocks into its shared-memory ring
// (decode/decode_kernel.cuh), contiguous or paged, and the staging of a paged cache's page numbers.
//
// Each thread copies its rows of a block, each row from its own slot address: rows past the
// sequence's keys, rows on a page outside [0, num_pages) and columns past head_dim are zero-filled.
// Paged caches: pages are multiples of 16 keys and blocks start at multiples of 16, so each
// 16-key chunk of a block lies on one page. Per chunk, its page number (copied from the block
// table by cp.async) and its first row on that page (computed by the staging thread) go into a
// shared-memory slot with the copies of the block kStages - 1 blocks earlier. The ring's wait for
// that earlier block (and the barrier after it) makes them visible to every thread exactly when the
// block's own copies are issued: no copy's address waits on a block-table load issued less than a
// full ring earlier, each page number is read from global memory once per CTA, and a row's address
// is two shared-memory reads and a multiply-add, with no division and no branch.
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
  int* page_slots;    // shared: kPageSlots x kPagesPerBlock page numbers, one per 16-key chunk
  int* start_slots;   // shared: the same chunks' first rows on their pages

  // page_shift: log2(page_size) where it is a power of two (the kernel's __ffs); slots: the
  // kernel's page-slot area (kPageSlots x kPagesPerBlock page numbers, then as many first rows).
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
        page_slots(slots),
        start_slots(slots + kPageSlots * kPagesPerBlock) {}

  __device__ bool paged() const { return table != nullptr; }

  // Paged: chunk i (< kPagesPerBlock) of block n_block into `slot`: its page number as part of the
  // calling thread's current cp.async group, its first row on the page by a shared store (seen
  // after the same barrier). Chunks past the sequence's keys are staged as page 0 and never used
  // (their rows are past L); all others lie inside the table's row.
  __device__ void stage_page(int slot, int n_block, int i) const {
    const int key0 = n_block * kBlockN + 16 * i;
    const int page = page_pow2 ? key0 >> page_shift : key0 / p.page_size;
    const bool used = key0 < L;
    cp_async_4_zfill(page_slots + slot * kPagesPerBlock + i, used ? table + page : table, used);
    start_slots[slot * kPagesPerBlock + i] = key0 - page * p.page_size;
  }
  // The chunks of block n_block into `slot`, by the first kPagesPerBlock threads.
  __device__ void stage_pages(int slot, int n_block, int tid) const {
    if (paged() && tid < kPagesPerBlock) stage_page(slot, n_block, tid);
  }

  // K and V of block n_block into the thread's partitions of a ring slot (dst_k, dst_v); paged
  // caches take the chunks' pages from `slot` (staged by stage_pages, landed and synchronised).
  // A row's page and position are looked up once for both tensors.
  template <typename Dst>
  __device__ void load_block(Dst dst_k, Dst dst_v, const Element* k_base, const Element* v_base, int n_block,
                             int slot) const {
    const int* pages = page_slots + slot * kPagesPerBlock;
    const int* starts = start_slots + slot * kPagesPerBlock;
    CUTE_UNROLL
    for (int m = 0; m < cute::size<1>(dst_k); ++m) {
      const int r = cute::get<0>(coords(0, m, 0));  // row in the block
      const int key = n_block * kBlockN + r;
      int64_t page = cache_row, row = key;  // contiguous: the sequence's cache row, the key
      bool ok = key < L;
      if (paged()) {
        const int pg = pages[r >> 4];
        page = pg;
        row = starts[r >> 4] + (r & 15);
        ok = ok && static_cast<unsigned>(pg) < static_cast<unsigned>(p.num_pages);
      }
      const Element* k_row = k_base + page * p.k_batch_stride + row * p.k_row_stride;
      const Element* v_row = v_base + page * p.v_batch_stride + row * p.v_row_stride;
      CUTE_UNROLL
      for (int k = 0; k < cute::size<2>(dst_k); ++k) {
        const int col = cute::get<1>(coords(0, m, k));
        const bool in = ok && col < p.head_dim;
        cp_async_16_zfill(&dst_k(0, m, k), in ? k_row + col : k_base, in);
        cp_async_16_zfill(&dst_v(0, m, k), in ? v_row + col : v_base, in);
      }
    }
  }
};

}  // namespace flash_ext::decode
