"""The ring's arithmetic, free of communication: which attention each step runs, the
log-sum-exp merge of partial results, and one step's forward and backward.

Notation. A rank holds the queries of its shard and, at step i of the ring, the keys and values
of rank ``src = (rank - i) mod world``. Each shard is a list of segments of the full sequence
(flash_ext/distributed/layout.py). The full sequence's mask (causal and/or a local window,
aligned as in flash_ext: query at position p sees key at position t iff
``p - window_left <= t <= p + window_right``, causal meaning window_right = 0) restricted to
one (query segment, key segment) pair is a *band*: local rows a and columns b with
``lo <= b - a <= hi``. :func:`plan_block` cuts the band to its bounding rectangle (the rows and
columns that see anything) and expresses it as one kernel call with a bottom-right aligned
window, which is always possible once the rectangle is trimmed (the last row and the last
column of the rectangle see something, so both window bounds are >= 0).

What the steps come to (S the full length, c = S / (2 world) the zigzag chunk):

- not causal, no window: every step is one full (unmasked) call on the whole shards.
- contiguous, causal: src < rank: full; src == rank: causal; src > rank: nothing (so rank r
  works on r + 1 steps: unbalanced).
- zigzag, causal (rank r holds chunks r and 2w-1-r; src likewise):
    src == rank: one causal call on the whole shard (2c x 2c; the local order of the tokens
    is their global order, so the global causal mask is the local one);
    src < rank: all 2c queries against the first c keys (chunk src), unmasked; the second
    key chunk (2w-1-src) lies after both query chunks;
    src > rank: the last c queries (chunk 2w-1-r) against all 2c keys, unmasked; the first
    query chunk (r) lies before both key chunks.
  Every off-diagonal step is one unmasked 2c x c (or c x 2c) call: the same work on every
  rank at every step.
- a window (window_left >= 0, or window_right >= 0 without causal): per chunk pair, up to
  four banded calls per step, merged where two unmasked calls are adjacent.

Merge: partial results (out_i, lse_i) over disjoint key sets combine exactly as
``out = sum_i w_i out_i / sum_i w_i`` with ``w_i = exp(lse_i - max_j lse_j)`` and
``lse = max_j lse_j + log(sum_i w_i)``, in float32 (:func:`merge_partials`).

Backward (as ring-flash-attention does it): with the merged (final) ``out`` and ``lse``, the
gradient of the loss with respect to one block's q, k, v is exactly what the attention
backward kernel computes for that block alone when it is given the final out and lse: it
forms ``P = exp(S - lse)`` (the global probabilities) and ``D = rowsum(dout * out)`` (the
global D). So each step's call of the backward kernel gives that block's share of dq, dk, dv;
dq adds up on the query's rank, dk and dv on a buffer that travels with the key shard back to
its owner.

The attention itself is a pluggable *backend* (:class:`FlashBackend`, flash_ext's kernels;
:class:`ReferenceBackend`, flash_ext.reference in float32 with autograd for the backward) so
that this code runs on CPU tensors in the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["BlockCall", "plan_block", "plan_step", "merge_partials", "merge_into",
           "forward_step", "backward_step", "FlashBackend", "ReferenceBackend"]

_INF = math.inf


@dataclass(frozen=True)
class BlockCall:
    """One attention call of a ring step: local query rows [q_start, q_end) against local key
    rows [k_start, k_end), with a bottom-right aligned window (-1 = unbounded; window_right
    = 0 with window_left = -1 is causal)."""
    q_start: int
    q_end: int
    k_start: int
    k_end: int
    window_left: int = -1
    window_right: int = -1

    @property
    def unmasked(self) -> bool:
        return self.window_left == -1 and self.window_right == -1

    def shifted(self, dq: int, dk: int) -> "BlockCall":
        return BlockCall(self.q_start + dq, self.q_end + dq, self.k_start + dk, self.k_end + dk,
                         self.window_left, self.window_right)


def _bounds(causal: bool, window_size: Sequence[int]) -> tuple:
    wl, wr = int(window_size[0]), int(window_size[1])
    if causal:
        wr = 0
    return wl, wr


def plan_block(q_pos: int, sq: int, k_pos: int, sk: int, causal: bool = False,
               window_size: Sequence[int] = (-1, -1)) -> Optional[BlockCall]:
    """The call for queries at global positions [q_pos, q_pos + sq) against keys at
    [k_pos, k_pos + sk), or None when no query sees any key. Indices of the call are relative
    to the two blocks."""
    wl, wr = _bounds(causal, window_size)
    delta = q_pos - k_pos  # b - a = (t - p) + delta for query p = q_pos + a, key t = k_pos + b
    lo = delta - wl if wl >= 0 else -_INF
    hi = delta + wr if wr >= 0 else _INF
    a0 = 0 if hi == _INF else max(0, -hi)
    a1 = sq if lo == -_INF else min(sq, sk - lo)
    b0 = 0 if lo == -_INF else max(0, lo)
    b1 = sk if hi == _INF else min(sk, sq + hi)
    if a0 >= a1 or b0 >= b1:
        return None
    sq2, sk2, shift = a1 - a0, b1 - b0, b0 - a0
    # Kernel convention on the trimmed rectangle: row a sees b iff
    # a + sk2 - sq2 - left <= b <= a + sk2 - sq2 + right.
    left = -1 if lo == -_INF else (sk2 - sq2) - (lo - shift)
    right = -1 if hi == _INF else (hi - shift) - (sk2 - sq2)
    if left >= sk2 - 1:
        left = -1  # bounds no row
    if right >= sq2 - 1:
        right = -1
    assert left >= -1 and right >= -1, "a trimmed band always has bounds >= 0"
    return BlockCall(int(a0), int(a1), int(b0), int(b1), int(left), int(right))


def _increasing(segments) -> bool:
    end = -_INF
    for start, length in segments:
        if start < end:
            return False
        end = start + length
    return True


def _merge_unmasked(calls: list) -> list:
    """Joins unmasked calls that share their key rows and have adjacent query rows, or share
    their query rows and have adjacent key rows: fewer, larger kernel calls."""
    calls = list(calls)
    joined = True
    while joined:
        joined = False
        for i in range(len(calls)):
            for j in range(len(calls)):
                x, y = calls[i], calls[j]
                if i == j or not (x.unmasked and y.unmasked):
                    continue
                if (x.k_start, x.k_end) == (y.k_start, y.k_end) and x.q_end == y.q_start:
                    new = BlockCall(x.q_start, y.q_end, x.k_start, x.k_end)
                elif (x.q_start, x.q_end) == (y.q_start, y.q_end) and x.k_end == y.k_start:
                    new = BlockCall(x.q_start, x.q_end, x.k_start, y.k_end)
                else:
                    continue
                calls = [c for n, c in enumerate(calls) if n not in (i, j)] + [new]
                joined = True
                break
            if joined:
                break
    return sorted(calls, key=lambda c: (c.q_start, c.k_start))


def plan_step(q_segments, k_segments, causal: bool = False,
              window_size: Sequence[int] = (-1, -1)) -> list:
    """The calls of one ring step: the local queries (``q_segments``, see layout.py) against
    the key shard of ``k_segments``. Returns a list of :class:`BlockCall` (empty: nothing to
    compute); their query rows may overlap (their results are merged) but no (query, key)
    pair is in two calls."""
    wl, wr = _bounds(causal, window_size)
    q_segments, k_segments = tuple(map(tuple, q_segments)), tuple(map(tuple, k_segments))
    if q_segments == k_segments and wl == -1 and wr in (-1, 0) and _increasing(q_segments):
        # The diagonal step: local order = global order, so the causal mask is the local one.
        n = sum(length for _, length in q_segments)
        return [BlockCall(0, n, 0, n, -1, wr)] if n else []
    calls = []
    q_off = 0
    for q_pos, sq in q_segments:
        k_off = 0
        for k_pos, sk in k_segments:
            c = plan_block(q_pos, sq, k_pos, sk, causal, (wl, wr))
            if c is not None:
                calls.append(c.shifted(q_off, k_off))
            k_off += sk
        q_off += sq
    return _merge_unmasked(calls)


# ----------------------------------------------------------------------------------------------
# Log-sum-exp merge
# ----------------------------------------------------------------------------------------------

def merge_partials(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple:
    """Merges attention results over disjoint key sets: outs (b, s, h, d), lses (b, h, s)
    (natural-log log-sum-exp, -inf for rows that saw no key). Returns (out float32, lse
    float32). Rows where every lse is -inf give out 0 and lse -inf (no NaN)."""
    lse = torch.stack([x.float() for x in lses])           # (n, b, h, s)
    m = lse.amax(dim=0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)                              # 0 where lse_i = -inf
    total = w.sum(dim=0)
    lse_out = m_safe + torch.log(total)                      # log(0) = -inf on empty rows
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    w = w.transpose(-1, -2).unsqueeze(-1)                    # (n, b, s, h, 1)
    out = (w * torch.stack([x.float() for x in outs])).sum(dim=0)
    return out, lse_out


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, q_start: int, q_end: int) -> None:
    """Merges a partial (out, lse) for rows [q_start, q_end) into the float32 accumulators
    acc_out (b, s, h, d) and acc_lse (b, h, s), in place."""
    o, l = merge_partials([acc_out[:, q_start:q_end], out], [acc_lse[:, :, q_start:q_end], lse])
    acc_out[:, q_start:q_end] = o
    acc_lse[:, :, q_start:q_end] = l


# ----------------------------------------------------------------------------------------------
# Backends: the attention of one call
# ----------------------------------------------------------------------------------------------

class FlashBackend:
    """flash_ext's kernels (CUDA tensors, float16 / bfloat16)."""

    def fwd(self, q, k, v, softmax_scale, window_left, window_right, softcap):
        import flash_ext
        causal = window_left == -1 and window_right == 0
        return flash_ext.attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                  window_size=(window_left, window_right), softcap=softcap)

    def bwd(self, dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap):
        import flash_ext
        causal = window_left == -1 and window_right == 0
        return flash_ext.attn_bwd(dout, q, k, v, out, lse.contiguous(),
                                  softmax_scale=softmax_scale, causal=causal,
                                  window_size=(window_left, window_right), softcap=softcap)

    def fwd_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, window_left,
                   window_right, softcap):
        import flash_ext
        causal = window_left == -1 and window_right == 0
        return flash_ext.attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                  max_seqlen_q=max_q, max_seqlen_k=max_k,
                                  softmax_scale=softmax_scale, causal=causal,
                                  window_size=(window_left, window_right), softcap=softcap)

    def bwd_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, softmax_scale,
                   window_left, window_right, softcap):
        import flash_ext
        causal = window_left == -1 and window_right == 0
        return flash_ext.attn_bwd(dout, q, k, v, out, lse.contiguous(), cu_seqlens_q=cu_q,
                                  cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                                  softmax_scale=softmax_scale, causal=causal,
                                  window_size=(window_left, window_right), softcap=softcap)


