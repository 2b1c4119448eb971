"""FlashAttention-2-compatible functions (signatures and return conventions of flash-attn 2.6+).

    from flash_ext import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)

Layouts: q (batch, seqlen, nheads, headdim); kv packed (batch, seqlen_k, 2, nheads_kv, headdim);
qkv packed (batch, seqlen, 3, nheads, headdim); varlen (total_tokens, nheads, headdim) with
int32 cu_seqlens. flash_attn_with_kvcache (decoding against a KV cache, flash_ext/kvcache.py)
is exported here too. With ``return_attn_probs=True`` the functions return ``(out, lse, S_dmask)``:
lse is (batch, nheads, seqlen_q) or varlen (nheads, total_q). S_dmask is None without dropout;
with dropout_p > 0 it is a float32 (batch, nheads, seqlen_q, seqlen_k) tensor (varlen:
(batch, nheads, max_seqlen_q, max_seqlen_k), each sequence in its top-left corner) of the
dropped-out, normalized probabilities P * keep / (1 - dropout_p): 0 where dropped or masked, so
that out = S_dmask @ v up to rounding. It is built from the kernel's own mask (the
flash_ext::dropout_mask op) and P recomputed from q, k and lse in float32: O(seqlen_q * seqlen_k)
memory, a testing aid only (FlashAttention documents its S_dmask the same way).

Dropout: ``dropout_p > 0`` drops each attention probability with that probability and scales the
kept ones by 1 / (1 - dropout_p), whenever it is > 0 (pass 0.0 for evaluation). The mask comes
from torch's default CUDA generator (torch.manual_seed reproduces it) and autograd's backward
regenerates the same mask. Dropout runs the FlashAttention-2 (sm80) kernels on every GPU.

All of them are differentiable (autograd, eager or torch.compile): the gradients of q, k, v
(or of the packed kv / qkv) come from flash_ext's backward kernel. ``deterministic=True`` makes
that backward bitwise reproducible (no atomics; more workspace, somewhat slower); the forward
is deterministic either way. The returned lse carries no gradient.

Arguments as FlashAttention takes them: window_size any length-2 sequence of ints (or numpy /
torch integer scalars) or a 2-element integer tensor; softcap <= 0 is off. Bad input raises a
flash_ext.FlashExtError (a RuntimeError; also a ValueError / TypeError as fits).

Not supported yet by the functions above (FlashExtNotImplementedError, a NotImplementedError):
alibi_slopes, block_table (paged KV); flash_attn_with_kvcache takes both.
"""

from __future__ import annotations

import math

import torch

from flash_ext import _fast_args, _validation, attn_fwd, ops
from flash_ext.kvcache import flash_attn_with_kvcache  # noqa: F401  (exported)
from flash_ext.reference import local_mask

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _unpack(fn: str, name: str, t: torch.Tensor, dim: int, n: int, ndim: int, layout: str):
    _validation.check_packed(fn, name, t, dim, n, ndim, layout)
    return t.unbind(dim)


