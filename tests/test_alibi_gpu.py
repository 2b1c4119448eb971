"""ALiBi on the prefill paths (flash_attn_func / flash_attn_varlen_func / attn_fwd with
alibi_slopes): forward and backward against the float32 reference on the GPU (skipped without
a CUDA GPU). FlashAttention-2's meaning: score (i, j) gets - slope_h * |i + sk - sq - j|.

Criterion (FlashAttention's, tests/test_bwd_gpu.py): for out and each gradient, with ref the
float32 reference and pt the same reference in the input dtype,
    max|x - ref| <= 2 * max|pt - ref| + max|round(ref) - ref| + 1e-4 * max|ref| + 1e-5.
"""

import pytest
import torch

import flash_ext
from flash_ext.reference import attention_ref, attention_ref_varlen

from conftest import requires_cuda

pytestmark = requires_cuda


@pytest.fixture(autouse=True, params=["sm80", "auto"], ids=lambda p: f"path_{p}")
def path(request, tuning):
    tuning.set("FLASH_EXT_FWD_PATH", request.param)
    tuning.set("FLASH_EXT_BWD_PATH", request.param)
    return request.param


def _check(label, got, ref, pt):
    err = (got.float() - ref).abs().max().item()
    base = (pt.float() - ref).abs().max().item()
    rounding = (ref.to(got.dtype).float() - ref).abs().max().item()
    bound = 2 * base + rounding + 1e-4 * ref.abs().max().item() + 1e-5
    assert not torch.isnan(got).any(), f"{label}: NaN"
    assert err <= bound, f"{label}: max err {err:.3e} > bound {bound:.3e} (pytorch {base:.3e})"


def _slopes(shape, device):
    # ALiBi's geometric slopes are in (0, 1]; add random ones so that every head differs.
    return (torch.rand(shape, device=device) * 0.5 + 0.01).float()


def _ref_grads(q, k, v, dout, upcast, **kw):
    leaves = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
              for t in (q, k, v)]
    out, _ = attention_ref(*leaves, upcast=upcast, **kw)
    out.backward(dout.float() if upcast else dout)
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 32))])
@pytest.mark.parametrize("sq,sk", [(128, 128), (113, 203), (200, 96)])
@pytest.mark.parametrize("batch_slopes", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_alibi_fwd_bwd(dtype, d, causal, window, sq, sk, batch_slopes, softcap):
    torch.manual_seed(0)
    b, hq, hkv = 2, 4, 2
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    slopes = _slopes((b, hq) if batch_slopes else (hq,), "cuda")
    out = flash_ext.flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes,
                                    softcap=softcap)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    kw = dict(causal=causal, window_size=window, alibi_slopes=slopes, softcap=softcap)
    ref, ref_g = _ref_grads(q, k, v, dout, True, **kw)
    pt, pt_g = _ref_grads(q, k, v, dout, False, **kw)
    _check("out", out, ref, pt)
    for name, g, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g, pt_g):
        _check(name, g, r, p)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_varlen(dtype, causal):
    torch.manual_seed(1)
    lens_q, lens_k = [37, 0, 130, 64], [50, 17, 130, 1]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    hq, hkv, d = 8, 2, 128
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    slopes = _slopes((len(lens_q), hq), "cuda")
    out = flash_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                           alibi_slopes=slopes)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    def ref_run(upcast):
        leaves = [t.detach().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
                  for t in (q, k, v)]
        o, _ = attention_ref_varlen(*leaves, cu_q, cu_k, causal=causal, alibi_slopes=slopes, upcast=upcast)
        o.backward(dout.float() if upcast else dout)
        return o, [t.grad for t in leaves]

    ref, ref_g = ref_run(True)
    pt, pt_g = ref_run(False)
    _check("out", out, ref, pt)
    for name, g, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g, pt_g):
        _check(name, g, r, p)


def test_alibi_lse_and_zero_slopes_equal_plain(path, tuning):
    """Zero slopes give exactly the plain causal sm80 kernel's result (the bias adds 0.0)."""
    tuning.set("FLASH_EXT_FWD_PATH", "sm80")
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 96, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    zero = torch.zeros(4, device="cuda", dtype=torch.float32)
    o1, lse1, _ = flash_ext.flash_attn_func(q, k, v, causal=True, alibi_slopes=zero, return_attn_probs=True)
    o2, lse2, _ = flash_ext.flash_attn_func(q, k, v, causal=True, window_size=(-1, 0), return_attn_probs=True)
    torch.testing.assert_close(o1, o2, atol=0, rtol=0)
    torch.testing.assert_close(lse1, lse2, atol=0, rtol=0)
