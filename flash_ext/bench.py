"""Attention throughput, flash_ext against PyTorch SDPA, side by side in one process.

    python -m flash_ext.bench                 # full sweep: fwd, bwd, fwd+bwd
    python -m flash_ext.bench --quick         # bf16, seqlens 1k/4k/16k: about 2 minutes
    python -m flash_ext.bench --dtypes fp16 --hdims 128 --seqlens 2048,8192 --causal true
    python -m flash_ext.bench --quick --directions bwd

Backends: flash_ext (attn_fwd and its autograd backward); torch.nn.functional.
scaled_dot_product_attention restricted (with torch.nn.attention.sdpa_kernel) to FLASH_ATTENTION
and to CUDNN_ATTENTION. All three read the same (batch, seqlen, heads, headdim) tensors; SDPA
gets (batch, heads, seqlen, headdim) transposed views of them. Shapes: batch = 16384 // seqlen,
heads = 2048 // headdim (16k tokens of model width 2048 per config). A backend that rejects a
shape is recorded as None.

Directions (--directions, default all three):
  fwd     one forward call (flash_ext.attn_fwd, no autograd graph);
  bwd     one backward: torch.autograd.grad(out, (q, k, v), dout) on an out computed once
          beforehand by the same backend (the same autograd path for all three backends);
  fwdbwd  forward with autograd, then that backward.

Metric: FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * headdim (two matmuls), halved for
causal, times 1 (fwd), 2.5 (bwd: five matmuls) or 3.5 (fwdbwd); TFLOP/s = FLOPs / median time.
Times: CUDA events around each call, after warmup, median of --reps calls; that is one round, and
a config runs --rounds rounds (3; 1 with --quick), each timing every backend in turn, and keeps
each backend's median round, so that clock and power drift during a config hit all backends alike
instead of whichever ran last. The order of the turns (--order) is by default serially balanced:
over 8 rounds of the 4 backends each one runs right after every other backend twice, and twice
right after itself (its turn ends one round and opens the next). A burst's clock depends on the
power drawn just before it, so a fixed cyclic order (--order rotated) times each backend after
the same neighbour in most rounds: SDPA cuDNN always after SDPA flash, a backend that draws less
power, and flash_ext after cuDNN. Use a multiple of 8
rounds for the full balance. --gap-s S idles S seconds before each backend's turn. Each timed
turn is kept in the JSON (`samples`: round, backend, the backend timed right before it, median
ms), and tools/carryover.py tabulates a backend's times by that neighbour. The L2 cache is not
flushed between calls: every config moves at least 3 x 64 MiB of q, k, v, several times the L2,
so a warm cache changes little. --warmup-s S adds S seconds of back-to-back calls before each
backend's timed calls: by default a round times a short burst, which an idle GPU runs at its
top clock; a training loop runs at the power cap (an H100: 700 W, 1.5-1.9 GHz), where a backend
that spends less energy per FLOP keeps a higher clock.

Memory: "extra MiB" is the peak memory allocated during one flash_ext call minus what was
allocated before it (inputs, and for bwd also out, lse, dout and what autograd saved) and minus
the bytes of what the call returns (fwd: out and lse; bwd and fwdbwd: dq, dk, dv): the workspace
beyond inputs and outputs. For bwd that is the backward's own workspace (the fp32 dq
accumulator, the GQA expansion buffers, the deterministic split of dq); for fwdbwd it also holds
the forward's out and lse.

Outputs: a table on stdout, and in --out (default bench_out/): bench_<directions>.json (GPU,
torch version, date, rows; bench_fwd.json for a forward-only run) and bench_<directions>.png
(needs matplotlib; skipped with a message otherwise).

The code is organised by direction: a direction is a FLOP count factor (DIRECTIONS) plus one
callable per backend (make_backend_fn).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
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


# ----------------------------------------------------------------------------------------------
# Metrics (pure Python, CPU-testable)
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

    @property
    def ratio_flash(self) -> Optional[float]:
        return ratio(self.tflops.get("flash_ext"), self.tflops.get("sdpa_flash"))

    @property
    def ratio_cudnn(self) -> Optional[float]:
        return ratio(self.tflops.get("flash_ext"), self.tflops.get("sdpa_cudnn"))

    def to_json(self) -> dict:
        d = asdict(self)
        d["ratio_ext_over_flash"] = self.ratio_flash
        d["ratio_ext_over_cudnn"] = self.ratio_cudnn
        return d


TABLE_COLUMNS = ("config", "flash_ext", "ext_sm80", "sdpa_flash", "sdpa_cudnn", "ext/flash",
                 "ext/cudnn", "sm80/flash", "extra MiB")


def _fmt(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width text table: TFLOP/s per backend, ratios, extra memory."""
    body = [(r.config, _fmt(r.tflops.get("flash_ext")), _fmt(r.tflops.get("flash_ext_sm80")),
             _fmt(r.tflops.get("sdpa_flash")), _fmt(r.tflops.get("sdpa_cudnn")),
             _fmt(r.ratio_flash, 2), _fmt(r.ratio_cudnn, 2),
             _fmt(ratio(r.tflops.get("flash_ext_sm80"), r.tflops.get("sdpa_flash")), 2),
             _fmt(r.extra_mib, 1)) for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h)
              for i, h in enumerate(TABLE_COLUMNS)]
    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(TABLE_COLUMNS), "  ".join("-" * w for w in widths)]
    out += [line(cells) for cells in body]
    return "\n".join(out)


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


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flash_ext.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="bf16 only, seqlens 1k,4k,16k, fewer reps (about 2 minutes on an H100 "
                        "for all three directions)")
    p.add_argument("--directions", type=_parse_directions, default=list(DIRECTIONS),
                   help="comma-separated subset of fwd,bwd,fwdbwd (default: all)")
    p.add_argument("--dtypes", type=_parse_dtypes, default=None, help="e.g. bf16,fp16")
    p.add_argument("--hdims", type=_parse_int_list, default=None, help="e.g. 64,128,256")
    p.add_argument("--seqlens", type=_parse_int_list, default=None, help="e.g. 1k,4096,16k")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--reps", type=int, default=None, help="timed calls per backend (median)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first")
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="seconds of back-to-back calls before each backend's timed calls, in "
                        "every round (default 0: a burst from a cool GPU; ~1 s reaches the power-"
                        "capped steady state of a training loop)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per config, backends timed in turn in each (median round; "
                        "default 3, 1 with --quick; a multiple of 8 balances the order fully)")
    p.add_argument("--order", choices=tuple(ORDERS), default="balanced",
                   help="order of the backends' turns in each round: balanced (default: each "
                        "backend right after every backend, itself included, equally often "
                        "over 8 rounds) or rotated (one fixed cyclic order)")
    p.add_argument("--gap-s", type=float, default=0.0,
                   help="seconds idle before each backend's turn (default 0)")
    p.add_argument("--out", default="bench_out", help="directory for the JSON and PNG")
    args = p.parse_args(argv)
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
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.warmup_s < 0:
        p.error("--warmup-s must be >= 0")
    if args.gap_s < 0:
        p.error("--gap-s must be >= 0")
    args.causal_modes = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    return args


