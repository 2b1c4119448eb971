// Last step of the sm80 backward's main kernel: the CTA's dK and dV (fp32 accumulators of the
// dK/dV GEMM, summed over every query block it visited) to global memory in the input dtype.
#pragma once
#include <cute/tensor.hpp>

#include "common/copy.h"
#include "common/fragment.h"

namespace flash_ext::sm80 {

// Through shared memory (the K and V buffers, which no GEMM reads any more once every warp has
// passed the first barrier) for 16-byte coalesced stores of the valid rows (< rows_k) and columns
// (< head_dim). kDrainCopies: wait for the cp.async groups still pending first (only empty ones
// can be: the prefetching loop commits one after its last load).
template <bool kDrainCopies, typename Traits, typename AccDK, typename AccDV, typename SmemK,
          typename SmemV, typename GmemThr, typename GmemDK, typename GmemDV, typename CoordKV>
__device__ __forceinline__ void store_dk_dv(const typename Traits::TiledMmadKV& mma_kv,
                                            const AccDK& acc_dk, const AccDV& acc_dv, SmemK& sK,
                                            SmemV& sV, const GmemThr& gmem_thr, GmemDK& gdK,
                                            GmemDV& gdV, const CoordKV& tKVc, int rows_k,
                                            int head_dim, int tid) {
  using namespace cute;
  using Element = typename Traits::Element;
  Tensor rdK = make_tensor_like<Element>(acc_dk);
  Tensor rdV = make_tensor_like<Element>(acc_dv);
  convert_into(rdK, acc_dk);
  convert_into(rdV, acc_dv);
  auto r2s_kv = make_tiled_copy_C(typename Traits::R2SCopy{}, mma_kv);
  auto r2s_kv_thr = r2s_kv.get_thread_slice(tid);
  if constexpr (kDrainCopies) cp_async_wait<0>();
  __syncthreads();  // every warp is done reading sK (dQ GEMM) and sV (dP GEMM)
  copy(r2s_kv, r2s_kv_thr.retile_S(rdK), r2s_kv_thr.partition_D(sK));
  copy(r2s_kv, r2s_kv_thr.retile_S(rdV), r2s_kv_thr.partition_D(sV));
  __syncthreads();
  Tensor tdKgdK = gmem_thr.partition_D(gdK);
  Tensor tdVgdV = gmem_thr.partition_D(gdV);
  store_tile(gmem_thr.partition_S(sK), tdKgdK, tKVc, rows_k, head_dim);
  store_tile(gmem_thr.partition_S(sV), tdVgdV, tKVc, rows_k, head_dim);
}

}  // namespace flash_ext::sm80
