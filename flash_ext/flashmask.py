"""FlashMask: attention with column-wise sparse masks (docs/flashmask.md).

    from flash_ext import flashmask_attention, flashmask_masks
    sri, causal = flashmask_masks.causal_document([300, 700, 24], device="cuda")
    out = flashmask_attention(q, k, v, sri, causal=causal)

The mask is given per key column j as int32 query-row bounds, ``startend_row_indices`` shaped
(batch, hm, seqlen_k, C) (varlen (hm, total_k, C)), hm 1 (every head) or nheads_kv (query head h
uses mask head h // (nheads_q // hm)). Row i of column j is masked iff (besides the causal rule
with causal=True, bottom-right aligned: j > i + seqlen_k - seqlen_q):

    causal=True,  C=1: LTS <= i                        (LTS)
    causal=True,  C=2: LTS <= i < LTE                  (LTS, LTE)
    causal=False, C=2: LTS <= i, or i < UTE            (LTS, UTE)
    causal=False, C=4: LTS <= i < LTE, or UTS <= i < UTE   (LTS, LTE, UTS, UTE)

Bounds lie in [0, seqlen_q] (varlen: the column's sequence's), LTS <= LTE, UTS <= UTE. A row
that sees no key gets out 0 and lse -inf (zero gradients). Differentiable in q, k and v
(autograd, eager or torch.compile) through the flash_ext::fwd op, which classifies each
(query block, key block) pair from per-block summaries of the bounds and skips fully masked
blocks in the forward and the backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from flash_ext import _fast_args, _padded_head_dim, _scalar_args, _validation, ops
from flash_ext.errors import FlashExtValueError

__all__ = ["flashmask_attention", "flashmask_attention_varlen"]

_NO_WINDOW = (-1, -1)


def _attention(q, k, v, startend_row_indices, causal, softmax_scale, softcap, args,
               cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    """After the checks: (out, lse) through flash_ext::fwd with the bounds."""
    varlen = cu_seqlens_q is not None
    if args is None:
        args = _scalar_args(q.shape[-1], softmax_scale, causal, _NO_WINDOW, softcap)
    if varlen:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if ops._nothing_to_do(q, k, varlen, max_seqlen_q, max_seqlen_k):
        return ops._no_attention(q, k, v, cu_seqlens_q)
    d = q.shape[-1]
    d_pad = _padded_head_dim(d)
    if d_pad != d:  # zero columns change neither q k^T nor the kept columns of P V
        q, k, v = (F.pad(t, (0, d_pad - d)) for t in (q, k, v))
    else:
        q, k, v = ops._aligned(q), ops._aligned(k), ops._aligned(v)
    out, lse = ops._fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args,
                        0.0, None, False, startend_row_indices)
    if d_pad != d:
        out = out[..., :d]
    return out, lse


def flashmask_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        startend_row_indices: torch.Tensor, *, causal: bool = True,
                        softmax_scale: Optional[float] = None, softcap: float = 0.0,
                        return_lse: bool = False):
    """Attention of q (batch, seqlen_q, nheads_q, headdim) over k, v (batch, seqlen_k,
    nheads_kv, headdim) with the FlashMask mask ``startend_row_indices`` (int32 (batch, hm,
    seqlen_k, C); see the module docstring). float16 / bfloat16 CUDA tensors as for
    flash_attn_func (GQA/MQA, head dims up to 256); softcap > 0 caps the scores before the mask.

    Returns out (q's shape and dtype), or (out, lse) with return_lse: lse float32 (batch,
    nheads_q, seqlen_q), natural log, -inf for rows that see no key. Bad input raises a
    flash_ext.FlashExtError before anything is launched."""
    fn = "flashmask_attention"
    args = _fast_args(q, k, v, softmax_scale, causal, _NO_WINDOW, softcap, False, 0.0)
    if args is None:
        _validation.check_fwd_inputs(q, k, v, softmax_scale=softmax_scale, softcap=softcap)
    _validation.check_flashmask_inputs(fn, startend_row_indices, q, k, causal, False)
    out, lse = _attention(q, k, v, startend_row_indices, causal, softmax_scale, softcap, args)
    return (out, lse) if return_lse else out


def flashmask_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               startend_row_indices: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                               max_seqlen_k: int, *, causal: bool = True,
                               softmax_scale: Optional[float] = None, softcap: float = 0.0,
                               return_lse: bool = False):
    """:func:`flashmask_attention` over packed sequences: q (total_q, nheads_q, headdim), k, v
    (total_k, nheads_kv, headdim), int32 cu_seqlens (batch + 1,) as flash_attn_varlen_func;
    startend_row_indices int32 (hm, total_k, C): the row of key token t of sequence b holds
    bounds local to that sequence (rows [0, seqlen_q of b]). Returns out, or (out, lse) with lse
    float32 (nheads_q, total_q)."""
    fn = "flashmask_attention_varlen"
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise FlashExtValueError(f"flash_ext.{fn} needs cu_seqlens_q and cu_seqlens_k (use "
                                 "flashmask_attention for batched inputs)")
    _validation.check_fwd_inputs(q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    _validation.check_flashmask_inputs(fn, startend_row_indices, q, k, causal, True,
                                       cu_seqlens_q, cu_seqlens_k)
    out, lse = _attention(q, k, v, startend_row_indices, causal, softmax_scale, softcap, None,
                          cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    return (out, lse) if return_lse else out
