"""flash_attn_with_kvcache on the GPU against the fp32 reference (docs/design-flash-decoding.md 4).

A seeded random sample of FlashAttention-2's grid and issue 26's (seqlen_q 1 to 128, keys up to
128k, new k/v or none, rotary fractions and both modes, batch index, left padding, pages of 16 /
64 / 256, causal, local, ALiBi, softcap, MHA/GQA/MQA, head dims 64 to 256, num_splits 1 / auto
/ 7 / 128, fp16 and bf16), edge cases, head dims that are not a multiple of 8 (FlashAttention-2's
59: padded copies), the caches element by element after each call, a CUDA graph decode loop and
torch.compile. About a minute on an H100.

    pytest -q tests/test_kvcache_gpu.py
"""

import random

import pytest
import torch

import flash_ext
from flash_ext import _validation as V
from flash_ext import ops
from flash_ext import reference as R

from conftest import requires_cuda
from kvcache_cases import make_case

pytestmark = [
    requires_cuda,
    pytest.mark.skipif(not ops._HAS_KVCACHE_OPS,
                       reason="this build of flash_ext._C has no KV-cache ops (rebuild)"),
]

_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def _to_cuda(kw):
    return {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}


def _written_slots(kw):
    """Bool masks over k_cache's first two dims: the slots the append writes."""
    kc = kw["k_cache"]
    mask = torch.zeros(kc.shape[:2], dtype=torch.bool, device=kc.device)
    if kw.get("k") is None or kw["k"].shape[1] == 0:
        return mask
    b, s_new = kw["k"].shape[:2]
    lens = kw["cache_seqlens"]
    lens = lens.tolist() if isinstance(lens, torch.Tensor) else [lens] * b
    bt, idx = kw.get("block_table"), kw.get("cache_batch_idx")
    page = kc.shape[1]
    for i in range(b):
        for n in range(lens[i], lens[i] + s_new):
            if bt is not None:
                mask[int(bt[i, n // page]), n % page] = True
            else:
                mask[int(idx[i]) if idx is not None else i, n] = True
    return mask


def check_caches(kw, before, ref_k, ref_v):
    """After the call: every slot the append did not write is bitwise the snapshot ``before``
    (across every page / row); written v and unrotated k bitwise the reference's; rotated k
    within 1 ulp of it (fp32 rotation rounded once, possibly by another fp32 op order)."""
    kc, vc = kw["k_cache"], kw["v_cache"]
    written = _written_slots(kw)
    assert torch.equal(kc[~written], before[0][~written]), "k_cache changed outside the append"
    assert torch.equal(vc[~written], before[1][~written]), "v_cache changed outside the append"
    assert torch.equal(vc[written], ref_v[written])
    got, want = kc[written].float(), ref_k[written].float()
    if kw.get("rotary_cos") is None:
        assert torch.equal(kc[written], ref_k[written])
        return
    bits = _MANTISSA_BITS[kc.dtype]
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0 ** -14))) - bits)
    bad = (got - want).abs() > ulp
    assert not bad.any(), f"{int(bad.sum())} rotated k elements more than 1 ulp off"


def check_attention(kw, out, lse, ref_out, ref_lse, low_out):
    """DESIGN.md's criterion: max error <= 2x PyTorch's low-precision max error + eps (both
    against the fp32 reference); lse close; rows with no key: out 0, lse -inf."""
    assert out.shape == kw["q"].shape and out.dtype == kw["q"].dtype
    assert lse.shape == (out.shape[0], out.shape[2], out.shape[1]) and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out.transpose(1, 2)[empty] == 0).all()
    err = (out.float() - ref_out).abs().max().item()
    low_err = (low_out.float() - ref_out).abs().max().item()
    assert err <= 2 * low_err + 1e-3, (err, low_err)
    rel = (out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-6)
    assert rel < 2e-2, rel
    fin = ~empty
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=2e-3, rtol=1e-3)


