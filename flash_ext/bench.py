"""Attention throughput, flash_ext against PyTorch SDPA and FlashAttention, side by side in one
process.

    python -m flash_ext.bench                 # full sweep: fwd, bwd, fwd+bwd
    python -m flash_ext.bench --quick         # bf16, seqlens 1k/4k/16k: a few minutes
    python -m flash_ext.bench --dtypes fp16 --hdims 128 --seqlens 2048,8192 --causal true
    python -m flash_ext.bench --quick --directions bwd --plot ratios.png
    python -m flash_ext.bench --decode      # KV-cache decode: GB/s and us per call (bench_decode.py)
    python -m flash_ext.bench --decode-loop --quick  # greedy decode of a small Llama: tokens/s
                                                     # (bench_decode_loop.py)
    python -m flash_ext.bench --mask all    # FlashMask vs FlexAttention and SDPA (bench_mask.py)

Backends: flash_ext (attn_fwd and its autograd backward); flash_ext forced onto its
FlashAttention-2 kernels (ext_sm80); torch.nn.functional.scaled_dot_product_attention restricted
(with torch.nn.attention.sdpa_kernel) to FLASH_ATTENTION and to CUDNN_ATTENTION; and, where they
import (--peers), FlashAttention-2 (flash_attn.flash_attn_func), FlashAttention-3
(flash_attn_interface.flash_attn_func) and FlashAttention-4 (flash_attn.cute.flash_attn_func).
All read the same (batch, seqlen, heads, headdim) tensors (SDPA gets (batch, heads, seqlen,
headdim) transposed views of them) and are timed the same way. Shapes: batch = 16384 // seqlen,
heads = 2048 // headdim (16k tokens of model width 2048 per config). A backend that fails on a
config gets "n/a" there, with the reason in a footnote under the table; the run goes on.

Directions (--directions, default all three):
  fwd     one forward call (no autograd graph);
  bwd     one backward: torch.autograd.grad(out, (q, k, v), dout) on an out computed once
          beforehand by the same backend (the same autograd path for every backend);
  fwdbwd  forward with autograd, then that backward.

Metric: FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * headdim (two matmuls), halved for
causal, times 1 (fwd), 2.5 (bwd: five matmuls) or 3.5 (fwdbwd); TFLOP/s = FLOPs / median time.
Ratios ("ext/flash", "ext/fa3", ...) are flash_ext's TFLOP/s over the other backend's: above 1,
flash_ext is faster. Times: CUDA events around each call, after warmup, median of --reps calls;
that is one round, and a config runs --rounds rounds (3; 1 with --quick), each timing every
backend in turn, and keeps each backend's median round, so that clock and power drift during a
config hit all backends alike instead of whichever ran last. The order of the turns (--order)
is by default serially balanced: over 8 rounds of the 4 built-in backends each one runs right
after every other backend twice, and twice right after itself (its turn ends one round and
opens the next). A burst's clock depends on the power drawn just before it, so a fixed cyclic
order (--order rotated) times each backend after the same neighbour in most rounds. Use a
multiple of the period (8 for 4 backends, 14 for 7) for the full balance. --gap-s S idles S
seconds before each backend's turn. Each timed turn is kept in the JSON (`samples`: round,
backend, the backend timed right before it, median ms), and tools/carryover.py tabulates a
backend's times by that neighbour. The L2 cache is not flushed between calls: every config
moves at least 3 x 64 MiB of q, k, v, several times the L2, so a warm cache changes little.
--warmup-s S adds S seconds of back-to-back calls before each backend's timed calls: by default
a round times a short burst, which an idle GPU runs at its top clock; a training loop runs at
the power cap (an H100: 700 W, 1.5-1.9 GHz), where a backend that spends less energy per FLOP
keeps a higher clock.

Memory: "extra MiB" is the peak memory allocated during one flash_ext call minus what was
allocated before it (inputs, and for bwd also out, lse, dout and what autograd saved) and minus
the bytes of what the call returns (fwd: out and lse; bwd and fwdbwd: dq, dk, dv): the workspace
beyond inputs and outputs.

Host time: after the table, the CPU time per call of one forward + backward step (the fwdbwd
callable above) on a problem so small that the GPU never holds the host back (b=1 s=128 h=2
d=128, causal, bf16), for flash_ext, SDPA flash and the peers: what bounds short, launch-bound
steps. --no-host-time skips it.

Outputs: progress on stderr (case i of n, elapsed, ETA, the case's TFLOP/s); the table, its
footnotes and the host times on stdout; in --out (default bench_out/): bench_<directions>.json
(GPU, torch version, peers, date, rows, host times) and a PNG of the ratios (--plot PATH, default
bench_<directions>.png in --out; needs matplotlib: pip install ".[bench]").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import importlib
import importlib.util
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch

TOKENS = 16384  # batch * seqlen of every config
MODEL_DIM = 2048  # heads * headdim of every config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_HDIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096, 16384)

# FLOPs of one call relative to the forward pass (the papers' convention: backward = 2.5 x fwd).
DIRECTIONS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}

# flash_ext_sm80: flash_ext with FLASH_EXT_FWD_PATH=sm80 and FLASH_EXT_BWD_PATH=sm80 (the
# FlashAttention-2 kernels), to compare the two paths on Hopper. Same numbers as flash_ext elsewhere.
BACKEND_NAMES = ("flash_ext", "flash_ext_sm80", "sdpa_flash", "sdpa_cudnn")
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}


@dataclass(frozen=True)
class Peer:
    """Another attention library timed beside flash_ext when it imports: ``module.attr`` is a
    FlashAttention-style ``fn(q, k, v, causal=...)`` on (batch, seqlen, heads, headdim) tensors
    returning out or (out, lse, ...)."""

    name: str  # column name
    label: str
    module: str
    attr: str = "flash_attn_func"


PEERS = (Peer("fa2", "FlashAttention-2", "flash_attn"),
         Peer("fa3", "FlashAttention-3", "flash_attn_interface"),
         Peer("fa4", "FlashAttention-4", "flash_attn.cute"))
PEER_NAMES = tuple(p.name for p in PEERS)
ALL_BACKENDS = BACKEND_NAMES + PEER_NAMES
# table headers (and short names in the ratio columns)
COLUMN_LABELS = {"flash_ext": "flash_ext", "flash_ext_sm80": "ext_sm80", "sdpa_flash": "sdpa_flash",
                 "sdpa_cudnn": "sdpa_cudnn", "fa2": "fa2", "fa3": "fa3", "fa4": "fa4"}
RATIO_LABELS = {"sdpa_flash": "flash", "sdpa_cudnn": "cudnn", "flash_ext_sm80": "sm80"}


# ----------------------------------------------------------------------------------------------
# Metrics, table and progress (pure Python, CPU-testable)
# ----------------------------------------------------------------------------------------------


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                    causal: bool, direction: str = "fwd") -> float:
    """FLOPs of one attention call: 4 * b * h * sq * sk * d (QK^T and PV, 2 FLOPs per
    multiply-add), halved for causal, times the direction's factor (fwd 1, bwd 2.5,
    fwdbwd 3.5)."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * headdim
    if causal:
        flops /= 2
    return flops * DIRECTIONS[direction]


def tflops_per_s(flops: float, ms: Optional[float]) -> Optional[float]:
    """FLOPs / (ms milliseconds) in TFLOP/s; None when the time is missing or not positive."""
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


@dataclass(frozen=True)
class Config:
    """One benchmark shape."""

    dtype: str
    headdim: int
    seqlen: int
    causal: bool
    direction: str = "fwd"

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    @property
    def heads(self) -> int:
        return max(1, MODEL_DIM // self.headdim)

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.headdim,
                               self.causal, self.direction)

    @property
    def name(self) -> str:
        c = "causal" if self.causal else "full"
        return (f"{self.direction} {self.dtype} d={self.headdim} s={self.seqlen} "
                f"b={self.batch} h={self.heads} {c}")


def make_configs(dtypes: Sequence[str], hdims: Sequence[int], seqlens: Sequence[int],
                 causal_modes: Sequence[bool], directions: Sequence[str] = ("fwd",)
                 ) -> list[Config]:
    """Every combination, in a stable order (direction, dtype, causal, headdim, seqlen)."""
    return [Config(dt, d, s, c, direction)
            for direction in directions for dt in dtypes for c in causal_modes
            for d in hdims for s in seqlens]


@dataclass
class Row:
    """Results of one config: TFLOP/s per backend (None = unsupported / failed)."""

    config: str
    dtype: str
    headdim: int
    seqlen: int
    batch: int
    heads: int
    causal: bool
    direction: str
    tflops: dict = field(default_factory=dict)  # backend name -> TFLOP/s or None
    ms: dict = field(default_factory=dict)  # backend name -> median ms or None
    extra_mib: Optional[float] = None  # flash_ext workspace beyond inputs and outputs
    errors: dict = field(default_factory=dict)  # backend name -> error message
    # every timed turn: {"round", "backend", "after" (the backend timed just before, or None), "ms"}
    samples: list = field(default_factory=list)

    def ratio_to(self, backend: str) -> Optional[float]:
        """flash_ext's TFLOP/s over ``backend``'s (> 1: flash_ext faster)."""
        return ratio(self.tflops.get("flash_ext"), self.tflops.get(backend))

    @property
    def ratio_flash(self) -> Optional[float]:
        return self.ratio_to("sdpa_flash")

    @property
    def ratio_cudnn(self) -> Optional[float]:
        return self.ratio_to("sdpa_cudnn")

    def to_json(self) -> dict:
        d = asdict(self)
        d["ratio_ext_over_flash"] = self.ratio_flash
        d["ratio_ext_over_cudnn"] = self.ratio_cudnn
        d["ratios_ext_over"] = {b: self.ratio_to(b) for b in self.tflops if b != "flash_ext"}
        return d


# the columns every table has; peers that ran add theirs (and their ratio columns)
TABLE_COLUMNS = ("config", "flash_ext", "ext_sm80", "sdpa_flash", "sdpa_cudnn", "ext/flash",
                 "ext/cudnn", "sm80/flash", "extra MiB")


def _fmt(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table_backends(rows: Sequence[Row]) -> list[str]:
    """The built-in backends, then the peers that any row has a result or an error for."""
    seen = {b for r in rows for b in (*r.tflops, *r.errors)}
    return list(BACKEND_NAMES) + [p for p in PEER_NAMES if p in seen]


def format_table(rows: Sequence[Row], backends: Optional[Sequence[str]] = None) -> str:
    """A fixed-width text table: TFLOP/s per backend, flash_ext's ratio to each other backend
    (sm80/flash: the FlashAttention-2 kernels' over SDPA flash), extra memory; a backend that
    failed on a config shows "n/a[k]", with the reason in footnote k under the table."""
    backends = list(backends) if backends is not None else table_backends(rows)
    peers = [b for b in backends if b in PEER_NAMES]
    ratio_of = ["sdpa_flash", "sdpa_cudnn"] + peers
    header = (["config"] + [COLUMN_LABELS.get(b, b) for b in backends]
              + ["ext/" + RATIO_LABELS.get(b, b) for b in ratio_of] + ["sm80/flash", "extra MiB"])
    notes: dict = {}  # (backend, message) -> footnote number

    def tflops_cell(r: Row, b: str) -> str:
        if b in r.errors:
            k = notes.setdefault((b, r.errors[b]), len(notes) + 1)
            return f"n/a[{k}]"
        return _fmt(r.tflops.get(b))

    def ratio_cell(r: Row, a: str, b: str) -> str:
        if a in r.errors or b in r.errors:
            return "n/a"
        return _fmt(ratio(r.tflops.get(a), r.tflops.get(b)), 2)

    body = [[r.config] + [tflops_cell(r, b) for b in backends]
            + [ratio_cell(r, "flash_ext", b) for b in ratio_of]
            + [ratio_cell(r, "flash_ext_sm80", "sdpa_flash"), _fmt(r.extra_mib, 1)] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h)
              for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(cells) for cells in body]
    if notes:
        counts: dict = {}
        for r in rows:
            for b, e in r.errors.items():
                counts[(b, e)] = counts.get((b, e), 0) + 1
        out += ["", "n/a: the backend failed on that config (it is left out there; the run goes on):"]
        out += [f"  [{k}] {COLUMN_LABELS.get(b, b)} ({counts[(b, e)]} config"
                f"{'s' if counts[(b, e)] > 1 else ''}): {e}" for (b, e), k in notes.items()]
    return "\n".join(out)


