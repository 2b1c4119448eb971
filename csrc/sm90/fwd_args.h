// What the parts of the Hopper forward hand each other: the kernel's one parameter (FwdArgs,
// built by sm90/fwd_launch.cuh) and one work item as the tile scheduler decodes it (FwdTile).
#pragma once
#include <cute/tensor.hpp>

#include "common/seqlen.h"
#include "params.h"
#include "sm90/tma_gmem.h"

namespace flash_ext::sm90 {

using namespace cute;

// Everything the kernel needs, passed by value as a __grid_constant__ parameter: the plain
// params and the TMA descriptors built on the host.
template <typename Traits>
struct FwdArgs {
  using Element = typename Traits::Element;
  using TensorShape = TmaTensorShape;  // (rows, d, heads, batch)
  using GTensor = TmaGTensor<Element const>;
  using GTensorO = TmaGTensor<Element>;
  // One consumer warpgroup's 64 rows of Q per load (SmemLayoutQSlab).
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{}, typename Traits::SmemLayoutQSlab{},
                                      Shape<_64, Int<Traits::kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GTensor{},
                                       take<0, 2>(typename Traits::SmemLayoutKV{}),
                                       Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{}));
  // One consumer warpgroup's 64 rows of O; built on the host only when p.sm90_tma_store_o.
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GTensorO{}, typename Traits::SmemLayoutOStage{},
                                     Shape<_64, Int<Traits::kHeadDim>>{}, _1{}));
  FwdParams p;
  TmaQ tma_q;
  TmaKV tma_k, tma_v;
  TmaO tma_o;
  TensorShape shape_q, shape_k;  // O has q's shape
};

// One work item: a tile (query block, head, batch), or a stream-K piece of one.
struct FwdTile {
  int tile;                // for a stream-K piece: the tile it is a piece of
  int piece_lo, piece_hi;  // a stream-K piece's key blocks [piece_lo, piece_hi)
  int m_block, head, batch;
  SeqInfo seq;
  // The tile holds query rows [row0, row0 + kBlockM): causal tiles aligned to end at seqlen_q
  // start before row 0 (p.sm90_row_shift), and rows before row 0 exist in no output.
  int row0;
  int row_shift;     // rows before row 0 in a tile (p.sm90_row_shift: the same for every tile)
  int n_min, n_max;  // the key blocks to run: the mask's visible ones, or the piece's
  int dense_walk;    // masks that skip blocks: 1 where [n_min, n_max) skips none (walk n - 1)
  int rows_q;        // rows [max(0, -row0), rows_q) of the tile exist
};

}  // namespace flash_ext::sm90
