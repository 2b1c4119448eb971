"""flash_ext.scaled_dot_product_attention on the GPU against
torch.nn.functional.scaled_dot_product_attention (skipped without a CUDA GPU).

Reference: torch's SDPA (math backend) in float32 on the same fp16/bf16 inputs. Pass criterion
(FlashAttention's, as in test_fwd_gpu.py and test_autograd_gpu.py): with pt = the same attention
computed by plain PyTorch in the input dtype (scores and P @ V in fp16/bf16, softmax in float32,
top-left causal mask from tril: independent of flash_ext's mapping of it),

    out:        max|out - ref| <= 2 * max|pt - ref| + max|round(ref) - ref| + 1e-5
    gradients:  max|g - ref|   <= 2 * max|pt - ref| + max|round(ref) - ref| + 1e-4 max|ref| + 1e-5

and no NaN. Fresh random inputs per test; causal with seqlen_q < seqlen_k and > seqlen_k (SDPA's
top-left alignment), GQA and MQA, head dims that need padding, strided views, dropout.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext

from conftest import requires_cuda

pytestmark = requires_cuda

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def dname(dtype):
    return str(dtype).replace("torch.", "")


def rnd(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def torch_ref(q, k, v, **kw):
    """torch's SDPA, math backend, in whatever dtype q, k, v have (float32 for the reference)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def plain_lowp(q, k, v, is_causal=False, scale=None, enable_gqa=False):
    """Attention the way plain PyTorch computes it in the inputs' dtype: pt of the criterion."""
    hq, hkv, sq, sk, d = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    if hkv != hq:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = (q * scale) @ k.transpose(-1, -2)
    if is_causal:
        top_left = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~top_left, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return p @ v


def assert_within(got, ref, pt, label, grad=False):
    assert got.shape == ref.shape, (label, got.shape, ref.shape)
    assert not got.isnan().any(), f"{label}: NaN"
    if got.numel() == 0:
        return
    err = (got.float() - ref).abs().max().item()
    pt_err = (pt.float() - ref).abs().max().item()
    round_err = (ref.to(got.dtype).float() - ref).abs().max().item()
    bound = 2 * pt_err + round_err + 1e-5 + (1e-4 * ref.abs().max().item() if grad else 0.0)
    rel = (got.float() - ref).norm().item() / max(ref.norm().item(), 1e-30)
    print(f"[{label}] max err {err:.3e} (pt {pt_err:.3e}, bound {bound:.3e}) rel {rel:.3e}")
    assert err <= bound, f"{label}: max err {err:.3e} > bound {bound:.3e} (pt {pt_err:.3e})"


def check_forward(q, k, v, label, **kw):
    out = flash_ext.scaled_dot_product_attention(q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape[:3] + (v.shape[3],)
    ref = torch_ref(q.float(), k.float(), v.float(), **kw)
    pt = plain_lowp(q, k, v, **kw)
    assert_within(out, ref, pt, label)
    return out


def check_gradients(q, k, v, label, **kw):
    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves, **kw)
        out.backward(dout.to(dtype))
        return out, [t.grad for t in leaves]

    dout = torch.randn(q.shape, device="cuda").to(q.dtype)
    out, got = grads(flash_ext.scaled_dot_product_attention, q.dtype)
    ref_out, ref = grads(torch_ref, torch.float32)
    _, pt = grads(plain_lowp, q.dtype)
    assert_within(out, ref_out, plain_lowp(q, k, v, **kw), f"{label} out")
    for name, g, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        assert g is not None and g.shape == r.shape, (label, name)
        assert_within(g, r, p, f"{label} {name}", grad=True)