def format_duration(seconds: float) -> str:
    """m:ss below an hour, else h:mm:ss."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def eta_seconds(elapsed: float, done: int, total: int) -> Optional[float]:
    """Seconds left if the remaining cases take as long on average as the done ones; None
    before the first is done."""
    if done <= 0:
        return None
    return elapsed / done * max(0, total - done)


def progress_line(done: int, total: int, elapsed: float, text: str = "") -> str:
    """``case 3/54, 0:42 elapsed, ETA 11:20: <text>``."""
    eta = eta_seconds(elapsed, done, total)
    head = (f"case {done:>{len(str(total))}}/{total}, {format_duration(elapsed)} elapsed, "
            f"ETA {'?' if eta is None else format_duration(eta)}")
    return f"{head}: {text}" if text else head


def _parse_int_list(text: str) -> list[int]:
    vals = []
    for tok in text.replace(";", ",").split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        mult = 1
        if tok.endswith("k"):
            tok, mult = tok[:-1], 1024
        vals.append(int(tok) * mult)
    if not vals:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {text!r}")
    return vals


def _parse_directions(text: str) -> list[str]:
    vals = []
    for v in (t.strip().lower() for t in text.split(",")):
        if not v:
            continue
        if v not in DIRECTIONS:
            raise argparse.ArgumentTypeError(
                f"unknown direction {v!r}; choose from {', '.join(DIRECTIONS)}")
        if v not in vals:
            vals.append(v)
    if not vals:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of directions, got {text!r}")
    return vals


def _parse_dtypes(text: str) -> list[str]:
    vals = [t.strip().lower() for t in text.split(",") if t.strip()]
    for v in vals:
        if v not in DTYPES:
            raise argparse.ArgumentTypeError(f"unknown dtype {v!r}; choose from bf16, fp16")
    return vals


def _parse_peers(text: str) -> list[str]:
    text = text.strip().lower()
    if text == "auto":
        return list(PEER_NAMES)
    if text == "none":
        return []
    vals = []
    for v in (t.strip() for t in text.split(",")):
        if v not in PEER_NAMES:
            raise argparse.ArgumentTypeError(
                f"unknown peer {v!r}; choose from auto, none or {', '.join(PEER_NAMES)}")
        if v not in vals:
            vals.append(v)
    return vals


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


MATPLOTLIB_HINT = "pip install matplotlib, or flash_ext's bench extra: pip install \".[bench]\""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flash_ext.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="bf16 only, seqlens 1k,4k,16k, fewer reps (a few minutes on an H100 "
                        "for all three directions)")
    p.add_argument("--directions", type=_parse_directions, default=list(DIRECTIONS),
                   help="comma-separated subset of fwd,bwd,fwdbwd (default: all)")
    p.add_argument("--dtypes", type=_parse_dtypes, default=None, help="e.g. bf16,fp16")
    p.add_argument("--hdims", type=_parse_int_list, default=None, help="e.g. 64,128,256")
    p.add_argument("--seqlens", type=_parse_int_list, default=None, help="e.g. 1k,4096,16k")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--peers", type=_parse_peers, default=list(PEER_NAMES),
                   help="FlashAttention versions to time beside flash_ext: auto (default: each "
                        "of fa2, fa3, fa4 that imports), none, or a comma-separated list")
    p.add_argument("--reps", type=int, default=None, help="timed calls per backend (median)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first")
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="seconds of back-to-back calls before each backend's timed calls, in "
                        "every round (default 0: a burst from a cool GPU; ~1 s reaches the power-"
                        "capped steady state of a training loop)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per config, backends timed in turn in each (median round; "
                        "default 3, 1 with --quick; a multiple of 8 balances the order of the 4 "
                        "built-in backends fully)")
    p.add_argument("--order", choices=tuple(ORDERS), default="balanced",
                   help="order of the backends' turns in each round: balanced (default: each "
                        "backend right after every backend, itself included, equally often "
                        "over a period of rounds) or rotated (one fixed cyclic order)")
    p.add_argument("--gap-s", type=float, default=0.0,
                   help="seconds idle before each backend's turn (default 0)")
    p.add_argument("--host-time", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the host (CPU) time of one small fwd+bwd step per backend "
                        "after the table (default: on)")
    p.add_argument("--decode", action="store_true",
                   help="run the decode section instead (flash_attn_with_kvcache against SDPA's "
                        "backends at issue 26's shapes; flash_ext/bench_decode.py)")
    p.add_argument("--decode-loop", action="store_true",
                   help="run the decode-loop section instead (tokens/s of a greedy decode loop "
                        "of a small Llama-architecture model, flash_attn_with_kvcache against "
                        "SDPA, eager and CUDA graph; --quick: 3 cells; --rounds: loops per variant; "
                        "flash_ext/bench_decode_loop.py)")
    p.add_argument("--mask", default=None, metavar="MASKS",
                   help="run the mask section instead (flashmask_attention against "
                        "FlexAttention and SDPA with a dense mask; flash_ext/bench_mask.py): all "
                        "or a comma-separated list of causal_doc, shared_question, prefix_lm, "
                        "sliding_window, global_sliding_window, causal_blockwise")
    p.add_argument("--mask-peers", default="flex,sdpa,causal",
                   help="the mask section's peers: a comma-separated subset of flex, sdpa, "
                        "causal (flash_ext's plain causal kernel)")
    p.add_argument("--sdpa-max-mib", type=float, default=1024.0,
                   help="the mask section times SDPA only when its dense mask fits this size")
    p.add_argument("--out", default="bench_out", help="directory for the JSON and PNG")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="where to write the PNG of the ratios (default: bench_<directions>.png "
                        "in --out, skipped with a message without matplotlib)")
    args = p.parse_args(argv)
    if args.mask is not None:
        from flash_ext import bench_mask
        try:
            args.mask_peers = bench_mask.parse_mask_peers(args.mask_peers)
            bench_mask.apply_mask_defaults(args, args.seqlens is not None, args.hdims is not None)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    if args.dtypes is None:
        args.dtypes = ["bf16"] if args.quick else ["bf16", "fp16"]
    if args.hdims is None:
        args.hdims = list(DEFAULT_HDIMS)
    if args.seqlens is None:
        args.seqlens = list(QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    if args.reps is None:
        args.reps = 10 if args.quick else 30
    if args.warmup is None:
        args.warmup = 3 if args.quick else 10
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.decode and args.decode_loop:
        p.error("--decode and --decode-loop are separate runs: give one")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.warmup_s < 0:
        p.error("--warmup-s must be >= 0")
    if args.gap_s < 0:
        p.error("--gap-s must be >= 0")
    if args.plot is not None and not have_matplotlib():
        # asked for a plot: say so before the sweep rather than after it
        p.error(f"--plot needs matplotlib ({MATPLOTLIB_HINT})")
    args.causal_modes = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    return args


# ----------------------------------------------------------------------------------------------
# Backends and peers
# ----------------------------------------------------------------------------------------------


def _error_text(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"[:300]


def load_peer(name: str) -> Callable:
    """The peer's attention function (ImportError / AttributeError etc. when it does not load)."""
    peer = next((p for p in PEERS if p.name == name), None)
    if peer is None:
        raise ValueError(f"unknown peer {name!r}")
    return getattr(importlib.import_module(peer.module), peer.attr)