def run_and_check(kw, num_splits=0):
    kw = _to_cuda(kw)
    before = (kw["k_cache"].clone(), kw["v_cache"].clone())
    ref_out, ref_lse, ref_k, ref_v = R.kvcache_attention(**kw)
    low_out, _, _, _ = R.kvcache_attention(**kw, upcast=False)
    out, lse = flash_ext.flash_attn_with_kvcache(**kw, num_splits=num_splits,
                                                 return_softmax_lse=True)
    check_caches(kw, before, ref_k, ref_v)
    check_attention(kw, out, lse, ref_out, ref_lse, low_out)
    return out, lse


# ---------------------------------------------------------------------------------------------
# A seeded random sample of the grid
# ---------------------------------------------------------------------------------------------


def _grid_cases(n=40, seed=2026):
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        d = rng.choice([64, 96, 128, 256])
        hkv = rng.choice([1, 2, 8])
        group = rng.choice([1, 4, 8, 32]) if hkv == 1 else rng.choice([1, 4, 8])
        sq = rng.choice([1, 1, 2, 3, 8, 16, 64, 128])
        page = rng.choice([None, None, 16, 64, 256])
        capacity = rng.choice([256, 512, 1024, 4096])
        s_new = rng.choice([0, 1, sq, sq])
        rotary = rng.choice([None, "interleaved", "half"]) if s_new else None
        window = rng.choice([(-1, -1), (-1, -1), (rng.randrange(0, 300), rng.randrange(0, 3)),
                             (rng.randrange(0, 300), -1)])
        case = dict(
            b=rng.choice([1, 2, 3]), sq=sq, hq=hkv * group, hkv=hkv, d=d, capacity=capacity,
            page_size=page, s_new=s_new, dtype=rng.choice([torch.float16, torch.bfloat16]),
            seqlens=rng.choice(["tensor", "tensor", "int"]) if s_new else
            rng.choice(["tensor", "int", None]),
            rotary=rotary, rotary_frac=rng.choice([0.5, 1.0]),
            leftpad=rng.random() < 0.3, batch_idx=page is None and rng.random() < 0.3,
            alibi=rng.choice([None, None, "h", "bh"]), causal=rng.random() < 0.5,
            window_size=window, softcap=rng.choice([0.0, 0.0, 30.0]),
            full=rng.random() < 0.15, seed=len(cases))
        if case["rotary"] and int(case["rotary_frac"] * d) // 16 * 16 == 0:
            continue
        num_splits = rng.choice([1, 0, 0, 7, 128])
        cases.append(pytest.param(case, num_splits, id=f"case{len(cases)}"))
    return cases


# The decode kernel's ring depth (FLASH_EXT_DECODE_RING): auto picks a deep ring for the small
# grids of most tests here, so every depth is forced too (a depth that does not fit the device
# runs the deepest that does: 4 is covered on an A100 / H100 / H200, not on sm86 / sm89).
RINGS = ["auto", "2", "3", "4"]


@pytest.mark.parametrize("ring", RINGS)
@pytest.mark.parametrize("case, num_splits", _grid_cases())
def test_grid(case, num_splits, ring, tuning):
    tuning.set("FLASH_EXT_DECODE_RING", ring)
    run_and_check(make_case(**case), num_splits)


@pytest.mark.parametrize("ring", RINGS)
@pytest.mark.parametrize("num_splits", [1, 0, 7, 128])
def test_num_splits_agree(num_splits, ring, tuning):
    """Every num_splits gives the reference's result (128 > key blocks: empty splits)."""
    tuning.set("FLASH_EXT_DECODE_RING", ring)
    kw = make_case(b=2, sq=1, hq=32, hkv=8, d=128, capacity=4096, s_new=1, dtype=torch.bfloat16,
                   causal=True, seed=11)
    run_and_check(kw, num_splits)


@pytest.mark.parametrize("ring", ["2", "3", "4"])
@pytest.mark.parametrize("page_size", [None, 16, 48, 64, 256])
@pytest.mark.parametrize("num_splits", [1, 3, 0, 128])
@pytest.mark.parametrize("window", [(-1, -1), (150, 0)])
def test_rings_pages_ragged(ring, page_size, num_splits, window, tuning):
    """Every ring depth over contiguous and paged caches (a paged cache's page numbers are staged
    a full ring ahead: decode/kv_block_loader.h), pages that divide the 64-key blocks and pages
    (48) that straddle them, with sequences of fewer key blocks than the ring (1 and 71 keys),
    splits of a block or two and empty splits (128 splits), and a window whose first visible
    block is not the sequence's first."""
    tuning.set("FLASH_EXT_DECODE_RING", ring)
    capacity = 1920 if page_size == 48 else 2048
    kw = make_case(b=4, sq=1, hq=8, hkv=2, d=128, capacity=capacity, page_size=page_size, s_new=1,
                   dtype=torch.bfloat16, window_size=window, seed=70 + num_splits)
    kw["cache_seqlens"] = torch.tensor([0, 70, 383, capacity - 1], dtype=torch.int32)
    run_and_check(kw, num_splits)


