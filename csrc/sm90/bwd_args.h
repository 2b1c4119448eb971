// The Hopper backward kernel's argument: the problem (BwdParams), the TMA descriptors of Q, dO,
// K and V, and the preprocess kernel's padded buffers (sm90/bwd_kernel.cuh, sm90/bwd_launch.cuh).
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>

#include "params.h"
#include "sm90/tma_gmem.h"

namespace flash_ext::sm90 {

using namespace cute;

template <typename Traits>
struct BwdArgs {
  using Element = typename Traits::Element;
  using TensorShape = TmaTensorShape;  // (rows, d, heads, batch)
  using GTensor = TmaGTensor<Element const>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, take<0, 2>(typename Traits::SmemLayoutQ{}),
                                      Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, typename Traits::SmemLayoutK{},
                                      Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{}));
  BwdParams p;
  TmaQ tma_q, tma_do;
  TmaK tma_k, tma_v;
  TensorShape shape_q, shape_k;
  // Padded (batch, heads_q, seqlen_q_padded) rows written by bwd_preprocess_kernel; varlen
  // (heads_q, seqlen_q_padded), a sequence's rows from varlen_padded_row0.
  const float* lse_log2;
  const float* dsum;
  int seqlen_q_padded;
};

}  // namespace flash_ext::sm90
