"""The PyTorch reference itself (CPU), checked against a naive float64 softmax(QK^T)V."""

import math

import pytest
import torch

from flash_ext.reference import attention_ref, attention_ref_varlen, local_mask


def naive(q, k, v, scale=None, mask=None, softcap=0.0):
    """float64 softmax(QK^T)V with an explicit boolean mask (True = visible), heads equal."""
    q, k, v = q.double(), k.double(), v.double()
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("sq,sk", [(1, 1), (7, 7), (5, 13), (13, 5)])
def test_plain_attention(seed, sq, sk):
    q, k, v = rand(2, sq, 3, 16), rand(2, sk, 3, 16), rand(2, sk, 3, 16)
    out, lse = attention_ref(q, k, v)
    ref, ref_lse = naive(q, k, v)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert lse.shape == (2, 3, sq)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_custom_scale(seed):
    q, k, v = rand(1, 9, 2, 32), rand(1, 11, 2, 32), rand(1, 11, 2, 32)
    out, lse = attention_ref(q, k, v, softmax_scale=0.37)
    ref, ref_lse = naive(q, k, v, scale=0.37)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def explicit_mask(sq, sk, wl, wr):
    m = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            lo_ok = wl < 0 or j >= i + sk - sq - wl
            hi_ok = wr < 0 or j <= i + sk - sq + wr
            m[i, j] = lo_ok and hi_ok
    return m


@pytest.mark.parametrize("sq,sk", [(4, 9), (9, 4), (6, 6)])
def test_causal_bottom_right(sq, sk):
    m = local_mask(sq, sk, causal=True)
    # The last query row sees every key; row i sees keys up to i + sk - sq.
    assert m[-1].all()
    for i in range(sq):
        last = i + sk - sq
        assert m[i, : max(last + 1, 0)].all() and not m[i, max(last + 1, 0):].any()
    assert torch.equal(m, explicit_mask(sq, sk, -1, 0))


def test_causal_sq_less_than_sk_values(seed):
    sq, sk = 3, 8
    q, k, v = rand(1, sq, 2, 16), rand(1, sk, 2, 16), rand(1, sk, 2, 16)
    out, lse = attention_ref(q, k, v, causal=True)
    ref, ref_lse = naive(q, k, v, mask=explicit_mask(sq, sk, -1, 0))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # Row 0 sees keys 0..5 (bottom-right), not only key 0 (top-left).
    ref_top_left, _ = naive(q[:, :1], k[:, :1], v[:, :1])
    assert not torch.allclose(out[:, :1].double(), ref_top_left, atol=1e-3)


def test_causal_sq_greater_than_sk_masks_first_rows(seed):
    sq, sk = 8, 3
    q, k, v = rand(1, sq, 2, 16), rand(1, sk, 2, 16), rand(1, sk, 2, 16)
    out, lse = attention_ref(q, k, v, causal=True)
    # The first sq - sk rows see no key: output 0, lse -inf, no NaN.
    assert torch.equal(out[:, : sq - sk], torch.zeros_like(out[:, : sq - sk]))
    assert torch.isneginf(lse[:, :, : sq - sk]).all()
    assert not out.isnan().any() and not lse.isnan().any()
    ref, ref_lse = naive(q[:, sq - sk:], k, v, mask=explicit_mask(sq, sk, -1, 0)[sq - sk:])
    torch.testing.assert_close(out[:, sq - sk:].double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :, sq - sk:].double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sq,sk,wl,wr", [(10, 10, 2, 1), (5, 12, 3, 0), (12, 5, 1, 1),
                                         (10, 10, 0, 0), (7, 9, -1, 2), (9, 7, 3, -1)])
