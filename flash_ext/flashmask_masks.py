"""Builders of common FlashMask masks (docs/flashmask.md, docs/design-flashmask.md 8).

Each returns ``(startend_row_indices, causal)`` ready for :func:`flash_ext.flashmask_attention`:
int32 bounds (batch, 1, seqlen, C) on ``device`` and the causal flag they are meant for. Every
builder is vectorized (no Python loop over tokens) and describes one square (seqlen x seqlen)
mask; "documents", "samples" and "blocks" are consecutive token ranges given by their lengths.
Tokens after the last given length form one more range of their own (a final document /
sample / block), so the lengths may sum to less than ``seqlen`` (never more). Lengths of 0 are
allowed (an empty range changes nothing).

    causal_document       True, C=1   a token sees the earlier tokens of its own document
    shared_question       True, C=1   answers see their sample's question and their own answer
    prefix_lm             False, C=2  a document's prefix is bidirectional, the rest causal
    sliding_window        True, C=1   i - w <= j <= i   (non-causal (wl, wr): False, C=2)
    global_sliding_window False, C=4  the first g tokens see and are seen by all, else |i - j| <= w
    causal_blockwise      True, C=2   causal within a block; the last block sees everything before

``causal_document`` takes one row's document lengths or a list of rows (a batch); the others
describe one row, and :func:`stack` concatenates rows built with the same flag into a batch.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from flash_ext.errors import FlashExtTypeError, FlashExtValueError

__all__ = ["causal_document", "shared_question", "prefix_lm", "sliding_window",
           "global_sliding_window", "causal_blockwise", "stack"]

_I32 = torch.int32


def _lengths(name: str, lens, seqlen: Optional[int], device) -> tuple[torch.Tensor, int]:
    """Lengths as int64 on ``device`` with a final range for the tokens left over; and seqlen
    (default: the lengths' sum)."""
    if isinstance(lens, torch.Tensor):
        lens = lens.tolist()
    lens = [int(x) for x in lens]
    if any(x < 0 for x in lens):
        raise FlashExtValueError(f"flash_ext.flashmask_masks: {name} must be >= 0; got {lens}")
    total = sum(lens)
    if seqlen is None:
        seqlen = total
    seqlen = int(seqlen)
    if total > seqlen:
        raise FlashExtValueError(
            f"flash_ext.flashmask_masks: {name} sum to {total}, more than seqlen ({seqlen})")
    if total < seqlen:
        lens.append(seqlen - total)
    return torch.tensor(lens, dtype=torch.int64, device=device), seqlen


def _ranges(lens: torch.Tensor, seqlen: int):
    """For each token j: the index, start and end of its range (ranges of length 0 skipped)."""
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    j = torch.arange(seqlen, device=lens.device)
    idx = torch.searchsorted(ends, j, right=True)
    return idx, starts[idx], ends[idx]


def _out(cols: list, causal: bool):
    """Per-column bound vectors (each (seqlen,)) -> ((1, 1, seqlen, C) int32, causal)."""
    return torch.stack(cols, dim=-1).to(_I32).view(1, 1, -1, len(cols)), causal


def causal_document(doc_lens: Union[Sequence[int], Sequence[Sequence[int]], None] = None,
                    seqlen: Optional[int] = None, *, cu_seqlens: Optional[torch.Tensor] = None,
                    device=None):
    """Packed documents, causal within each: row i sees column j iff doc(i) == doc(j) and
    j <= i. Bounds (causal, C=1): LTS of column j = the end of j's document.

    doc_lens: one row's document lengths, or a list of rows (each a list: a batch, all with the
    same seqlen); or give ``cu_seqlens`` (int, (docs + 1,), starting at 0) instead."""
    if cu_seqlens is not None:
        if doc_lens is not None:
            raise FlashExtValueError("flash_ext.flashmask_masks.causal_document: give doc_lens "
                                     "or cu_seqlens, not both")
        cu = cu_seqlens.to("cpu", torch.int64)
        doc_lens = (cu[1:] - cu[:-1]).tolist()
    if doc_lens is None:
        raise FlashExtTypeError("flash_ext.flashmask_masks.causal_document needs doc_lens or "
                                "cu_seqlens")
    if len(doc_lens) and isinstance(doc_lens[0], (list, tuple, torch.Tensor)):
        if seqlen is None:
            seqlen = max(int(sum(int(x) for x in row)) for row in doc_lens)
        return stack([causal_document(row, seqlen, device=device) for row in doc_lens])
    lens, seqlen = _lengths("doc_lens", doc_lens, seqlen, device)
    _, _, end = _ranges(lens, seqlen)
    return _out([end], True)


def shared_question(question_len: Union[int, Sequence[int]],
                    answer_lens: Union[Sequence[int], Sequence[Sequence[int]]],
                    seqlen: Optional[int] = None, *, device=None):
    """One question shared by several answers (per sample; samples may be packed in a row):
    row i sees column j iff j <= i, both in one sample, and j is in the question or in i's own
    answer. Bounds (causal, C=1): a question column's LTS = its sample's end; an answer
    column's LTS = its answer's end.

    question_len an int and answer_lens a list of ints: one sample. question_len a list (one
    per packed sample) and answer_lens a list of lists: several samples in one row. Tokens
    after the last sample form a sample of their own (a question without answers)."""
    if isinstance(question_len, (list, tuple)):
        if len(question_len) != len(answer_lens):
            raise FlashExtValueError(
                "flash_ext.flashmask_masks.shared_question: one answer_lens list per question; "
                f"got {len(question_len)} questions and {len(answer_lens)} lists")
        samples = [(int(qn), [int(a) for a in ans]) for qn, ans in zip(question_len, answer_lens)]
    else:
        samples = [(int(question_len), [int(a) for a in answer_lens])]
    # Segments: each sample's question then its answers; seg_sample maps them to samples.
    seg_lens, seg_sample, seg_is_q = [], [], []
    for s, (qn, ans) in enumerate(samples):
        for n, is_q in [(qn, True)] + [(a, False) for a in ans]:
            seg_lens.append(n)
            seg_sample.append(s)
            seg_is_q.append(is_q)
    lens, seqlen = _lengths("question_len + answer_lens", seg_lens, seqlen, device)
    if lens.numel() > len(seg_lens):  # the tokens left over: a question of their own
        seg_sample.append(len(samples))
        seg_is_q.append(True)
    seg_sample_t = torch.tensor(seg_sample, dtype=torch.int64, device=lens.device)
    seg_is_q_t = torch.tensor(seg_is_q, dtype=torch.bool, device=lens.device)
    sample_end = torch.zeros(len(samples) + 1, dtype=torch.int64, device=lens.device)
    sample_end.scatter_reduce_(0, seg_sample_t, torch.cumsum(lens, 0), "amax")
    idx, _, seg_end = _ranges(lens, seqlen)
    lts = torch.where(seg_is_q_t[idx], sample_end[seg_sample_t[idx]], seg_end)
    return _out([lts], True)


def prefix_lm(prefix_lens: Union[int, Sequence[int]], doc_lens: Optional[Sequence[int]] = None,
              seqlen: Optional[int] = None, *, device=None):
    """Prefix LM over packed documents: row i sees column j iff both are in one document
    [s, e) and (j < s + p or j <= i), p the document's prefix (bidirectional). Bounds
    (non-causal, C=2): LTS = e; UTE = s for prefix columns, UTE = j for the others.

    prefix_lens: one int for every document or one per document (clipped to its length).
    doc_lens None: one document of ``seqlen`` tokens."""
    if doc_lens is None:
        if seqlen is None:
            raise FlashExtValueError("flash_ext.flashmask_masks.prefix_lm needs doc_lens or "
                                     "seqlen")
        doc_lens = [int(seqlen)]
    lens, seqlen = _lengths("doc_lens", doc_lens, seqlen, device)
    n_given = len(doc_lens)
    if isinstance(prefix_lens, (list, tuple, torch.Tensor)):
        prefix = [int(x) for x in (prefix_lens.tolist() if isinstance(prefix_lens, torch.Tensor)
                                   else prefix_lens)]
        if len(prefix) != n_given:
            raise FlashExtValueError(
                f"flash_ext.flashmask_masks.prefix_lm: {len(prefix)} prefix_lens for "
                f"{n_given} documents")
    else:
        prefix = [int(prefix_lens)] * n_given
    if any(p < 0 for p in prefix):
        raise FlashExtValueError(f"flash_ext.flashmask_masks.prefix_lm: prefix_lens must be "
                                 f">= 0; got {prefix}")
    prefix += [0] * (lens.numel() - n_given)  # the tokens left over: causal, no prefix
    prefix_t = torch.tensor(prefix, dtype=torch.int64, device=lens.device)
    idx, start, end = _ranges(lens, seqlen)
    j = torch.arange(seqlen, device=lens.device)
    ute = torch.where(j < start + prefix_t[idx], start, j)
    return _out([end, ute], False)


def sliding_window(window: Union[int, Sequence[int]], seqlen: int, causal: bool = True, *,
                   device=None):
    """Local attention: row i sees column j iff i - wl <= j <= i + wr (causal: wl = window,
    wr = 0). Bounds: causal, C=1: LTS = min(j + w + 1, seqlen); non-causal, C=2: LTS =
    min(j + wl + 1, seqlen), UTE = max(j - wr, 0). window: an int (non-causal: the same on both
    sides) or (wl, wr) with causal=False."""
    if isinstance(window, (list, tuple)):
        if causal:
            raise FlashExtValueError("flash_ext.flashmask_masks.sliding_window: a (left, right) "
                                     "window needs causal=False (causal is (window, 0))")
        wl, wr = (int(w) for w in window)
    else:
        wl = wr = int(window)
    if wl < 0 or wr < 0:
        raise FlashExtValueError(f"flash_ext.flashmask_masks.sliding_window: window sizes must "
                                 f"be >= 0; got {window}")
    seqlen = int(seqlen)
    j = torch.arange(seqlen, device=device, dtype=torch.int64)
    lts = torch.clamp(j + wl + 1, max=seqlen)
    if causal:
        return _out([lts], True)
    return _out([lts, torch.clamp(j - wr, min=0)], False)


def global_sliding_window(num_global: int, window: int, seqlen: int, *, device=None):
    """Global tokens plus a sliding window: row i sees column j iff i < g or j < g or
    |i - j| <= w (g = num_global). Bounds (non-causal, C=4): a global column has no interval
    (LTS = LTE = seqlen, UTS = UTE = 0); column j >= g masks [min(j + w + 1, seqlen), seqlen)
    and [g, max(g, j - w))."""
    g, w, seqlen = int(num_global), int(window), int(seqlen)
    if g < 0 or w < 0:
        raise FlashExtValueError("flash_ext.flashmask_masks.global_sliding_window: num_global "
                                 f"and window must be >= 0; got {g}, {w}")
    j = torch.arange(seqlen, device=device, dtype=torch.int64)
    is_global = j < g
    full = torch.full_like(j, seqlen)
    zero = torch.zeros_like(j)
    lts = torch.where(is_global, full, torch.clamp(j + w + 1, max=seqlen))
    uts = torch.where(is_global, zero, torch.full_like(j, min(g, seqlen)))
    ute = torch.where(is_global, zero, torch.clamp(j - w, min=min(g, seqlen)))
    return _out([lts, full, uts, ute], False)


def causal_blockwise(block_lens: Sequence[int], seqlen: Optional[int] = None, *, device=None):
    """Causal blocks: row i sees column j iff j <= i and (both in one block, or i in the last
    block). Bounds (causal, C=2): a column in block k before the last masks [end_k,
    start_last); the last block's columns mask nothing (LTS = LTE = seqlen)."""
    lens, seqlen = _lengths("block_lens", block_lens, seqlen, device)
    idx, _, end = _ranges(lens, seqlen)
    ends = torch.cumsum(lens, 0)
    last = int(torch.nonzero(lens).max()) if seqlen else 0  # the last non-empty block
    start_last = int(ends[last] - lens[last]) if seqlen else 0
    in_last = idx == last
    full = torch.full_like(end, seqlen)
    lts = torch.where(in_last, full, end)
    lte = torch.where(in_last, full, torch.full_like(end, start_last))
    return _out([lts, lte], True)


def stack(masks: Sequence[tuple]):
    """Rows built separately -> one batch: ((b, 1, seqlen, C) int32, causal). Every row must have
    the same seqlen, C and causal flag."""
    masks = list(masks)
    if not masks:
        raise FlashExtValueError("flash_ext.flashmask_masks.stack: no rows")
    causal = masks[0][1]
    shape = masks[0][0].shape[1:]
    for t, c in masks:
        if c != causal or t.shape[1:] != shape:
            raise FlashExtValueError(
                "flash_ext.flashmask_masks.stack: rows must share seqlen, C and causal; got "
                f"{tuple(t.shape)} causal={c} and {(1,) + tuple(shape)} causal={causal}")
    return torch.cat([t for t, _ in masks], dim=0), causal
