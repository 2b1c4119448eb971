"""FlashMask's block classification in Python: a transcription of kernel A
(csrc/flashmask/flashmask_summary.cu) and of ``fm_classify`` (csrc/common/flashmask.h), for the
tests only. The GPU tests compare the op ``flash_ext::flashmask_summary`` with
:func:`normalize` / :func:`summaries` bit for bit (on the used slots, :func:`used_slots`); the
CPU tests check :func:`classify` against the dense mask.

Normalization (docs/design-flashmask.md 1.3, the contract of issue 27): R = seqlen_q rounded up
to a multiple of 128 (varlen: max_seqlen_q). Per column the bounds are clamped into [0, R] and
read as two intervals [ls, le), [us, ue): causal C=1 [LTS, R) and nothing; causal C=2 [LTS,
LTE) and nothing; non-causal C=2 [LTS, R) and [0, UTE); non-causal C=4 [LTS, LTE) and [UTS,
UTE). Each is ordered (e = max(e, s)); an empty one becomes (R, R). ``nb`` stores (ls, le - ls,
us, ue - us). Columns past a sequence's end (up to its next multiple of 128) are padding,
(0, R, R, 0): masked in every row.

Layout (common/flashmask.h): nb (hm, cols, 4), column j of batch row b at col0(b) + j with
col0(b) = b * sk_pad (sk_pad = seqlen_k rounded up to 128; cols = batch * sk_pad) or, varlen,
cu_seqlens_k[b] + 128 b (cols = total_k + 128 batch). kbs (hm, blocks, 2, 4), key block n of
row b at blk0(b) + n with blk0(b) = b * blocks_per_batch (blocks_per_batch = ceil(sk_pad /
block_n), which is sk_pad / block_n for every block_n dividing 128) or, varlen,
cu_seqlens_k[b] // block_n + b (blocks = total_k // block_n + batch + 1). Summary of a block's
block_n columns: skip half (max ls, min le, max us, min ue), full half (min ls, max le, min us,
max ue), over the raw (s, e) values.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SKIP", "FULL", "PARTIAL", "empty_row", "normalize", "summaries", "classify",
           "query_runs", "runs_class", "used_slots", "interval_mask"]

SKIP, FULL, PARTIAL = 0, 1, 2  # kFmSkip, kFmFull, kFmPartial
_PAD = 128


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def empty_row(seqlen_q: int) -> int:
    """R: the start of an empty interval (seqlen_q, or varlen max_seqlen_q, rounded up to 128)."""
    return _round_up(int(seqlen_q), _PAD)


def _intervals(bounds: torch.Tensor, causal: bool, R: int):
    """bounds (..., C) int -> (ls, le, us, ue) int64 (...), clamped, ordered, empty = (R, R)."""
    v = bounds.long().clamp(0, R)
    c = bounds.shape[-1]
    full = torch.full_like(v[..., 0], R)
    if causal:
        ls, le = v[..., 0], (v[..., 1] if c == 2 else full)
        us, ue = full, full
    elif c == 2:
        ls, le, us, ue = v[..., 0], full, torch.zeros_like(full), v[..., 1]
    else:
        ls, le, us, ue = v[..., 0], v[..., 1], v[..., 2], v[..., 3]
    le = torch.maximum(le, ls)
    ue = torch.maximum(ue, us)
    l_empty, u_empty = ls == le, us == ue
    ls, le = torch.where(l_empty, full, ls), torch.where(l_empty, full, le)
    us, ue = torch.where(u_empty, full, us), torch.where(u_empty, full, ue)
    return ls, le, us, ue


def _seq_lengths(batch: int, seqlen_k: int, cu_seqlens_k: Optional[torch.Tensor]):
    if cu_seqlens_k is None:
        return [0] * batch, [int(seqlen_k)] * batch
    cu = [int(x) for x in cu_seqlens_k.tolist()]
    return cu[:-1], [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def normalize(startend_row_indices: torch.Tensor, seqlen_q: int, seqlen_k: int, causal: bool,
              cu_seqlens_k: Optional[torch.Tensor] = None) -> torch.Tensor:
    """nb int32 (hm, cols, 4) as kernel A writes it (see the module docstring). seqlen_q: the
    batch's seqlen_q, or varlen max_seqlen_q; seqlen_k: seqlen_k (varlen: unused). Slots that
    kernel A does not write (the varlen gaps past each sequence's padding) are filled with
    padding too; compare only :func:`used_slots`."""
    R = empty_row(seqlen_q)
    sri = startend_row_indices
    varlen = cu_seqlens_k is not None
    hm = sri.shape[-3]
    batch = cu_seqlens_k.shape[0] - 1 if varlen else sri.shape[0]
    starts, lens = _seq_lengths(batch, seqlen_k, cu_seqlens_k)
    sk_pad = _round_up(int(seqlen_k), _PAD)
    cols = sri.shape[1] + _PAD * batch if varlen else batch * sk_pad
    pad = torch.tensor([0, R, R, 0], dtype=torch.int64, device=sri.device)
    nb = pad.repeat(hm, cols, 1)
    ls, le, us, ue = _intervals(sri, causal, R)
    vals = torch.stack([ls, le - ls, us, ue - us], dim=-1)  # (b, hm, sk, 4) or (hm, total_k, 4)
    for b in range(batch):
        c0 = starts[b] + _PAD * b if varlen else b * sk_pad
        if varlen:
            nb[:, c0:c0 + lens[b]] = vals[:, starts[b]:starts[b] + lens[b]]
        else:
            nb[:, c0:c0 + lens[b]] = vals[b]
    return nb.to(torch.int32)


def _blocks_layout(batch: int, seqlen_k: int, block_n: int, cu_seqlens_k, total_k: int):
    """(number of block slots, [(blk0, col0, n_blocks) per sequence])."""
    starts, lens = _seq_lengths(batch, seqlen_k, cu_seqlens_k)
    if cu_seqlens_k is None:
        sk_pad = _round_up(int(seqlen_k), _PAD)
        per = -(-sk_pad // block_n)
        return batch * per, [(b * per, b * sk_pad, per) for b in range(batch)]
    layout = [(starts[b] // block_n + b, starts[b] + _PAD * b, -(-lens[b] // block_n))
              for b in range(batch)]
    return total_k // block_n + batch + 1, layout


def summaries(nb: torch.Tensor, seqlen_k: int, block_n: int,
              cu_seqlens_k: Optional[torch.Tensor] = None, batch: Optional[int] = None,
              seqlen_q: Optional[int] = None) -> torch.Tensor:
    """kbs int32 (hm, blocks, 2, 4) from nb (:func:`normalize`'s): per key block of block_n
    columns, the skip half (max ls, min le, max us, min ue) and the full half (min ls, max le,
    min us, max ue). batch: required for the non-varlen layout (nb's columns / sk_pad
    otherwise); seqlen_q (or R) is needed only when a block reaches past nb's columns, which
    are then padding. Unused slots are 0."""
    hm, cols = nb.shape[0], nb.shape[1]
    varlen = cu_seqlens_k is not None
    if batch is None:
        batch = cu_seqlens_k.shape[0] - 1 if varlen else cols // _round_up(int(seqlen_k), _PAD)
    total_k = cols - _PAD * batch if varlen else 0
    n_slots, layout = _blocks_layout(batch, seqlen_k, block_n, cu_seqlens_k, total_k)
    x = nb.long()
    ls, le, us, ue = x[..., 0], x[..., 0] + x[..., 1], x[..., 2], x[..., 2] + x[..., 3]
    raw = torch.stack([ls, le, us, ue], dim=-1)  # (hm, cols, 4)
    if any(c0 + n * block_n > cols for _, c0, n in layout):  # blocks past nb's end: padding
        R = int(raw[..., 1].max()) if seqlen_q is None else empty_row(seqlen_q)
        extra = max(c0 + n * block_n for _, c0, n in layout) - cols
        pad = torch.tensor([0, R, R, R], dtype=torch.int64, device=nb.device)
        raw = torch.cat([raw, pad.repeat(hm, extra, 1)], dim=1)
    kbs = torch.zeros(hm, n_slots, 2, 4, dtype=torch.int64, device=nb.device)
    for blk0, c0, n in layout:
        if n == 0:
            continue
        blk = raw[:, c0:c0 + n * block_n].reshape(hm, n, block_n, 4)
        mx, mn = blk.amax(dim=2), blk.amin(dim=2)
        skip = torch.stack([mx[..., 0], mn[..., 1], mx[..., 2], mn[..., 3]], dim=-1)
        full = torch.stack([mn[..., 0], mx[..., 1], mn[..., 2], mx[..., 3]], dim=-1)
        kbs[:, blk0:blk0 + n] = torch.stack([skip, full], dim=2)
    return kbs.to(torch.int32)


def used_slots(seqlen_k: int, block_n: int, batch: int,
               cu_seqlens_k: Optional[torch.Tensor] = None, total_k: int = 0):
    """(nb column indices, kbs block indices) that kernel A writes: per sequence, its columns up
    to its length rounded up to 128 and its ceil(len / block_n) blocks (non-varlen: all of
    sk_pad's columns and blocks_per_batch blocks)."""
    starts, lens = _seq_lengths(batch, seqlen_k, cu_seqlens_k)
    _, layout = _blocks_layout(batch, seqlen_k, block_n, cu_seqlens_k, total_k)
    cols, blocks = [], []
    for b, (blk0, c0, n) in enumerate(layout):
        width = _round_up(int(seqlen_k), _PAD) if cu_seqlens_k is None else \
            _round_up(lens[b], _PAD)
        cols.append(torch.arange(c0, c0 + width))
        blocks.append(torch.arange(blk0, blk0 + n))
    return torch.cat(cols), torch.cat(blocks)


def classify(skip, full, r0: int, r1: int) -> torch.Tensor:
    """fm_classify of common/flashmask.h, elementwise: skip and full (..., 4) int tensors (the two
    summary halves), query rows [r0, r1) (ints or tensors broadcasting with skip[..., 0]).
    Returns SKIP / FULL / PARTIAL (int64)."""
    s = skip.long()
    f = full.long()
    lt_covers = (s[..., 0] <= r0) & (s[..., 1] >= r1)
    ut_covers = (s[..., 2] <= r0) & (s[..., 3] >= r1)
    both_cover = (s[..., 2] <= r0) & (s[..., 0] <= s[..., 3]) & (s[..., 1] >= r1)
    lt_clear = (f[..., 0] >= r1) | (f[..., 1] <= r0)
    ut_clear = (f[..., 2] >= r1) | (f[..., 3] <= r0)
    out = torch.full(s.shape[:-1], PARTIAL, dtype=torch.int64, device=s.device)
    out = torch.where(lt_clear & ut_clear, torch.full_like(out, FULL), out)
    return torch.where(lt_covers | ut_covers | both_cover, torch.full_like(out, SKIP), out)


def query_runs(skip, full, block_m: int, seqlen_q: int):
    """FlashMaskQueryRuns::build of sm90/bwd_flashmask.h: one key block's summary pair (two
    sequences of 4 ints >= 0) as ((start, length) of the two skipped runs, (start, length) of the
    two runs that need the per-score test), in query blocks of block_m rows."""
    s = [int(x) for x in skip]
    f = [int(x) for x in full]
    n_blocks = -(-seqlen_q // block_m)

    def first_at(x):
        return -(-x // block_m)

    def end_below(e):
        return n_blocks if seqlen_q <= e else e // block_m

    skip0 = first_at(s[0])
    skip1 = first_at(s[2])
    end1 = max(end_below(s[3]), end_below(s[1])) if s[0] <= s[3] else end_below(s[3])
    part0, part1 = f[0] // block_m, f[2] // block_m
    len0 = max(first_at(f[1]) - part0, 0) if seqlen_q > f[0] else 0
    len1 = max(first_at(f[3]) - part1, 0) if seqlen_q > f[2] else 0
    return ((skip0, max(end_below(s[1]) - skip0, 0)), (skip1, max(end1 - skip1, 0))), \
        ((part0, len0), (part1, len1))


def runs_class(runs, m: int) -> int:
    """Query block m's class from :func:`query_runs`' runs (what the Hopper backward's loop reads
    from next_visible and partial)."""
    skips, parts = runs
    if any(a <= m < a + n for a, n in skips):
        return SKIP
    return PARTIAL if any(a <= m < a + n for a, n in parts) else FULL


def interval_mask(nb: torch.Tensor, rows: int) -> torch.Tensor:
    """bool (hm, rows, cols): True where row i of nb's column is masked by its intervals
    (``fm_masked``; padding columns are masked in every row)."""
    x = nb.long().unsqueeze(1)  # (hm, 1, cols, 4)
    i = torch.arange(rows, device=nb.device).view(1, rows, 1)
    return ((i - x[..., 0] >= 0) & (i - x[..., 0] < x[..., 1])) | \
        ((i - x[..., 2] >= 0) & (i - x[..., 2] < x[..., 3]))
