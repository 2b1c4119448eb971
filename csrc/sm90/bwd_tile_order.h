// The Hopper backward's CTA order (docs/kernels-sm90-bwd.md "Grid"). The 3-D grid runs one CTA
// per (key block, head, batch) with key blocks fastest. Under a causal mask key block 0 of a head
// has the most query blocks, so with a few waves the long CTAs of the last heads start last and
// the launch ends on a tail. The longest-first order (p.sm90_lpt_section > 0) is a 1-D grid:
// (head, batch) units in sections of p.sm90_lpt_section, and inside a section every unit's key
// block 0 first, then every unit's block 1, ...; sections in turn, so the CTAs in flight share
// a bounded set of heads' Q, dO and dq_accum in L2 (chosen by tuning/heuristics.h
// choose_sm90_bwd_lpt_section). FlashMask calls may take either order on the GPU (below).
#pragma once
#include "params.h"

namespace flash_ext::sm90 {

// The (key block, head, batch) of this CTA; heads_y: query heads, or KV heads with the group loop.
template <bool kFlashMask>
__device__ __forceinline__ void bwd_tile_of_cta(const BwdParams& p, int n_blocks, int heads_y, int& n_block,
                                                int& head_y, int& batch) {
  if (p.sm90_lpt_section <= 0) {
    n_block = blockIdx.x, head_y = blockIdx.y, batch = blockIdx.z;
    return;
  }
  const int units = heads_y * p.batch;
  int section = p.sm90_lpt_section;
  // FlashMask (fixed length, auto): a 1-D launch in one section whose order kernel A chose on the
  // GPU (common/flashmask.h bwd_longest_first), read once per CTA; sections of one unit are the
  // 3-D grid's order. redux.sync puts the flag in a uniform register, so that the decode stays
  // on the uniform datapath as a blockIdx-derived one does (from a plain register the d = 64
  // kernels spilled 56-80 bytes).
  if constexpr (kFlashMask) {
    if (p.fm.bwd_longest_first != nullptr) {
      const int longest_first = __reduce_max_sync(0xffffffffu, __ldg(p.fm.bwd_longest_first));
      if (longest_first == 0) section = 1;
    }
  }
  const int t = blockIdx.x, per_section = section * n_blocks;
  const int s = t / per_section, r = t - s * per_section;
  const int in_section = min(section, units - s * section);  // the last section may be short
  n_block = r / in_section;
  const int unit = s * section + (r - n_block * in_section);
  batch = unit / heads_y;
  head_y = unit - batch * heads_y;
}

}  // namespace flash_ext::sm90