def _peer_version(peer: Peer) -> str:
    """The module's own __version__, else every installed distribution of its top-level package
    (flash_attn.cute shares flash_attn with FlashAttention-2: both are named then)."""
    v = getattr(sys.modules.get(peer.module), "__version__", None)
    if isinstance(v, str):
        return v
    try:
        from importlib import metadata
        dists = metadata.packages_distributions().get(peer.module.split(".")[0], [])
        return ", ".join(f"{d} {metadata.version(d)}" for d in sorted(set(dists))) or "version unknown"
    except Exception:
        return "version unknown"


def detect_peers(names: Sequence[str] = PEER_NAMES) -> tuple[dict, dict]:
    """({peer: version text} for the peers that load, {peer: why not} for the others). Loading
    may fail in any way (a missing module, a compiled extension built for another torch)."""
    found, missing = {}, {}
    for peer in PEERS:
        if peer.name not in names:
            continue
        try:
            load_peer(peer.name)
            found[peer.name] = _peer_version(peer)
        except Exception as e:
            missing[peer.name] = _error_text(e)
    return found, missing


def backend_scope(name: str):
    """What a backend runs under, entered once around its timed calls (not per call, so that the
    context switch costs no host time inside the measurement): SDPA restricted to one kernel;
    flash_ext forced onto its sm80 kernels."""
    if name in SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[name])])
    if name == "flash_ext_sm80":
        return _tuning(FLASH_EXT_FWD_PATH="sm80", FLASH_EXT_BWD_PATH="sm80")
    return contextlib.nullcontext()


def _backend_inputs(name: str, q, k, v) -> tuple:
    """q, k, v in the backend's layout: SDPA's (batch, heads, seqlen, headdim) views of the
    (batch, seqlen, heads, headdim) tensors; the others take them as they are."""
    if name in SDPA_BACKENDS:
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return q, k, v


def _forward_fn(name: str, q, k, v, causal: bool) -> Callable[[], object]:
    """A zero-argument callable running one backend's forward on inputs in its layout; returns
    out or a tuple starting with out. Run it under ``backend_scope(name)``."""
    if name in ("flash_ext", "flash_ext_sm80"):
        import flash_ext
        return lambda: flash_ext.attn_fwd(q, k, v, causal=causal)
    if name in SDPA_BACKENDS:
        import torch.nn.functional as F
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if name in PEER_NAMES:
        fn = load_peer(name)
        return lambda: fn(q, k, v, causal=causal)
    raise ValueError(f"unknown backend {name!r}")


def make_backend_fn(name: str, direction: str, q, k, v, causal: bool) -> Callable[[], object]:
    """A zero-argument callable running one backend in one direction on (b, s, h, d) tensors
    q, k, v, to be called under ``backend_scope(name)``. bwd runs the forward once here
    (outside the timed callable)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}")
    if direction == "fwd":
        return _forward_fn(name, *_backend_inputs(name, q, k, v), causal)
    leaves = tuple(t.detach().requires_grad_() for t in _backend_inputs(name, q, k, v))
    fwd = _forward_fn(name, *leaves, causal)

    def forward():
        out = fwd()
        return out[0] if isinstance(out, (tuple, list)) else out

    with backend_scope(name):
        out = forward()
    dout = torch.randn_like(out)
    if direction == "bwd":
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    del out
    return lambda: torch.autograd.grad(forward(), leaves, dout)


@contextlib.contextmanager
def _tuning(**values):
    """Sets the extension's tuning switches (README: the FLASH_EXT_* switches, read from the
    environment once per process) for the duration of a block through flash_ext::set_tuning,
    then restores them."""
    ops = torch.ops.flash_ext
    prev = {k: ops.get_tuning(k) for k in values}
    for k, v in values.items():
        ops.set_tuning(k, v)
    try:
        yield
    finally:
        for k, v in prev.items():
            ops.set_tuning(k, v)


def time_ms(fn: Callable[[], object], reps: int, warmup: int, warmup_s: float = 0.0) -> float:
    """Median milliseconds of ``reps`` calls (each between two CUDA events) after ``warmup``
    calls, and then after ``warmup_s`` seconds of back-to-back calls (0: none)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if warmup_s > 0:
        # Back-to-back calls until the GPU has run this backend for warmup_s seconds: under a
        # sustained load an H100 sits at its power cap, at a lower clock than a short burst from
        # an idle GPU gets, and a backend's clock there depends on its energy per FLOP.
        t_end = time.perf_counter() + warmup_s
        while time.perf_counter() < t_end:
            for _ in range(4):
                fn()
            torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def extra_memory_mib(fn: Callable[[], object]) -> float:
    """Peak memory allocated during one call, minus memory allocated before it and minus the
    bytes of what it returns, in MiB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    extra = peak - before - _tensor_bytes(result)
    del result
    return extra / 2**20



def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` starting from entry ``round_index`` (mod its length): the order in which round
    ``round_index`` times its backends, so that no backend is always timed first or last. Each
    name still follows the same neighbour in every round but one: see ``balanced``."""
    shift = round_index % len(names)
    return list(names[shift:]) + list(names[:shift])


