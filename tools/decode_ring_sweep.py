"""The decode kernel's ring depth x forced split count, per shape: GB/s of K+V read by the raw
op flash_ext::fwd_kvcache (no append; GQA 32/8, bf16, one query token), to check or re-fit
choose_decode_config (csrc/tuning/heuristics.cpp; developer tool for docs/perf-notes.md).

    PYTHONPATH=. python tools/decode_ring_sweep.py [--rings 2,3,4] [--page 0|16|64|256]
        [--shapes 1x8192,1x131072] [--splits 0,1,2,4,8,12,16,24,32,48] [--d 128]

One line per (shape, ring): `BxN ring R: S:GBps ...` for each split count S (0: the heuristic's
choice for that ring), then `BxN auto: GBps` (ring and splits both chosen). A ring that does not
fit the device runs the deepest that does (FLASH_EXT_DECODE_RING's rule), so its line repeats that
ring's. Times: triton's do_bench median, L2 flushed between calls (flash_ext.bench_decode's)."""
import argparse

import torch

import flash_ext  # noqa: F401  (registers the ops)
from flash_ext.bench_decode import _median_us

SHAPES = "1x8192,1x32768,1x131072,2x16384,4x32768,8x65536,16x8192,32x16384,64x4096,128x2048"


def cache(b, n, hkv, d, page, dt):
    """K and V caches of n keys per sequence, contiguous or paged (pages shuffled), and the table."""
    if not page:
        kc = torch.randn(b, n, hkv, d, device="cuda", dtype=dt)
        return kc, torch.randn_like(kc), None
    pages = b * n // page
    kc = torch.randn(pages, page, hkv, d, device="cuda", dtype=dt)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, n // page)
    return kc, torch.randn_like(kc), table


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rings", default="2,3,4")
    ap.add_argument("--page", type=int, default=0, help="page size (0: contiguous cache)")
    ap.add_argument("--shapes", default=SHAPES, help="batch x keys, comma-separated")
    ap.add_argument("--splits", default="0,1,2,3,4,6,8,12,16,24,32,48")
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args()
    ops = torch.ops.flash_ext
    dt, hq, hkv, d = torch.bfloat16, 32, 8, args.d
    splits = [int(s) for s in args.splits.split(",")]
    print(f"{torch.cuda.get_device_name()}; GQA {hq}/{hkv} d {d} bf16; "
          f"{'pages of %d' % args.page if args.page else 'contiguous'}; GB/s of K+V", flush=True)
    for shape in args.shapes.split(","):
        b, n = (int(x) for x in shape.split("x"))
        gb = b * n * hkv * d * 4 / 1e9
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=dt)
        kc, vc, table = cache(b, n, hkv, d, args.page, dt)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")

        def call(s):
            return lambda: ops.fwd_kvcache(q, kc, vc, None, None, lens, -1, 0, None, None, table, None,
                                           d ** -0.5, False, -1, -1, 0.0, True, s)

        try:
            for ring in args.rings.split(","):
                ops.set_tuning("FLASH_EXT_DECODE_RING", ring)
                line = " ".join(f"{s}:{gb / _median_us(call(s)) * 1e6:.0f}" for s in splits)
                print(f"{shape} ring {ring}: {line}", flush=True)
            ops.set_tuning("FLASH_EXT_DECODE_RING", "auto")
            print(f"{shape} auto: {gb / _median_us(call(0)) * 1e6:.0f}", flush=True)
        finally:
            ops.set_tuning("FLASH_EXT_DECODE_RING", "")


if __name__ == "__main__":
    main()