@pytest.mark.parametrize("ring", RINGS)
def test_split_merge_counters_reused_across_calls_and_streams(ring, tuning):
    """The split that finishes last merges a tile's splits and leaves its arrival counter at 0:
    calls with more and then fewer tiles, forced split counts and two streams all give the first
    call's result, bit for bit, and that result is the reference's."""
    tuning.set("FLASH_EXT_DECODE_RING", ring)
    shapes = [(1, 1, 5), (4, 3, 9), (2, 17, 3), (3, 1, 128)]  # (batch, seqlen_q, num_splits)
    cases = [_to_cuda(make_case(b=b, sq=sq, hq=8, hkv=2, d=128, capacity=1024, s_new=0,
                                dtype=torch.bfloat16, causal=i % 2 == 0, seed=40 + i))
             for i, (b, sq, _) in enumerate(shapes)]
    first = []
    for kw, (_, _, splits) in zip(cases, shapes):
        first.append(run_and_check(kw, splits))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for rep in range(6):
        for i, (kw, (_, _, splits)) in enumerate(zip(cases, shapes)):
            stream = streams[(rep + i) % 2]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out, lse = flash_ext.flash_attn_with_kvcache(**kw, num_splits=splits,
                                                             return_softmax_lse=True)
            torch.cuda.current_stream().wait_stream(stream)
            assert torch.equal(out, first[i][0]) and torch.equal(lse, first[i][1]), (rep, i)


@pytest.mark.parametrize("pdl", ["0", "1"])
def test_decode_after_kernels_that_write_its_inputs(pdl, tuning, monkeypatch):
    """FLASH_EXT_DECODE_PDL off and on (common/pdl.h; on sm90+ with sm90 PTX the decode grid is
    scheduled while the kernel before it drains and waits for it): each call follows, with no
    sync in between (no value checks), kernels that rewrite its Q, lengths and whole cache
    (dtype conversions, not copies: V's is the kernel right before the call); every output is
    the reference's for the new contents. (A missing wait would show only after a kernel that
    lets its dependents in early, which these do not.)"""
    tuning.set("FLASH_EXT_DECODE_PDL", pdl)
    monkeypatch.setattr(V, "CHECK_KVCACHE_VALUES", False)
    cap = 8192
    kw = _to_cuda(make_case(b=2, sq=1, hq=32, hkv=8, d=128, capacity=cap, s_new=0,
                            dtype=torch.bfloat16, seed=90))
    g = torch.Generator(device="cuda").manual_seed(1)
    steps = []
    for i in range(4):
        new = {"q": torch.randn(kw["q"].shape, generator=g, device="cuda"),  # fp32: copy_ converts
               "cache_seqlens": torch.tensor([cap - 100 * i, 5000 + 3 * i], device="cuda")}  # int64
        for n in ("k_cache", "v_cache"):
            new[n] = torch.randn(kw[n].shape, generator=g, device="cuda")
        steps.append(new)
    torch.cuda.synchronize()
    outs = []
    for new in steps:
        for n, t in new.items():
            kw[n].copy_(t)
        outs.append(flash_ext.flash_attn_with_kvcache(**kw, num_splits=0, return_softmax_lse=True))
    for new, (out, lse) in zip(steps, outs):
        step_kw = dict(kw, **{n: t.to(kw[n].dtype) for n, t in new.items()})
        ref_out, ref_lse, _, _ = R.kvcache_attention(**step_kw)
        low_out, _, _, _ = R.kvcache_attention(**step_kw, upcast=False)
        check_attention(step_kw, out, lse, ref_out, ref_lse, low_out)


