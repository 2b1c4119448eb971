"""The mask section of ``python -m flash_ext.bench --mask ...`` (docs/design-flashmask.md 11):
flash_ext.flashmask_attention beside FlexAttention and SDPA with a dense mask, on FlashMask's
masks, bf16, forward and backward.

    python -m flash_ext.bench --mask causal_doc,shared_question,prefix_lm,sliding_window \\
        --seqlens 8k,16k,32k --hdims 128,256
    python -m flash_ext.bench --mask all --quick        # 8k, d = 128: a couple of minutes

Shapes as the rest of the bench: batch = 16384 // seqlen (at least 1), heads = 2048 // headdim,
every batch row and head with the same mask. Masks (fixed parameters, written into the JSON):
causal_doc (document lengths drawn once from seed 0, uniform in [s/10, s/3], the last cut to
fit), shared_question (a question of s/4, 6 answers of s/8), prefix_lm (one document, prefix
s/4), sliding_window (1024, causal); off the target grid: global_sliding_window (64 global
tokens, window 1024), causal_blockwise (4 blocks of s/4).

Backends, each timed on the same (batch, seqlen, heads, headdim) tensors:
- flash_ext: flashmask_attention with the builder's bounds (its per-call block summaries inside
  the timed region);
- flex: torch.compile(flex_attention) with create_block_mask(mask_mod, B, None, s, s,
  BLOCK_SIZE=128, _compile=True) made once outside the timed region; the mask_mod reads the same
  bounds, so both compute the same mask;
- sdpa: F.scaled_dot_product_attention with the dense bool mask (b, 1, s, s), when it takes at
  most --sdpa-max-mib (default 1024);
- causal: flash_ext's plain causal kernel (flash_attn_func(causal=True)) at the same shape, for
  the "mask costs almost nothing" comparison (its TFLOP/s count the causal half).
fwd: one forward call; bwd: torch.autograd.grad of an out computed once (as the main bench).
Times: triton's do_bench median, L2 flushed between calls (bench_decode's helper).
TFLOP/s count only unmasked entries U: 4 * d * h * U forward, 2.5 times that backward. Ratios
are flash_ext's time advantage (peer ms / flash_ext ms). Memory: the bounds plus flash_ext's
derived summaries (O(s)), FlexAttention's BlockMask tensors, the dense bool mask.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch

from flash_ext.bench import MODEL_DIM, TOKENS, _error_text, format_duration, progress_line

MASKS = ("causal_doc", "shared_question", "prefix_lm", "sliding_window",
         "global_sliding_window", "causal_blockwise")
TARGET_MASKS = MASKS[:4]
MASK_SEQLENS = (8192, 16384, 32768)
MASK_HDIMS = (128, 256)
QUICK_MASK_SEQLENS = (8192,)
QUICK_MASK_HDIMS = (128,)
MASK_DIRECTIONS = ("fwd", "bwd")
MASK_PEERS = ("flex", "sdpa", "causal")
WINDOW = 1024
FM_BLOCK = 128  # the block size for the block density column


def parse_masks(text: str) -> list[str]:
    text = text.strip().lower()
    if text == "all":
        return list(TARGET_MASKS)
    vals = []
    for v in (t.strip() for t in text.split(",")):
        if not v:
            continue
        if v not in MASKS:
            raise argparse.ArgumentTypeError(
                f"unknown mask {v!r}; choose from all, {', '.join(MASKS)}")
        if v not in vals:
            vals.append(v)
    if not vals:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of masks, got {text!r}")
    return vals


def parse_mask_peers(text: str) -> list[str]:
    vals = [t.strip().lower() for t in text.split(",") if t.strip()]
    for v in vals:
        if v not in MASK_PEERS:
            raise argparse.ArgumentTypeError(
                f"unknown mask peer {v!r}; choose from {', '.join(MASK_PEERS)}")
    return vals


def apply_mask_defaults(args: argparse.Namespace, seqlens_given: bool,
                        hdims_given: bool) -> None:
    """The mask section's defaults for the arguments the main bench shares (called by
    bench.parse_args when --mask is given)."""
    args.mask = parse_masks(args.mask)
    if not seqlens_given:
        args.seqlens = list(QUICK_MASK_SEQLENS if args.quick else MASK_SEQLENS)
    if not hdims_given:
        args.hdims = list(QUICK_MASK_HDIMS if args.quick else MASK_HDIMS)
    args.directions = [d for d in args.directions if d in MASK_DIRECTIONS] or \
        list(MASK_DIRECTIONS)


@dataclass(frozen=True)
class MaskCell:
    mask: str
    seqlen: int
    headdim: int

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    @property
    def heads(self) -> int:
        return max(1, MODEL_DIM // self.headdim)

    @property
    def name(self) -> str:
        return f"{self.mask} d={self.headdim} s={self.seqlen} b={self.batch} h={self.heads}"


def mask_cells(masks: Sequence[str], seqlens: Sequence[int], hdims: Sequence[int]
               ) -> list[MaskCell]:
    """Every (mask, headdim, seqlen), in that order."""
    return [MaskCell(m, s, d) for m in masks for d in hdims for s in seqlens]


def doc_lengths(seqlen: int, seed: int = 0) -> list[int]:
    """Document lengths uniform in [s/10, s/3] from a fixed seed, the last cut to fit."""
    rng = random.Random(seed)
    lens = []
    while sum(lens) < seqlen:
        lens.append(rng.randint(max(1, seqlen // 10), max(1, seqlen // 3)))
    lens[-1] -= sum(lens) - seqlen
    return lens


def build_mask(name: str, seqlen: int, device=None) -> tuple[torch.Tensor, bool, dict]:
    """(bounds (1, 1, s, C), causal, parameters) of one benchmark mask."""
    from flash_ext import flashmask_masks as M
    s = seqlen
    if name == "causal_doc":
        lens = doc_lengths(s)
        sri, causal = M.causal_document(lens, s, device=device)
        return sri, causal, {"doc_lens": lens}
    if name == "shared_question":
        sri, causal = M.shared_question(s // 4, [s // 8] * 6, s, device=device)
        return sri, causal, {"question": s // 4, "answers": [s // 8] * 6}
    if name == "prefix_lm":
        sri, causal = M.prefix_lm(s // 4, None, s, device=device)
        return sri, causal, {"prefix": s // 4}
    if name == "sliding_window":
        sri, causal = M.sliding_window(WINDOW, s, device=device)
        return sri, causal, {"window": WINDOW}
    if name == "global_sliding_window":
        sri, causal = M.global_sliding_window(64, WINDOW, s, device=device)
        return sri, causal, {"num_global": 64, "window": WINDOW}
    if name == "causal_blockwise":
        sri, causal = M.causal_blockwise([s // 4] * 4, s, device=device)
        return sri, causal, {"block_lens": [s // 4] * 4}
    raise ValueError(f"unknown mask {name!r}")


def mask_density(sri: torch.Tensor, causal: bool, block: int = FM_BLOCK,
                 rows_per_chunk: int = 1024) -> tuple[int, float, float]:
    """(unmasked entries U, element density U / s^2, density of block x block tiles with any
    unmasked entry) of a (1, 1, s, C) mask, built row chunk by row chunk (never s x s at once)."""
    s = sri.shape[2]
    visible, tiles = 0, 0
    rows_per_chunk = max(block, rows_per_chunk // block * block)
    n_col_tiles = -(-s // block)
    for r0 in range(0, s, rows_per_chunk):
        vis = _visible_rows(sri, causal, r0, min(s, r0 + rows_per_chunk))
        visible += int(vis.sum())
        pad_r = -vis.shape[0] % block
        pad_c = n_col_tiles * block - s
        v = torch.nn.functional.pad(vis, (0, pad_c, 0, pad_r))
        tiles += int(v.view(-1, block, n_col_tiles, block).any(dim=3).any(dim=1).sum())
    return visible, visible / s / s, tiles / (n_col_tiles * n_col_tiles)


def flashmask_bytes(sri: torch.Tensor, batch: int) -> int:
    """The bounds of the batch plus the derived data of both directions: nb (16 B per column,
    padded to 128) and key-block summaries (32 B per 64-key block) each."""
    s, c = sri.shape[2], sri.shape[3]
    sk_pad = -(-s // 128) * 128
    return batch * (s * c * 4 + 2 * (sk_pad * 16 + (sk_pad // 64) * 32))


@dataclass
class MaskRow:
    cell: str
    mask: str
    seqlen: int
    headdim: int
    batch: int
    heads: int
    direction: str
    params: dict
    unmasked: int  # per batch row and head
    density: float
    block_density: float
    ms: dict = field(default_factory=dict)  # backend -> median ms (None: failed / skipped)
    tflops: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    memory_mib: dict = field(default_factory=dict)  # flash_ext / flex / sdpa mask memory
    summary_us: Optional[float] = None  # the block summaries alone (flash_ext::flashmask_summary)

    def speedup(self, peer: str) -> Optional[float]:
        a, b = self.ms.get("flash_ext"), self.ms.get(peer)
        return b / a if a and b else None

    def to_json(self) -> dict:
        d = asdict(self)
        d["speedup"] = {p: self.speedup(p) for p in self.ms if p != "flash_ext"}
        return d


def row_tflops(row: MaskRow) -> None:
    """TFLOP/s of every timed backend: unmasked entries for the masked ones, the causal half for
    the plain causal kernel."""
    factor = 1.0 if row.direction == "fwd" else 2.5
    per_entry = 4.0 * row.headdim * row.heads * row.batch * factor
    causal_entries = row.seqlen * (row.seqlen + 1) / 2
    for name, ms in row.ms.items():
        entries = causal_entries if name == "causal" else row.unmasked
        row.tflops[name] = per_entry * entries / (ms * 1e-3) / 1e12 if ms else None


def _fmt(x, digits=1):
    return "n/a" if x is None else f"{x:.{digits}f}"


def format_mask_table(rows: Sequence[MaskRow], peers: Sequence[str]) -> str:
    head = ["cell", "dir", "dens", "ext ms", "ext TF"] + [f"{p} TF" for p in peers] + \
        [f"x{p}" for p in peers] + ["MiB ext/flex/sdpa"]
    lines = [head]
    for r in rows:
        mem = "/".join(_fmt(r.memory_mib.get(k), 2) for k in ("flash_ext", "flex", "sdpa"))
        lines.append([r.cell, r.direction, f"{r.density:.3f}", _fmt(r.ms.get("flash_ext"), 3),
                      _fmt(r.tflops.get("flash_ext"))] +
                     [_fmt(r.tflops.get(p)) for p in peers] +
                     [_fmt(r.speedup(p), 2) for p in peers] + [mem])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    notes = [f"  {r.cell} {r.direction} {p}: {e}" for r in rows for p, e in r.errors.items()]
    return "\n".join(out + (["n/a:"] + notes if notes else []))


# ----------------------------------------------------------------------------------------------
# GPU part
# ----------------------------------------------------------------------------------------------


def _median_ms(fn: Callable[[], object]) -> float:
    from flash_ext.bench_decode import _median_us  # do_bench median, L2 flushed
    return _median_us(fn) / 1e3


def _timed(direction: str, forward: Callable[[], torch.Tensor], leaves) -> Callable[[], object]:
    if direction == "fwd":
        def fwd():
            with torch.no_grad():
                return forward()
        return fwd
    out = forward()
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def _flex_parts(sri, causal, batch, seqlen):
    """(compiled flex_attention, block mask, its bytes) for the bounds' mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from flash_ext.reference import flashmask_intervals
    # Each cell's mask_mod closes over new tensors, so every cell compiles again; past dynamo's
    # recompile limit (8) flex_attention silently falls back to its unfused form, which
    # materializes the scores (seen after 12 cells: 0.03x, then out of memory). A reset per cell
    # instead cost minutes of compilation per cell.
    import torch._dynamo.config as dynamo_config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
    ls, le, us, ue = (t.reshape(-1).contiguous() for t in
                      flashmask_intervals(sri[0, 0], seqlen, causal))

    def mask_mod(b, h, q_idx, kv_idx):
        masked = ((ls[kv_idx] <= q_idx) & (q_idx < le[kv_idx])) | \
            ((us[kv_idx] <= q_idx) & (q_idx < ue[kv_idx]))
        if causal:
            masked = masked | (kv_idx > q_idx)
        return ~masked
    block_mask = create_block_mask(mask_mod, batch, None, seqlen, seqlen, device=sri.device,
                                   BLOCK_SIZE=128, _compile=True)
    parts = (getattr(block_mask, a, None) for a in (
        "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
        "q_indices", "full_q_num_blocks", "full_q_indices"))
    nbytes = sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))
    # The timed backward reuses one graph (retain_graph=True), which compiled backwards with
    # donated buffers refuse; donation saves memory only, not time.
    import torch._functorch.config as functorch_config
    functorch_config.donated_buffer = False
    return torch.compile(flex_attention), block_mask, nbytes


