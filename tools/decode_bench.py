"""Decode with a KV cache: flash_ext.flash_attn_with_kvcache beside SDPA's cuDNN and flash
backends (docs/design-flash-decoding.md section 4), as GB/s of K and V read.

    PYTHONPATH=. python tools/decode_bench.py [--shapes 1x8192,8x65536] [--hq 32 --hkv 8 --d 128]

One query token per sequence, the cache full to its capacity (every key read), bf16. Times are
triton's do_bench medians (L2 flushed between calls); GB/s = batch x keys x hkv x d x 2 (K, V)
x 2 bytes / time. Also a paged cache (pages of 16 and 256) for flash_ext.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext

SHAPES = "1x8192,1x131072,8x65536,32x16384,64x4096"


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="batch x keys, comma separated")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    a = ap.parse_args()
    dt = torch.bfloat16
    print(f"decode, 1 query token, {a.hq} q / {a.hkv} kv heads, d={a.d}, bf16, {torch.cuda.get_device_name()}")
    print(f"{'batch x keys':>14} {'flash_ext':>10} {'paged 16':>10} {'paged 256':>10} {'cudnn':>10} {'sdpa flash':>10}"
          f"  GB/s;  x cudnn")
    for shape in a.shapes.split(","):
        b, n = (int(x) for x in shape.split("x"))
        gbytes = b * n * a.hkv * a.d * 2 * 2 / 1e9
        q = torch.randn(b, 1, a.hq, a.d, device="cuda", dtype=dt)
        kc = torch.randn(b, n, a.hkv, a.d, device="cuda", dtype=dt)
        vc = torch.randn(b, n, a.hkv, a.d, device="cuda", dtype=dt)
        seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        res = {"flash_ext": bench(lambda: flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens))}
        for page in (16, 256):
            pages = b * n // page
            perm = torch.randperm(pages, device="cuda", dtype=torch.int32)
            table = perm.view(b, n // page)
            kp = kc.view(pages, page, a.hkv, a.d)[perm.argsort()].contiguous()  # page table[b, i] holds block i
            vp = vc.view(pages, page, a.hkv, a.d)[perm.argsort()].contiguous()
            res[f"paged {page}"] = bench(lambda: flash_ext.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=seqlens, block_table=table))
            del kp, vp
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                    res[name] = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
            except RuntimeError:
                res[name] = float("nan")
        cells = " ".join(f"{gbytes / (res[k] * 1e-6):10.0f}" for k in ("flash_ext", "paged 16", "paged 256", "cudnn",
                                                                       "sdpa flash"))
        print(f"{shape:>14} {cells}  {res['cudnn'] / res['flash_ext']:.2f}x   ({res['flash_ext']:.1f} us)", flush=True)
        del q, kc, vc


if __name__ == "__main__":
    main()
