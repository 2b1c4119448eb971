// Mask policies of the Hopper forward. A policy is built per tile from the params and the tile
// (its sequence's lengths; head and batch for masks that differ by them) and answers: which key
// blocks the tile's rows see (key_block_range_rows), whether a key block needs the elementwise
// mask (needs_mask_rows), and the mask itself on a score fragment (apply_rows).
#pragma once
#include "common/mask.h"
#include "params.h"
#include "sm90/fwd_args.h"

namespace flash_ext::sm90 {

// Causal / local windows (and the seqlen_k edge): common/mask.h's BlockMask. kHasWindow false:
// no mask but the seqlen_k edge.
template <int kBlockM, int kBlockN, bool kHasWindow>
struct CausalLocalMask : BlockMask<kBlockM, kBlockN, kHasWindow> {
  __device__ __forceinline__ CausalLocalMask(const FwdParams& p, const SeqInfo& seq, int /*head*/, int /*batch*/)
      : BlockMask<kBlockM, kBlockN, kHasWindow>(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right) {}
};

}  // namespace flash_ext::sm90
