"""Attention dropout on the GPU (skipped without a CUDA GPU).

The kernels' mask must equal the independent pure-PyTorch Philox of flash_ext/_philox.py bit for
bit; the forward and the backward are then compared with float32 references that use that mask,
with FlashAttention's criteria (as in test_fwd_gpu.py / test_bwd_gpu.py):

    out:       max|out - ref| <= 2 max|pt - ref| + max|round(ref) - ref| + 1e-5
    dq/dk/dv:  max|g - ref|   <= 2 max|pt - ref| + max|round(ref) - ref| + 1e-4 max|ref| + 1e-5

where ref is the float32 reference and pt the same reference computed in the input dtype. The
backward runs with FLASH_EXT_BWD_PATH=sm80 and both FLASH_EXT_BWD_VARIANT=1 and 2 (set through
flash_ext::set_tuning, tests/conftest.py), plus once with the default dispatch.

    python -m pytest -q tests/test_dropout_gpu.py
"""

import itertools
import math

import pytest
import torch

import flash_ext
from flash_ext import _philox, ops
from flash_ext.reference import attention_ref, attention_ref_varlen, local_mask

from conftest import requires_cuda

pytestmark = requires_cuda

DTYPES = [torch.float16, torch.bfloat16]
P = 0.17


def dname(dtype):
    return str(dtype).replace("torch.", "")


def rs_of(seed, offset):
    """An rng_state tensor from unsigned 64-bit seed / offset."""
    to_i64 = lambda x: x - 2**64 if x >= 2**63 else x  # noqa: E731
    return torch.tensor([to_i64(seed), to_i64(offset)], dtype=torch.int64)


def cu_of(lens):
    return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")


def py_mask(rs, b, h, sq, sk, p):
    return _philox.dropout_keep_mask(rs, b, h, sq, sk, p, device="cuda")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["1", "2"], ids=lambda v: f"bwd_v{v}")
def bwd_variant(request, tuning):
    tuning.set("FLASH_EXT_BWD_PATH", "sm80")
    tuning.set("FLASH_EXT_BWD_VARIANT", request.param)
    return request.param


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def check_out(out, ref, pt, label):
    assert not out.isnan().any(), f"{label}: NaN"
    err, pt_err = max_err(out, ref), max_err(pt, ref)
    round_err = max_err(ref.to(out.dtype), ref)
    bound = 2 * pt_err + round_err + 1e-5
    print(f"[{label}] out max err {err:.3e} (pt {pt_err:.3e}, bound {bound:.3e})")
    assert err <= bound, f"{label}: out max err {err:.3e} > {bound:.3e}"


def check_lse(lse, ref_lse, label):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{label}: -inf mismatch"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        diff = (lse[fin] - ref_lse[fin]).abs()
        assert (diff <= 1e-3 + 1e-3 * ref_lse[fin].abs()).all(), f"{label}: lse {diff.max():.3e}"


def check_grads(got, ref, pt, label):
    for name, g, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        assert g.shape == r.shape, (name, g.shape, r.shape)
        assert not g.isnan().any(), f"{label}: NaN in {name}"
        if g.numel() == 0:
            continue
        err, pt_err = max_err(g, r), max_err(p, r)
        round_err = max_err(r.to(g.dtype), r)
        bound = 2 * pt_err + round_err + 1e-4 * r.abs().max().item() + 1e-5
        print(f"[{label}] {name} max err {err:.3e} (pt {pt_err:.3e}, bound {bound:.3e})")
        assert err <= bound, f"{label}: {name} max err {err:.3e} > {bound:.3e} (pt {pt_err:.3e})"


def ref_fwd_bwd(q, k, v, dout, mask, p, *, upcast, varlen=None, **kw):
    cdt = torch.float32 if upcast else q.dtype
    qr, kr, vr = (t.detach().to(cdt).requires_grad_() for t in (q, k, v))
    if varlen is None:
        out, lse = attention_ref(qr, kr, vr, upcast=upcast, dropout_p=p, dropout_mask=mask, **kw)
    else:
        out, lse = attention_ref_varlen(qr, kr, vr, *varlen, upcast=upcast, dropout_p=p,
                                        dropout_mask=mask, **kw)
    out.backward(dout.to(out.dtype))
    return out.detach(), lse, (qr.grad, kr.grad, vr.grad)


# ---------------------------------------------------------------------------------------------
# (a), (b) the mask op
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3, 77, 130), (1, 1, 1, 1), (3, 2, 256, 33)])
@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("seed,offset", [(0, 0), (2**64 - 5, 2**32 + 12), (123456789, 4)])
def test_mask_op_matches_python_philox(shape, p, seed, offset):
    rs = rs_of(seed, offset)
    q = torch.empty(1, device="cuda")
    got = ops._dropout_mask(q, rs, *shape, p)
    want = py_mask(rs, *shape, p)
    assert got.dtype == torch.bool and got.shape == shape
    assert torch.equal(got, want), f"{(got != want).sum().item()} mismatches"


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate(p):
    q = torch.empty(1, device="cuda")
    rs = ops._dropout_rng_state(q)
    mask = ops._dropout_mask(q, rs, 4, 8, 512, 512, p)
    n = mask.numel()
    rate = mask.float().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), rate


def test_rng_state_draws_advance_and_reproduce():
    q = torch.empty(1, device="cuda")
    torch.manual_seed(7)
    a, b = ops._dropout_rng_state(q), ops._dropout_rng_state(q)
    torch.manual_seed(7)
    a2 = ops._dropout_rng_state(q)
    assert torch.equal(a, a2) and not torch.equal(a, b)
    assert a.device.type == "cpu" and a.dtype == torch.int64


# ---------------------------------------------------------------------------------------------
# (c) forward
# ---------------------------------------------------------------------------------------------

FWD_CASES = [
    # b, sq, sk, hq, hkv, d, causal
    (2, 128, 128, 4, 4, 64, False),
    (2, 128, 128, 4, 4, 64, True),
    (2, 113, 203, 4, 2, 128, False),
    (2, 113, 203, 4, 2, 128, True),
    (1, 203, 113, 2, 1, 96, True),    # rows that see no key (bottom-right causal, sq > sk)
    (1, 77, 301, 3, 3, 256, False),
    (3, 1, 65, 2, 2, 40, False),      # head dim padded to 40 -> 64 kernel
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_forward_matches_reference(case, dtype):
    b, sq, sk, hq, hkv, d, causal = case
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    out, lse, rs = flash_ext.attn_fwd(q, k, v, causal=causal, dropout_p=P)
    mask = py_mask(rs, b, hq, sq, sk, P)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, dropout_p=P, dropout_mask=mask)
    pt, _ = attention_ref(q, k, v, causal=causal, dropout_p=P, dropout_mask=mask, upcast=False)
    label = f"fwd {case} {dname(dtype)}"
    check_out(out, ref, pt, label)
    check_lse(lse, ref_lse, label)
    # lse is that of the un-dropped softmax: equal to the no-dropout call's
    _, lse0 = flash_ext.attn_fwd(q, k, v, causal=causal)  # (Hopper: the sm90 kernel)
    torch.testing.assert_close(lse, lse0, atol=1e-4, rtol=1e-4)


def test_forward_varlen_window_softcap():
    dtype = torch.bfloat16
    lens_q, lens_k = [37, 0, 128, 65], [50, 20, 128, 1]
    cq, ck = cu_of(lens_q), cu_of(lens_k)
    q = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), 2, 64, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    kw = dict(window_size=(40, 3), softcap=5.0)
    out, lse, rs = flash_ext.attn_fwd(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                      max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                      dropout_p=0.3, **kw)
    mask = py_mask(rs, 4, 4, max(lens_q), max(lens_k), 0.3)
    ref, ref_lse = attention_ref_varlen(q, k, v, cq, ck, dropout_p=0.3, dropout_mask=mask, **kw)
    pt, _ = attention_ref_varlen(q, k, v, cq, ck, dropout_p=0.3, dropout_mask=mask, upcast=False,
                                 **kw)
    check_out(out, ref, pt, "fwd varlen")
    check_lse(lse, ref_lse, "fwd varlen")


def test_forward_p1_gives_zeros():
    q = torch.randn(2, 70, 4, 64, device="cuda", dtype=torch.float16)
    out, lse, _ = flash_ext.attn_fwd(q, q, q, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))
    _, lse0 = flash_ext.attn_fwd(q, q, q)
    torch.testing.assert_close(lse, lse0)


def test_forced_sm90_forward_with_dropout_is_refused(tuning):
    if torch.cuda.get_device_capability()[0] != 9 or "90a" not in flash_ext.build_info():
        pytest.skip("needs an sm90 GPU and a build with 90a")
    tuning.set("FLASH_EXT_FWD_PATH", "sm90")
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dropout"):
        flash_ext.attn_fwd(q, q, q, dropout_p=0.1)


# ---------------------------------------------------------------------------------------------
# (d) backward
# ---------------------------------------------------------------------------------------------

BWD_CASES = [
    # b, sq, sk, hq, hkv, d, causal
    (2, 128, 128, 4, 4, 64, False),
    (2, 128, 128, 4, 4, 64, True),
    (2, 113, 203, 4, 2, 128, False),
    (1, 203, 113, 4, 1, 128, True),   # GQA/MQA, rows without keys
    (1, 97, 97, 2, 2, 96, True),
    (1, 65, 130, 2, 2, 256, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_backward_matches_reference(case, dtype, bwd_variant):
    b, sq, sk, hq, hkv, d, causal = case
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    dout = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    out, lse, rs = flash_ext.attn_fwd(q, k, v, causal=causal, dropout_p=P)
    grads = flash_ext.attn_bwd(dout, q, k, v, out, lse, causal=causal, dropout_p=P, rng_state=rs)
    mask = py_mask(rs, b, hq, sq, sk, P)
    _, _, ref = ref_fwd_bwd(q, k, v, dout, mask, P, upcast=True, causal=causal)
    _, _, pt = ref_fwd_bwd(q, k, v, dout, mask, P, upcast=False, causal=causal)
    check_grads(grads, ref, pt, f"bwd v{bwd_variant} {case} {dname(dtype)}")


def test_backward_varlen(bwd_variant):
    dtype = torch.float16
    lens_q, lens_k = [37, 0, 128, 65], [50, 20, 131, 1]
    cq, ck = cu_of(lens_q), cu_of(lens_k)
    q = torch.randn(sum(lens_q), 4, 128, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=dtype)
    v, dout = torch.randn_like(k), torch.randn_like(q)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lens_q),
              max_seqlen_k=max(lens_k), causal=True)
    out, lse, rs = flash_ext.attn_fwd(q, k, v, dropout_p=0.4, **kw)
    grads = flash_ext.attn_bwd(dout, q, k, v, out, lse, dropout_p=0.4, rng_state=rs, **kw)
    mask = py_mask(rs, 4, 4, max(lens_q), max(lens_k), 0.4)
    _, _, ref = ref_fwd_bwd(q, k, v, dout, mask, 0.4, upcast=True, varlen=(cq, ck), causal=True)
    _, _, pt = ref_fwd_bwd(q, k, v, dout, mask, 0.4, upcast=False, varlen=(cq, ck), causal=True)
    check_grads(grads, ref, pt, f"bwd varlen v{bwd_variant}")


def test_backward_softcap_window_deterministic(bwd_variant):
    dtype = torch.bfloat16
    q = torch.randn(2, 150, 4, 64, device="cuda", dtype=dtype)
    k = torch.randn(2, 180, 4, 64, device="cuda", dtype=dtype)
    v, dout = torch.randn_like(k), torch.randn_like(q)
    kw = dict(window_size=(50, 10), softcap=8.0)
    out, lse, rs = flash_ext.attn_fwd(q, k, v, dropout_p=0.25, **kw)
    g1 = flash_ext.attn_bwd(dout, q, k, v, out, lse, dropout_p=0.25, rng_state=rs,
                            deterministic=True, **kw)
    g2 = flash_ext.attn_bwd(dout, q, k, v, out, lse, dropout_p=0.25, rng_state=rs,
                            deterministic=True, **kw)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    mask = py_mask(rs, 2, 4, 150, 180, 0.25)
    _, _, ref = ref_fwd_bwd(q, k, v, dout, mask, 0.25, upcast=True, **kw)
    _, _, pt = ref_fwd_bwd(q, k, v, dout, mask, 0.25, upcast=False, **kw)
    check_grads(g1, ref, pt, f"bwd softcap/window v{bwd_variant}")


def test_backward_default_dispatch_falls_back_to_sm80(tuning):
    """FLASH_EXT_BWD_PATH=auto, deterministic=False, d = 128, fixed length: where the Hopper
    backward would run, dropout must still get the sm80 kernel (the Hopper one has none)."""
    tuning.set("FLASH_EXT_BWD_PATH", "auto")
    tuning.set("FLASH_EXT_BWD_VARIANT", "2")
    q = torch.randn(2, 128, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v, dout = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    out, lse, rs = flash_ext.attn_fwd(q, k, v, dropout_p=0.3)
    g_auto = flash_ext.attn_bwd(dout, q, k, v, out, lse, dropout_p=0.3, rng_state=rs)
    mask = py_mask(rs, 2, 4, 128, 128, 0.3)
    _, _, ref = ref_fwd_bwd(q, k, v, dout, mask, 0.3, upcast=True)
    _, _, pt = ref_fwd_bwd(q, k, v, dout, mask, 0.3, upcast=False)
    check_grads(g_auto, ref, pt, "bwd auto")


def test_backward_p1_gives_zeros(bwd_variant):
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    out, lse, rs = flash_ext.attn_fwd(q, q, q, dropout_p=1.0)
    for g in flash_ext.attn_bwd(torch.randn_like(q), q, q, q, out, lse, dropout_p=1.0,
                                rng_state=rs):
        assert torch.equal(g, torch.zeros_like(g))


# ---------------------------------------------------------------------------------------------
# (e) reproducibility
# ---------------------------------------------------------------------------------------------


def test_same_seed_same_output_different_seed_different_mask():
    q = torch.randn(2, 100, 4, 64, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(1234)
    o1, _, r1 = flash_ext.attn_fwd(q, q, q, dropout_p=0.5)
    torch.manual_seed(1234)
    o2, _, r2 = flash_ext.attn_fwd(q, q, q, dropout_p=0.5)
    assert torch.equal(r1, r2) and torch.equal(o1, o2)
    o3, _, r3 = flash_ext.attn_fwd(q, q, q, dropout_p=0.5)  # next call: fresh offset
    assert not torch.equal(r1, r3) and not torch.equal(o1, o3)
    torch.manual_seed(99)
    _, _, r4 = flash_ext.attn_fwd(q, q, q, dropout_p=0.5)
    m1, m4 = py_mask(r1, 2, 4, 100, 100, 0.5), py_mask(r4, 2, 4, 100, 100, 0.5)
    assert (m1 != m4).float().mean().item() > 0.4
    o5, _, _ = flash_ext.attn_fwd(q, q, q, dropout_p=0.5, rng_state=r1)  # explicit state
    assert torch.equal(o1, o5)


# ---------------------------------------------------------------------------------------------
# (f) return_attn_probs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_return_attn_probs_dmask(causal):
    b, sq, sk, hq, hkv, d = 2, 90, 140, 4, 2, 64
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.float16)
    torch.manual_seed(5)
    out, lse, s = flash_ext.flash_attn_func(q, k, v, dropout_p=0.3, causal=causal,
                                            return_attn_probs=True)
    torch.manual_seed(5)
    rs = ops._dropout_rng_state(q)  # the state flash_attn_func drew
    assert s.shape == (b, hq, sq, sk) and s.dtype == torch.float32
    keep = py_mask(rs, b, hq, sq, sk, 0.3)
    vis = local_mask(sq, sk, causal=causal, device="cuda")
    assert not ((s != 0) & ~(keep & vis)).any()          # zero where dropped or masked
    assert (s[keep & vis] > 0).float().mean() > 0.99     # positive where kept (up to underflow)
    vr = v.float().repeat_interleave(hq // hkv, dim=2)
    pv = torch.einsum("bhqk,bkhd->bqhd", s, vr)
    torch.testing.assert_close(out.float(), pv, atol=5e-3, rtol=5e-3)
    out0, _, none = flash_ext.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert none is None


def test_return_attn_probs_varlen():
    lens = [30, 70, 1]
    cu = torch.tensor([0, 30, 100, 101], dtype=torch.int32, device="cuda")
    qkv = torch.randn(sum(lens), 3, 2, 64, device="cuda", dtype=torch.bfloat16)
    out, lse, s = flash_ext.flash_attn_varlen_qkvpacked_func(qkv, cu, 70, dropout_p=0.2,
                                                             causal=True, return_attn_probs=True)
    assert s.shape == (3, 2, 70, 70)
    v = qkv[:, 2].float()
    for i, (a, n) in enumerate(zip([0, 30, 100], lens)):
        pv = torch.einsum("hqk,khd->qhd", s[i, :, :n, :n], v[a:a + n])
        torch.testing.assert_close(out[a:a + n].float(), pv, atol=2e-2, rtol=2e-2)
        assert (s[i, :, n:, :] == 0).all() and (s[i, :, :, n:] == 0).all()


# ---------------------------------------------------------------------------------------------
# (g) flash_attn_* functions with autograd
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_flash_attn_func_autograd(dtype, bwd_variant):
    b, s, h, d = 2, 120, 4, 64
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    torch.manual_seed(11)
    out = flash_ext.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
    out.backward(dout)
    torch.manual_seed(11)
    rs = ops._dropout_rng_state(q)
    mask = py_mask(rs, b, h, s, s, 0.2)
    ref_out, _, ref = ref_fwd_bwd(q, k, v, dout, mask, 0.2, upcast=True, causal=True)
    pt_out, _, pt = ref_fwd_bwd(q, k, v, dout, mask, 0.2, upcast=False, causal=True)
    check_out(out.detach(), ref_out, pt_out, "flash_attn_func fwd")
    check_grads((q.grad, k.grad, v.grad), ref, pt, f"flash_attn_func bwd v{bwd_variant}")


def test_kvpacked_autograd_and_compile():
    b, s, h, d = 1, 96, 2, 128
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(b, s, 2, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(q, kv):
        return flash_ext.flash_attn_kvpacked_func(q, kv, dropout_p=0.1)

    torch.manual_seed(3)
    out = f(q, kv)
    out.float().sum().backward()
    g_eager = (q.grad.clone(), kv.grad.clone())
    q.grad = kv.grad = None
    torch.manual_seed(3)
    out_c = torch.compile(f, fullgraph=True)(q, kv)
    out_c.float().sum().backward()
    # The compiled graph draws the rng state from the same generator at the same point.
    assert torch.equal(out_c, out)
    assert torch.equal(q.grad, g_eager[0]) or torch.allclose(q.grad, g_eager[0], atol=1e-2)
