"""A/B timing of Hopper forward variants selected by environment variables, beside cuDNN, in one
process (developer tool for docs/perf-notes.md).

Usage: PYTHONPATH=. python tools/ab_sm90.py [--variants auto,old,tma_off,per_tile] [--hdims 64,128]
       [--seqlens 1024,4096] [--masks full,causal,local] [--rounds N] [--no-cudnn] [--bh 1x10]

Variants (environment variables read by flash_api.cpp at each call):
  auto      the defaults: TMA-store epilogue (at d = 256 staged in Q's buffer), persistent grid
            (tiles claimed from a counter under causal/local masks)
  old       the defaults before the TMA store and the dynamic scheduler: register epilogue, and
            one CTA per tile under masks
  tma_off   FLASH_EXT_SM90_TMA_STORE=0 (register epilogue), grid as auto
  per_tile  FLASH_EXT_SM90_PERSISTENT=0 (one CTA per tile), epilogue as auto
  persist   FLASH_EXT_SM90_PERSISTENT=1 (= auto since the dynamic scheduler)
  nopp      FLASH_EXT_SM90_PINGPONG=0
  pp_tile   FLASH_EXT_SM90_PINGPONG=tile (turns re-synchronised at every tile, as before 2026-11-22)
  eager     FLASH_EXT_SM90_LAZY_RESCALE=0 (O rescaled whenever a row's max grows)
  no_sect   FLASH_EXT_SM90_HEAD_SECTIONS=0 (masked tiles longest first over all heads)
  sect      FLASH_EXT_SM90_HEAD_SECTIONS=always (head sections whatever the bandwidth estimate)
  uneven    FLASH_EXT_SM90_HEAD_SECTIONS=uneven (full sections and a smaller last one: before session 7)
  base      FLASH_EXT_SM90_FWD_TILE=base (d = 64: 128 x 128 tiles, d = 256: 128 x 64)
  alt_tile  FLASH_EXT_SM90_FWD_TILE=alt (d = 64: 192 x 128 tiles, d = 256: 128 x 80)
  alt_nopp  alt_tile without ping-pong
  pp        FLASH_EXT_SM90_PINGPONG=1 (ping-pong forced on, the turn passed right after the issue;
            auto has it off at d = 256 without a mask)
  row0      FLASH_EXT_SM90_ALIGN_END=0 (causal query tiles from row 0, not aligned to end at seqlen_q)
  nosk      FLASH_EXT_SM90_STREAM_K=0 (no mask: the last partial wave's tiles walked whole)
  sk        FLASH_EXT_SM90_STREAM_K=1 (the stream-K tail wherever it can run, not only where auto
            expects a gain)
The variants of one row and cuDNN are timed in turns, --rounds times, in the balanced order of
flash_ext.bench (each one right after every column, itself included, equally often over
flash_ext.bench.balanced_period(columns) rounds: 6 for three columns, 8 for four, the default
--rounds), and each reports its median over the rounds, so that
clock, power and thermal drift hit all of them alike (cuDNN moved by up to 25% between runs:
compare within one run; up to session 14 the order was rotated, cuDNN always after the same
variant).
TFLOP/s: 4 * b * h * s^2 * d, halved for causal; local (window (512, 0)): 4 * b * h * d * the
number of visible (query, key) pairs."""
import argparse
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from flash_ext.bench import _env, balanced, balanced_period
from flash_ext.bench import time_ms as _bench_time_ms


def time_ms(fn, reps=20, warmup=5):
    return _bench_time_ms(fn, reps, warmup)


