"""Backward pass on the GPU against autograd through the PyTorch reference (skipped without a
CUDA GPU). Calls torch.ops.flash_ext.fwd and torch.ops.flash_ext.bwd directly.

Pass criterion (FlashAttention's), for each of dq, dk, dv: with ref = the gradient of the
float32 reference (float32 leaves made from the same low-precision inputs) and pt = the gradient
of the same reference computed in the input dtype (upcast=False),

    max|g - ref| <= 2 * max|pt - ref| + max|round(ref) - ref| + 1e-4 * max|ref| + 1e-5

The rounding term is the error of merely rounding the exact gradient to fp16/bf16; the small
relative term covers cases where pt happens to be (nearly) exact. No NaN anywhere.
"""

import math

import pytest
import torch

from flash_ext.reference import attention_ref, attention_ref_varlen, local_mask

from conftest import requires_cuda

pytestmark = requires_cuda

DTYPES = [torch.float16, torch.bfloat16]


BWD_VARIANTS = ["1", "2"]
# (FLASH_EXT_BWD_PATH, FLASH_EXT_BWD_VARIANT) per fixture value.
BWD_CONFIGS = {"sm80_v1": ("sm80", "1"), "sm80_v2": ("sm80", "2"), "auto": ("auto", "2")}


@pytest.fixture(autouse=True, params=list(BWD_CONFIGS), ids=lambda c: f"bwd_{c}")
def bwd_variant(request, tuning):
    """Every test runs once per backward kernel (both switches set through flash_ext::set_tuning,
    tests/conftest.py): the sm80 kernel's variants 1 and 2 (docs/kernels-sm80-bwd.md, "Variant 2"),
    and the default dispatch, which on Hopper runs the wgmma kernel where it applies
    (docs/kernels-sm90-bwd.md)."""
    path, variant = BWD_CONFIGS[request.param]
    tuning.set("FLASH_EXT_BWD_PATH", path)
    tuning.set("FLASH_EXT_BWD_VARIANT", variant)
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def dname(dtype):
    return str(dtype).replace("torch.", "")


def _load_ops():
    import flash_ext  # noqa: F401  (registers the ops)
    try:
        import flash_ext._C  # noqa: F401
    except ImportError:
        pass
    return torch.ops.flash_ext


def pad8(t):
    d = t.shape[-1]
    return t if d % 8 == 0 else torch.nn.functional.pad(t, (0, 8 - d % 8))


def flash_fwd_bwd(q, k, v, dout, *, cu_q=None, cu_k=None, max_sq=0, max_sk=0, softmax_scale=None,
                  causal=False, window=(-1, -1), softcap=0.0, deterministic=False):
    """fwd then bwd through the raw ops; returns (out, lse, dq, dk, dv)."""
    ops = _load_ops()
    d = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qp, kp, vp, dop = pad8(q), pad8(k), pad8(v), pad8(dout)
    out, lse = ops.fwd(qp, kp, vp, cu_q, cu_k, max_sq, max_sk, scale, causal, window[0], window[1],
                       softcap)
    dq, dk, dv = ops.bwd(dop, qp, kp, vp, out, lse, cu_q, cu_k, max_sq, max_sk, scale, causal,
                         window[0], window[1], softcap, deterministic)
    return out[..., :d], lse, dq[..., :d], dk[..., :d], dv[..., :d]


def ref_grads(q, k, v, dout, *, upcast, varlen=None, **kw):
    """Gradients of the reference: float32 leaves when upcast, else input-dtype leaves."""
    cdt = torch.float32 if upcast else q.dtype
    qr, kr, vr = (t.detach().to(cdt).requires_grad_() for t in (q, k, v))
    if varlen is None:
        out, _ = attention_ref(qr, kr, vr, upcast=upcast, **kw)
    else:
        out, _ = attention_ref_varlen(qr, kr, vr, *varlen, upcast=upcast, **kw)
    out.backward(dout.to(out.dtype))
    return qr.grad, kr.grad, vr.grad


def check_grads(got, ref, pt, label):
    for name, g, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        assert g.shape == r.shape, (name, g.shape, r.shape)
        assert not g.isnan().any(), f"{label}: NaN in {name}"
        if g.numel() == 0:
            continue
        err = (g.float() - r).abs().max().item()
        pt_err = (p.float() - r).abs().max().item()
        round_err = (r.to(g.dtype).float() - r).abs().max().item()
        bound = 2 * pt_err + round_err + 1e-4 * r.abs().max().item() + 1e-5
        print(f"[{label}] {name} max err {err:.3e} (pt {pt_err:.3e}, bound {bound:.3e})")
        assert err <= bound, f"{label}: {name} max err {err:.3e} > bound {bound:.3e} (pt {pt_err:.3e})"


