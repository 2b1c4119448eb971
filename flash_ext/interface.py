"""FlashAttention-2-compatible functions (signatures and return conventions of flash-attn 2.6+).

    from flash_ext import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)

Layouts: q (batch, seqlen, nheads, headdim); kv packed (batch, seqlen_k, 2, nheads_kv, headdim);
qkv packed (batch, seqlen, 3, nheads, headdim); varlen (total_tokens, nheads, headdim) with
int32 cu_seqlens. With ``return_attn_probs=True`` the functions return ``(out, lse, None)``:
lse is (batch, nheads, seqlen_q) or varlen (nheads, total_q); the attention probabilities are
only returned by FlashAttention when dropout is on, which flash_ext does not support yet.

All of them are differentiable (autograd, eager or torch.compile): the gradients of q, k, v
(or of the packed kv / qkv) come from flash_ext's backward kernel. ``deterministic=True`` makes
that backward bitwise reproducible (no atomics; more workspace, somewhat slower); the forward
is deterministic either way. The returned lse carries no gradient.

Not supported yet (NotImplementedError): dropout_p > 0, alibi_slopes, block_table (paged KV).
"""

from __future__ import annotations


import torch

from flash_ext import attn_fwd

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]


def _check_unsupported(fn: str, dropout_p, alibi_slopes, block_table=None) -> None:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"flash_ext.{fn}: dropout_p must be a number in [0, 1]; got {dropout_p!r}")
    if dropout_p > 0.0:
        raise NotImplementedError(
            f"flash_ext.{fn}: dropout (dropout_p={dropout_p}) is not supported yet; pass "
            f"dropout_p=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError(f"flash_ext.{fn}: alibi_slopes are not supported yet")
    if block_table is not None:
        raise NotImplementedError(
            f"flash_ext.{fn}: block_table (paged KV cache) is not supported yet")


def _unpack(fn: str, name: str, t: torch.Tensor, dim: int, n: int, ndim: int, layout: str):
    if not isinstance(t, torch.Tensor) or t.dim() != ndim or t.shape[dim] != n:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"flash_ext.{fn}: {name} must have shape {layout}; got {shape}")
    return t.unbind(dim)


def _result(out, lse, return_attn_probs: bool):
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q (b, sq, hq, d), k and v (b, sk, hkv, d) -> out (b, sq, hq, d)
    [or (out, lse, None) with return_attn_probs]."""
    _check_unsupported("flash_attn_func", dropout_p, alibi_slopes)
    out, lse = attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, deterministic=deterministic)
    return _result(out, lse, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q (b, sq, hq, d), kv (b, sk, 2, hkv, d) -> out (b, sq, hq, d)."""
    fn = "flash_attn_kvpacked_func"
    _check_unsupported(fn, dropout_p, alibi_slopes)
    k, v = _unpack(fn, "kv", kv, 2, 2, 5, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    out, lse = attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, deterministic=deterministic)
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv (b, s, 3, h, d) -> out (b, s, h, d)."""
    fn = "flash_attn_qkvpacked_func"
    _check_unsupported(fn, dropout_p, alibi_slopes)
    q, k, v = _unpack(fn, "qkv", qkv, 2, 3, 5, "(batch, seqlen, 3, nheads, headdim)")
    out, lse = attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, deterministic=deterministic)
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, hq, d), k and v (total_k, hkv, d), cu_seqlens int32 (batch + 1,)
    -> out (total_q, hq, d) [or (out, lse (hq, total_q), None)]."""
    _check_unsupported("flash_attn_varlen_func", dropout_p, alibi_slopes, block_table)
    out, lse = attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, deterministic=deterministic,
                        cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k)
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """q (total_q, hq, d), kv (total_k, 2, hkv, d) -> out (total_q, hq, d)."""
    fn = "flash_attn_varlen_kvpacked_func"
    _check_unsupported(fn, dropout_p, alibi_slopes)
    k, v = _unpack(fn, "kv", kv, 1, 2, 4, "(total_k, 2, nheads_kv, headdim)")
    out, lse = attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, deterministic=deterministic,
                        cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k)
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, h, d), cu_seqlens int32 (batch + 1,) -> out (total, h, d)."""
    fn = "flash_attn_varlen_qkvpacked_func"
    _check_unsupported(fn, dropout_p, alibi_slopes)
    q, k, v = _unpack(fn, "qkv", qkv, 1, 3, 4, "(total, 3, nheads, headdim)")
    out, lse = attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, deterministic=deterministic,
                        cu_seqlens_q=cu_seqlens,
                        cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
    return _result(out, lse, return_attn_probs)
