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

flash_attn_varlen_func also takes ``seqused_k`` (FlashAttention-3's meaning: sequence b uses
only its first seqused_k[b] keys) and ``block_table`` (FlashAttention-2's paged KV: k and v are
caches (num_pages, page_size, nheads_k, headdim) and sequence b's key j is row j % page_size of
page block_table[b, j // page_size]), for prefill and chunked prefill against a paged cache.
Neither has a backward: with inputs that require grad the forward runs, and the output's
backward raises FlashExtNotImplementedError (flash_ext/forward_only.py). Version 1 of
block_table gathers the used pages into a padded contiguous K and V first (flash_ext/paged_kv.py:
O(batch * max_seqlen_k) extra memory, no host sync), then runs the varlen forward.

ALiBi: ``alibi_slopes`` float32 (nheads,) or (batch, nheads), FlashAttention-2's meaning: the
score of query i and key j gets - slope * |i + seqlen_k - seqlen_q - j| (forward and backward;
these calls run the FlashAttention-2 (sm80) kernels on every GPU; not yet together with dropout).
"""

from __future__ import annotations

import math

import torch

from flash_ext import _attn_fwd_checked, _fast_args, _validation, attn_fwd, ops, paged_kv
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
                   cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                   seqused_k=None):
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
        used = None if seqused_k is None else [int(x) for x in seqused_k.tolist()]
        b, mq, mk = len(cq) - 1, int(max_seqlen_q), int(max_seqlen_k)
        keep = ops._dropout_mask(q, rng_state, b, hq, mq, mk, float(dropout_p))
        out = torch.zeros(b, hq, mq, mk, dtype=torch.float32, device=q.device)
        for i in range(b):
            q0, q1, k0 = cq[i], cq[i + 1], ck[i]
            k1 = ck[i + 1] if used is None else k0 + used[i]
            if q1 > q0 and k1 > k0:
                out[i, :, :q1 - q0, :k1 - k0] = probs(q[q0:q1], k[k0:k1], lse[:, q0:q1])
        return out * keep * keep_scale


def _run(q, k, v, dropout_p, return_attn_probs: bool, fwd=attn_fwd, **kw):
    """attn_fwd (or ``fwd``, with its keywords), then the FlashAttention return convention:
    out, or (out, lse, S_dmask)."""
    res = fwd(q, k, v, dropout_p=dropout_p, **kw)
    out, lse = res[0], res[1]
    if not return_attn_probs:
        return out
    if dropout_p == 0:
        return out, lse, None
    _validation.check_attn_probs_alibi(kw.get("alibi_slopes"))
    s_dmask = _dropped_probs(
        q, k, lse, res[2], dropout_p, kw.get("softmax_scale"), kw.get("causal", False),
        _validation.window_pair(kw.get("window_size", (-1, -1))), kw.get("softcap", 0.0),
        kw.get("cu_seqlens_q"),
        kw.get("cu_seqlens_k"), kw.get("max_seqlen_q"), kw.get("max_seqlen_k"),
        kw.get("seqused_k"))
    return out, lse, s_dmask


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q (b, sq, hq, d), k and v (b, sk, hkv, d) -> out (b, sq, hq, d)
    [or (out, lse, S_dmask) with return_attn_probs]."""
    if return_attn_probs is False and alibi_slopes is None:
        args = _fast_args(q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                          dropout_p)
        if args is not None:  # attn_fwd's fast path, without its call
            return ops._fwd(q, k, v, None, None, 0, 0, *args, 0.0, None, deterministic)[0]
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                deterministic=deterministic)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q (b, sq, hq, d), kv (b, sk, 2, hkv, d) -> out (b, sq, hq, d)."""
    fn = "flash_attn_kvpacked_func"
    k, v = _unpack(fn, "kv", kv, 2, 2, 5, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    if return_attn_probs is False and alibi_slopes is None:
        args = _fast_args(q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                          dropout_p)
        if args is not None:  # attn_fwd's fast path, without its call
            return ops._fwd(q, k, v, None, None, 0, 0, *args, 0.0, None, deterministic)[0]
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                deterministic=deterministic)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv (b, s, 3, h, d) -> out (b, s, h, d)."""
    fn = "flash_attn_qkvpacked_func"
    q, k, v = _unpack(fn, "qkv", qkv, 2, 3, 5, "(batch, seqlen, 3, nheads, headdim)")
    if return_attn_probs is False and alibi_slopes is None:
        args = _fast_args(q, k, v, softmax_scale, causal, window_size, softcap, deterministic,
                          dropout_p)
        if args is not None:  # attn_fwd's fast path, without its call
            return ops._fwd(q, k, v, None, None, 0, 0, *args, 0.0, None, deterministic)[0]
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                deterministic=deterministic)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None,
                           seqused_k=None):
    """q (total_q, hq, d), k and v (total_k, hkv, d), cu_seqlens int32 (batch + 1,)
    -> out (total_q, hq, d) [or (out, lse (hq, total_q), S_dmask)].

    seqused_k: optional int32 (batch,): sequence b uses only its first seqused_k[b] keys (of
    cu_seqlens_k[b + 1] - cu_seqlens_k[b]); masks align bottom-right to that count.

    block_table: optional int32 (batch, max_pages_per_seq): k and v are then paged caches
    (num_pages, page_size, hkv, d), any page_size >= 1, and sequence b's key j is row
    j % page_size of page block_table[b, j // page_size]. cu_seqlens_k gives each sequence's key
    count (its steps; FlashAttention-2's convention) unless seqused_k is given, which then sets
    the counts (0 <= count <= max_seqlen_k <= max_pages_per_seq * page_size). Chunked prefill:
    the new tokens' k and v are already in the cache, cu_seqlens_q counts the new queries, the
    key count covers the cached tokens plus the new ones, and causal aligns bottom-right.
    Version 1 gathers the first max_seqlen_k slots of every sequence into a padded contiguous
    K and V (O(batch * max_seqlen_k * hkv * d) extra memory, one vectorized index, no host
    sync: it captures in CUDA graphs and compiles), then runs the varlen forward.

    With either, the call has no backward: when q, k or v requires grad (grad mode on) the
    forward runs and returns the same out (FlashAttention-2's tests do this), and out's
    backward raises FlashExtNotImplementedError saying what to do instead
    (flash_ext/forward_only.py)."""
    fn = "flash_attn_varlen_func"
    if block_table is not None:
        return _varlen_paged(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             block_table, seqused_k, dropout_p, return_attn_probs,
                             softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                             softcap=softcap, deterministic=deterministic, alibi_slopes=alibi_slopes)
    kw = {} if seqused_k is None else {"seqused_k": seqused_k}
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                **kw)


