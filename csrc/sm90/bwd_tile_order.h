// The Hopper backward's CTA order (docs/kernels-sm90-bwd.md "Grid"). The 3-D grid runs one CTA
// per (key block, head, batch) with key blocks fastest. Under a causal mask key block 0 of a head
// has the most query blocks, so with a few waves the long CTAs of the last heads start last and
// the launch ends on a tail. The longest-first order (p.sm90_lpt_section > 0) is a 1-D grid:
// (head, batch) units in sections of p.sm90_lpt_section, and inside a section every unit's key
// block 0 first, then every unit's block 1, ...; sections in turn, so the CTAs in flight share
// a bounded set of heads' Q, dO and dq_accum in L2 (chosen by tuning/heuristics.h
// choose_sm90_bwd_lpt_section).
#pragma once
#include "params.h"

namespace flash_ext::sm90 {

// The (key block, head, batch) of this CTA; heads_y: query heads, or KV heads with the group loop.
__device__ __forceinline__ void bwd_tile_of_cta(const BwdParams& p, int n_blocks, int heads_y, int& n_block,
                                                int& head_y, int& batch) {
  if (p.sm90_lpt_section <= 0) {
    n_block = blockIdx.x, head_y = blockIdx.y, batch = blockIdx.z;
    return;
  }
  const int units = heads_y * p.batch, section = p.sm90_lpt_section;
  const int t = blockIdx.x, per_section = section * n_blocks;
  const int s = t / per_section, r = t - s * per_section;
  const int in_section = min(section, units - s * section);  // the last section may be short
  n_block = r / in_section;
  const int unit = s * section + (r - n_block * in_section);
  batch = unit / heads_y;
  head_y = unit - batch * heads_y;
}

}  // namespace flash_ext::sm90