# name -> env for a call with this mask (a function where the variant depends on the mask).
VARIANTS = {
    "auto": {},
    "old": lambda mask: {"FLASH_EXT_SM90_TMA_STORE": "0",
                         **({"FLASH_EXT_SM90_PERSISTENT": "0"} if mask != "full" else {})},
    "tma_off": {"FLASH_EXT_SM90_TMA_STORE": "0"},
    "per_tile": {"FLASH_EXT_SM90_PERSISTENT": "0"},
    "persist": {"FLASH_EXT_SM90_PERSISTENT": "1"},
    "nopp": {"FLASH_EXT_SM90_PINGPONG": "0"},
    "pp_tile": {"FLASH_EXT_SM90_PINGPONG": "tile"},
    "eager": {"FLASH_EXT_SM90_LAZY_RESCALE": "0"},
    "no_sect": {"FLASH_EXT_SM90_HEAD_SECTIONS": "0"},
    "sect": {"FLASH_EXT_SM90_HEAD_SECTIONS": "always"},
    "uneven": {"FLASH_EXT_SM90_HEAD_SECTIONS": "uneven"},
    "base": {"FLASH_EXT_SM90_FWD_TILE": "base"},
    "alt_tile": {"FLASH_EXT_SM90_FWD_TILE": "alt"},
    "alt_nopp": {"FLASH_EXT_SM90_FWD_TILE": "alt", "FLASH_EXT_SM90_PINGPONG": "0"},
    "pp": {"FLASH_EXT_SM90_PINGPONG": "1"},
    "row0": {"FLASH_EXT_SM90_ALIGN_END": "0"},
    "nosk": {"FLASH_EXT_SM90_STREAM_K": "0"},
    "sk": {"FLASH_EXT_SM90_STREAM_K": "1"},
}
MASK_KW = {"full": {}, "causal": {"causal": True}, "local": {"window_size": (512, 0)}}


def ints(text):
    return [int(x) for x in text.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="auto,old,tma_off,per_tile")
    ap.add_argument("--hdims", type=ints, default=[64, 128, 256])
    ap.add_argument("--seqlens", type=ints, default=[1024, 4096, 16384])
    ap.add_argument("--masks", default="full,causal")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds per row (default: the balanced order's period for the columns)")
    ap.add_argument("--no-cudnn", action="store_true")
    ap.add_argument("--bh", default=None,
                    help="batch x heads, e.g. 1x10 (default: b = 16384 / s, h = 2048 / d, the bench grid)")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be >= 1")
    masks = args.masks.split(",")
    cols = names + ([] if args.no_cudnn else ["cudnn"])
    print(f"{'config':28s} " + " ".join(f"{k:>9s}" for k in cols), flush=True)
    for d in args.hdims:
        for s in args.seqlens:
            for mask in masks:
                b, h = (max(1, 16384 // s), 2048 // d) if args.bh is None else map(int, args.bh.split("x"))
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                if mask == "local":
                    w = MASK_KW["local"]["window_size"][0]
                    flops = 4 * b * h * d * sum(min(i + 1, w + 1) for i in range(s))
                else:
                    flops = 4 * b * h * s * s * d / (1 if mask == "full" else 2)
                kw = MASK_KW[mask]
                # cuDNN is timed in the same rounds as the variants, in the balanced order (SDPA
                # has no sliding window without a dense mask: "-" for local).
                cudnn = not args.no_cudnn and mask != "local"
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                times = {n: [] for n in names + ["cudnn"]}
                order = names + (["cudnn"] if cudnn else [])
                rounds = args.rounds or balanced_period(len(order))
                for r in range(rounds):
                    for n in balanced(order, r):
                        if n == "cudnn":
                            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                                times[n].append(time_ms(
                                    lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=mask == "causal")))
                            continue
                        variant = VARIANTS[n]
                        with _env(**(variant(mask) if callable(variant) else variant)):
                            times[n].append(time_ms(lambda: flash_ext.attn_fwd(q, k, v, **kw)))
                row = [f"{flops / statistics.median(times[n]) / 1e9:.1f}" for n in names]
                if not args.no_cudnn:
                    row.append(f"{flops / statistics.median(times['cudnn']) / 1e9:.1f}" if cudnn else "-")
                print(f"d={d:<3d} s={s:<5d} {mask:6s} b{b}h{h:<3d}" + " ".join(f"{x:>9s}" for x in row), flush=True)


if __name__ == "__main__":
    main()