@pytest.mark.parametrize("page_size", [None, 16, 256])
def test_long_decode_128k(page_size):
    """One sequence of ~128k keys, GQA 32/8, d = 128 (built on the GPU: a CPU randn of two
    128k caches would dominate the run)."""
    torch.manual_seed(0)
    b, hq, hkv, d, cap = 1, 32, 8, 128, 131072
    dev, dt = "cuda", torch.bfloat16
    kw = dict(q=torch.randn(b, 1, hq, d, device=dev, dtype=dt),
              k=torch.randn(b, 1, hkv, d, device=dev, dtype=dt),
              v=torch.randn(b, 1, hkv, d, device=dev, dtype=dt),
              cache_seqlens=torch.tensor([cap - 37], dtype=torch.int32, device=dev), causal=True)
    if page_size is None:
        kw["k_cache"] = torch.randn(b, cap, hkv, d, device=dev, dtype=dt)
        kw["v_cache"] = torch.randn(b, cap, hkv, d, device=dev, dtype=dt)
    else:
        pages = cap // page_size
        kw["k_cache"] = torch.randn(pages + 5, page_size, hkv, d, device=dev, dtype=dt)
        kw["v_cache"] = torch.randn(pages + 5, page_size, hkv, d, device=dev, dtype=dt)
        kw["block_table"] = torch.randperm(pages + 5, device=dev)[:pages].view(1, pages).int()
    run_and_check(kw, 0)


# ---------------------------------------------------------------------------------------------
# Edge cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("s_new", [0, 2])
def test_empty_caches(s_new):
    """cache_seqlens = 0: without new k/v no key at all (out 0, lse -inf); with them, only the
    new keys."""
    kw = make_case(b=2, sq=2, s_new=s_new, causal=True, seed=3)
    kw["cache_seqlens"] = torch.zeros(2, dtype=torch.int32)
    out, lse = run_and_check(kw)
    if s_new == 0:
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_leftpad_equal_to_length():
    """cache_leftpad == cache_seqlens: only the new tokens are visible."""
    kw = make_case(b=2, sq=1, s_new=1, leftpad=True, seed=4)
    kw["cache_leftpad"] = kw["cache_seqlens"].clone()
    run_and_check(kw)


@pytest.mark.parametrize("page_size", [16, 64])
def test_blocks_cross_pages_and_ragged_lengths(page_size):
    """Lengths that are not multiples of 64 or of the page, a ragged batch, a 64-key block
    spanning pages, appends that cross a page boundary."""
    kw = make_case(b=4, sq=3, s_new=3, page_size=page_size, capacity=1024, causal=True, seed=5)
    kw["cache_seqlens"] = torch.tensor([page_size - 1, 70, 0, 1021 - 3], dtype=torch.int32)
    run_and_check(kw)


def test_strided_caches_kv_views_of_one_buffer():
    """vLLM's layout: k_cache and v_cache are kv_cache[0] and kv_cache[1] of one buffer, with
    strides of their own."""
    torch.manual_seed(6)
    pages, page, hkv, d = 40, 16, 2, 64
    buf = torch.randn(2, pages, page, hkv, d, dtype=torch.float16, device="cuda")
    kw = make_case(b=2, sq=1, s_new=1, page_size=16, capacity=256, seed=6)
    kw = _to_cuda(kw)
    kw["k_cache"], kw["v_cache"] = buf[0], buf[1]
    kw["block_table"] = torch.randperm(pages, device="cuda")[:32].view(2, 16).int()
    run_and_check(kw)


# ---------------------------------------------------------------------------------------------
# Head dims that are not a multiple of 8 (FlashAttention-2's test uses 59): the call runs on
# zero-padded copies and copies the caches back after an append (flash_ext/kvcache.py)
# ---------------------------------------------------------------------------------------------

