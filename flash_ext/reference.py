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
- ``attn_mask`` (bool, True = visible), applied where the causal mask is: broadcast to
  (b, hq, sq, sk), a head dim of 1 or hm (mask heads, hq a multiple of hm: query head h uses
  mask head h // (hq // hm)). :func:`flashmask_visible` makes one from FlashMask bounds.
- A row that sees no key gives output 0 and lse = -inf (never NaN).
- Dropout (``dropout_mask`` given): out = (P * keep / (1 - p)) V with P the softmax above; lse
  is unchanged. The keep mask of the kernels is ``flash_ext._philox.dropout_keep_mask`` (pure
  PyTorch) or the ``flash_ext::dropout_mask`` op.

:func:`kvcache_attention` is the reference of flash_ext.flash_attn_with_kvcache (append into a
contiguous or paged cache, rotary, batch index, left padding, ALiBi), with the helpers it is
made of (:func:`apply_rotary`, :func:`kvcache_append`, :func:`kvcache_gather`).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = ["attention_ref", "attention_ref_varlen", "local_mask", "flashmask_visible",
           "flashmask_visible_varlen", "apply_rotary",
           "kvcache_append", "kvcache_gather", "kvcache_attention"]


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
                  dropout_mask: Optional[torch.Tensor] = None,
                  attn_mask: Optional[torch.Tensor] = None,
                  alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over batched inputs q (b, sq, hq, d), k and v (b, sk, hkv, d).

    upcast=True computes in float32 and returns out in float32 (the "fp32 reference").
    upcast=False computes in the input dtype the way plain PyTorch would (scores and P @ V in
    low precision, the softmax normalised in float32 then rounded), and returns out in that
    dtype: the "low-precision PyTorch" result of FlashAttention's error criterion.
    dropout_mask: bool (b, hq, sq, sk), True = kept; kept probabilities are scaled by
    1 / (1 - dropout_p) (0 for dropout_p = 1).
    attn_mask: bool, True = visible, (sq, sk) or (b or 1, 1 or hm, sq, sk) with hq a multiple of
    hm (query head h uses mask head h // (hq // hm)); combined with causal / window.
    alibi_slopes: fp32 (hq,) or (b, hq); score (i, j) gets - slope * |i + sk - sq - j| after
    scaling (and softcap), before the mask (FlashAttention-2's ALiBi).
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
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().to(q.device).expand(b, hq).reshape(b, hq, 1, 1)
        i = torch.arange(sq, device=q.device).view(sq, 1)
        j = torch.arange(sk, device=q.device).view(1, sk)
        scores = scores - slopes * (i + sk - sq - j).abs().float()
    wl, wr = window_size
    if causal or wl >= 0 or wr >= 0:
        visible = local_mask(sq, sk, (wl, wr), causal, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~_heads_mask(attn_mask, hq).to(q.device), float("-inf"))
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
    sequence's [i, :, :sq_i, :sk_i] corner, an ``attn_mask`` given as a list (one bool
    mask per sequence, each as :func:`attention_ref` takes it) is handed out per sequence, and
    (batch, hq) ``alibi_slopes`` are cut to row i.
    Returns (out (total_q, hq, d), lse (hq, total_q) float32)."""
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    total_q, hq, d = q.shape
    out_dtype = torch.float32 if kwargs.get("upcast", True) else q.dtype
    out = torch.zeros(total_q, hq, d, dtype=out_dtype, device=q.device)
    lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    mask = kwargs.pop("dropout_mask", None)
    attn_masks = kwargs.pop("attn_mask", None)
    slopes = kwargs.pop("alibi_slopes", None)
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if q1 == q0:
            continue
        if attn_masks is not None:
            kwargs["attn_mask"] = attn_masks[i]
        if mask is not None:
            kwargs["dropout_mask"] = mask[i:i + 1, :, :q1 - q0, :k1 - k0]
        if slopes is not None:
            kwargs["alibi_slopes"] = slopes if slopes.dim() == 1 else slopes[i:i + 1]
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kwargs)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def _heads_mask(attn_mask: torch.Tensor, hq: int) -> torch.Tensor:
    """attn_mask as (b or 1, 1 or hq, sq, sk): mask heads repeated over their query-head group."""
    if attn_mask.dtype != torch.bool:
        raise ValueError("attention_ref: attn_mask must be bool (True = visible)")
    if attn_mask.dim() == 2:
        return attn_mask
    hm = attn_mask.shape[1]
    if hm in (1, hq):
        return attn_mask
    if hq % hm != 0:
        raise ValueError(f"attention_ref: hq ({hq}) must be a multiple of the mask heads ({hm})")
    return attn_mask.repeat_interleave(hq // hm, dim=1)


# ----------------------------------------------------------------------------------------------
# FlashMask (flash_ext.flashmask_attention; docs/design-flashmask.md 1, docs/flashmask.md)
# ----------------------------------------------------------------------------------------------


def flashmask_intervals(startend_row_indices: torch.Tensor, seqlen_q: int, causal: bool):
    """The masked row intervals of each key column, [ls, le) and [us, ue), each (..., sk) int64,
    from bounds (..., sk, C): causal C=1 [LTS, sq); causal C=2 [LTS, LTE); non-causal C=2
    [LTS, sq) and [0, UTE); non-causal C=4 [LTS, LTE) and [UTS, UTE). Absent intervals are
    (0, 0) (empty)."""
    b = startend_row_indices.long()
    c = b.shape[-1]
    ls = b[..., 0]
    zero = torch.zeros_like(ls)
    end = torch.full_like(ls, seqlen_q)
    if causal and c == 1:
        return ls, end, zero, zero
    if causal and c == 2:
        return ls, b[..., 1], zero, zero
    if not causal and c == 2:
        return ls, end, zero, b[..., 1]
    if not causal and c == 4:
        return ls, b[..., 1], b[..., 2], b[..., 3]
    raise ValueError(f"flashmask: C = {c} does not fit causal={causal} (causal: 1 or 2; "
                     f"non-causal: 2 or 4)")


def flashmask_visible(startend_row_indices: torch.Tensor, seqlen_q: int, causal: bool,
                      seqlen_k: Optional[int] = None) -> torch.Tensor:
    """The dense form of FlashMask bounds: bool (b, hm, seqlen_q, seqlen_k), True = visible.

    startend_row_indices (b, hm, sk, C) (or (hm, sk, C): then the result is (hm, sq, sk)). Row i
    of column j is masked iff it lies in one of the column's intervals
    (:func:`flashmask_intervals`) or, with causal, j > i + sk - sq (bottom-right aligned, which
    for sq == sk is FlashMask's ``j > i``). seqlen_k defaults to the bounds' sk. Vectorized."""
    sk = startend_row_indices.shape[-2]
    if seqlen_k is not None and seqlen_k != sk:
        raise ValueError(f"flashmask_visible: seqlen_k ({seqlen_k}) must equal the bounds' "
                         f"columns ({sk})")
    ls, le, us, ue = (t.unsqueeze(-2) for t in
                      flashmask_intervals(startend_row_indices, seqlen_q, causal))
    device = startend_row_indices.device
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)  # (sq, 1)
    masked = ((ls <= i) & (i < le)) | ((us <= i) & (i < ue))
    if causal:
        j = torch.arange(sk, device=device).unsqueeze(0)
        masked = masked | (j > i + (sk - seqlen_q))
    return ~masked


def flashmask_visible_varlen(startend_row_indices: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, causal: bool) -> list:
    """Varlen bounds (hm, total_k, C): one bool (1, hm, sq_b, sk_b) mask per sequence (the form
    :func:`attention_ref_varlen` takes as ``attn_mask``)."""
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    return [flashmask_visible(startend_row_indices[:, ck[i]:ck[i + 1]].unsqueeze(0),
                              cq[i + 1] - cq[i], causal) for i in range(len(cq) - 1)]


# ----------------------------------------------------------------------------------------------
# KV cache (flash_ext.flash_attn_with_kvcache; docs/design-flash-decoding.md 3.1, 1.5, 4)
# ----------------------------------------------------------------------------------------------


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x (b, s, h, d) at integer ``positions`` (b, s): the first rd = 2 *
    cos.shape[1] columns are rotated in float32 and rounded to x's dtype (as the kernels do);
    the other columns are unchanged. Pairs: (2i, 2i+1) when ``interleaved``, else (i, i + rd/2)
    (GPT-NeoX), each rotated by the angle whose cos/sin are column i of row ``position``:
    (a, b) -> (a cos - b sin, a sin + b cos)."""
    rd = 2 * cos.shape[1]
    c = cos.float()[positions.long()].unsqueeze(2)  # (b, s, 1, rd/2)
    sn = sin.float()[positions.long()].unsqueeze(2)
    xf = x.float()
    rot = xf[..., :rd]
    if interleaved:
        a, b_ = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b_ * sn, a * sn + b_ * c], dim=-1).flatten(-2)
    else:
        a, b_ = rot[..., :rd // 2], rot[..., rd // 2:]
        out = torch.cat([a * c - b_ * sn, a * sn + b_ * c], dim=-1)
    return torch.cat([out, xf[..., rd:]], dim=-1).to(x.dtype)


def _slot_rows(n: torch.Tensor, b: int, cache: torch.Tensor, cache_batch_idx, block_table):
    """(row along dim 0, row along dim 1) of sequence b's slots n in a contiguous or paged
    cache."""
    if block_table is not None:
        page_size = cache.shape[1]
        return block_table[b].long()[n // page_size], n % page_size
    row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
    return torch.full_like(n, row), n


def _lengths(cache_seqlens, b: int, capacity: int) -> list:
    """Each sequence's tokens in the cache, as Python ints (None: the capacity)."""
    if cache_seqlens is None:
        return [capacity] * b
    if isinstance(cache_seqlens, torch.Tensor):
        return [int(x) for x in cache_seqlens.tolist()]
    return [int(cache_seqlens)] * b


def _capacity(k_cache: torch.Tensor, block_table) -> int:
    if block_table is not None:
        return block_table.shape[1] * k_cache.shape[1]
    return k_cache.shape[1]


def kvcache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, cache_seqlens, *, rotary_cos=None, rotary_sin=None,
                   rotary_interleaved: bool = True, cache_batch_idx=None,
                   block_table=None) -> None:
    """Writes new tokens k, v (b, s_new, hkv, d) IN PLACE into the caches at slots
    cache_seqlens[b] + t (contiguous rows through cache_batch_idx, or pages through
    block_table); k rotated at those positions first when rotary_cos/sin are given."""
    b, s_new = k.shape[0], k.shape[1]
    lens = _lengths(cache_seqlens, b, _capacity(k_cache, block_table))
    if rotary_cos is not None:
        pos = torch.tensor(lens, device=k.device).unsqueeze(1) + torch.arange(s_new,
                                                                               device=k.device)
        k = apply_rotary(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
    for i in range(b):
        n = torch.arange(lens[i], lens[i] + s_new, device=k.device)
        r0, r1 = _slot_rows(n, i, k_cache, cache_batch_idx, block_table)
        k_cache[r0, r1] = k[i].to(k_cache.dtype)
        v_cache[r0, r1] = v[i].to(v_cache.dtype)


def kvcache_gather(cache: torch.Tensor, b: int, length: int, cache_batch_idx=None,
                   block_table=None) -> torch.Tensor:
    """Slots [0, length) of sequence b as one (length, hkv, d) tensor (a copy)."""
    n = torch.arange(length, device=cache.device)
    r0, r1 = _slot_rows(n, b, cache, cache_batch_idx, block_table)
    return cache[r0, r1]


def kvcache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                      rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None,
                      softmax_scale: Optional[float] = None, causal: bool = False,
                      window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                      rotary_interleaved: bool = True, alibi_slopes=None,
                      upcast: bool = True):
    """The reference of flash_ext.flash_attn_with_kvcache (same arguments). Works on clones of
    the caches and returns ``(out, lse, k_cache_new, v_cache_new)``: out (b, sq, hq, d) (float32
    with upcast, else q's dtype), lse (b, hq, sq) float32, and the caches after the append.

    Semantics (docs/design-flash-decoding.md 3.1, 1.5):

    - k, v (b, s_new, hkv, d) are appended at slots cache_seqlens[b] + t; k rotated first
      (float32, rounded to the cache dtype). Sequence b then has L_b = cache_seqlens[b] + s_new
      keys (cache_seqlens None: the capacity), of which slots [cache_leftpad[b], L_b) are
      visible. Slots are absolute positions: left padding shifts neither the rotary positions
      nor the masks.
    - q is rotated (float32, rounded to q's dtype) at position cache_seqlens[b] + t when
      causal or local, else at cache_seqlens[b] for every query token.
    - Scores of query t and key slot j: softmax_scale q.k; softcap; then ALiBi (slopes (hq,) or
      (b, hq)): - slope |t + L_b - sq - j| (exact, under causal masks too); then the mask:
      bottom-right aligned to L_b, query t sees j iff j >= t + L_b - sq - window_left (left
      >= 0) and j <= t + L_b - sq + window_right (right >= 0; causal sets it to 0).
    - A query row that sees no key: out 0, lse -inf.

    upcast=False computes the attention in q's dtype, as plain low-precision PyTorch would (the
    baseline of the error criterion); the rotations are the same either way."""
    b, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    wl, wr = (int(w) for w in window_size)
    if causal:
        wr = 0
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    capacity = _capacity(k_cache, block_table)
    before = _lengths(cache_seqlens, b, capacity)
    s_new = 0
    if k is not None:
        s_new = k.shape[1]
        kvcache_append(k_cache, v_cache, k, v, cache_seqlens, rotary_cos=rotary_cos,
                       rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                       cache_batch_idx=cache_batch_idx, block_table=block_table)
    if rotary_cos is not None:
        per_token = causal or wl >= 0 or wr >= 0
        pos = torch.tensor(before, device=q.device).unsqueeze(1) + \
            (torch.arange(sq, device=q.device) if per_token else torch.zeros(sq, dtype=torch.long,
                                                                             device=q.device))
        q = apply_rotary(q, rotary_cos, rotary_sin, pos, rotary_interleaved)

    cdt = torch.float32 if upcast else q.dtype
    out = torch.zeros(b, sq, hq, d, dtype=cdt, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    leftpad = [0] * b if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    for i in range(b):
        length = before[i] + s_new
        kb = kvcache_gather(k_cache, i, length, cache_batch_idx, block_table).to(cdt)
        vb = kvcache_gather(v_cache, i, length, cache_batch_idx, block_table).to(cdt)
        kb = kb.repeat_interleave(hq // hkv, dim=1)
        vb = vb.repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[i].to(cdt) * softmax_scale, kb)
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        s = s.float()
        t = torch.arange(sq, device=q.device).unsqueeze(1)
        j = torch.arange(length, device=q.device).unsqueeze(0)
        diag = t + length - sq  # key slot on query t's bottom-right aligned diagonal
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
            s = s - slopes.float().view(hq, 1, 1) * (diag - j).abs().float()
        visible = j >= leftpad[i]
        if wl >= 0:
            visible = visible & (j >= diag - wl)
        if wr >= 0:
            visible = visible & (j <= diag + wr)
        s = s.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is visible
        safe = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)
        p = torch.exp(s - safe.unsqueeze(-1)).to(cdt)
        out[i] = torch.einsum("hqk,khd->qhd", p, vb)
        lse[i] = row_lse
    return out, lse, k_cache, v_cache