def _dropped_probs(q, k, lse, rng_state, dropout_p, softmax_scale, causal, window_size, softcap,
                   cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """S_dmask of return_attn_probs with dropout: P * keep / (1 - p) in float32, (batch, heads,
    seqlen_q, seqlen_k), keep from the kernels' own mask op. O(N^2) memory: testing only."""
    with torch.no_grad():
        d = q.shape[-1]
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
        keep_scale = 0.0 if dropout_p >= 1.0 else 1.0 / (1.0 - dropout_p)
        hq, hkv = q.shape[-2], k.shape[-2]

        def probs(qs, ks, lse_s):  # (sq, hq, d), (sk, hkv, d), (hq, sq) -> (hq, sq, sk)
            kf = ks.float().repeat_interleave(hq // hkv, dim=1)
            s = torch.einsum("qhd,khd->hqk", qs.float() * scale, kf)
            if softcap > 0:
                s = torch.tanh(s / softcap) * softcap
            wl, wr = window_size
            if causal or wl >= 0 or wr >= 0:
                vis = local_mask(qs.shape[0], ks.shape[0], (wl, wr), causal, device=q.device)
                s = s.masked_fill(~vis, float("-inf"))
            lse_f = lse_s.float().unsqueeze(-1)
            p = torch.exp(s - torch.where(torch.isinf(lse_f), torch.zeros_like(lse_f), lse_f))
            return torch.where(torch.isinf(lse_f), torch.zeros_like(p), p)

        if cu_seqlens_q is None:
            b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
            keep = ops._dropout_mask(q, rng_state, b, hq, sq, sk, float(dropout_p))
            p = torch.stack([probs(q[i], k[i], lse[i]) for i in range(b)]) if b else \
                torch.zeros(0, hq, sq, sk, device=q.device)
            return p * keep * keep_scale
        cq = [int(x) for x in cu_seqlens_q.tolist()]
        ck = [int(x) for x in cu_seqlens_k.tolist()]
        b, mq, mk = len(cq) - 1, int(max_seqlen_q), int(max_seqlen_k)
        keep = ops._dropout_mask(q, rng_state, b, hq, mq, mk, float(dropout_p))
        out = torch.zeros(b, hq, mq, mk, dtype=torch.float32, device=q.device)
        for i in range(b):
            q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
            if q1 > q0 and k1 > k0:
                out[i, :, :q1 - q0, :k1 - k0] = probs(q[q0:q1], k[k0:k1], lse[:, q0:q1])
        return out * keep * keep_scale


def _run(q, k, v, dropout_p, return_attn_probs: bool, **kw):
    """attn_fwd, then the FlashAttention return convention: out, or (out, lse, S_dmask)."""
    res = attn_fwd(q, k, v, dropout_p=dropout_p, **kw)
    out, lse = res[0], res[1]
    if not return_attn_probs:
        return out
    if dropout_p == 0:
        return out, lse, None
    s_dmask = _dropped_probs(
        q, k, lse, res[2], dropout_p, kw.get("softmax_scale"), kw.get("causal", False),
        _validation.window_pair(kw.get("window_size", (-1, -1))), kw.get("softcap", 0.0),
        kw.get("cu_seqlens_q"),
        kw.get("cu_seqlens_k"), kw.get("max_seqlen_q"), kw.get("max_seqlen_k"))
    return out, lse, s_dmask


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q (b, sq, hq, d), k and v (b, sk, hkv, d) -> out (b, sq, hq, d)
    [or (out, lse, S_dmask) with return_attn_probs]."""
    _validation.check_unsupported("flash_attn_func", alibi_slopes)
    if return_attn_probs is False:
        args = _fast_args(q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                          dropout_p)
        if args is not None:  # attn_fwd's fast path, without its call
            return ops._fwd(q, k, v, None, None, 0, 0, *args, 0.0, None, deterministic)[0]
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap,
                deterministic=deterministic)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q (b, sq, hq, d), kv (b, sk, 2, hkv, d) -> out (b, sq, hq, d)."""
    fn = "flash_attn_kvpacked_func"
    _validation.check_unsupported(fn, alibi_slopes)
    k, v = _unpack(fn, "kv", kv, 2, 2, 5, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    if return_attn_probs is False:
        args = _fast_args(q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                          dropout_p)
        if args is not None:  # attn_fwd's fast path, without its call
            return ops._fwd(q, k, v, None, None, 0, 0, *args, 0.0, None, deterministic)[0]
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap,
                deterministic=deterministic)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv (b, s, 3, h, d) -> out (b, s, h, d)."""
    fn = "flash_attn_qkvpacked_func"
    _validation.check_unsupported(fn, alibi_slopes)
    q, k, v = _unpack(fn, "qkv", qkv, 2, 3, 5, "(batch, seqlen, 3, nheads, headdim)")
    if return_attn_probs is False:
        args = _fast_args(q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                          dropout_p)
        if args is not None:  # attn_fwd's fast path, without its call
            return ops._fwd(q, k, v, None, None, 0, 0, *args, 0.0, None, deterministic)[0]
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap,
                deterministic=deterministic)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, hq, d), k and v (total_k, hkv, d), cu_seqlens int32 (batch + 1,)
    -> out (total_q, hq, d) [or (out, lse (hq, total_q), S_dmask)]."""
    _validation.check_unsupported("flash_attn_varlen_func", alibi_slopes, block_table)
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap,
                deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """q (total_q, hq, d), kv (total_k, 2, hkv, d) -> out (total_q, hq, d)."""
    fn = "flash_attn_varlen_kvpacked_func"
    _validation.check_unsupported(fn, alibi_slopes)
    k, v = _unpack(fn, "kv", kv, 1, 2, 4, "(total_k, 2, nheads_kv, headdim)")
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap,
                deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, h, d), cu_seqlens int32 (batch + 1,) -> out (total, h, d)."""
    fn = "flash_attn_varlen_qkvpacked_func"
    _validation.check_unsupported(fn, alibi_slopes)
    q, k, v = _unpack(fn, "qkv", qkv, 1, 3, 4, "(total, 3, nheads, headdim)")
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap,
                deterministic=deterministic, cu_seqlens_q=cu_seqlens,
                cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