PADDED_HEAD_DIM_CASES = {
    "d59_decode_rotary_interleaved": dict(d=59, b=2, sq=1, s_new=1, rotary="interleaved",
                                          causal=True, capacity=512),
    "d59_append_rotary_half_local": dict(d=59, b=2, sq=3, s_new=3, rotary="half",
                                         rotary_frac=0.5, window_size=(40, 0), capacity=256),
    "d59_paged_16_rotary_gqa": dict(d=59, b=3, sq=2, hq=6, hkv=3, s_new=2, page_size=16,
                                    rotary="interleaved", causal=True, capacity=512),
    "d59_paged_256_rotary_alibi": dict(d=59, b=2, sq=16, hq=6, hkv=1, s_new=16, page_size=256,
                                       rotary="half", alibi="bh", causal=True, capacity=1024,
                                       dtype=torch.bfloat16),
    "d59_paged_no_new_kv": dict(d=59, b=2, sq=4, s_new=0, page_size=64, capacity=512),
    "d59_batch_idx_leftpad": dict(d=59, b=2, sq=2, s_new=2, batch_idx=True, leftpad=True,
                                  rotary="half", causal=True, capacity=256),
    "d59_speculative_64": dict(d=59, b=2, sq=64, s_new=64, rotary="interleaved", causal=True,
                               capacity=800),
    "d36_gqa": dict(d=36, b=2, sq=1, hq=8, hkv=2, s_new=1, rotary="half", causal=True),
    "d100_softcap_bf16": dict(d=100, b=2, sq=3, s_new=3, softcap=30.0, causal=True,
                              dtype=torch.bfloat16, page_size=16, capacity=256),
}


@pytest.mark.parametrize("name", sorted(PADDED_HEAD_DIM_CASES))
@pytest.mark.parametrize("num_splits", [1, 0])
def test_head_dim_not_multiple_of_8(name, num_splits):
    kw = make_case(seed=sum(map(ord, name)), **PADDED_HEAD_DIM_CASES[name])
    assert kw["q"].shape[-1] % 8 != 0
    kw = _to_cuda(kw)
    ptrs = (kw["k_cache"].data_ptr(), kw["v_cache"].data_ptr())
    run_and_check(kw, num_splits)  # the caches checked slot by slot, the caller's tensors
    assert (kw["k_cache"].data_ptr(), kw["v_cache"].data_ptr()) == ptrs


def test_head_dim_59_bad_value_leaves_caches():
    """A bad cache_seqlens value raises before the padded copies are even made; the caches
    stay as they were."""
    kw = _to_cuda(make_case(d=59, b=2, s_new=2, page_size=16, seed=17))
    before = (kw["k_cache"].clone(), kw["v_cache"].clone())
    kw["cache_seqlens"] = torch.tensor([3, 63], dtype=torch.int32, device="cuda")
    with pytest.raises(flash_ext.FlashExtValueError, match="at most the cache capacity"):
        flash_ext.flash_attn_with_kvcache(**kw)
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])


def test_head_dim_59_compile():
    """torch.compile: eager's result, the caller's caches updated."""
    torch._dynamo.reset()
    kw = _to_cuda(make_case(d=59, b=2, sq=1, hq=6, hkv=3, capacity=512, s_new=1,
                            page_size=16, rotary="interleaved", causal=True, seed=19))
    eager = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}

    def step(q, k_cache, v_cache, k, v, cos, sin, lens, table):
        return flash_ext.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
            block_table=table, causal=True, return_softmax_lse=True)

    def args(d):
        return (d["q"], d["k_cache"], d["v_cache"], d["k"], d["v"], d["rotary_cos"],
                d["rotary_sin"], d["cache_seqlens"], d["block_table"])

    out, lse = torch.compile(step, fullgraph=True)(*args(kw))
    want_out, want_lse = step(*args(eager))
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert torch.equal(kw["k_cache"], eager["k_cache"])
    assert torch.equal(kw["v_cache"], eager["v_cache"])


# ---------------------------------------------------------------------------------------------
# Bad values on CUDA tensors: raised before the append, caches untouched
# ---------------------------------------------------------------------------------------------