def _williams_rows(n: int) -> list[tuple[int, ...]]:
    """A Williams design: n rows (2n for odd n) in which each ordered pair of different items
    is adjacent equally often within the rows (not across the boundaries between rows)."""
    # 0, 1, n-1, 2, n-2, ...: its successive differences 1, -2, 3, -4, ... (mod n) are all
    # different, so the n shifts of the row give each ordered pair once as neighbours.
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [tuple((b + i) % n for b in base) for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]  # odd n: the mirrored square completes the balance
    return rows


@functools.lru_cache(maxsize=None)
def _serially_balanced_rows(n: int, max_nodes: int = 300_000) -> tuple[tuple[int, ...], ...]:
    """R permutations of range(n) (R = n, else 2n; from a depth-first search that tries at most
    max_nodes rows) such that each row starts with the item the previous row ended with
    (cyclically), and within the rows every ordered pair of different items is adjacent R / n
    times. Timed in sequence, every item then runs right after every other item, and right after
    itself (at the row boundaries), equally often: R / n times each. Falls back to a Williams
    design (balanced within rows only) where the search gives up (n >= 8; n = 7 takes ~0.5 s)."""
    if n < 2:
        return (tuple(range(n)),)
    rows_from = {a: [p for p in itertools.permutations(range(n)) if p[0] == a] for a in range(n)}
    for count in (n, 2 * n):
        per_pair = count // n
        uses: dict = {}
        rows: list = []
        nodes = [0]

        def extend() -> bool:
            if len(rows) == count:
                return rows[-1][-1] == rows[0][0]
            for row in rows_from[rows[-1][-1] if rows else 0]:
                nodes[0] += 1
                if nodes[0] > max_nodes:
                    raise TimeoutError
                pairs = list(zip(row, row[1:]))
                for pair in pairs:
                    uses[pair] = uses.get(pair, 0) + 1
                if all(uses[pair] <= per_pair for pair in pairs):
                    rows.append(row)
                    if extend():
                        return True
                    rows.pop()
                for pair in pairs:
                    uses[pair] -= 1
            return False

        try:
            if extend():
                return tuple(rows)
        except TimeoutError:
            break
    return tuple(_williams_rows(n))


