"""The ring's per-step arithmetic for packed documents (varlen): q, k, v (total, heads, d),
every document sharded on its own (layout.shard_varlen), lse (heads, total).

A step's work is, per document, the calls of :func:`ring_steps.plan_step` on that document's
segments. Calls with the same kernel window, from all documents, are independent sequences of
one varlen kernel call: their query and key rows are gathered (``index_select``; skipped when
they are all rows in order, as on the diagonal step), the results merged back by the same
log-sum-exp merge, and in the backward dq, dk, dv scattered back with ``index_add_``. Zigzag
causal needs at most one varlen call per step: the diagonal step is one causal call over the
shards as they are; an off-diagonal one takes every document's first key half (src < rank) or
second query half (src > rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flash_ext.distributed.layout import shard_segments
from flash_ext.distributed.ring_steps import merge_partials, plan_step

__all__ = ["VarlenCall", "plan_varlen_step", "forward_step_varlen", "backward_step_varlen"]


@dataclass
class VarlenCall:
    """One varlen kernel call of a step: the gathered query rows ``q_index`` (None: all rows in
    order) against the gathered key rows ``k_index``, as sequences ``cu_q`` / ``cu_k`` (int32,
    on the tensors' device), with one bottom-right aligned window for all of them."""
    q_index: Optional[torch.Tensor]
    k_index: Optional[torch.Tensor]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    window_left: int
    window_right: int


def _rows(ranges, total: int, device):
    """The index of the concatenated row ranges, or None when they are all rows in order."""
    pos = 0
    for a, b in ranges:
        if a != pos:
            break
        pos = b
    else:
        if pos == total:
            return None
    return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)


def _cu(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def plan_varlen_step(local_lengths, layout: str, world: int, rank: int, src: int,
                     causal: bool, window_size, device) -> list:
    """The :class:`VarlenCall` list of one step: the local queries of every document against
    the key shard of rank ``src`` (``local_lengths``: each document's local length)."""
    # (window) -> list of subgroups; a subgroup is one kernel call whose query rows are all
    # distinct (so that its results merge back with one gather / scatter).
    groups: dict = {}
    off = 0
    for m in local_lengths:
        q_segs = shard_segments(layout, m, world, rank)
        k_segs = shard_segments(layout, m, world, src)
        for c in plan_step(q_segs, k_segs, causal, window_size):
            subgroups = groups.setdefault((c.window_left, c.window_right), [])
            q_range = (off + c.q_start, off + c.q_end)
            k_range = (off + c.k_start, off + c.k_end)
            for sub in subgroups:
                # Documents do not overlap: only this document's earlier calls can collide.
                if all(q_range[1] <= a or b <= q_range[0] for a, b in sub["doc_rows"]):
                    break
            else:
                sub = {"q": [], "k": [], "doc_rows": []}
                subgroups.append(sub)
            if sub.get("doc") != off:
                sub["doc"], sub["doc_rows"] = off, []
            sub["q"].append(q_range)
            sub["k"].append(k_range)
            sub["doc_rows"].append(q_range)
        off += m
    calls = []
    for (wl, wr), subgroups in groups.items():
        for sub in subgroups:
            lq = [b - a for a, b in sub["q"]]
            lk = [b - a for a, b in sub["k"]]
            calls.append(VarlenCall(_rows(sub["q"], off, device), _rows(sub["k"], off, device),
                                    _cu(lq, device), _cu(lk, device), max(lq), max(lk), wl, wr))
    return calls


def _take(t: torch.Tensor, index, dim: int = 0) -> torch.Tensor:
    return t if index is None else t.index_select(dim, index)


def forward_step_varlen(q, k, v, calls, acc_out, acc_lse, backend, softmax_scale,
                        softcap) -> None:
    """Runs one step's varlen calls and merges their results into the float32 accumulators
    acc_out (total, h, d) and acc_lse (h, total), in place."""
    for c in calls:
        o, l = backend.fwd_varlen(_take(q, c.q_index), _take(k, c.k_index), _take(v, c.k_index),
                                  c.cu_q, c.cu_k, c.max_q, c.max_k, softmax_scale,
                                  c.window_left, c.window_right, softcap)
        rows_out, rows_lse = _take(acc_out, c.q_index), _take(acc_lse, c.q_index, 1)
        new_out, new_lse = merge_partials([rows_out[None], o[None]], [rows_lse[None], l[None]])
        if c.q_index is None:
            acc_out.copy_(new_out[0])
            acc_lse.copy_(new_lse[0])
        else:
            acc_out.index_copy_(0, c.q_index, new_out[0])
            acc_lse.index_copy_(1, c.q_index, new_lse[0])


def _add(acc: torch.Tensor, index, g: torch.Tensor) -> None:
    if index is None:
        acc += g
    else:
        acc.index_add_(0, index, g.float())


def backward_step_varlen(dout, q, k, v, out, lse, calls, dq_acc, dk_acc, dv_acc, backend,
                         softmax_scale, softcap) -> None:
    """One step's share of the gradients (see ring_steps.backward_step), packed documents."""
    for c in calls:
        dq, dk, dv = backend.bwd_varlen(
            _take(dout, c.q_index), _take(q, c.q_index), _take(k, c.k_index),
            _take(v, c.k_index), _take(out, c.q_index), _take(lse, c.q_index, 1), c.cu_q,
            c.cu_k, c.max_q, c.max_k, softmax_scale, c.window_left, c.window_right, softcap)
        _add(dq_acc, c.q_index, dq)
        _add(dk_acc, c.k_index, dk)
        _add(dv_acc, c.k_index, dv)