def run_case(b, sq, sk, hq, hkv, d, dtype, label, magnitude=1.0, deterministic=False, **kw):
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    if magnitude != 1.0:
        q, k = (q.float() * magnitude).to(dtype), (k.float() * magnitude).to(dtype)
    dout = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    out, lse, dq, dk, dv = flash_fwd_bwd(q, k, v, dout, deterministic=deterministic, **kw)
    ref_kw = dict(causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                  softcap=kw.get("softcap", 0.0))
    if kw.get("softmax_scale") is not None:
        ref_kw["softmax_scale"] = kw["softmax_scale"]
    ref = ref_grads(q, k, v, dout, upcast=True, **ref_kw)
    pt = ref_grads(q, k, v, dout, upcast=False, **ref_kw)
    for g, t in zip((dq, dk, dv), (q, k, v)):
        assert g.dtype == t.dtype and g.shape == t.shape
    check_grads((dq, dk, dv), ref, pt, label)
    return q, k, v, dout, (dq, dk, dv)


# ---------------------------------------------------------------------------------------------
# Core: dtype x head dim x causal x seqlens
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [32, 40, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (97, 97), (113, 203), (1025, 1025), (203, 113)])
def test_core(dtype, d, causal, sq, sk):
    b, h = (1, 2) if sq >= 1025 else (2, 2)
    run_case(b, sq, sk, h, h, d, dtype, f"{dname(dtype)} d={d} {sq}x{sk} causal={causal}",
             causal=causal)


# ---------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("hkv", [8, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_mqa(dtype, hkv, causal, d):
    run_case(2, 257, 300, 8, hkv, d, dtype, f"hkv={hkv} d={d} causal={causal}", causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("sq,sk", [(97, 97), (113, 203), (203, 113), (1, 300)])
@pytest.mark.parametrize("window", [(0, 0), (16, 0), (-1, 8), (32, 32), (100, -1), (0, -1)])
def test_local_window(dtype, sq, sk, window):
    run_case(2, sq, sk, 4, 2, 64, dtype, f"{sq}x{sk} window={window}", window=window)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("sq,sk,kw", [
    (300, 100, dict(causal=True)),          # sq > sk: the first 200 rows see nothing
    (200, 100, dict(window=(0, 0))),        # only the last 100 rows see one key each
    (128, 64, dict(window=(10, -1))),
    (300, 500, dict(causal=True, window=(64, 0))),
])
@pytest.mark.parametrize("d", [64, 128])
def test_fully_masked_rows(dtype, sq, sk, kw, d):
    q, k, v, dout, (dq, dk, dv) = run_case(2, sq, sk, 4, 2, d, dtype, f"masked {sq}x{sk} {kw}", **kw)
    w = kw.get("window", (-1, -1))
    visible = local_mask(sq, sk, w, kw.get("causal", False), device="cuda")
    empty_rows = ~visible.any(1)
    unseen_keys = ~visible.any(0)
    assert torch.equal(dq[:, empty_rows], torch.zeros_like(dq[:, empty_rows]))
    assert torch.equal(dk[:, unseen_keys], torch.zeros_like(dk[:, unseen_keys]))
    assert torch.equal(dv[:, unseen_keys], torch.zeros_like(dv[:, unseen_keys]))


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap(dtype, causal, d):
    run_case(2, 300, 400, 4, 2, d, dtype, f"softcap d={d} causal={causal}", magnitude=4.0,
             causal=causal, softcap=30.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_custom_scale(dtype):
    run_case(2, 200, 200, 4, 4, 64, dtype, "scale", softmax_scale=0.3)


# ---------------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------------


def cu_of(lens):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device="cuda")


VARLEN_CASES = [
    ([0, 17, 300, 0, 1025], [0, 17, 300, 0, 1025]),
    ([0, 17, 300, 0, 1025], [5, 40, 0, 1, 1025]),  # seq 2 has queries but no keys
    ([1, 1, 1], [1000, 7, 1]),
    ([128, 64], [64, 128]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("lens_q,lens_k", VARLEN_CASES)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(32, 8)),
                                dict(causal=True, softcap=30.0)], ids=str)
