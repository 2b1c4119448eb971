"""Host (CPU) time per call of the flash_ext entry points beside SDPA flash's, on a problem so
small that the GPU never holds the host back: where the time of a short, launch-bound step goes
(developer tool for docs/perf-notes.md). Usage: PYTHONPATH=. python tools/host_overhead.py"""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flash_ext


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    b, s, h, d = 1, 128, 2, 128
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flash_ext.attn_fwd(q, k, v, causal=True)
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    gt = dout.transpose(1, 2)
    scale = d ** -0.5

    def sdpa_fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt.detach(), kt.detach(), vt.detach(), is_causal=True)

    def sdpa_step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return torch.autograd.grad(o, (qt, kt, vt), gt)

    def ext_step():
        o, _ = flash_ext.attn_fwd(ql, kl, vl, causal=True)
        return torch.autograd.grad(o, (ql, kl, vl), dout)

    def raw_fwd_step():  # the op itself, without attn_fwd's Python layer
        o, _ = torch.ops.flash_ext.fwd(ql, kl, vl, None, None, 0, 0, scale, True, -1, 0, 0.0, 0.0, None)
        return torch.autograd.grad(o, (ql, kl, vl), dout)

    cases = {
        "flash_ext.attn_fwd (no grad)": lambda: flash_ext.attn_fwd(q, k, v, causal=True),
        "torch.ops.flash_ext.fwd (no grad)": lambda: torch.ops.flash_ext.fwd(
            q, k, v, None, None, 0, 0, scale, True, -1, 0, 0.0, 0.0, None),
        "flash_ext.attn_fwd (grad)": lambda: flash_ext.attn_fwd(ql, kl, vl, causal=True),
        "flash_ext.attn_bwd": lambda: flash_ext.attn_bwd(dout, q, k, v, out, lse, causal=True),
        "torch.ops.flash_ext.bwd": lambda: torch.ops.flash_ext.bwd(
            dout, q, k, v, out, lse, None, None, 0, 0, scale, True, -1, 0, 0.0, False),
        "flash_ext fwd+bwd step (attn_fwd + autograd.grad)": ext_step,
        "flash_ext fwd+bwd step (ops.fwd + autograd.grad)": raw_fwd_step,
        "sdpa flash fwd (no grad)": sdpa_fwd,
        "sdpa flash fwd+bwd step": sdpa_step,
    }
    for name, fn in cases.items():
        print(f"{host_us(fn):8.1f} us host per call  {name}", flush=True)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            ext_step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
