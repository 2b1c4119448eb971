"""The Hopper (wgmma) backward on varlen (cu_seqlens) batches, forced with FLASH_EXT_BWD_PATH=sm90,
against the float32 reference per sequence (criterion: tests/test_bwd_gpu.py check_grads), and
the packed batch against each sequence run alone: dK and dV bitwise equal without GQA (a
sequence's rows are written by its own CTAs only, and the next sequence's rows that its loads run
into contribute exact zeros; with GQA a rounding apart, torch's group sum), dQ equal up to the
order of its fp32 atomics. Skipped without an sm90 GPU (the
kernel is sm_90a only). Design: docs/kernels-sm90-bwd.md, "Varlen"."""

import pytest
import torch

from conftest import built_dtype, requires_cuda
from test_bwd_gpu import DTYPES, _load_ops, check_grads, cu_of, dname, flash_fwd_bwd, ref_grads

pytestmark = requires_cuda


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="the Hopper backward needs an sm90 GPU")


@pytest.fixture(autouse=True)
def _force_sm90(tuning):
    tuning.set("FLASH_EXT_BWD_PATH", "sm90")
    torch.manual_seed(0)


# (query lengths, key lengths) per sequence. Block sizes: kBlockN = 128 keys (64 at d = 256),
# kBlockM = 128 (d = 64) or 64 query rows; the padded rows of a sequence are 128-aligned.
LENS = {
    "edges": ([128, 64, 256, 192], [128, 64, 256, 192]),  # every sequence ends on a block edge
    "inside": ([100, 1, 300, 65, 129], [100, 1, 300, 65, 129]),  # ends inside blocks, a length 1
    "sq!=sk": ([100, 1, 257, 64, 30], [300, 129, 64, 64, 1]),  # bottom-right alignment per sequence
    "empty": ([0, 17, 300, 5, 1025], [5, 40, 0, 1, 1025]),  # no queries; no keys (queries see nothing)
}
KWS = [dict(), dict(causal=True), dict(window=(32, 8)), dict(window=(100, 0)), dict(softcap=30.0),
       dict(causal=True, softcap=5.0), dict(softmax_scale=0.3, causal=True)]


def _packed(lens_q, lens_k, hq, hkv, d, dtype, extra_k=0, extra_q=0):
    """Packed q, k, v, dout; extra_k rows of k, v (extra_q of q, dout) after the last sequence
    belong to none."""
    q = torch.randn(sum(lens_q) + extra_q, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k) + extra_k, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    return q, k, v, dout, cu_of(lens_q), cu_of(lens_k)


def _run_against_reference(lens_q, lens_k, hq, hkv, d, dtype, kw, label):
    q, k, v, dout, cq, ck = _packed(lens_q, lens_k, hq, hkv, d, dtype)
    _, _, dq, dk, dv = flash_fwd_bwd(q, k, v, dout, cu_q=cq, cu_k=ck, max_sq=max(lens_q), max_sk=max(lens_k), **kw)
    ref_kw = dict(causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                  softcap=kw.get("softcap", 0.0))
    if kw.get("softmax_scale") is not None:
        ref_kw["softmax_scale"] = kw["softmax_scale"]
    ref = ref_grads(q, k, v, dout, upcast=True, varlen=(cq, ck), **ref_kw)
    pt = ref_grads(q, k, v, dout, upcast=False, varlen=(cq, ck), **ref_kw)
    for g, t in zip((dq, dk, dv), (q, k, v)):
        assert g.dtype == t.dtype and g.shape == t.shape
    check_grads((dq, dk, dv), ref, pt, label)


@requires_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("lens", list(LENS), ids=str)
@pytest.mark.parametrize("kw", KWS, ids=str)
def test_sm90_varlen(dtype, d, lens, kw):
    lens_q, lens_k = LENS[lens]
    _run_against_reference(lens_q, lens_k, 2, 2, d, dtype, kw, f"sm90 varlen {lens} d={d} {kw}")


@requires_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [40, 64, 128, 200, 256])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1), (6, 2)])  # GQA, MQA, group 3
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(100, 30))], ids=str)
def test_sm90_varlen_gqa(dtype, d, hq, hkv, kw, tuning):
    """GQA / MQA: the varlen kernels expand (FLASH_EXT_SM90_BWD_GQA=loop is ignored for varlen)."""
    tuning.set("FLASH_EXT_SM90_BWD_GQA", "loop")
    lens_q, lens_k = LENS["sq!=sk"]
    _run_against_reference(lens_q, lens_k, hq, hkv, d, dtype, kw, f"sm90 varlen gqa {hq}/{hkv} d={d} {kw}")


@requires_sm90
@pytest.mark.parametrize("lens_q,lens_k", [([2048, 1000, 4096, 3000], [2048, 1000, 4096, 3000]),
                                           ([1500, 3100], [1700, 3000])], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_varlen_long(lens_q, lens_k, causal):
    """A packed training batch's shape: long sequences, 8 / 2 heads, d = 128, bf16."""
    _run_against_reference(lens_q, lens_k, 8, 2, 128, torch.bfloat16, dict(causal=causal),
                           f"sm90 varlen long {lens_q}/{lens_k} causal={causal}")


def _nan_primed_cache(q):
    """Free blocks of NaN in the caching allocator, of q's size (dq's: the small pool for small
    shapes) and larger (the op's work buffer), so that rows the backward leaves unwritten in its
    torch.empty outputs show up as NaN rather than as whatever the memory held."""
    for n in (q.numel(), 16 * q.numel()):
        torch.full((n,), float("nan"), device="cuda", dtype=q.dtype)


def _bwd_one(ops, q, k, v, out, lse, dout, cq, ck, max_sq, max_sk, kw):
    scale = kw.get("softmax_scale", q.shape[-1] ** -0.5)
    window = kw.get("window", (-1, -1))
    return ops.bwd(dout, q, k, v, out, lse, cq, ck, max_sq, max_sk, scale, kw.get("causal", False),
                   window[0], window[1], kw.get("softcap", 0.0), False)


@requires_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2)])
@pytest.mark.parametrize("lens", ["inside", "sq!=sk", "empty"], ids=str)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(32, 8))], ids=str)
def test_sm90_varlen_sequences_independent(dtype, d, hq, hkv, lens, kw):
    """Each sequence of the packed batch gets exactly the dK, dV it gets alone (same out, lse);
    rows of k after the last sequence, and the keys of sequences without queries, stay 0; rows of
    q after the last sequence, and the queries of sequences without keys, get dQ = 0."""
    ops = _load_ops()
    lens_q, lens_k = LENS[lens]
    extra_k, extra_q = 5, 3
    q, k, v, dout, cq, ck = _packed(lens_q, lens_k, hq, hkv, d, dtype, extra_k=extra_k, extra_q=extra_q)
    window = kw.get("window", (-1, -1))
    scale = kw.get("softmax_scale", d ** -0.5)
    out, lse = ops.fwd(q, k, v, cq, ck, max(lens_q), max(lens_k), scale, kw.get("causal", False),
                       window[0], window[1], kw.get("softcap", 0.0))
    _nan_primed_cache(q)
    dq, dk, dv = _bwd_one(ops, q, k, v, out, lse, dout, cq, ck, max(lens_q), max(lens_k), kw)
    assert not dq.isnan().any() and not dk.isnan().any() and not dv.isnan().any()
    total_q, total_k = sum(lens_q), sum(lens_k)
    assert torch.equal(dq[total_q:], torch.zeros_like(dq[total_q:])), "dQ of rows past the last sequence"
    assert torch.equal(dk[total_k:], torch.zeros_like(dk[total_k:])), "dK written past the last sequence"
    assert torch.equal(dv[total_k:], torch.zeros_like(dv[total_k:])), "dV written past the last sequence"
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        q0, k0 = int(cq[i]), int(ck[i])
        rows_q, rows_k = slice(q0, q0 + lq), slice(k0, k0 + lk)
        if lq == 0 or lk == 0:  # alone, such a sequence is no Hopper call (nothing to load)
            assert torch.equal(dk[rows_k], torch.zeros_like(dk[rows_k])), f"seq {i}: dK of keys without queries"
            assert torch.equal(dv[rows_k], torch.zeros_like(dv[rows_k])), f"seq {i}: dV of keys without queries"
            assert torch.equal(dq[rows_q], torch.zeros_like(dq[rows_q])), f"seq {i}: dQ of queries without keys"
            continue
        one_q = torch.tensor([0, lq], device="cuda", dtype=torch.int32)
        one_k = torch.tensor([0, lk], device="cuda", dtype=torch.int32)
        dq1, dk1, dv1 = _bwd_one(ops, q[rows_q].contiguous(), k[rows_k].contiguous(), v[rows_k].contiguous(),
                                 out[rows_q].contiguous(), lse[:, rows_q].contiguous(), dout[rows_q].contiguous(),
                                 one_q, one_k, lq, lk, kw)
        if hq == hkv:  # the kernel's own rows: bitwise
            assert torch.equal(dk[rows_k], dk1), f"seq {i}: dK differs from the sequence alone"
            assert torch.equal(dv[rows_k], dv1), f"seq {i}: dV differs from the sequence alone"
        else:  # torch's group sum may add in another order for another size: a rounding apart
            for name, a, b in (("dK", dk[rows_k], dk1), ("dV", dv[rows_k], dv1)):
                torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=1e-3 * b.float().abs().max().item(),
                                           msg=f"seq {i}: {name} differs from the sequence alone")
        torch.testing.assert_close(dq[rows_q].float(), dq1.float(), atol=2e-3, rtol=2e-2, msg=f"seq {i}: dQ")


@requires_sm90
@pytest.mark.parametrize("lens_q,lens_k", [([0, 0], [3, 5]), ([3, 5], [0, 0])], ids=str)
def test_sm90_varlen_nothing_visible(lens_q, lens_k):
    """Every sequence without queries (max_seqlen_q = 0) or without keys (max_seqlen_k = 0), with
    rows of q and k that belong to no sequence: all gradients 0, no grid of 0 CTAs. The backward
    alone (out = 0, lse = -inf as the forward leaves rows that see nothing)."""
    ops = _load_ops()
    q, k, v, dout, cq, ck = _packed(lens_q, lens_k, 4, 2, 64, torch.bfloat16, extra_k=2, extra_q=3)
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device="cuda")
    _nan_primed_cache(q)
    for kw in (dict(), dict(causal=True)):
        dq, dk, dv = _bwd_one(ops, q, k, v, out, lse, dout, cq, ck, max(lens_q), max(lens_k), kw)
        for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
            assert torch.equal(g, torch.zeros_like(g)), f"{name} {kw}"


@requires_sm90
def test_sm90_varlen_matches_sm80(tuning):
    """The same packed call on both backward paths (a check beside the reference's). The paths round
    dS to the input dtype differently (sm80: dS * scale; sm90: dS, the scale applied to dK and dQ in
    fp32), so they agree to the bf16 error of a backward, not bitwise: the largest difference must
    stay within twice the error of torch's bf16 backward against the float32 reference."""
    lens_q, lens_k = [700, 1, 129, 2000], [900, 64, 129, 1999]
    q, k, v, dout, cq, ck = _packed(lens_q, lens_k, 8, 2, 128, torch.bfloat16)
    kw = dict(cu_q=cq, cu_k=ck, max_sq=max(lens_q), max_sk=max(lens_k), causal=True)
    sm90 = flash_fwd_bwd(q, k, v, dout, **kw)[2:]
    tuning.set("FLASH_EXT_BWD_PATH", "sm80")
    sm80 = flash_fwd_bwd(q, k, v, dout, **kw)[2:]
    ref = ref_grads(q, k, v, dout, upcast=True, varlen=(cq, ck), causal=True)
    pt = ref_grads(q, k, v, dout, upcast=False, varlen=(cq, ck), causal=True)
    for name, a, b, r, p in zip(("dq", "dk", "dv"), sm90, sm80, ref, pt):
        assert not a.isnan().any(), name
        diff = (a.float() - b.float()).abs().max().item()
        pt_err = (p.float() - r).abs().max().item()
        assert diff <= 2 * pt_err + 1e-5, f"{name}: max |sm90 - sm80| {diff:.3e} > 2 x torch bf16's error {pt_err:.3e}"


@requires_sm90
def test_sm90_varlen_refuses_deterministic():
    """Forced sm90 with varlen and deterministic=True is still a clear error."""
    q = torch.randn(64, 2, 64, device="cuda", dtype=built_dtype())
    cu = torch.tensor([0, 30, 64], device="cuda", dtype=torch.int32)
    with pytest.raises(RuntimeError, match="FLASH_EXT_BWD_PATH=sm90"):
        flash_fwd_bwd(q, q, q, torch.randn_like(q), cu_q=cu, cu_k=cu, max_sq=34, max_sk=34, deterministic=True)