# ----------------------------------------------------------------------------------------------
# Backends and timing (GPU)
# ----------------------------------------------------------------------------------------------


def _sdpa_fn(q, k, v, causal: bool, backend) -> Callable[[], object]:
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def run():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return run


def _forward_fn(name: str, q, k, v, causal: bool) -> Callable[[], object]:
    """A zero-argument callable running one backend's forward; returns out (flash_ext:
    (out, lse))."""
    if name == "flash_ext":
        import flash_ext
        return lambda: flash_ext.attn_fwd(q, k, v, causal=causal)
    if name == "flash_ext_sm80":
        import flash_ext

        def run_sm80():
            with _tuning(FLASH_EXT_FWD_PATH="sm80"):
                return flash_ext.attn_fwd(q, k, v, causal=causal)
        return run_sm80
    from torch.nn.attention import SDPBackend
    if name == "sdpa_flash":
        return _sdpa_fn(q, k, v, causal, SDPBackend.FLASH_ATTENTION)
    if name == "sdpa_cudnn":
        return _sdpa_fn(q, k, v, causal, SDPBackend.CUDNN_ATTENTION)
    raise ValueError(f"unknown backend {name!r}")


def make_backend_fn(name: str, direction: str, q, k, v, causal: bool) -> Callable[[], object]:
    """A zero-argument callable running one backend in one direction on (b, s, h, d) tensors
    q, k, v. bwd runs the forward once here (outside the timed callable)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}")
    if direction == "fwd":
        return _forward_fn(name, q, k, v, causal)
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    fwd = _forward_fn(name, *leaves, causal)

    def forward():
        out = fwd()
        return out[0] if isinstance(out, tuple) else out

    if direction == "bwd":
        out = forward()
        dout = torch.randn_like(out)
        run = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)  # noqa: E731
    else:
        dout = torch.randn_like(forward())
        run = lambda: torch.autograd.grad(forward(), leaves, dout)  # noqa: E731
    if name != "flash_ext_sm80":
        return run

    def run_sm80():
        with _tuning(FLASH_EXT_BWD_PATH="sm80"):
            return run()
    return run_sm80


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


def run_config(cfg: Config, reps: int, warmup: int, rounds: int = 1, device="cuda", warmup_s: float = 0.0,
               order: str = "balanced", gap_s: float = 0.0) -> Row:
    """Times every backend on one config: ``rounds`` rounds, each backend in turn in each round
    (in the order ``ORDERS[order]`` gives for the round; median of ``reps`` calls after
    ``warmup``, after ``gap_s`` seconds idle), and keeps each backend's median round. Every turn
    is recorded in ``row.samples``."""
    torch.manual_seed(0)
    dtype = DTYPES[cfg.dtype]
    shape = (cfg.batch, cfg.seqlen, cfg.heads, cfg.headdim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device) for _ in range(3))
    row = Row(cfg.name, cfg.dtype, cfg.headdim, cfg.seqlen, cfg.batch, cfg.heads, cfg.causal,
              cfg.direction)
    fns: dict[str, Callable[[], object]] = {}
    times: dict[str, list[float]] = {name: [] for name in BACKEND_NAMES}
    order_of_round = ORDERS[order]
    previous = None  # the backend timed right before (None: the first turn of the config)
    for r in range(rounds):
        for name in order_of_round(BACKEND_NAMES, r):
            if name in row.errors:
                continue
            try:
                if name not in fns:
                    fns[name] = make_backend_fn(name, cfg.direction, q, k, v, cfg.causal)
                if gap_s > 0:
                    torch.cuda.synchronize()
                    time.sleep(gap_s)
                ms = time_ms(fns[name], reps, warmup, warmup_s)
                times[name].append(ms)
                row.samples.append({"round": r, "backend": name, "after": previous, "ms": ms})
                previous = name
            except Exception as e:  # a peer (or flash_ext) rejecting a shape is data, not a crash
                row.errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                fns.pop(name, None)
                torch.cuda.synchronize()
    for name in BACKEND_NAMES:
        ms = statistics.median(times[name]) if name not in row.errors and times[name] else None
        row.ms[name] = ms
        row.tflops[name] = tflops_per_s(cfg.flops, ms)
    if "flash_ext" in fns:
        fl = fns.pop("flash_ext")
        fns.clear()  # free the peers' outputs and saved tensors before measuring the workspace
        row.extra_mib = extra_memory_mib(fl)
    del fns, q, k, v
    return row


def write_json(path: str, rows: Sequence[Row], args: argparse.Namespace) -> None:
    meta = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "flops_convention": "4*b*h*sq*sk*d, halved for causal; x2.5 for bwd, x3.5 for fwdbwd",
        "args": {k: v for k, v in vars(args).items() if k != "causal_modes"},
        "rows": [r.to_json() for r in rows],
    }
    try:
        import flash_ext
        meta["flash_ext"] = {"version": flash_ext.__version__, "build_info": flash_ext.build_info()}
    except Exception as e:  # pragma: no cover
        meta["flash_ext"] = {"error": str(e)}
    with open(path, "w") as f:
        json.dump(meta, f, indent=2)


def write_plot(path: str, rows: Sequence[Row]) -> bool:
    """One panel per (direction, dtype, causal, headdim): TFLOP/s vs seqlen per backend.
    Returns False (after printing a message) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the plot (pip install matplotlib)")
        return False
    panels: dict = {}
    for r in rows:
        panels.setdefault((r.direction, r.dtype, r.causal, r.headdim), []).append(r)
    keys = sorted(panels, key=lambda t: (t[0], t[1], t[2], t[3]))
    ncols = min(3, len(keys)) or 1
    nrows = max(1, math.ceil(len(keys) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        rs = sorted(panels[key], key=lambda r: r.seqlen)
        for name in BACKEND_NAMES:
            pts = [(r.seqlen, r.tflops.get(name)) for r in rs if r.tflops.get(name) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        direction, dtype, causal, hd = key
        ax.set_title(f"{direction} {dtype} d={hd} {'causal' if causal else 'full'}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    fig.suptitle(f"flash_ext vs SDPA ({gpu}, torch {torch.__version__})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("flash_ext.bench needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    configs = make_configs(args.dtypes, args.hdims, args.seqlens, args.causal_modes,
                           args.directions)
    print(f"{len(configs)} configs on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"median of {args.reps} calls after {args.warmup} warmup"
          f"{f' and {args.warmup_s:g} s of back-to-back calls' if args.warmup_s else ''}, median of {args.rounds} "
          f"round(s) of every backend in turn ({args.order} order"
          f"{f', {args.gap_s:g} s idle before each turn' if args.gap_s else ''})")
    rows = []
    for cfg in configs:
        row = run_config(cfg, args.reps, args.warmup, args.rounds, warmup_s=args.warmup_s,
                         order=args.order, gap_s=args.gap_s)
        rows.append(row)
        print(f"  {cfg.name}: " + ", ".join(f"{n} {_fmt(row.tflops.get(n))}" for n in BACKEND_NAMES),
              flush=True)
    print()
    print(format_table(rows))
    errors = [(r.config, n, e) for r in rows for n, e in r.errors.items()]
    if errors:
        print("\nbackends that failed (recorded as None):")
        for cfg_name, n, e in errors:
            print(f"  {cfg_name} [{n}]: {e}")
    os.makedirs(args.out, exist_ok=True)
    stem = "bench_" + "_".join(args.directions)
    json_path = os.path.join(args.out, stem + ".json")
    write_json(json_path, rows, args)
    print(f"\nwrote {json_path}")
    png_path = os.path.join(args.out, stem + ".png")
    if write_plot(png_path, rows):
        print(f"wrote {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
