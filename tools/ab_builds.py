"""Balanced A/B of two builds of flash_ext on one GPU: the same cells timed in alternating
processes (A B B A, repeated), each process importing one build (PYTHONPATH=its tree).

  python tools/ab_builds.py --a TREE_A --b TREE_B [--rounds 4] [--cells CELL,...] [--json F]

A cell is direction:headdim:dtype:seqlen[:flag...], e.g. fwd:64:bf16:4096, bwd:128:bf16:2048:varlen,
fwd:256:fp16:1024:causal; flags: causal, varlen, dropout. Batch x seqlen = 16k tokens, 2048 / headdim
query heads (GQA off). Each process times every cell (CUDA events around a group of calls, median of
--reps groups of calls (about 2 ms each) after --warmup, inputs fresh per cell and rotated over 4 sets); the table is the median over
rounds of each side and B / A (> 1: B slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

DEFAULT_CELLS = ",".join(
    [f"fwd:{d}:{t}:{s}" for d in (64, 256) for t in ("bf16", "fp16") for s in (512, 1024, 4096, 16384)]
    + [f"fwd:{d}:bf16:{s}:causal" for d in (64, 128, 256) for s in (1024, 4096)]
    + [f"bwd:{d}:bf16:4096:varlen" for d in (64, 256)]
    + [f"bwd:{d}:bf16:4096:causal:dropout" for d in (64, 256)])


def _one_call_ms(call) -> float:
    import torch
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    call(0)
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1)


def _worker(cells: list[str], reps: int, warmup: int) -> dict:
    import torch
    import flash_ext

    dev = torch.device("cuda")
    res = {}
    for cell in cells:
        direction, d, dtype, s, *flags = cell.split(":")
        d, s = int(d), int(s)
        dt = torch.bfloat16 if dtype == "bf16" else torch.float16
        b, h = max(1, 16384 // s), max(1, 2048 // d)
        causal, varlen, dropout = "causal" in flags, "varlen" in flags, "dropout" in flags
        kw = dict(causal=causal)
        if varlen:
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
            kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
        shape = (b * s, h, d) if varlen else (b, s, h, d)
        sets = []
        for _ in range(4):
            q, k, v, g = (torch.randn(shape, device=dev, dtype=dt) for _ in range(4))
            fkw = dict(kw, dropout_p=0.1) if dropout else kw
            r = flash_ext.attn_fwd(q, k, v, **fkw)
            out, lse = r[0], r[1]
            bkw = dict(kw, dropout_p=0.1, rng_state=r[2]) if dropout else kw
            sets.append((q, k, v, g, out, lse, fkw, bkw))

        def call(i):
            q, k, v, g, out, lse, fkw, bkw = sets[i % 4]
            if direction == "fwd":
                flash_ext.attn_fwd(q, k, v, **fkw)
            else:
                flash_ext.attn_bwd(g, q, k, v, out, lse, **bkw)

        for i in range(warmup):
            call(i)
        torch.cuda.synchronize()
        # a group of calls between two events: the GPU stays busy (short calls would otherwise
        # time the host's launch path too); per-call time = group time / group
        group = max(1, min(20, int(2.0 / max(1e-3, _one_call_ms(call)))))
        times = []
        for r in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for i in range(group):
                call(r * group + i)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / group)
        res[cell] = statistics.median(times)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a")
    ap.add_argument("--b")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cells", default=DEFAULT_CELLS)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cells = args.cells.split(",")
    if args.worker:
        print(json.dumps(_worker(cells, args.reps, args.warmup)))
        return 0

    runs = {"a": [], "b": []}
    order = ["a", "b", "b", "a"] * ((args.rounds + 1) // 2)
    for i, side in enumerate(order[: 2 * args.rounds]):
        tree = os.path.abspath(getattr(args, side))
        env = dict(os.environ, PYTHONPATH=tree)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--cells", args.cells,
               "--reps", str(args.reps), "--warmup", str(args.warmup)]
        r = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        runs[side].append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"[ab] process {i + 1}/{2 * args.rounds} ({side}) done", file=sys.stderr, flush=True)

    rows = []
    print(f"{'cell':36s} {'A ms':>9s} {'B ms':>9s} {'B/A':>7s}  spread A / B")
    for c in cells:
        a = [r[c] for r in runs["a"]]
        b = [r[c] for r in runs["b"]]
        ma, mb = statistics.median(a), statistics.median(b)
        spread = lambda xs: (max(xs) - min(xs)) / statistics.median(xs)
        rows.append(dict(cell=c, a_ms=ma, b_ms=mb, ratio=mb / ma, a_runs=a, b_runs=b))
        print(f"{c:36s} {ma:9.4f} {mb:9.4f} {mb / ma:7.3f}  {spread(a):.3f} / {spread(b):.3f}")
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"worst B/A: {worst['ratio']:.3f} ({worst['cell']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
