"""Repeats the sustained bench's turns on one config and prints each flash_ext turn's per-call
times and host time per call (looking for the slow turn seen in session 16's sustained grid)."""
import statistics, sys, time
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import flash_ext
d, s, causal, iters = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "causal", int(sys.argv[4])
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
def ext(): return flash_ext.attn_fwd(q, k, v, causal=causal)
def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
def turn(fn, reps=20, warm_s=0.6):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    t_end = time.perf_counter() + warm_s
    while time.perf_counter() < t_end:
        for _ in range(4): fn()
        torch.cuda.synchronize()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    t0 = time.perf_counter()
    for a, e in zip(st, en):
        a.record(); fn(); e.record()
    host = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    ms = [a.elapsed_time(e) for a, e in zip(st, en)]
    return statistics.median(ms), min(ms), max(ms), host
for i in range(iters):
    c = turn(cudnn)
    e = turn(ext)
    flag = " SLOW" if e[0] > 1.5 * e[1] or e[0] > 1.5 * c[0] else ""
    print(f"{i:3d} cudnn med {c[0]:.3f} | ext med {e[0]:.3f} min {e[1]:.3f} max {e[2]:.3f} host/call {e[3]:.3f} ms{flag}", flush=True)
