"""A/B timing of Hopper forward variants selected by environment variables, beside cuDNN, in one
process (developer tool for docs/perf-notes.md). Usage: PYTHONPATH=. python tools/ab_sm90.py"""
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from flash_ext.bench import time_ms as _bench_time_ms


def time_ms(fn, reps=20, warmup=5):
    return _bench_time_ms(fn, reps, warmup)


VARIANTS = {
    "auto": {},
    "persist": {"FLASH_EXT_SM90_PERSISTENT": "1"},
    "per_tile": {"FLASH_EXT_SM90_PERSISTENT": "0"},
    "nopp": {"FLASH_EXT_SM90_PINGPONG": "0"},
}
print(f"{'config':28s} " + " ".join(f"{k:>9s}" for k in VARIANTS) + f" {'cudnn':>9s}")
for d in (64, 128, 256):
    for s in (1024, 4096, 16384):
        for causal in (False, True):
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            row = []
            for name, env in VARIANTS.items():
                if "n176" in name and d != 128:
                    row.append("-")
                    continue
                os.environ.update(env)
                ms = time_ms(lambda: flash_ext.attn_fwd(q, k, v, causal=causal))
                for key in env:
                    os.environ.pop(key)
                row.append(f"{flops / ms / 1e9:.1f}")
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            row.append(f"{flops / ms / 1e9:.1f}")
            print(f"d={d:<3d} s={s:<5d} {'causal' if causal else 'full':6s}        " +
                  " ".join(f"{x:>9s}" for x in row), flush=True)