def run_mask_cell(cell: MaskCell, directions: Sequence[str], peers: Sequence[str],
                  sdpa_max_mib: float = 1024.0) -> list[MaskRow]:
    import flash_ext
    import torch.nn.functional as F
    dev = "cuda"
    b, h, s, d = cell.batch, cell.heads, cell.seqlen, cell.headdim
    sri1, causal, params = build_mask(cell.mask, s, device=dev)
    unmasked1, density, block_density = mask_density(sri1, causal)
    sri = sri1.expand(b, 1, s, sri1.shape[-1]).contiguous()
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    forwards, errors, memory = {}, {}, {}
    forwards["flash_ext"] = lambda: flash_ext.flashmask_attention(q, k, v, sri, causal=causal)
    memory["flash_ext"] = flashmask_bytes(sri1, b) / 2**20
    if "causal" in peers:
        forwards["causal"] = lambda: flash_ext.flash_attn_func(q, k, v, causal=True)
    if "flex" in peers:
        try:
            flex, block_mask, nbytes = _flex_parts(sri1, causal, b, s)
            forwards["flex"] = lambda: flex(qt, kt, vt, block_mask=block_mask).transpose(1, 2)
            memory["flex"] = nbytes / 2**20
        except Exception as e:  # noqa: BLE001 - an unavailable peer is a table note
            errors["flex"] = _error_text(e)
    if "sdpa" in peers:
        mib = b * s * s / 2**20
        memory["sdpa"] = mib
        if mib > sdpa_max_mib:
            errors["sdpa"] = f"dense mask of {mib:.0f} MiB > --sdpa-max-mib {sdpa_max_mib:g}"
        else:
            dense = torch.empty(b, 1, s, s, dtype=torch.bool, device=dev)
            for r0 in range(0, s, 1024):  # the (s, s) mask, built in row chunks
                dense[:, 0, r0:r0 + 1024] = _visible_rows(sri1, causal, r0, min(s, r0 + 1024))
            forwards["sdpa"] = lambda: F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=dense).transpose(1, 2)
    summary_us = None
    op = getattr(torch.ops.flash_ext, "flashmask_summary", None)
    if op is not None:
        try:
            from flash_ext.bench_decode import _median_us
            summary_us = _median_us(lambda: op(sri, s, s, None, causal, 64))
        except Exception:  # noqa: BLE001 - informative column only
            summary_us = None
    rows = []
    for direction in directions:
        row = MaskRow(cell.name, cell.mask, s, d, b, h, direction, params, unmasked1,
                      density, block_density, errors=dict(errors), memory_mib=dict(memory),
                      summary_us=summary_us)
        for name, fwd in forwards.items():
            try:
                row.ms[name] = _median_ms(_timed(direction, fwd, (q, k, v)))
            except Exception as e:  # noqa: BLE001 - a failing backend is a table note
                row.ms[name] = None
                row.errors[name] = _error_text(e)
                torch.cuda.empty_cache()
        row_tflops(row)
        rows.append(row)
    return rows