def test_cuda_values_checked_before_the_append():
    kw = _to_cuda(make_case(b=2, s_new=2, page_size=16, seed=7))
    before = (kw["k_cache"].clone(), kw["v_cache"].clone())
    kw["cache_seqlens"] = torch.tensor([3, 63], dtype=torch.int32, device="cuda")
    with pytest.raises(flash_ext.FlashExtValueError, match="at most the cache capacity"):
        flash_ext.flash_attn_with_kvcache(**kw)
    kw["cache_seqlens"] = torch.tensor([3, 5], dtype=torch.int32, device="cuda")
    kw["block_table"][1, 0] = 10_000
    with pytest.raises(flash_ext.FlashExtValueError, match="block_table entries"):
        flash_ext.flash_attn_with_kvcache(**kw)
    assert torch.equal(kw["k_cache"], before[0]) and torch.equal(kw["v_cache"], before[1])
    assert V.CHECK_KVCACHE_VALUES  # the default


# ---------------------------------------------------------------------------------------------
# CUDA graph: a decode step captured once, replayed with cache_seqlens bumped in place
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [128, 59])
@pytest.mark.parametrize("page_size", [None, 16])
def test_cuda_graph_decode_loop(page_size, d):
    """d = 59 captures the padded copies and the copy back (slow, but replayable)."""
    kw = _to_cuda(make_case(b=3, sq=1, hq=8, hkv=2, d=d, capacity=512, s_new=1,
                            page_size=page_size, rotary="half", causal=True, seed=8))
    kw["cache_seqlens"] = torch.tensor([5, 200, 311], dtype=torch.int32, device="cuda")
    eager = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}

    def step(args):
        return flash_ext.flash_attn_with_kvcache(**args, return_softmax_lse=True)

    # Warm up on copies of the caches (a warm-up call appends), on a side stream.
    warm = dict(kw, k_cache=kw["k_cache"].clone(), v_cache=kw["v_cache"].clone())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(warm)
    torch.cuda.current_stream().wait_stream(s)
    del warm

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = step(kw)
    # Capturing ran nothing: the caches are as before.
    assert torch.equal(kw["k_cache"], eager["k_cache"])

    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(16):
        for name in ("q", "k", "v"):
            new = torch.randn(kw[name].shape, generator=g, device="cuda").to(kw[name].dtype)
            kw[name].copy_(new)
            eager[name].copy_(new)
        graph.replay()
        want_out, want_lse = step(eager)
        assert torch.equal(static_out, want_out) and torch.equal(static_lse, want_lse)
        assert torch.equal(kw["k_cache"], eager["k_cache"])
        assert torch.equal(kw["v_cache"], eager["v_cache"])
        kw["cache_seqlens"] += 1
        eager["cache_seqlens"] += 1


# ---------------------------------------------------------------------------------------------
# torch.compile: no graph break, eager's result, caches updated in place, no cache copy
# ---------------------------------------------------------------------------------------------


def test_compile_decode_step_in_place():
    torch._dynamo.reset()
    kw = _to_cuda(make_case(b=2, sq=1, hq=8, hkv=2, d=128, capacity=16384, s_new=1,
                            page_size=256, rotary="interleaved", alibi="h", causal=True, seed=9))
    eager = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}

    def step(q, k_cache, v_cache, k, v, cos, sin, lens, table, slopes):
        return flash_ext.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
            block_table=table, causal=True, alibi_slopes=slopes, return_softmax_lse=True)

    def args(d):
        return (d["q"], d["k_cache"], d["v_cache"], d["k"], d["v"], d["rotary_cos"],
                d["rotary_sin"], d["cache_seqlens"], d["block_table"], d["alibi_slopes"])

    explanation = torch._dynamo.explain(step)(*args(dict(
        kw, k_cache=kw["k_cache"].clone(), v_cache=kw["v_cache"].clone())))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(step, fullgraph=True)
    # First call compiles (on copies of the caches); the second is measured.
    compiled(*args(dict(kw, k_cache=kw["k_cache"].clone(), v_cache=kw["v_cache"].clone())))
    ptrs = (kw["k_cache"].data_ptr(), kw["v_cache"].data_ptr())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = compiled(*args(kw))
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    want_out, want_lse = step(*args(eager))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert (kw["k_cache"].data_ptr(), kw["v_cache"].data_ptr()) == ptrs
    assert torch.equal(kw["k_cache"], eager["k_cache"])
    assert torch.equal(kw["v_cache"], eager["v_cache"])
    cache_bytes = kw["k_cache"].numel() * kw["k_cache"].element_size()
    assert grown < cache_bytes, (grown, cache_bytes)