class ReferenceBackend:
    """flash_ext.reference.attention_ref in float32 (any device, CPU included). The backward
    is torch autograd on the reference: the block's share of the loss with the global lse
    and D held constant (see the module docstring), whose gradient is the kernel's."""

    def fwd(self, q, k, v, softmax_scale, window_left, window_right, softcap):
        from flash_ext.reference import attention_ref
        return attention_ref(q, k, v, softmax_scale=softmax_scale,
                             window_size=(window_left, window_right), softcap=softcap)

    def bwd(self, dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap):
        from flash_ext.reference import attention_ref
        with torch.enable_grad():
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            o_blk, lse_blk = attention_ref(qf, kf, vf, softmax_scale=softmax_scale,
                                           window_size=(window_left, window_right),
                                           softcap=softcap)
            lse_g = lse.float()
            lse_g = torch.where(torch.isneginf(lse_g), torch.zeros_like(lse_g), lse_g)
            # The block's probabilities summed per row: exp(lse_blk - lse), (b, h, s) -> (b, s, h).
            w = torch.exp(lse_blk - lse_g).transpose(1, 2)
            dout_f = dout.float()
            d_rows = (dout_f * out.float()).sum(-1)          # D = rowsum(dout * out), (b, s, h)
            share = (dout_f * o_blk * w.unsqueeze(-1)).sum() - (d_rows * w).sum()
            dq, dk, dv = torch.autograd.grad(share, (qf, kf, vf))
        return dq, dk, dv

    def fwd_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, window_left,
                   window_right, softcap):
        from flash_ext.reference import attention_ref_varlen
        return attention_ref_varlen(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale,
                                    window_size=(window_left, window_right), softcap=softcap)

    def bwd_varlen(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, softmax_scale,
                   window_left, window_right, softcap):
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
        cq, ck = [int(x) for x in cu_q.tolist()], [int(x) for x in cu_k.tolist()]
        for i in range(len(cq) - 1):
            qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            if qs.stop == qs.start:
                continue
            dq, dk, dv = self.bwd(dout[None, qs], q[None, qs], k[None, ks], v[None, ks],
                                  out[None, qs], lse[None, :, qs], softmax_scale, window_left,
                                  window_right, softcap)
            grads[0][qs] += dq[0]
            grads[1][ks] += dk[0]
            grads[2][ks] += dv[0]
        return tuple(grads)


