"""CPU model of the Hopper FlashMask kernels' grids (docs/perf-notes.md, "the FlashMask backward's
tail" and "the FlashMask forward's sections"). No GPU: the visited blocks come from the same
key-block summaries and classification the kernels use (flash_ext/_flashmask_blocks.py).

  PYTHONPATH=. python tools/fm_grid_model.py bwd [C0 [SECTION]]
  PYTHONPATH=. python tools/fm_grid_model.py fwd [C0]
  PYTHONPATH=. python tools/fm_grid_model.py bound [C0]

For each mask of the bench's mask section at d = 128 (16k tokens x 16 heads per call), the cost
of every work item in steps (C0 fixed + visited blocks + 0.15 per partial block), then the
makespan of the launch on 132 SMs (one CTA each, an item goes to the first free one) as a
multiple of the bound total work / 132, for several orders:
- bwd (one CTA per (key block, head, batch); 64-row query blocks, 128-key blocks): the 3-D grid
  (key block fastest), longest first in sections of SECTION units (the L2 rule's order), in one
  section, sorted by cost;
- fwd (tiles of 128 query rows claimed dynamically; 128-key blocks): the launch's order (query
  block descending in sections of units) for 1, 2 and 6 sections, and sorted by cost.
It ignores memory: the sections exist to bound K/V (forward) or Q/dO (backward) traffic.

bound: the causal document mask's useful entries per unit of forward work (C0 + visited blocks
+ 0.15 per partial block, 128 x 128 tiles) over the plain causal mask's: the most its TFLOP/s on
unmasked entries can reach as a share of the causal kernel's, for the FlashMask walk and for
varlen tiles that start at each document (issue 27's 0.9x target).
"""
import heapq
import sys

import torch

from flash_ext import _flashmask_blocks as B
from flash_ext import bench_mask as BM

SMS, EXTRA = 132, 0.15
MASKS = ("causal", "causal_doc", "shared_question", "prefix_lm", "sliding_window")


def summaries(name, s, block_n):
    if name == "causal":
        sri, causal = torch.full((1, 1, s, 1), s, dtype=torch.int32), True
    else:
        sri, causal, _ = BM.build_mask(name, s)
    nb = B.normalize(sri, s, s, causal)
    return B.summaries(nb, s, block_n, batch=1, seqlen_q=s)[0], causal


def cost(cls, c0):
    return c0 + int((cls != B.SKIP).sum()) + EXTRA * int((cls == B.PARTIAL).sum())


def bwd_costs(name, s, c0, block_m=64, block_n=128):
    """Per key block: its CTA's cost (the query blocks it visits)."""
    kbs, causal = summaries(name, s, block_n)
    n_m = (s + block_m - 1) // block_m
    out = []
    for n in range(s // block_n):
        r0 = torch.arange((n * block_n) // block_m if causal else 0, n_m) * block_m
        out.append(cost(B.classify(kbs[n, 0], kbs[n, 1], r0, torch.clamp(r0 + block_m, max=s)), c0))
    return out


def fwd_costs(name, s, c0, block_m=128, block_n=128):
    """Per query block: its tile's cost (the key blocks it visits)."""
    kbs, causal = summaries(name, s, block_n)
    out = []
    for m in range(s // block_m):
        r0, r1 = m * block_m, min(m * block_m + block_m, s)
        n_max = (r1 - 1) // block_n + 1 if causal else s // block_n
        out.append(cost(B.classify(kbs[:n_max, 0], kbs[:n_max, 1], r0, r1), c0))
    return out


def makespan(costs):
    sm = [0.0] * SMS
    heapq.heapify(sm)
    for c in costs:
        heapq.heappush(sm, heapq.heappop(sm) + c)
    return max(sm)


def varlen_fwd_cost(lens, c0, block_m=128, block_n=128):
    """Forward work of varlen tiles over documents of `lens` (tiles start at each document)."""
    total = 0.0
    for length in lens:
        for m in range(-(-length // block_m)):
            r0, r1 = m * block_m, min(length, (m + 1) * block_m)
            blocks = -(-r1 // block_n)  # key blocks from the document's start to the tile's end
            total += c0 + blocks + EXTRA * (blocks - r0 // block_n)  # those right of r0 are partial
    return total


def doc_bound(c0):
    for s in (8192, 16384, 32768):
        lens = BM.doc_lengths(s)
        useful_doc = sum(n * (n + 1) / 2 for n in lens)
        useful_causal = s * (s + 1) / 2
        per_causal = useful_causal / sum(fwd_costs("causal", s, c0))
        fm = useful_doc / sum(fwd_costs("causal_doc", s, c0)) / per_causal
        varlen = useful_doc / varlen_fwd_cost(lens, c0) / per_causal
        print(f"causal_doc {s:6d} ({len(lens)} documents, C0 {c0}): FlashMask walk {fm:.3f}, varlen {varlen:.3f} "
              f"of the causal kernel's TFLOP/s at equal time per block", flush=True)


def main():
    direction = sys.argv[1] if len(sys.argv) > 1 else "bwd"
    if direction == "bound":
        doc_bound(float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)
        return
    c0 = float(sys.argv[2]) if len(sys.argv) > 2 else (6.0 if direction == "bwd" else 1.0)
    section = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    for name in MASKS:
        for s in (8192, 16384, 32768):
            units = max(1, 16384 // s) * 16
            per = (bwd_costs if direction == "bwd" else fwd_costs)(name, s, c0)
            bound = sum(per) * units / SMS
            rel = lambda order: f"{makespan(order) / bound:5.3f}"  # noqa: E731
            srt = sorted((c for c in per for _ in range(units)), reverse=True)
            if direction == "bwd":
                grid = [c for _ in range(units) for c in per]
                sec = [c for s0 in range(0, units, section) for c in per for _ in range(min(section, units - s0))]
                one = [c for c in per for _ in range(units)]
                cols = f"grid {rel(grid)} sections of {section} {rel(sec)} one section {rel(one)}"
            else:
                cols = ""
                for n_sec in (1, 2, 6):
                    size = -(-units // n_sec)
                    order = [per[m] for s0 in range(0, units, size) for m in reversed(range(len(per)))
                             for _ in range(min(size, units - s0))]
                    cols += f"{n_sec} section(s) {rel(order)} "
                    if n_sec > 1:  # the same sections, each sorted by cost (longest first)
                        by_cost = sorted(range(len(per)), key=lambda m: -per[m])
                        order = [per[m] for s0 in range(0, units, size) for m in by_cost
                                 for _ in range(min(size, units - s0))]
                        cols += f"(sorted {rel(order)}) "
            print(f"{name:16s} {s:6d} items {len(per) * units:5d} | {cols}| sorted {rel(srt)}", flush=True)


if __name__ == "__main__":
    main()