def _visible_rows(sri1, causal, r0, r1):
    """Rows [r0, r1) of the dense visibility of a (1, 1, s, C) mask: bool (r1 - r0, s)."""
    from flash_ext.reference import flashmask_intervals
    s = sri1.shape[2]
    ls, le, us, ue = (t.reshape(1, s) for t in flashmask_intervals(sri1[0, 0], s, causal))
    i = torch.arange(r0, r1, device=sri1.device).view(-1, 1)
    vis = ~(((ls <= i) & (i < le)) | ((us <= i) & (i < ue)))
    if causal:
        vis &= torch.arange(s, device=sri1.device).view(1, s) <= i
    return vis


def run_mask(args: argparse.Namespace) -> int:
    peers = list(args.mask_peers)
    cells = mask_cells(args.mask, args.seqlens, args.hdims)
    print(f"mask section: {len(cells)} cells x {', '.join(args.directions)} on "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16; peers "
          f"{', '.join(peers) or 'none'}; do_bench medians (L2 flushed)", flush=True)
    rows, t0 = [], time.monotonic()
    for n, cell in enumerate(cells, 1):
        cell_rows = run_mask_cell(cell, args.directions, peers, args.sdpa_max_mib)
        rows += cell_rows
        text = "; ".join(f"{r.direction} ext {_fmt(r.tflops.get('flash_ext'))} TF" +
                         "".join(f", x{p} {_fmt(r.speedup(p), 2)}" for p in peers)
                         for r in cell_rows)
        print(progress_line(n, len(cells), time.monotonic() - t0, f"{cell.name}: {text}"),
              file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    print()
    print(format_mask_table(rows, peers))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_mask.json")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       peers=peers, seconds=time.monotonic() - t0,
                       rows=[r.to_json() for r in rows]), f, indent=1)
    print(f"\nwrote {path} ({format_duration(time.monotonic() - t0)})")
    return 0


__all__ = ["MASKS", "TARGET_MASKS", "MaskCell", "MaskRow", "mask_cells", "build_mask",
           "mask_density", "doc_lengths", "parse_masks", "parse_mask_peers",
           "apply_mask_defaults", "format_mask_table", "row_tflops", "run_mask",
           "run_mask_cell", "flashmask_bytes"]
