"""flash_attn_with_kvcache: attention of new query tokens against a KV cache, with
FlashAttention-2's signature and semantics (docs/design-flash-decoding.md 3.1).

    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                  cache_seqlens=cache_seqlens, causal=True)

One call appends the new keys and values (if any) to the caches in place, then attends q to
every cached token of its sequence. It is two ops at most, both declared to torch.compile
(flash_ext/ops.py): ``kvcache_append``, the only one that writes (and only the caches), then
``fwd_kvcache``, which reads. Every input check runs before the first of them, so a rejected
call leaves the caches as they were.
"""

from __future__ import annotations

import torch

from flash_ext import _scalar_args, _validation, ops

__all__ = ["flash_attn_with_kvcache"]


def _last_dim_contiguous(t):
    """t, or a copy with a contiguous last dim (small tensors only: never the caches)."""
    if t is None or t.stride(-1) == 1 or t.dim() == 0:
        return t
    return t.contiguous()


def _rotary_table(t):
    """A rotary table the op can read: rows contiguous and 16-byte aligned (copied otherwise;
    the tables are small)."""
    if t is None:
        return t
    return t if ops._is_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Attention of q against a KV cache, appending the new k, v to it first (in place).

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with block_table
            (num_pages, page_size, nheads_k, headdim), page_size a multiple of 16; q's dtype.
            Used and written in place, never copied: last dim contiguous and rows 16-byte
            aligned (other strides are honoured, and may differ between the two). nheads must
            be a multiple of nheads_k (GQA/MQA); headdim a multiple of 8, at most 256. Without
            cache_batch_idx, sequence b uses cache row b (batch_cache >= batch).
        k, v: optional new tokens (batch, seqlen_new, nheads_k, headdim), both or neither.
            Written to slots cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1 of each
            sequence's cache, which then holds L_b = cache_seqlens[b] + seqlen_new keys.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2) in q's dtype, rotary_dim
            a multiple of 16 and <= headdim, seqlen_ro >= the cache capacity; only with k, v.
            The new k is rotated at positions cache_seqlens[b] + t; q at cache_seqlens[b] + t
            when causal or local, else at cache_seqlens[b] for every query token.
        cache_seqlens: the tokens already in each sequence's cache: an int (the same for all;
            no tensor is made from it) or an int32 (batch,) tensor. None: every cache is full
            (its capacity), allowed only without k, v. Not updated by this call.
        cache_batch_idx: optional int32 (batch,): the k_cache row of each sequence (not with
            block_table).
        cache_leftpad: optional int32 (batch,): the first valid slot of each sequence; keys
            before it are not attended. Positions (rotary, masks) stay absolute slot indices.
        block_table: optional int32 (batch, max_pages_per_seq): the pages of each sequence
            (paged cache); capacity = max_pages_per_seq * page_size.
        softmax_scale: default 1 / sqrt(headdim).
        causal, window_size: mask aligned to the bottom-right corner of each sequence's
            L_b keys: query t sees key j iff t + L_b - seqlen_q - left <= j <= t + L_b -
            seqlen_q + right (-1 = unbounded; causal sets right = 0).
        softcap: > 0 caps the scores at softcap * tanh(scores / softcap); <= 0 is off.
        rotary_interleaved: True pairs dims (0, 1), (2, 3), ...; False pairs (i, i +
            rotary_dim / 2) (GPT-NeoX).
        alibi_slopes: optional float32 (nheads,) or (batch, nheads): the bias -slope * |t +
            L_b - seqlen_q - j| is added to the scaled (and capped) scores.
        num_splits: 0 = chosen automatically; N = split each sequence's keys into N parts
            (capped at 128); 1 = no split. The result is the same up to rounding.
        return_softmax_lse: also return lse.

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype, or (out, lse) with
        return_softmax_lse, lse (batch, nheads, seqlen_q) float32 (natural log). A query row
        that sees no key gets out 0 and lse -inf. No gradients (as FlashAttention-2).

    Bad input raises a flash_ext.FlashExtError before anything is written. Index values
    (cache_seqlens + seqlen_new past the capacity, block_table entries out of range, ...) are
    checked too, with one host sync for a new set of CUDA index tensors, except while a CUDA
    graph is captured or torch.compile traces, or with FLASH_EXT_CHECK_KVCACHE=0
    (flash_ext/_validation.py).
    """
    capacity, seqlen_new = _validation.check_kvcache_inputs(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, alibi_slopes,
        num_splits)
    scale, causal, window_left, window_right, softcap = _scalar_args(
        q.shape[-1], softmax_scale, causal, window_size, softcap)
    cache_batch_idx = _last_dim_contiguous(cache_batch_idx)
    cache_leftpad = _last_dim_contiguous(cache_leftpad)
    block_table = _last_dim_contiguous(block_table)
    alibi_slopes = _last_dim_contiguous(alibi_slopes)
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens_tensor, seqlen_int = _last_dim_contiguous(cache_seqlens), -1
    else:
        seqlens_tensor, seqlen_int = None, (-1 if cache_seqlens is None else cache_seqlens)
    rotary_cos, rotary_sin = _rotary_table(rotary_cos), _rotary_table(rotary_sin)
    _validation.check_kvcache_values(
        q, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, capacity,
        seqlen_new, rotary_cos.shape[0] if rotary_cos is not None else None,
        window_left >= 0 or window_right >= 0)
    interleaved = bool(rotary_interleaved)
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_tensor, seqlen_int,
            seqlen_new, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, scale,
            causal, window_left, window_right, softcap, interleaved, int(num_splits))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, alibi_slopes)):
        with torch.no_grad():  # no gradients (FlashAttention-2's behaviour): plain outputs
            out, lse = _run_ops(*args)
    else:
        out, lse = _run_ops(*args)
    return (out, lse) if return_softmax_lse else out


def _run_ops(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_tensor, seqlen_int,
             seqlen_new, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, scale,
             causal, window_left, window_right, softcap, interleaved, num_splits):
    """The append (when there are new tokens), then the attention: the ops' arguments as their
    contract in flash_ext/ops.py states it."""
    if seqlen_new > 0:
        ops._kvcache_append(k_cache, v_cache, ops._aligned(k), ops._aligned(v), rotary_cos,
                            rotary_sin, seqlens_tensor, seqlen_int, cache_batch_idx,
                            cache_leftpad, block_table, interleaved)
    return ops._fwd_kvcache(
        ops._aligned(q), k_cache, v_cache, rotary_cos, rotary_sin, seqlens_tensor, seqlen_int,
        seqlen_new, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, scale, causal,
        window_left, window_right, softcap, interleaved, num_splits)
