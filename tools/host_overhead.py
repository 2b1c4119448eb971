"""Host (CPU) time per call of the flash_ext entry points beside SDPA flash's, on a problem so
small that the GPU never holds the host back: where the time of a short, launch-bound step goes
(developer tool for docs/perf-notes.md, "host time per call").

    PYTHONPATH=. python tools/host_overhead.py [--b 1 --s 128 --hq 2 --hkv 2 --d 128] [--no-causal]

Prints microseconds of host time per call (the median of --repeats interleaved rounds of --n
calls per case, no synchronisation inside a run; the step's flash_ext / SDPA ratio per round), then the top CPU ops of --profile-steps steps of flash_ext and of
SDPA (torch.profiler, self CPU time per step), and last one line:

    host step us: flash_ext X, sdpa Y, ratio Z

where a step is forward + torch.autograd.grad for q, k, v (flash_ext.attn_fwd against
F.scaled_dot_product_attention with the flash backend), and ratio = X / Y."""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flash_ext


def run_us(fn, n):
    """Host microseconds per call over one run of `n` calls (not synchronised inside, so with a
    GPU that keeps up its wall time is the host's)."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def host_us_rounds(cases, n, rounds):
    """name -> per-round host us. Every round runs each case once (n calls), the order reversed
    every other round, so that a slower or faster stretch of the machine weighs on all cases
    alike and the cases of one round can be compared pairwise."""
    for fn in cases.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    names = list(cases)
    per_round = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            per_round[name].append(run_us(cases[name], n))
    return per_round


def cpu_table(fn, steps, rows):
    """torch.profiler's top CPU ops of `steps` calls of fn, by self CPU time."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                     max_name_column_width=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--s", type=int, default=128)
    ap.add_argument("--hq", type=int, default=2)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--n", type=int, default=300, help="calls per run")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved rounds (the median is kept)")
    ap.add_argument("--profile-steps", type=int, default=50)
    ap.add_argument("--rows", type=int, default=12, help="rows of each profiler table")
    a = ap.parse_args()

    dt, dev = torch.bfloat16, "cuda"
    q = torch.randn(a.b, a.s, a.hq, a.d, device=dev, dtype=dt)
    k, v = (torch.randn(a.b, a.s, a.hkv, a.d, device=dev, dtype=dt) for _ in range(2))
    dout = torch.randn_like(q)
    ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flash_ext.attn_fwd(q, k, v, causal=a.causal)
    scale = a.d ** -0.5
    wr = 0 if a.causal else -1
    # SDPA's layout (b, h, s, d): transposed views of the same tensors, as a model would pass.
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    gt = dout.transpose(1, 2)
    gqa = a.hq != a.hkv

    # SDPA runs inside one sdpa_kernel(FLASH_ATTENTION) context held for the whole run (see
    # main's end), so that the context manager's own cost is not counted per call.
    def sdpa_fwd():
        return F.scaled_dot_product_attention(qt.detach(), kt.detach(), vt.detach(),
                                              is_causal=a.causal, enable_gqa=gqa)

    def sdpa_step():
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal, enable_gqa=gqa)
        return torch.autograd.grad(o, (qt, kt, vt), gt)

    def ext_step():
        o, _ = flash_ext.attn_fwd(ql, kl, vl, causal=a.causal)
        return torch.autograd.grad(o, (ql, kl, vl), dout)

    def raw_step():  # the op itself, without attn_fwd's Python layer
        o, _ = torch.ops.flash_ext.fwd(ql, kl, vl, None, None, 0, 0, scale, a.causal, -1, wr, 0.0)
        return torch.autograd.grad(o, (ql, kl, vl), dout)

    cases = {
        "flash_ext.attn_fwd (no grad)": lambda: flash_ext.attn_fwd(q, k, v, causal=a.causal),
        "torch.ops.flash_ext.fwd (no grad)": lambda: torch.ops.flash_ext.fwd(
            q, k, v, None, None, 0, 0, scale, a.causal, -1, wr, 0.0),
        "flash_ext.attn_bwd": lambda: flash_ext.attn_bwd(dout, q, k, v, out, lse, causal=a.causal),
        "torch.ops.flash_ext.bwd": lambda: torch.ops.flash_ext.bwd(
            dout, q, k, v, out, lse, None, None, 0, 0, scale, a.causal, -1, wr, 0.0, False),
        "flash_ext step (attn_fwd + autograd.grad)": ext_step,
        "flash_ext step (torch.ops.flash_ext.fwd + autograd.grad)": raw_step,
        "sdpa flash fwd (no grad)": sdpa_fwd,
        "sdpa flash step (fwd + autograd.grad)": sdpa_step,
    }
    print(f"b={a.b} s={a.s} hq={a.hq} hkv={a.hkv} d={a.d} causal={a.causal} bf16, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {a.repeats} interleaved "
          f"rounds x {a.n} calls: median (min-max) us")
    rounds = host_us_rounds(cases, a.n, a.repeats)
    us = {name: statistics.median(t) for name, t in rounds.items()}
    for name, t in rounds.items():
        print(f"{us[name]:8.1f} us host per call  ({min(t):.1f}-{max(t):.1f})  {name}", flush=True)
    ext_name, sdpa_name = "flash_ext step (attn_fwd + autograd.grad)", "sdpa flash step (fwd + autograd.grad)"
    ratios = [e / s for e, s in zip(rounds[ext_name], rounds[sdpa_name])]
    print(f"step ratio flash_ext / sdpa per round: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds")

    print(f"\nflash_ext step, top CPU ops over {a.profile_steps} steps:")
    print(cpu_table(ext_step, a.profile_steps, a.rows))
    print(f"sdpa flash step, top CPU ops over {a.profile_steps} steps:")
    print(cpu_table(sdpa_step, a.profile_steps, a.rows))

    ext, sdpa = us["flash_ext step (attn_fwd + autograd.grad)"], us["sdpa flash step (fwd + autograd.grad)"]
    print(f"host step us: flash_ext {ext:.1f}, sdpa {sdpa:.1f}, ratio {ext / sdpa:.2f}")


if __name__ == "__main__":
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # SDPA: the flash backend or an error
        main()