def test_local_window(seed, sq, sk, wl, wr):
    m = explicit_mask(sq, sk, wl, wr)
    assert torch.equal(local_mask(sq, sk, (wl, wr)), m)
    q, k, v = rand(2, sq, 2, 8), rand(2, sk, 2, 8), rand(2, sk, 2, 8)
    out, lse = attention_ref(q, k, v, window_size=(wl, wr))
    empty = ~m.any(1)
    if empty.any():
        assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
        assert torch.isneginf(lse[:, :, empty]).all()
    ref, ref_lse = naive(q[:, ~empty], k, v, mask=m[~empty])
    torch.testing.assert_close(out[:, ~empty].double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :, ~empty].double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert not out.isnan().any() and not lse.isnan().any()


def test_causal_combines_with_window_left(seed):
    q, k, v = rand(1, 10, 2, 8), rand(1, 10, 2, 8), rand(1, 10, 2, 8)
    a = attention_ref(q, k, v, causal=True, window_size=(3, -1))
    b = attention_ref(q, k, v, window_size=(3, 0))
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


def test_no_keys(seed):
    q, k, v = rand(2, 4, 2, 8), rand(2, 0, 2, 8), rand(2, 0, 2, 8)
    out, lse = attention_ref(q, k, v)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_gqa_equals_explicit_repeat(seed, hkv):
    hq = 8
    q, k, v = rand(2, 6, hq, 16), rand(2, 9, hkv, 16), rand(2, 9, hkv, 16)
    out, lse = attention_ref(q, k, v, causal=True)
    rep = hq // hkv
    k_rep = torch.stack([k[:, :, h // rep] for h in range(hq)], dim=2)
    v_rep = torch.stack([v[:, :, h // rep] for h in range(hq)], dim=2)
    out2, lse2 = attention_ref(q, k_rep, v_rep, causal=True)
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(lse, lse2)


def test_softcap(seed):
    q, k, v = rand(1, 7, 2, 16) * 4, rand(1, 9, 2, 16) * 4, rand(1, 9, 2, 16)
    out, lse = attention_ref(q, k, v, softcap=2.5)
    ref, ref_lse = naive(q, k, v, softcap=2.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # Softcap bounds every score, so lse <= log(sk) + cap.
    assert (lse <= math.log(9) + 2.5 + 1e-5).all()
    plain, _ = attention_ref(q, k, v)
    assert not torch.allclose(out, plain, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_mode(seed, dtype):
    q, k, v = rand(1, 33, 2, 32, dtype=dtype), rand(1, 40, 2, 32, dtype=dtype), rand(1, 40, 2, 32, dtype=dtype)
    lo, lo_lse = attention_ref(q, k, v, upcast=False)
    hi, hi_lse = attention_ref(q, k, v)
    assert lo.dtype == dtype and hi.dtype == torch.float32 and lo_lse.dtype == torch.float32
    err = (lo.float() - hi).abs().max().item()
    # Some rounding error, but of the dtype's order only.
    eps = torch.finfo(dtype).eps
    assert 0 < err < 20 * eps


def test_varlen_equals_per_sequence(seed):
    lens_q, lens_k = [0, 5, 9, 0, 3], [4, 0, 11, 0, 6]
    hq, hkv, d = 4, 2, 16
    q, k, v = rand(sum(lens_q), hq, d), rand(sum(lens_k), hkv, d), rand(sum(lens_k), hkv, d)
    cq = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    ck = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    out, lse = attention_ref_varlen(q, k, v, cq, ck, causal=True, softcap=3.0)
    assert out.shape == (sum(lens_q), hq, d) and lse.shape == (hq, sum(lens_q))
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = cq[i].item(), cq[i + 1].item(), ck[i].item(), ck[i + 1].item()
        if q1 == q0:
            continue
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True,
                             softcap=3.0)
        torch.testing.assert_close(out[q0:q1], o[0])
        torch.testing.assert_close(lse[:, q0:q1], l[0])
    # Sequence 1 has 5 query rows and no keys: zeros and -inf.
    assert torch.equal(out[0:5], torch.zeros_like(out[0:5]))
    assert torch.isneginf(lse[:, 0:5]).all()
    assert not out.isnan().any()