# ----------------------------------------------------------------------------------------------
# One step
# ----------------------------------------------------------------------------------------------

def forward_step(q, k, v, calls, acc_out, acc_lse, backend, softmax_scale, softcap) -> None:
    """Runs one step's calls (q the local shard, k and v the shard held at this step) and
    merges their results into the float32 accumulators, in place."""
    for c in calls:
        o, l = backend.fwd(q[:, c.q_start:c.q_end], k[:, c.k_start:c.k_end],
                           v[:, c.k_start:c.k_end], softmax_scale, c.window_left,
                           c.window_right, softcap)
        merge_into(acc_out, acc_lse, o, l, c.q_start, c.q_end)


def backward_step(dout, q, k, v, out, lse, calls, dq_acc, dk_acc, dv_acc, backend,
                  softmax_scale, softcap) -> None:
    """One step's share of the gradients: adds each call's dq into dq_acc (the local queries)
    and dk, dv into dk_acc, dv_acc (the key shard held at this step); float32, in place.
    ``out`` and ``lse`` are the merged (final) forward results of the local queries."""
    for c in calls:
        qs, ks = slice(c.q_start, c.q_end), slice(c.k_start, c.k_end)
        dq, dk, dv = backend.bwd(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs],
                                 lse[:, :, qs], softmax_scale, c.window_left, c.window_right,
                                 softcap)
        dq_acc[:, qs] += dq
        dk_acc[:, ks] += dk
        dv_acc[:, ks] += dv