SEQLENS = [(128, 128), (113, 203), (203, 113), (1, 257), (257, 1), (1024, 1024), (64, 1024),
           (1024, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("sq,sk", SEQLENS)
@pytest.mark.parametrize("d", [64, 128])
def test_forward(dtype, is_causal, sq, sk, d):
    q, k, v = rnd(2, 4, sq, d, dtype=dtype), rnd(2, 4, sk, d, dtype=dtype), rnd(2, 4, sk, d,
                                                                                 dtype=dtype)
    check_forward(q, k, v, f"{dname(dtype)} causal={is_causal} {sq}x{sk} d{d}",
                  is_causal=is_causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("sq,sk", [(97, 97), (64, 300), (300, 64)])
@pytest.mark.parametrize("hq,hkv,enable_gqa", [(8, 2, True), (6, 1, True), (4, 1, False)])
def test_gqa_and_mqa(dtype, sq, sk, hq, hkv, enable_gqa):
    q = rnd(2, hq, sq, 128, dtype=dtype)
    k, v = rnd(2, hkv, sk, 128, dtype=dtype), rnd(2, hkv, sk, 128, dtype=dtype)
    check_forward(q, k, v, f"{dname(dtype)} {hq}/{hkv} gqa={enable_gqa} {sq}x{sk}",
                  is_causal=True, enable_gqa=enable_gqa)


@pytest.mark.parametrize("d", [32, 59, 96, 256])
@pytest.mark.parametrize("sq,sk", [(150, 90), (90, 150)])
def test_head_dims(d, sq, sk):
    q, k, v = rnd(1, 3, sq, d), rnd(1, 3, sk, d), rnd(1, 3, sk, d)
    check_forward(q, k, v, f"d{d} {sq}x{sk}", is_causal=True)


def test_scale():
    q, k, v = rnd(2, 4, 100, 64), rnd(2, 4, 120, 64), rnd(2, 4, 120, 64)
    check_forward(q, k, v, "scale 0.05", scale=0.05, is_causal=True)


def test_strided_views():
    """Inputs as a model produces them: a fused (b, s, 3, h, d) projection viewed as SDPA's
    (b, h, s, d); and q, k, v slices of wider buffers. The output is a (b, h, s, d) view of a
    contiguous (b, s, h, d) tensor."""
    b, s, h, d = 2, 333, 4, 64
    qkv = rnd(b, s, 3, h, d)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    out = check_forward(q, k, v, "fused projection", is_causal=True)
    assert out.transpose(1, 2).is_contiguous()
    wide = rnd(b, h + 2, s + 40, d)
    q, k, v = wide[:, 1:h + 1, :s], wide[:, :h, 8:s + 8], wide[:, 2:, 40:]
    check_forward(q, k, v, "slices", is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("sq,sk", [(128, 128), (97, 203), (203, 97)])
@pytest.mark.parametrize("hkv,enable_gqa", [(4, False), (2, True)])
def test_gradients(dtype, sq, sk, hkv, enable_gqa):
    q = rnd(2, 4, sq, 64, dtype=dtype)
    k, v = rnd(2, hkv, sk, 64, dtype=dtype), rnd(2, hkv, sk, 64, dtype=dtype)
    for is_causal in (False, True):
        check_gradients(q, k, v, f"{dname(dtype)} causal={is_causal} {sq}x{sk} hkv={hkv}",
                        is_causal=is_causal, enable_gqa=enable_gqa)


def test_gradients_strided_and_padded_head_dim():
    qkv = rnd(2, 150, 3, 4, 72)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    check_gradients(q, k, v, "strided d72", is_causal=True)
    q, k, v = rnd(1, 2, 80, 40), rnd(1, 2, 50, 40), rnd(1, 2, 50, 40)
    check_gradients(q, k, v, "d40 sq>sk", is_causal=True)


def test_dropout_is_flash_ext_dropout():
    """dropout_p > 0 is attn_fwd's dropout on the transposed views: the same seed gives the
    same output bit for bit; it changes the output; its backward runs; dropout_p=0 is plain."""
    q, k, v = rnd(2, 4, 256, 64), rnd(2, 4, 256, 64), rnd(2, 4, 256, 64)
    torch.manual_seed(123)
    out = flash_ext.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
    torch.manual_seed(123)
    want, _, _ = flash_ext.attn_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                    causal=True, dropout_p=0.2)
    assert torch.equal(out, want.transpose(1, 2))
    plain = flash_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.equal(out, plain)
    assert torch.equal(flash_ext.scaled_dot_product_attention(q, k, v, dropout_p=0.0,
                                                              is_causal=True), plain)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    flash_ext.scaled_dot_product_attention(*leaves, dropout_p=0.2).float().sum().backward()
    for t in leaves:
        assert t.grad is not None and torch.isfinite(t.grad).all()


def test_no_copy_of_inputs():
    """The op reads the views in place: no new allocation of q, k or v's size for the inputs
    (measured as the peak memory of the call, which holds out and lse only)."""
    b, s, h, d = 4, 2048, 8, 128
    qkv = rnd(b, s, 3, h, d)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    flash_ext.scaled_dot_product_attention(q, k, v, is_causal=True)  # warm up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = flash_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    one_tensor = b * s * h * d * q.element_size()
    assert extra < 1.5 * one_tensor, f"peak extra {extra} bytes, one input is {one_tensor}"
    assert out.data_ptr() != q.data_ptr()