@pytest.mark.parametrize("d", [64, 40])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen(dtype, lens_q, lens_k, kw, d, deterministic):
    hq, hkv = 8, 2
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    cq, ck = cu_of(lens_q), cu_of(lens_k)
    out, lse, dq, dk, dv = flash_fwd_bwd(q, k, v, dout, cu_q=cq, cu_k=ck, max_sq=max(lens_q),
                                         max_sk=max(lens_k), deterministic=deterministic, **kw)
    ref_kw = dict(causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
                  softcap=kw.get("softcap", 0.0))
    ref = ref_grads(q, k, v, dout, upcast=True, varlen=(cq, ck), **ref_kw)
    pt = ref_grads(q, k, v, dout, upcast=False, varlen=(cq, ck), **ref_kw)
    check_grads((dq, dk, dv), ref, pt, f"varlen {lens_q}/{lens_k} {kw}")


# ---------------------------------------------------------------------------------------------
# Deterministic mode
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("hkv,causal,d", [(4, False, 128), (1, True, 64), (2, False, 256)])
def test_deterministic_bitwise(dtype, hkv, causal, d):
    q, k, v, dout, grads = run_case(2, 1025, 1025, 4, hkv, d, dtype, f"det hkv={hkv}",
                                    deterministic=True, causal=causal)
    for _ in range(3):
        _, _, *again = flash_fwd_bwd(q, k, v, dout, causal=causal, deterministic=True)
        for g, a in zip(grads, again):
            assert torch.equal(g, a), "deterministic=True is not bitwise reproducible"
    # Same values as the atomic path, up to fp32 summation order.
    _, _, *atomic = flash_fwd_bwd(q, k, v, dout, causal=causal, deterministic=False)
    for g, a in zip(grads, atomic):
        torch.testing.assert_close(g, a, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# Op-level details
# ---------------------------------------------------------------------------------------------


def test_bwd_empty_and_zero_keys():
    ops = _load_ops()
    q = torch.randn(2, 5, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 0, 4, 64, device="cuda", dtype=torch.float16)
    out, lse = ops.fwd(q, k, k, None, None, 0, 0, 0.125, False, -1, -1, 0.0)
    dq, dk, dv = ops.bwd(torch.randn_like(q), q, k, k, out, lse, None, None, 0, 0, 0.125, False,
                         -1, -1, 0.0, False)
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape and dv.shape == k.shape
    q = torch.randn(2, 0, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 7, 4, 64, device="cuda", dtype=torch.float16)
    out, lse = ops.fwd(q, k, k, None, None, 0, 0, 0.125, False, -1, -1, 0.0)
    dq, dk, dv = ops.bwd(out, q, k, k, out, lse, None, None, 0, 0, 0.125, False, -1, -1, 0.0, False)
    assert dq.shape == q.shape
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


def test_bwd_bad_dout():
    ops = _load_ops()
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.float16)
    out, lse = ops.fwd(q, q, q, None, None, 0, 0, 0.125, False, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match="dout"):
        ops.bwd(out[:, :8], q, q, q, out, lse, None, None, 0, 0, 0.125, False, -1, -1, 0.0, False)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.bwd(out.bfloat16(), q, q, q, out, lse, None, None, 0, 0, 0.125, False, -1, -1, 0.0, False)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [96, 128, 192, 256])
@pytest.mark.parametrize("kw", [dict(causal=False), dict(causal=True), dict(window=(40, 3)),
                                dict(causal=True, deterministic=True)], ids=str)
def test_small_smem_tiles(dtype, d, kw, tuning):
    """The tiles chosen on 99 KB devices (sm86/sm89), forced on this GPU."""
    tuning.set("FLASH_EXT_BWD_SMALL_TILE", "1")
    run_case(2, 203, 300, 4, 2, d, dtype, f"small tile d={d} {kw}", **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d,kw", [(64, dict()), (128, dict(causal=True)), (256, dict(window=(100, 20))),
                                  (128, dict(deterministic=True))], ids=str)
def test_variants_agree(dtype, d, kw, bwd_variant, tuning):
    """Both main kernels give the same gradients on a many-query-block case (up to fp32
    summation order of the dQ atomics). Runs once per fixture value; compares 1 against 2."""
    if bwd_variant != "sm80_v1":
        pytest.skip("compared once, in the sm80_v1 run")
    q = torch.randn(2, 1100, 4, d, device="cuda", dtype=dtype)
    k = torch.randn(2, 1000, 2, d, device="cuda", dtype=dtype)
    v = torch.randn(2, 1000, 2, d, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    grads = {}
    for var in BWD_VARIANTS:
        tuning.set("FLASH_EXT_BWD_VARIANT", var)
        grads[var] = flash_fwd_bwd(q, k, v, dout, **kw)[2:]
    for name, a, b in zip(("dq", "dk", "dv"), grads["1"], grads["2"]):
        assert not b.isnan().any(), name
        torch.testing.assert_close(b.float(), a.float(), atol=1e-2, rtol=1e-2, msg=name)
