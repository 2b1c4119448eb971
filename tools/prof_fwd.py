"""Runs one forward configuration a few times, for a profiler to capture (developer tool for
docs/perf-notes.md): flash_ext under a variant of tools/ab_sm90.py, or SDPA's cuDNN backend.

Usage: PYTHONPATH=. python tools/prof_fwd.py d=128,s=4096,mask=full [variant|cudnn] [calls]
e.g.   ncu --clock-control none -k regex:fwd_kernel -s 2 -c 1 --section SpeedOfLight \\
           python tools/prof_fwd.py d=128,s=4096 q_regs
Shapes as the bench: batch = 16384 / s, heads = 2048 / d, bf16."""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from flash_ext.bench import _env

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ab_sm90 import VARIANTS  # noqa: E402


def main(argv):
    kv = dict(item.split("=") for item in (argv[0] if argv else "d=128,s=4096").split(","))
    d, s, mask = int(kv["d"]), int(kv["s"]), kv.get("mask", "full")
    which = argv[1] if len(argv) > 1 else "auto"
    calls = int(argv[2]) if len(argv) > 2 else 4
    b, h = max(1, 16384 // s), 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    causal = mask == "causal"
    if which == "cudnn":
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for _ in range(calls):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    else:
        variant = VARIANTS[which]
        with _env(**(variant(mask) if callable(variant) else variant)):
            for _ in range(calls):
                flash_ext.attn_fwd(q, k, v, causal=causal)
    torch.cuda.synchronize()
    print(f"prof_fwd: d={d} s={s} {mask} {which} x{calls}")


if __name__ == "__main__":
    main(sys.argv[1:])
