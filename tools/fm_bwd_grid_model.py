"""CPU model of the Hopper FlashMask backward's grid (docs/perf-notes.md, "the FlashMask backward's
tail"). Usage: PYTHONPATH=. python tools/fm_bwd_grid_model.py [C0 [SECTION]]

For each mask of the bench's mask section (bf16 d = 128: 64-row query blocks, 128-key blocks,
16k tokens x 16 heads per call), the query blocks each key block's CTA visits (skip / partial /
full from the key-block summaries, as the kernel walks them), then the makespan of the grid on 132
SMs (one CTA per SM) in four orders, as a multiple of the bound total work / 132: the 3-D grid
(key block fastest), longest-first in sections of SECTION units (the L2 rule's order), in one
section, and sorted by cost. A CTA costs C0 + its visited steps (+ EXTRA per partial step), in
steps. It ignores memory: the L2 sections exist for the plain causal kernel's Q / dO reuse."""
import heapq
import sys

import torch
from flash_ext import _flashmask_blocks as B
from flash_ext import bench_mask as BM

SMS, BM_, BN = 132, 64, 128
C0, EXTRA = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0, 0.15
SECTION = int(sys.argv[2]) if len(sys.argv) > 2 else 2

def key_block_steps(name, s):
    if name == "causal":
        sri, causal = torch.full((1, 1, s, 1), s, dtype=torch.int32), True
    else:
        sri, causal, _ = BM.build_mask(name, s)
    nb = B.normalize(sri, s, s, causal)
    kbs = B.summaries(nb, s, BN, batch=1, seqlen_q=s)[0]  # (blocks, 2, 4)
    nmb = (s + BM_ - 1) // BM_
    steps = []
    for n in range(s // BN):
        m0 = (n * BN) // BM_ if causal else 0
        r0 = torch.arange(m0, nmb) * BM_
        cls = B.classify(kbs[n, 0], kbs[n, 1], r0, torch.clamp(r0 + BM_, max=s))
        vis = int((cls != B.SKIP).sum()); part = int((cls == B.PARTIAL).sum())
        steps.append(vis + EXTRA * part)
    return steps

def makespan(costs):
    sm = [0.0] * SMS; heapq.heapify(sm)
    for c in costs:
        t = heapq.heappop(sm); heapq.heappush(sm, t + c)
    return max(sm)

for name in ("causal", "causal_doc", "shared_question", "prefix_lm", "sliding_window"):
    for s in (8192, 16384, 32768):
        units = max(1, 16384 // s) * 16
        st = key_block_steps(name, s)
        per = [C0 + x for x in st]
        grid = [c for _ in range(units) for c in per]               # x (key block) fastest
        lpt = [c for c in per for _ in range(units)]                # every unit's block 0 first, ...
        sec = [c for s0 in range(0, units, SECTION) for c in per for _ in range(min(SECTION, units - s0))]
        srt = sorted(grid, reverse=True)
        bound = sum(grid) / SMS
        print(f"{name:16s} {s:6d} CTAs {len(grid):5d} steps/CTA {sum(st)/len(st):6.1f} max {max(st):5.1f} | "
              f"grid {makespan(grid)/bound:5.3f} sec{SECTION} {makespan(sec)/bound:5.3f} lpt {makespan(lpt)/bound:5.3f} sorted {makespan(srt)/bound:5.3f} (x bound)")
