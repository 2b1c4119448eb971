"""Plain PyTorch attention, the reference the tests compare flash_ext against.

It materialises the full (seqlen_q, seqlen_k) score matrix (O(N^2) memory): a test tool, not
a fast path. Runs on CPU or GPU.

Semantics (the same as the kernels'):

- q (b, sq, hq, d), k and v (b, sk, hkv, d); hq a multiple of hkv (GQA/MQA: query head h uses
  key/value head h // (hq // hkv)).
- Scores S = softmax_scale * q k^T; with softcap > 0, S = softcap * tanh(S / softcap).
- Local / causal mask, aligned to the bottom-right corner: query row i sees key j iff
  ``i + sk - sq - window_left <= j <= i + sk - sq + window_right`` (a bound of -1 is
  unbounded); causal=True sets window_right = 0.
- lse[b, h, i] = log(sum_j exp(S[i, j])) over the visible keys (natural log, float32).
- A row that sees no key gives output 0 and lse = -inf (never NaN).
- Dropout (``dropout_mask`` given): out = (P * keep / (1 - p)) V with P the softmax above; lse
  is unchanged. The keep mask of the kernels is ``flash_ext._philox.dropout_keep_mask`` (pure
  PyTorch) or the ``flash_ext::dropout_mask`` op.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = ["attention_ref", "attention_ref_varlen", "local_mask"]


def local_mask(seqlen_q: int, seqlen_k: int, window_size: Sequence[int] = (-1, -1),
               causal: bool = False, device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) mask, True where query row i may see key j (bottom-right
    aligned window; see the module docstring)."""
    wl, wr = window_size
    if causal:
        wr = 0
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = i + seqlen_k - seqlen_q  # the key column on row i's (bottom-right aligned) diagonal
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if wl >= 0:
        visible &= j >= diag - wl
    if wr >= 0:
        visible &= j <= diag + wr
    return visible


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  softmax_scale: Optional[float] = None, causal: bool = False,
                  window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                  upcast: bool = True, dropout_p: float = 0.0,
                  dropout_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over batched inputs q (b, sq, hq, d), k and v (b, sk, hkv, d).

    upcast=True computes in float32 and returns out in float32 (the "fp32 reference").
    upcast=False computes in the input dtype the way plain PyTorch would (scores and P @ V in
    low precision, the softmax normalised in float32 then rounded), and returns out in that
    dtype: the "low-precision PyTorch" result of FlashAttention's error criterion.
    dropout_mask: bool (b, hq, sq, sk), True = kept; kept probabilities are scaled by
    1 / (1 - dropout_p) (0 for dropout_p = 1).
    Returns (out (b, sq, hq, d), lse (b, hq, sq) float32).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention_ref takes 4-D (batch, seqlen, nheads, headdim) tensors")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"attention_ref: hq ({hq}) must be a multiple of hkv ({hkv})")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    cdt = torch.float32 if upcast else q.dtype
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    if hkv != hq:
        kc = kc.repeat_interleave(hq // hkv, dim=2)
        vc = vc.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qc * softmax_scale, kc)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float()
    wl, wr = window_size
    if causal or wl >= 0 or wr >= 0:
        visible = local_mask(sq, sk, (wl, wr), causal, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows that see nothing (or sk == 0)
    # Subtracting 0 instead of -inf on empty rows makes their probabilities exp(-inf) = 0.
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - lse_safe.unsqueeze(-1))
    if dropout_mask is not None:
        keep_scale = 0.0 if dropout_p >= 1.0 else 1.0 / (1.0 - dropout_p)
        probs = probs * dropout_mask.to(probs.device, torch.float32) * keep_scale
    probs = probs.to(cdt)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vc)
    return out, lse


def attention_ref_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention: q (total_q, hq, d), k and v (total_k, hkv, d); sequence i has query
    rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) and keys [cu_seqlens_k[i], cu_seqlens_k[i+1]).
    Empty sequences are allowed. Loops over the sequences, calling :func:`attention_ref` with
    ``kwargs``; a ``dropout_mask`` (batch, hq, max_seqlen_q, max_seqlen_k) is cut to each
    sequence's [i, :, :sq_i, :sk_i] corner. Returns (out (total_q, hq, d), lse (hq, total_q)
    float32)."""
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    total_q, hq, d = q.shape
    out_dtype = torch.float32 if kwargs.get("upcast", True) else q.dtype
    out = torch.zeros(total_q, hq, d, dtype=out_dtype, device=q.device)
    lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    mask = kwargs.pop("dropout_mask", None)
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if q1 == q0:
            continue
        if mask is not None:
            kwargs["dropout_mask"] = mask[i:i + 1, :, :q1 - q0, :k1 - k0]
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kwargs)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse
