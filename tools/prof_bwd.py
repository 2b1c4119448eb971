"""Per-kernel GPU time of one flash_ext backward call (and SDPA flash's, for comparison), from
torch.profiler: where the time of a short-sequence backward goes (developer tool for
docs/perf-notes.md). Usage: PYTHONPATH=. python tools/prof_bwd.py [d=64,s=1024,causal=0 ...]"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flash_ext


def kernel_times(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count >= reps:
            rows.append((t / reps, e.key))
    return sorted(rows, reverse=True)


def main(argv):
    configs = argv or ["d=64,s=1024,causal=0", "d=64,s=1024,causal=1", "d=128,s=1024,causal=0",
                       "d=256,s=1024,causal=0"]
    for cfg in configs:
        kv = dict(item.split("=") for item in cfg.split(","))
        d, s, causal = int(kv["d"]), int(kv["s"]), kv.get("causal", "0") == "1"
        b, h = 16384 // s, 2048 // d
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = flash_ext.attn_fwd(q, k, v, causal=causal)
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        g = dout.transpose(1, 2)
        for name, fn in (("flash_ext", lambda: flash_ext.attn_bwd(dout, q, k, v, out, lse, causal=causal)),
                         ("sdpa_flash", lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True))):
            rows = kernel_times(fn)
            total = sum(t for t, _ in rows)
            print(f"{cfg} {name}: {total:.1f} us of kernels per call")
            for t, key in rows:
                print(f"  {t:9.1f} us {100 * t / total:5.1f}%  {key[:100]}")


if __name__ == "__main__":
    main(sys.argv[1:])
