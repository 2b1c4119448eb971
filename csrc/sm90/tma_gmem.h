// The global-memory views of Q, K, V, O and dO that the Hopper kernels' TMA descriptors are built
// on (sm90/fwd_launch.cuh, sm90/bwd_launch.cuh) and typed by (FwdArgs, BwdArgs): (rows, head dim,
// heads, batch) with unit column stride. Varlen tensors are one packed batch (batch stride 0).
#pragma once
#include <cute/tensor.hpp>

namespace flash_ext::sm90 {

using TmaTensorShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
using TmaTensorStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
// Element const for a load's source, Element for a store's destination.
template <typename Element>
using TmaGTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), TmaTensorShape{},
                                              TmaTensorStride{}));

template <typename Element>
TmaGTensor<Element> tma_gtensor(Element* ptr, TmaTensorShape shape, int64_t row_stride, int64_t head_stride,
                                int64_t batch_stride) {
  return cute::make_tensor(cute::make_gmem_ptr(ptr), shape,
                           cute::make_stride(row_stride, cute::_1{}, head_stride, batch_stride));
}

}  // namespace flash_ext::sm90
