"""flash_attn_with_kvcache: attention of new query tokens against a KV cache, with
FlashAttention-2's signature and semantics (docs/design-flash-decoding.md 3.1).

    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                  cache_seqlens=cache_seqlens, causal=True)

One call appends the new keys and values (if any) to the caches in place, then attends q to
every cached token of its sequence. It is two ops at most, both declared to torch.compile
(flash_ext/ops.py): ``kvcache_append``, the only one that writes (and only the caches), then
``fwd_kvcache``, which reads. Every input check runs before the first of them, so a rejected
call leaves the caches as they were. A head dim that is not a multiple of 8 takes a slow
compatibility path (as FlashAttention-2 does): the ops run on zero-padded copies, and the
caches are copied back after the append (:func:`_run_padded`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import flash_ext
from flash_ext import _rows_aligned, _scalar_args, _validation, ops

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
            be a multiple of nheads_k (GQA/MQA); headdim at most 256. Without cache_batch_idx,
            sequence b uses cache row b (batch_cache >= batch).
            A headdim that is not a multiple of 8 works, for compatibility, but slowly (as in
            FlashAttention-2): the call then runs on zero-padded copies of q, k, v and both
            whole caches, and after an append copies the updated caches back into the
            caller's (whose layout is then free; see _run_padded). Use a multiple of 8 for
            speed.
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
        softmax_scale: default 1 / sqrt(headdim) (the given headdim, padded or not).
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
    if rotary_cos is None and rotary_sin is None and cache_batch_idx is None \
            and cache_leftpad is None and alibi_slopes is None:
        result = _fast_call(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal,
                            window_size, softcap, rotary_interleaved, num_splits,
                            return_softmax_lse, block_table)
        if result is not None:
            return result
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
    run = _run_ops if q.shape[-1] % _validation.KVCACHE_HEADDIM_MULTIPLE == 0 else _run_padded
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, alibi_slopes)):
        with torch.no_grad():  # no gradients (FlashAttention-2's behaviour): plain outputs
            out, lse = run(*args)
    else:
        out, lse = run(*args)
    return (out, lse) if return_softmax_lse else out


# What check_kvcache_values keys its cache entry on, for the fast path's calls (which index
# tensors are given: cache_seqlens, cache_leftpad, cache_batch_idx, block_table); no rotary table.
_SEQLENS_ONLY = (True, None, None, None)
_SEQLENS_AND_PAGES = (True, None, None, True)
_PAGES_ONLY = (None, None, None, True)


def _fast_call(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size,
               softcap, rotary_interleaved, num_splits, return_softmax_lse, block_table=None):
    """The common decode call, recognised with a few inline tests and run: what the full path
    returns, or None for anything else (nothing called then; the caller runs the full path).

    Why: the full path's checks and argument handling cost more host time than the two ops'
    dispatch (issue 26: ~35 us of a 68 us decode call on the H100 machine). Its caller has
    already seen no rotary, cache_batch_idx, cache_leftpad or alibi_slopes.

    What it must keep equal to the full path (tests/test_kvcache_fast_path.py checks it): it
    accepts only calls that the full path's structural checks accept, applies the same value
    check policy (a cache hit of check_kvcache_values' entry is a dict lookup and a version
    comparison; otherwise it calls check_kvcache_values itself, which raises its errors or
    skips as the policy says), and makes the same op calls with the same arguments (the caller's
    tensors themselves: no copy to make, nothing to pad). It never raises but through that
    check, before any op call.

    The common call: q, k_cache, v_cache (and k, v, both or neither) plain torch.Tensor on one
    CUDA device (or CPU with flash_ext._FAST_PATH_ON_CPU), none requiring grad, all float16 or
    all bfloat16, 4-D with consistent shapes (batch_cache >= batch, nheads a multiple of
    nheads_k, head dim a multiple of 8 and <= 256), rows aligned (ops._is_aligned); or a paged
    cache: block_table a contiguous int32 (batch, max_pages) tensor on that device, the caches
    (num_pages, page_size, nheads_k, head dim) with page_size a positive multiple of 16
    (capacity max_pages * page_size, any num_pages: check_block_table's rules);
    cache_seqlens a plain int or a contiguous int32 (batch,) tensor on that device;
    softmax_scale None or a finite float > 0; causal and rotary_interleaved bools; window_size
    a tuple or list of two ints >= -1; softcap a finite float; num_splits an int >= 0;
    return_softmax_lse anything (its truth value, as in the full path). Not while torch.compile
    traces (fake and functional tensors, SymInts)."""
    if torch.compiler.is_compiling():
        return None
    tensor = torch.Tensor
    if type(q) is not tensor or type(k_cache) is not tensor or type(v_cache) is not tensor:
        return None
    cpu = flash_ext._FAST_PATH_ON_CPU
    device = q.get_device()
    if not ((q.is_cuda or cpu and q.is_cpu) and (k_cache.is_cuda or cpu and k_cache.is_cpu)
            and (v_cache.is_cuda or cpu and v_cache.is_cpu)
            and k_cache.get_device() == device and v_cache.get_device() == device):
        return None
    dtype = q.dtype
    if (dtype is not torch.float16 and dtype is not torch.bfloat16) \
            or k_cache.dtype is not dtype or v_cache.dtype is not dtype:
        return None
    if q.requires_grad or k_cache.requires_grad or v_cache.requires_grad:
        return None
    if q.dim() != 4 or k_cache.dim() != 4:
        return None
    b, sq, hq, d = q.shape
    cache_shape = k_cache.shape
    b_cache, capacity, hkv, d_cache = cache_shape
    if v_cache.shape != cache_shape or d_cache != d or d % 8 or d > _validation.MAX_HEADDIM \
            or d < 1 or b < 1 or sq < 1 or hq < 1 or hkv < 1 or hq % hkv:
        return None
    if block_table is None:
        if b_cache < b:
            return None
        page_size = 0
    else:  # k_cache (num_pages, page_size, hkv, d): b_cache is num_pages, any count
        if type(block_table) is not tensor or block_table.dtype is not torch.int32 \
                or not (block_table.is_cuda or cpu and block_table.is_cpu) \
                or block_table.get_device() != device or block_table.dim() != 2 \
                or block_table.shape[0] != b or not block_table.is_contiguous():
            return None
        page_size = capacity
        if page_size < 1 or page_size % _validation.KVCACHE_PAGE_MULTIPLE:
            return None
        capacity = block_table.shape[1] * page_size

    # The new tokens
    if k is None:
        if v is not None:
            return None
        seqlen_new = 0
    else:
        if type(k) is not tensor or type(v) is not tensor:
            return None
        if not ((k.is_cuda or cpu and k.is_cpu) and (v.is_cuda or cpu and v.is_cpu)
                and k.get_device() == device and v.get_device() == device):
            return None
        if k.dtype is not dtype or v.dtype is not dtype or k.requires_grad or v.requires_grad:
            return None
        if k.dim() != 4:
            return None
        new_shape = k.shape
        bk, seqlen_new, hk, dk = new_shape
        if v.shape != new_shape or bk != b or hk != hkv or dk != d or sq > capacity \
                or seqlen_new > capacity:
            return None
        if not (_rows_aligned(k) and _rows_aligned(v)):
            return None

    # The lengths already in the caches
    if type(cache_seqlens) is int:
        if cache_seqlens < 0 or cache_seqlens + seqlen_new > capacity:
            return None
        seqlens_tensor, seqlen_int = None, cache_seqlens
    elif type(cache_seqlens) is tensor:
        if not (cache_seqlens.is_cuda or cpu and cache_seqlens.is_cpu) \
                or cache_seqlens.get_device() != device \
                or cache_seqlens.dtype is not torch.int32 or cache_seqlens.dim() != 1 \
                or cache_seqlens.shape[0] != b or not cache_seqlens.is_contiguous():
            return None
        seqlens_tensor, seqlen_int = cache_seqlens, -1
    else:
        return None

    # Plain Python scalars only (numpy scalars, SymInts, tensors, ... take the full path).
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(d)
    elif type(softmax_scale) is float and 0.0 < softmax_scale < math.inf:
        scale = softmax_scale
    else:
        return None
    if type(softcap) is not float or not -math.inf < softcap < math.inf:
        return None
    if (type(window_size) is not tuple and type(window_size) is not list) \
            or len(window_size) != 2:
        return None
    left, right = window_size
    if type(left) is not int or type(right) is not int or left < -1 or right < -1:
        return None
    if causal is True:
        right = 0
    elif causal is not False:
        return None
    if type(num_splits) is not int or num_splits < 0:
        return None
    if rotary_interleaved is not True and rotary_interleaved is not False:
        return None
    # Last, as in the full path (which reads strides and offsets after all other checks).
    if not (_rows_aligned(q) and _rows_aligned(k_cache) and _rows_aligned(v_cache)):
        return None

    # check_kvcache_values' policy: a hit of its cache entry (the same tensors, versions and
    # parameters) means checked; anything else is left to it (it checks, or skips during
    # capture, with FLASH_EXT_CHECK_KVCACHE=0, ..., and raises for bad values). Its entry's
    # key and parameters, as it makes them.
    if block_table is None:
        if seqlens_tensor is not None:
            params = (_SEQLENS_ONLY, None, capacity, seqlen_new, 0, 0, b_cache, sq, None)
            entry = _validation._CHECKED.get(("kvcache", id(seqlens_tensor)))
            if entry is None or entry[0][0]() is not seqlens_tensor or entry[2] != params \
                    or entry[1][0] != seqlens_tensor._version:
                _validation.check_kvcache_values(
                    q, k_cache, seqlens_tensor, None, None, None, capacity, seqlen_new, None,
                    left >= 0 or right >= 0)
    elif seqlens_tensor is not None:
        params = (_SEQLENS_AND_PAGES, None, capacity, seqlen_new, page_size, b_cache, b_cache,
                  sq, None)
        entry = _validation._CHECKED.get(("kvcache", id(seqlens_tensor), id(block_table)))
        if entry is None or entry[2] != params or entry[0][0]() is not seqlens_tensor \
                or entry[0][1]() is not block_table \
                or entry[1] != (seqlens_tensor._version, block_table._version):
            _validation.check_kvcache_values(
                q, k_cache, seqlens_tensor, None, None, block_table, capacity, seqlen_new,
                None, left >= 0 or right >= 0)
    else:
        params = (_PAGES_ONLY, seqlen_int, capacity, seqlen_new, page_size, b_cache, b_cache,
                  sq, None)
        entry = _validation._CHECKED.get(("kvcache", id(block_table)))
        if entry is None or entry[2] != params or entry[0][0]() is not block_table \
                or entry[1][0] != block_table._version:
            _validation.check_kvcache_values(
                q, k_cache, seqlen_int, None, None, block_table, capacity, seqlen_new, None,
                left >= 0 or right >= 0)

    if seqlen_new > 0:
        ops._kvcache_append(k_cache, v_cache, k, v, None, None, seqlens_tensor, seqlen_int,
                            None, None, block_table, rotary_interleaved)
    result = ops._fwd_kvcache(q, k_cache, v_cache, None, None, seqlens_tensor, seqlen_int,
                              seqlen_new, None, None, block_table, None, scale, causal, left,
                              right, softcap if softcap > 0.0 else 0.0, rotary_interleaved,
                              num_splits)
    return result if return_softmax_lse else result[0]


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


def _run_padded(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_tensor, seqlen_int,
                seqlen_new, *rest):
    """_run_ops for a head dim d that is not a multiple of 8 (the ops need 16-byte rows): on
    copies of q, the caches and the new k, v zero-padded to the next multiple of 8, then out
    cut back to d and, after an append, the caches' first d columns copied back into the
    caller's caches.

    Why this is exact: zero columns add nothing to q.k (the default softmax_scale was already
    resolved from the original d), rotary touches only the first rotary_dim <= d columns, and
    P V's first d columns are the unpadded ones. Every check has run on the caller's tensors
    before this, and the caller's caches are written only after both ops returned (a failing
    op leaves them as they were); the copy back rewrites the unwritten slots with their own
    values, so only the appended slots change.

    Slow, for compatibility (FlashAttention-2 does the same): each call copies both whole
    caches (every page of a paged pool) twice when it appends, once otherwise, and holds the
    padded copies meanwhile. Under CUDA graph capture and torch.compile it is these same
    copies (the copy back is a plain in-place write to the caller's caches). Use a head dim
    that is a multiple of 8 for speed."""
    d = q.shape[-1]
    pad = -d % _validation.KVCACHE_HEADDIM_MULTIPLE

    def padded(t):
        return None if t is None else F.pad(t, (0, pad))

    k_cache_p, v_cache_p = padded(k_cache), padded(v_cache)
    out, lse = _run_ops(padded(q), k_cache_p, v_cache_p, padded(k), padded(v), rotary_cos,
                        rotary_sin, seqlens_tensor, seqlen_int, seqlen_new, *rest)
    if seqlen_new > 0:
        k_cache.copy_(k_cache_p[..., :d])
        v_cache.copy_(v_cache_p[..., :d])
    return out[..., :d], lse
