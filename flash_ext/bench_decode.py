"""The decode section of ``python -m flash_ext.bench --decode``: attention of one new token per
sequence against a full KV cache (GQA, bf16), flash_ext.flash_attn_with_kvcache beside SDPA's
cuDNN and flash backends (and FlashAttention-2's flash_attn_with_kvcache when flash_attn is
installed), as microseconds per call and GB/s of K and V read (issue 26's benchmark).

Times are triton.testing.do_bench medians, the L2 flushed between calls. GB/s = batch x keys x
kv heads x head dim x 2 (K and V) x 2 bytes / time. flash_ext also runs on paged copies of the
caches (pages of 16 and of 256 tokens, the block table a random permutation). Last, the host
(CPU) time of one decode call at the first shape, no synchronisation inside the timed loop.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

DECODE_SHAPES = ((1, 8192), (1, 131072), (8, 65536), (32, 16384), (64, 4096))
PAGE_SIZES = (16, 256)


def _median_us(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel(backend)


def _fa2_kvcache():
    try:
        from flash_attn import flash_attn_with_kvcache
        return flash_attn_with_kvcache
    except Exception:  # not installed, or built for another torch
        return None


def _paged(cache: torch.Tensor, page: int, perm: torch.Tensor) -> torch.Tensor:
    """cache (b, n, h, d) as pages: page perm[j] holds the j-th block of page tokens."""
    b, n, h, d = cache.shape
    return cache.reshape(b * n // page, page, h, d)[perm.argsort()].contiguous()


def host_us(fn: Callable[[], object], n: int = 200, rounds: int = 5) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def run_decode(heads_q: int = 32, heads_kv: int = 8, head_dim: int = 128, shapes=DECODE_SHAPES,
               out_dir: Optional[str] = None) -> List[Dict]:
    import flash_ext
    from torch.nn.attention import SDPBackend
    dt = torch.bfloat16
    fa2 = _fa2_kvcache()
    print(f"decode: 1 query token, {heads_q} q / {heads_kv} kv heads, d={head_dim}, bf16, full caches, "
          f"{torch.cuda.get_device_name()}; do_bench medians (L2 flushed); FlashAttention-2 "
          f"{'timed' if fa2 else 'not installed'}")
    cols = ["flash_ext", "paged16", "paged256", "cudnn", "sdpa_flash"] + (["fa2"] if fa2 else [])
    print(f"{'batch x keys':>13} {'us':>8} " + " ".join(f"{c:>10}" for c in cols) + "  (GB/s)  x cudnn  paged/contig")
    rows = []
    for b, n in shapes:
        gb = b * n * heads_kv * head_dim * 2 * 2 / 1e9
        q = torch.randn(b, 1, heads_q, head_dim, device="cuda", dtype=dt)
        kc = torch.randn(b, n, heads_kv, head_dim, device="cuda", dtype=dt)
        vc = torch.randn_like(kc)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        us = {"flash_ext": _median_us(lambda: flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens))}
        for page in PAGE_SIZES:
            perm = torch.randperm(b * n // page, device="cuda", dtype=torch.int32)
            kp, vp = _paged(kc, page, perm), _paged(vc, page, perm)
            table = perm.view(b, n // page)
            us[f"paged{page}"] = _median_us(lambda: flash_ext.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lens, block_table=table))
            del kp, vp
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with _sdpa(backend):
                    F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                    us[name] = _median_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
            except RuntimeError:
                us[name] = float("nan")
        if fa2:
            us["fa2"] = _median_us(lambda: fa2(q, kc, vc, cache_seqlens=lens))
        gbs = {k: gb / (v * 1e-6) for k, v in us.items()}
        row = dict(batch=b, keys=n, us=us, gb_per_s=gbs, x_cudnn=us["cudnn"] / us["flash_ext"],
                   paged_vs_contiguous={p: us["flash_ext"] / us[f"paged{p}"] for p in PAGE_SIZES})
        rows.append(row)
        paged = "/".join(f"{row['paged_vs_contiguous'][p]:.2f}" for p in PAGE_SIZES)
        print(f"{f'{b} x {n}':>13} {us['flash_ext']:8.1f} " + " ".join(f"{gbs[c]:10.0f}" for c in cols) +
              f"  {row['x_cudnn']:14.2f}  {paged:>12}", flush=True)
        del q, kc, vc, qt, kt, vt

    # Host time per call at a small shape (the GPU keeps up; the loop's wall time is the host's).
    b, n = 1, 8192
    q = torch.randn(b, 1, heads_q, head_dim, device="cuda", dtype=dt)
    kc = torch.randn(b, n, heads_kv, head_dim, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    host = {"flash_ext": host_us(lambda: flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens))}
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    try:
        with _sdpa(SDPBackend.CUDNN_ATTENTION):
            host["sdpa_cudnn"] = host_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
    except RuntimeError:
        host["sdpa_cudnn"] = float("nan")
    print(f"host time per decode call (CPU us, {b} x {n}): " +
          ", ".join(f"{k} {v:.1f}" for k, v in host.items()) +
          f"; flash_ext / sdpa_cudnn {host['flash_ext'] / host['sdpa_cudnn']:.2f}")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "bench_decode.json")
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, heads_q=heads_q,
                           heads_kv=heads_kv, head_dim=head_dim, rows=rows, host_us=host), f, indent=1)
        print(f"wrote {path}")
    return rows
