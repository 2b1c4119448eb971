"""Backward time of one packed (varlen, padding-free) attention call: flash_ext's Hopper backward
(FLASH_EXT_BWD_PATH=sm90) beside its sm80 backward (sm80), and FlashAttention-2/3's varlen
backward when they import, on the same packed batch.

    python tools/bench_bwd_varlen.py                      # 8 sequences of 1-4k tokens, 16 / 16 heads, d = 128, bf16, causal
    python tools/bench_bwd_varlen.py --seqs 16 --min 256 --max 2048 --kv-heads 2 --no-causal

Times the backward op alone (torch.ops.flash_ext.bwd on the forward's out and lse, with its buffer
allocations and, for GQA, the sum over each group), CUDA events, median of --reps after --warmup,
the paths taking turns over --rounds. TFLOP/s: 2.5 x the forward's 4 d FLOPs per visible
(query, key) pair per head (causal: bottom-right per sequence).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics


def visible_pairs(sq: int, sk: int, causal: bool) -> int:
    if not causal:
        return sq * sk
    shift = sk - sq  # query i sees keys [0, i + shift]
    return sum(max(0, min(sk, i + shift + 1)) for i in range(sq))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--min", type=int, default=1024)
    p.add_argument("--max", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    import torch
    import flash_ext  # noqa: F401  (registers the ops)

    ops = torch.ops.flash_ext
    dt = getattr(torch, args.dtype)
    hq, d = args.heads, args.hdim
    hkv = args.kv_heads or hq
    rng = random.Random(args.seed)
    lens = [rng.randint(args.min, args.max) for _ in range(args.seqs)]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
    total, smax = sum(lens), max(lens)
    torch.manual_seed(args.seed)
    q = torch.randn(total, hq, d, device="cuda", dtype=dt)
    k = torch.randn(total, hkv, d, device="cuda", dtype=dt)
    v = torch.randn(total, hkv, d, device="cuda", dtype=dt)
    dout = torch.randn_like(q)
    scale = 1.0 / math.sqrt(d)
    wr = 0 if args.causal else -1
    out, lse = ops.fwd(q, k, v, cu, cu, smax, smax, scale, args.causal, -1, wr, 0.0)
    flops = 2.5 * 4 * d * hq * sum(visible_pairs(n, n, args.causal) for n in lens)

    def flash_ext_path(path):
        def run():
            return ops.bwd(dout, q, k, v, out, lse, cu, cu, smax, smax, scale, args.causal, -1, wr, 0.0, False)
        run.path = path  # set before the block of calls, not inside the timed ones
        return run

    impls = {"flash_ext sm90": flash_ext_path("sm90"), "flash_ext sm80": flash_ext_path("sm80")}
    try:  # FlashAttention-2's varlen backward through autograd (its forward once)
        from flash_attn import flash_attn_varlen_func
        qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
        of = flash_attn_varlen_func(qf, kf, vf, cu, cu, smax, smax, causal=args.causal)
        impls["flash_attn (FA2)"] = lambda: torch.autograd.grad(of, (qf, kf, vf), dout, retain_graph=True)
    except Exception as e:  # not installed, or no kernel for this GPU / shape
        print(f"flash_attn (FA2): skipped ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    try:
        from flash_attn_interface import flash_attn_varlen_func as fa3_varlen
        qf3, kf3, vf3 = (t.detach().requires_grad_() for t in (q, k, v))
        of3 = fa3_varlen(qf3, kf3, vf3, cu, cu, smax, smax, causal=args.causal)
        of3 = of3[0] if isinstance(of3, tuple) else of3
        impls["flash_attn_interface (FA3)"] = lambda: torch.autograd.grad(of3, (qf3, kf3, vf3), dout, retain_graph=True)
    except Exception as e:
        print(f"flash_attn_interface (FA3): skipped ({str(e).splitlines()[0] if str(e) else type(e).__name__})")

    times = {name: [] for name in impls}
    order = list(impls)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            fn = impls[name]
            ops.set_tuning("FLASH_EXT_BWD_PATH", getattr(fn, "path", ""))
            for _ in range(args.warmup):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(args.reps):
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
    ops.set_tuning("FLASH_EXT_BWD_PATH", "")
    print(f"varlen backward, {len(lens)} sequences {lens} ({total} tokens), {hq} / {hkv} heads, d = {d}, "
          f"{args.dtype}, causal={args.causal}")
    base = statistics.median(times["flash_ext sm80"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"  {name:28s} {ms:.4f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  {base / ms:.2f}x sm80's")


if __name__ == "__main__":
    main()