def _varlen_paged(fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, block_table, seqused_k, dropout_p, return_attn_probs, **kw):
    """flash_attn_varlen_func with block_table: the checks, the gather into a padded varlen
    K and V (flash_ext/paged_kv.py), then the varlen forward with each sequence's key count as
    seqused_k. The forward skips attn_fwd's checks (done here, on the caller's tensors): its
    cu_seqlens_k and seqused_k are new tensors every call, whose value checks would sync."""
    _validation.check_paged_varlen_inputs(
        fn, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        block_table, seqused_k, kw["softmax_scale"], kw["window_size"], kw["softcap"], dropout_p)
    _validation.check_alibi_slopes(fn, kw["alibi_slopes"], q, cu_seqlens_q.shape[0] - 1, q.shape[-2],
                                   dropout_p)
    mk = int(max_seqlen_k)
    batch = cu_seqlens_q.shape[0] - 1
    k, v = paged_kv.gather_paged_kv(k_cache, v_cache, block_table, mk)
    return _run(q, k, v, dropout_p, return_attn_probs, fwd=_attn_fwd_checked,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=paged_kv.padded_cu_seqlens(batch, mk, q.device),
                max_seqlen_q=max_seqlen_q, max_seqlen_k=mk,
                seqused_k=paged_kv.used_key_counts(cu_seqlens_k, seqused_k), **kw)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """q (total_q, hq, d), kv (total_k, 2, hkv, d) -> out (total_q, hq, d)."""
    fn = "flash_attn_varlen_kvpacked_func"
    k, v = _unpack(fn, "kv", kv, 1, 2, 4, "(total_k, 2, nheads_kv, headdim)")
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, h, d), cu_seqlens int32 (batch + 1,) -> out (total, h, d)."""
    fn = "flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(fn, "qkv", qkv, 1, 3, 4, "(total, 3, nheads, headdim)")
    return _run(q, k, v, dropout_p, return_attn_probs, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                deterministic=deterministic, cu_seqlens_q=cu_seqlens,
                cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
