"""A/B timing of backward variants selected by environment variables, beside SDPA flash's
backward, in one process (developer tool for docs/perf-notes.md).
Usage: PYTHONPATH=. python tools/ab_sm90_bwd.py
TFLOP/s with the backward counted as 2.5x the forward's FLOPs (halved for causal)."""
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from flash_ext.bench import time_ms as _bench_time_ms


def time_ms(fn, reps=20, warmup=5):
    return _bench_time_ms(fn, reps, warmup)


VARIANTS = {
    "default": {},
    "sm80": {"FLASH_EXT_BWD_PATH": "sm80"},
}
print(f"{'config':28s} " + " ".join(f"{k:>10s}" for k in VARIANTS) + f" {'sdpa_flash':>10s}")
for d in (64, 128, 256):
    for s in (1024, 4096, 16384):
        for causal in (False, True):
            b, h = 16384 // s, 2048 // d
            q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            out, lse = flash_ext.attn_fwd(q, k, v, causal=causal)
            row = []
            for env in VARIANTS.values():
                old = {key: os.environ.get(key) for key in env}
                os.environ.update(env)
                ms = time_ms(lambda: flash_ext.attn_bwd(dout, q, k, v, out, lse, causal=causal))
                for key, val in old.items():
                    if val is None:
                        del os.environ[key]
                    else:
                        os.environ[key] = val
                row.append(flops / ms / 1e9)
            qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            g = dout.transpose(1, 2)
            ms = time_ms(lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True))
            row.append(flops / ms / 1e9)
            name = f"d={d} s={s} {'causal' if causal else 'full'}"
            print(f"{name:28s} " + " ".join(f"{x:10.1f}" for x in row), flush=True)
