"""Backward time of one GQA attention layer: flash_ext's Hopper backward in each GQA schedule
(FLASH_EXT_SM90_BWD_GQA = expand, loop, auto) beside SDPA's backends (cuDNN, flash) with
enable_gqa, at the transformers training shape by default.

    python tools/bench_bwd_gqa.py                    # 4 x 2048, 8 / 2 heads, d = 128, bf16, causal
    python tools/bench_bwd_gqa.py --no-causal --batch 8 --seqlen 4096 --hdim 64

Times the backward op alone (flash_ext: torch.ops.flash_ext.bwd on the forward's out and lse,
including its buffer allocations and, expanded, the sum over each group; SDPA: autograd.grad of
its output), CUDA events, median of --reps after --warmup, the implementations taking turns
over --rounds. Prints ms per call and each beside cuDNN's.
"""

from __future__ import annotations

import argparse
import math
import statistics


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    import torch
    import flash_ext  # noqa: F401  (registers the ops)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ops = torch.ops.flash_ext
    dt = getattr(torch, args.dtype)
    b, s, hq, hkv, d = args.batch, args.seqlen, args.heads, args.kv_heads, args.hdim
    torch.manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dt)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dt)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=dt)
    dout = torch.randn_like(q)
    scale = 1.0 / math.sqrt(d)
    wr = 0 if args.causal else -1
    out, lse = ops.fwd(q, k, v, None, None, 0, 0, scale, args.causal, -1, wr, 0.0)

    def flash(schedule):
        def run():
            return ops.bwd(dout, q, k, v, out, lse, None, None, 0, 0, scale, args.causal, -1, wr, 0.0, False)
        run.schedule = schedule  # set before the block of calls, not inside the timed ones
        return run

    # SDPA in (batch, heads, seq, dim); the forward runs once, each call is one backward.
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    dot = dout.transpose(1, 2)

    def sdpa(backend):
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal, enable_gqa=True)

        def run():
            with sdpa_kernel(backend):
                return torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)
        return run

    impls = {"flash_ext expand": flash("expand"), "flash_ext loop": flash("loop"), "flash_ext auto": flash("auto")}
    for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
        try:
            impls[name] = sdpa(backend)
            impls[name]()
        except RuntimeError as e:  # backend unavailable for this shape / build
            print(f"{name}: skipped ({str(e).splitlines()[0]})")
            impls.pop(name)

    times = {name: [] for name in impls}
    order = list(impls)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            fn = impls[name]
            ops.set_tuning("FLASH_EXT_SM90_BWD_GQA", getattr(fn, "schedule", ""))
            ops.set_tuning("FLASH_EXT_BWD_PATH", "sm90" if hasattr(fn, "schedule") else "")
            for _ in range(args.warmup):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(args.reps):
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
    ops.set_tuning("FLASH_EXT_SM90_BWD_GQA", "")
    ops.set_tuning("FLASH_EXT_BWD_PATH", "")
    base = statistics.median(times["sdpa cudnn"]) if "sdpa cudnn" in times else None
    print(f"backward, {b} x {s}, {hq} / {hkv} heads, d = {d}, {args.dtype}, causal={args.causal}")
    for name, ts in times.items():
        ms = statistics.median(ts)
        rel = f"  {ms / base:.2f}x cuDNN's" if base else ""
        print(f"  {name:18s} {ms:.4f} ms{rel}")


if __name__ == "__main__":
    main()