def balanced(names: Sequence[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: row ``round_index`` of ``_serially_balanced_rows``.
    Over a period of n or 2n rounds (8 for the bench's 4 backends; 6 for 3 names) every name
    runs right after every other name, and right after itself (its turn ending one round and
    opening the next), equally often: what a backend inherits from the one timed before it
    (clock, power) is spread evenly over all backends instead of favouring the one timed after
    the coolest. ``balanced_period`` gives the period."""
    rows = _serially_balanced_rows(len(names))
    return [names[j] for j in rows[round_index % len(rows)]]


def balanced_period(count: int) -> int:
    """Rounds after which the balanced order of ``count`` names repeats (and is balanced)."""
    return len(_serially_balanced_rows(count))


ORDERS = {"balanced": balanced, "rotated": rotated}


def _release_after_failure() -> None:
    """After a backend fails: wait for the GPU and return the failed call's memory, so that the
    next backend starts clean (errors here are not the bench's to raise)."""
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def run_config(cfg: Config, reps: int, warmup: int, rounds: int = 1, device="cuda", warmup_s: float = 0.0,
               order: str = "balanced", gap_s: float = 0.0,
               backends: Sequence[str] = BACKEND_NAMES) -> Row:
    """Times every backend on one config: ``rounds`` rounds, each backend in turn in each round
    (in the order ``ORDERS[order]`` gives for the round; median of ``reps`` calls after
    ``warmup``, after ``gap_s`` seconds idle), and keeps each backend's median round. Every turn
    is recorded in ``row.samples``; a backend that raises is recorded in ``row.errors`` and
    left out of the later rounds."""
    torch.manual_seed(0)
    dtype = DTYPES[cfg.dtype]
    shape = (cfg.batch, cfg.seqlen, cfg.heads, cfg.headdim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device) for _ in range(3))
    row = Row(cfg.name, cfg.dtype, cfg.headdim, cfg.seqlen, cfg.batch, cfg.heads, cfg.causal,
              cfg.direction)
    backends = tuple(backends)
    fns: dict[str, Callable[[], object]] = {}
    times: dict[str, list[float]] = {name: [] for name in backends}
    order_of_round = ORDERS[order]
    previous = None  # the backend timed right before (None: the first turn of the config)
    for r in range(rounds):
        for name in order_of_round(backends, r):
            if name in row.errors:
                continue
            try:
                if name not in fns:
                    fns[name] = make_backend_fn(name, cfg.direction, q, k, v, cfg.causal)
                if gap_s > 0:
                    torch.cuda.synchronize()
                    time.sleep(gap_s)
                with backend_scope(name):
                    ms = time_ms(fns[name], reps, warmup, warmup_s)
                times[name].append(ms)
                row.samples.append({"round": r, "backend": name, "after": previous, "ms": ms})
                previous = name
            except Exception as e:  # a backend rejecting a shape is data, not a crash
                row.errors[name] = _error_text(e)
                fns.pop(name, None)
                _release_after_failure()
    for name in backends:
        ms = statistics.median(times[name]) if name not in row.errors and times[name] else None
        row.ms[name] = ms
        row.tflops[name] = tflops_per_s(cfg.flops, ms)
    if "flash_ext" in fns:
        fl = fns.pop("flash_ext")
        fns.clear()  # free the others' outputs and saved tensors before measuring the workspace
        row.extra_mib = extra_memory_mib(fl)
    del fns, q, k, v
    return row


# ----------------------------------------------------------------------------------------------
# Host time of a small step
# ----------------------------------------------------------------------------------------------

HOST_SHAPE = (1, 128, 2, 128)  # batch, seqlen, heads, headdim: the GPU work is far below the host's


def host_us_per_call(fn: Callable[[], object], calls: int = 200, repeats: int = 5,
                     warmup: int = 20, sync: Optional[Callable[[], None]] = None) -> float:
    """Host (CPU) microseconds per call: the median over ``repeats`` of time.perf_counter around
    ``calls`` calls, the GPU synchronised before each batch and after it (outside the timed span:
    the host's own time, not the GPU's)."""
    sync = torch.cuda.synchronize if sync is None else sync
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(per_call)


def measure_host_time(backends: Sequence[str], device="cuda") -> tuple[dict, dict]:
    """({backend: host us per fwd+bwd step}, {backend: error}) for flash_ext, SDPA flash and the
    peers among ``backends``, each step the bench's fwdbwd callable on HOST_SHAPE, causal, bf16."""
    names = ["flash_ext", "sdpa_flash"] + [b for b in backends if b in PEER_NAMES]
    torch.manual_seed(0)
    q, k, v = (torch.randn(HOST_SHAPE, dtype=torch.bfloat16, device=device) for _ in range(3))
    times, errors = {}, {}
    for name in names:
        try:
            fn = make_backend_fn(name, "fwdbwd", q, k, v, True)
            with backend_scope(name):
                times[name] = host_us_per_call(fn)
        except Exception as e:
            errors[name] = _error_text(e)
            _release_after_failure()
    return times, errors


def format_host_time(times: dict, errors: dict) -> str:
    b, s, h, d = HOST_SHAPE
    out = ["host time per call (CPU us): flash_ext fwd+bwd step vs SDPA flash",
           f"  (b={b} s={s} h={h} d={d} causal bf16: forward + torch.autograd.grad; median of 5 x 200 calls)"]
    ext = times.get("flash_ext")
    for name in [*times, *(n for n in errors if n not in times)]:
        label = COLUMN_LABELS.get(name, name)
        if name in errors:
            out.append(f"  {label:<12} n/a ({errors[name]})")
            continue
        rel = "" if name == "flash_ext" or ext is None else f"   flash_ext / {label}: {ext / times[name]:.2f}"
        out.append(f"  {label:<12} {times[name]:8.1f} us{rel}")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------


def write_json(path: str, rows: Sequence[Row], args: argparse.Namespace,
               extra: Optional[dict] = None) -> None:
    meta = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "flops_convention": "4*b*h*sq*sk*d, halved for causal; x2.5 for bwd, x3.5 for fwdbwd",
        "args": {k: v for k, v in vars(args).items() if k != "causal_modes"},
        **(extra or {}),
        "rows": [r.to_json() for r in rows],
    }
    try:
        import flash_ext
        meta["flash_ext"] = {"version": flash_ext.__version__, "build_info": flash_ext.build_info()}
    except Exception as e:  # pragma: no cover
        meta["flash_ext"] = {"error": str(e)}
    with open(path, "w") as f:
        json.dump(meta, f, indent=2)


def _seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def write_plot(path: str, rows: Sequence[Row], backends: Optional[Sequence[str]] = None) -> bool:
    """flash_ext's TFLOP/s over each other backend's, one panel per (direction, dtype, mask),
    configs along x grouped by head dim. Returns False (after printing a message) when
    matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; skipping the plot ({MATPLOTLIB_HINT})")
        return False
    backends = list(backends) if backends is not None else table_backends(rows)
    others = [b for b in backends if b != "flash_ext"]
    colors = {b: plt.get_cmap("tab10")(i) for i, b in enumerate(others)}
    directions = [d for d in DIRECTIONS if any(r.direction == d for r in rows)]
    columns = sorted({(r.dtype, r.causal) for r in rows})
    nrows, ncols = max(1, len(directions)), max(1, len(columns))
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.0 * nrows), squeeze=False)
    for i, direction in enumerate(directions):
        for j, (dtype, causal) in enumerate(columns):
            ax = axes[i][j]
            rs = sorted((r for r in rows if (r.direction, r.dtype, r.causal) == (direction, dtype, causal)),
                        key=lambda r: (r.headdim, r.seqlen))
            # x: the configs in order, a gap between head dims
            xs, groups, x = [], {}, 0
            for n, r in enumerate(rs):
                if n and r.headdim != rs[n - 1].headdim:
                    x += 1
                xs.append(x)
                groups.setdefault(r.headdim, []).append(x)
                x += 1
            for b in others:
                labelled = False
                for hd in groups:
                    pts = [(px, r.ratio_to(b)) for px, r in zip(xs, rs)
                           if r.headdim == hd and r.ratio_to(b) is not None]
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4,
                                color=colors[b], label=None if labelled else COLUMN_LABELS.get(b, b))
                        labelled = True
            ax.axhline(1.0, color="gray", lw=1, ls="--")
            ax.set_xticks(xs)
            ax.set_xticklabels([_seqlen_label(r.seqlen) for r in rs], fontsize=8)
            for hd, gx in groups.items():
                ax.annotate(f"d={hd}", xy=(sum(gx) / len(gx), 0), xycoords=("data", "axes fraction"),
                            xytext=(0, -26), textcoords="offset points", ha="center", fontsize=9)
            ax.set_title(f"{direction} {dtype} {'causal' if causal else 'no mask'}")
            ax.set_ylabel("flash_ext / backend")
            ax.grid(True, axis="y", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    fig.suptitle(f"flash_ext TFLOP/s over each backend's (above 1: flash_ext faster)\n"
                 f"{gpu}, torch {torch.__version__}; x: seqlen by head dim", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _case_summary(row: Row, backends: Sequence[str]) -> str:
    cells = (f"{COLUMN_LABELS.get(b, b)} {'n/a' if b in row.errors else _fmt(row.tflops.get(b))}"
             for b in backends)
    return f"{row.config}: " + ", ".join(cells)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("flash_ext.bench needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    if args.decode:
        from flash_ext.bench_decode import run_decode
        run_decode(out_dir=args.out)
        return 0
    if args.decode_loop:
        from flash_ext.bench_decode_loop import run_decode_loop
        run_decode_loop(quick=args.quick, out_dir=args.out, rounds=args.rounds)
        return 0
    if args.mask is not None:
        from flash_ext.bench_mask import run_mask
        return run_mask(args)
    found, missing = detect_peers(args.peers)
    backends = list(BACKEND_NAMES) + [p for p in PEER_NAMES if p in found]
    configs = make_configs(args.dtypes, args.hdims, args.seqlens, args.causal_modes,
                           args.directions)
    print(f"{len(configs)} configs on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"median of {args.reps} calls after {args.warmup} warmup"
          f"{f' and {args.warmup_s:g} s of back-to-back calls' if args.warmup_s else ''}, median of {args.rounds} "
          f"round(s) of every backend in turn ({args.order} order"
          f"{f', {args.gap_s:g} s idle before each turn' if args.gap_s else ''})")
    for peer in PEERS:
        if peer.name in found:
            print(f"peer {peer.name}: {peer.label} ({peer.module}.{peer.attr}, {found[peer.name]})")
        elif peer.name in missing:
            print(f"peer {peer.name}: {peer.label} not timed ({missing[peer.name]})")
    sys.stdout.flush()
    rows = []
    t0 = time.monotonic()
    for i, cfg in enumerate(configs, 1):
        row = run_config(cfg, args.reps, args.warmup, args.rounds, warmup_s=args.warmup_s,
                         order=args.order, gap_s=args.gap_s, backends=backends)
        rows.append(row)
        print(progress_line(i, len(configs), time.monotonic() - t0, _case_summary(row, backends)),
              file=sys.stderr, flush=True)
    print()
    print(format_table(rows, backends))
    extra = {"peers": {"found": found, "not_loaded": missing}}
    if args.host_time:
        times, errors = measure_host_time(backends)
        print()
        print(format_host_time(times, errors))
        extra["host_time_us"] = {"shape_bshd": list(HOST_SHAPE), "causal": True, "dtype": "bf16",
                                 "fwdbwd_step": times, "errors": errors}
    os.makedirs(args.out, exist_ok=True)
    stem = "bench_" + "_".join(args.directions)
    json_path = os.path.join(args.out, stem + ".json")
    write_json(json_path, rows, args, extra)
    print(f"\nwrote {json_path}")
    png_path = args.plot or os.path.join(args.out, stem + ".png")
    if os.path.dirname(png_path):
        os.makedirs(os.path.dirname(png_path), exist_ok=True)
    if write_plot(png_path, rows, backends):
        print(f"wrote {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
