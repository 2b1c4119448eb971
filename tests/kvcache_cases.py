"""Inputs of flash_attn_with_kvcache for the tests (CPU and GPU), and a brute-force loop that
computes what the call must do, slot by slot and key by key, written independently of
flash_ext.reference.kvcache_attention (which the tests check against it)."""

from __future__ import annotations

import math

import torch


def make_case(*, b=2, sq=1, hq=4, hkv=2, d=64, capacity=64, page_size=None, s_new=1,
              dtype=torch.float16, seqlens="tensor", rotary=None, rotary_frac=1.0,
              leftpad=False, batch_idx=False, alibi=None, causal=False, window_size=(-1, -1),
              softcap=0.0, device="cpu", seed=0, full=False):
    """The keyword arguments of one flash_attn_with_kvcache call (random values, seeded).

    page_size: None for a contiguous (b_cache, capacity, hkv, d) cache; else a paged cache of
    capacity / page_size pages per sequence, pages shuffled over a pool with spare pages, no
    page shared by two sequences. seqlens: "tensor" (int32 (b,)), "int" or None (every cache
    full; then no new tokens). rotary: None, "interleaved" or "half" with rotary_dim =
    rotary_frac * d (a multiple of 16). alibi: None, "h" ((hq,) slopes) or "bh" ((b, hq)).
    full: cache_seqlens + s_new == capacity for every sequence (the edge)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    def randint(lo, hi, shape=()):  # [lo, hi]
        return torch.randint(lo, hi + 1, shape, generator=g)

    if seqlens is None:
        s_new = 0
    kw = dict(q=randn(b, sq, hq, d), causal=causal, window_size=window_size, softcap=softcap)
    if page_size is None:
        b_cache = 2 * b + 1 if batch_idx else b
        kw["k_cache"] = randn(b_cache, capacity, hkv, d)
        kw["v_cache"] = randn(b_cache, capacity, hkv, d)
        if batch_idx:
            kw["cache_batch_idx"] = torch.randperm(b_cache, generator=g)[:b].to(
                torch.int32).to(device)
    else:
        assert capacity % page_size == 0
        pages_per_seq = capacity // page_size
        num_pages = b * pages_per_seq + 3
        kw["k_cache"] = randn(num_pages, page_size, hkv, d)
        kw["v_cache"] = randn(num_pages, page_size, hkv, d)
        perm = torch.randperm(num_pages, generator=g)[:b * pages_per_seq]
        kw["block_table"] = perm.view(b, pages_per_seq).to(torch.int32).to(device)
    if s_new > 0:
        kw["k"] = randn(b, s_new, hkv, d)
        kw["v"] = randn(b, s_new, hkv, d)
    # The most tokens past cache_seqlens any rule needs (q's rotary positions go to + sq - 1).
    ahead = max(s_new, sq) if rotary is not None and s_new > 0 else s_new
    if seqlens == "tensor":
        lens = torch.full((b,), capacity - ahead) if full else randint(0, capacity - ahead, (b,))
        kw["cache_seqlens"] = lens.to(torch.int32).to(device)
    elif seqlens == "int":
        lens = torch.full((b,), capacity - ahead if full else int(randint(0, capacity - ahead)))
        kw["cache_seqlens"] = int(lens[0])
    else:
        lens = torch.full((b,), capacity)
    if leftpad:
        kw["cache_leftpad"] = torch.stack([randint(0, int(n)) for n in lens]).to(
            torch.int32).to(device)
    if rotary is not None:
        rd = int(rotary_frac * d) // 16 * 16
        angles = torch.rand(capacity + 8, rd // 2, generator=g) * 2 * math.pi
        kw["rotary_cos"] = angles.cos().to(dtype).to(device)
        kw["rotary_sin"] = angles.sin().to(dtype).to(device)
        kw["rotary_interleaved"] = rotary == "interleaved"
    if alibi == "h":
        kw["alibi_slopes"] = (torch.rand(hq, generator=g) * 0.3).to(device)
    elif alibi == "bh":
        kw["alibi_slopes"] = (torch.rand(b, hq, generator=g) * 0.3).to(device)
    return kw


def _lengths(cache_seqlens, b, capacity):
    if cache_seqlens is None:
        return [capacity] * b
    if isinstance(cache_seqlens, torch.Tensor):
        return [int(x) for x in cache_seqlens.tolist()]
    return [int(cache_seqlens)] * b


def brute_force(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                rotary_interleaved=True, alibi_slopes=None, **_):
    """out (float64), lse (float64, -inf for rows with no key) and the caches after the
    append, by explicit loops over slots, pairs of rotated dims, query rows and keys."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    b, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    page = k_cache.shape[1]
    capacity = block_table.shape[1] * page if block_table is not None else k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    s_new = 0 if k is None else k.shape[1]
    before = _lengths(cache_seqlens, b, capacity)

    def slot(i, n):
        if block_table is not None:
            return int(block_table[i, n // page]), n % page
        return (int(cache_batch_idx[i]) if cache_batch_idx is not None else i), n

    rd = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    if rotary_interleaved:
        pairs = [(2 * i, 2 * i + 1) for i in range(rd // 2)]
    else:
        pairs = [(i, i + rd // 2) for i in range(rd // 2)]

    def rotate(x, pos):  # x (d,): its pairs rotated in float32, rounded to x's dtype
        xf = x.float()
        out = xf.clone()
        cos, sin = rotary_cos[pos].float(), rotary_sin[pos].float()
        for i, (a, c) in enumerate(pairs):
            out[a] = xf[a] * cos[i] - xf[c] * sin[i]
            out[c] = xf[a] * sin[i] + xf[c] * cos[i]
        return out.to(x.dtype)

    for i in range(b):
        for t in range(s_new):
            r0, r1 = slot(i, before[i] + t)
            for h in range(hkv):
                kt = k[i, t, h]
                if rd:
                    kt = rotate(kt, before[i] + t)
                k_cache[r0, r1, h] = kt
                v_cache[r0, r1, h] = v[i, t, h]

    per_token = causal or left >= 0 or right >= 0
    out = torch.zeros(b, sq, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float64)
    for i in range(b):
        length = before[i] + s_new
        first = int(cache_leftpad[i]) if cache_leftpad is not None else 0
        keys = [k_cache[slot(i, n)].double() for n in range(length)]
        vals = [v_cache[slot(i, n)].double() for n in range(length)]
        for h in range(hq):
            hk = h // group
            if alibi_slopes is None:
                slope = 0.0
            elif alibi_slopes.dim() == 1:
                slope = float(alibi_slopes[h])
            else:
                slope = float(alibi_slopes[i, h])
            for t in range(sq):
                qt = q[i, t, h]
                if rd:
                    qt = rotate(qt, before[i] + (t if per_token else 0))
                qt = qt.double()
                diag = t + length - sq
                scores = {}
                for j in range(first, length):
                    if left >= 0 and j < diag - left:
                        continue
                    if right >= 0 and j > diag + right:
                        continue
                    s = scale * float(torch.dot(qt, keys[j][hk]))
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    scores[j] = s - slope * abs(diag - j)
                if not scores:
                    continue
                m = max(scores.values())
                total = sum(math.exp(s - m) for s in scores.values())
                lse[i, h, t] = m + math.log(total)
                acc = torch.zeros(d, dtype=torch.float64)
                for j, s in scores.items():
                    acc += math.exp(s - m) / total * vals[j][hk]
                out[i, t, h] = acc
    return out, lse, k_cache, v_cache
