"""flash_ext.scaled_dot_product_attention on the CPU: argument handling, errors, the mapping of
SDPA's top-left causal mask onto flash_ext's bottom-right one, the no-copy layout, and results
and gradients against torch.nn.functional.scaled_dot_product_attention.

The flash_ext ops get CPU kernels for the duration of a test (test_op_wiring's CpuKernels: the
float32 reference, and its gradient written out), which here also record the tensors and
arguments each call receives; the GPU kernels are tested in test_sdpa_gpu.py."""

import math

import pytest
import torch
import torch.nn.functional as F

import flash_ext
from flash_ext import FlashExtError, FlashExtNotImplementedError, FlashExtValueError
from flash_ext.errors import DeviceError

from test_op_wiring import CpuKernels


class RecordingKernels(CpuKernels):
    """CpuKernels that also keep each fwd call's inputs, scalar arguments and output."""

    def __init__(self):
        super().__init__()
        self.fwd_calls = []

    def fwd(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, window_left, window_right, softcap, dropout_p=0.0,
            rng_state=None, deterministic=False):
        out, lse = super().fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right, softcap,
                               dropout_p, rng_state, deterministic)
        self.fwd_calls.append(dict(q=q, k=k, v=v, out=out, scale=softmax_scale, causal=causal,
                                   window=(window_left, window_right)))
        return out, lse


@pytest.fixture
def kernels(meta_ok):
    kernels = RecordingKernels()
    yield kernels
    kernels.lib._destroy()


def rnd(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def torch_sdpa_f32(q, k, v, **kw):
    """torch's SDPA in float32 from the same half-precision inputs: output and gradients of
    q, k, v for dout."""
    dout = kw.pop("dout")
    q32, k32, v32 = leaves(q.float(), k.float(), v.float())
    out = F.scaled_dot_product_attention(q32, k32, v32, **kw)
    out.backward(dout.float())
    return out, (q32.grad, k32.grad, v32.grad)


def close(actual, want):
    assert actual.dtype == torch.float16
    torch.testing.assert_close(actual.float(), want, atol=2e-2, rtol=2e-2)


# (b, hq, hkv, sq, sk, d, kw)
CASES = {
    "plain": (2, 4, 4, 17, 23, 64, dict()),
    "causal-square": (2, 4, 4, 19, 19, 64, dict(is_causal=True)),
    "causal-sq<sk": (2, 4, 4, 9, 30, 64, dict(is_causal=True)),
    "causal-sq>sk": (2, 4, 4, 30, 9, 64, dict(is_causal=True)),
    "causal-sq1": (1, 2, 2, 1, 12, 64, dict(is_causal=True)),
    "causal-sk1": (1, 2, 2, 12, 1, 64, dict(is_causal=True)),
    "gqa-causal-sq<sk": (2, 6, 2, 11, 20, 64, dict(is_causal=True, enable_gqa=True)),
    "gqa-causal-sq>sk": (2, 6, 3, 20, 11, 64, dict(is_causal=True, enable_gqa=True)),
    "mqa-broadcast": (2, 4, 1, 13, 13, 64, dict(is_causal=True)),
    "scale": (1, 2, 2, 16, 16, 64, dict(scale=0.3)),
    "d40-padded": (1, 2, 2, 10, 14, 40, dict(is_causal=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_sdpa(kernels, case):
    torch.manual_seed(0)
    b, hq, hkv, sq, sk, d, kw = CASES[case]
    q, k, v = leaves(rnd(b, hq, sq, d), rnd(b, hkv, sk, d), rnd(b, hkv, sk, d))
    out = flash_ext.scaled_dot_product_attention(q, k, v, **kw)
    assert out.shape == (b, hq, sq, d) and out.dtype == torch.float16
    dout = rnd(*out.shape)
    out.backward(dout)
    want, grads = torch_sdpa_f32(q.detach(), k.detach(), v.detach(), dout=dout, **kw)
    close(out, want)
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert t.grad is not None and t.grad.shape == t.shape, name
        close(t.grad, g)


def test_causal_alignment_is_top_left(kernels):
    """What the op receives: sq < sk drops the keys no row sees (a view) and runs the square
    causal case; sq > sk runs window (-1, sq - sk) without causal; sq == sk plain causal."""
    torch.manual_seed(0)
    q, k = rnd(1, 2, 9, 64), rnd(1, 2, 30, 64)
    flash_ext.scaled_dot_product_attention(q, k, k, is_causal=True)
    call = kernels.fwd_calls[-1]
    assert call["causal"] and call["window"] == (-1, 0)
    assert call["k"].shape == (1, 9, 2, 64) and call["k"].data_ptr() == k.data_ptr()

    flash_ext.scaled_dot_product_attention(k, q, q, is_causal=True)  # sq 30 > sk 9
    call = kernels.fwd_calls[-1]
    assert not call["causal"] and call["window"] == (-1, 21)

    flash_ext.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert kernels.fwd_calls[-1]["causal"]
    flash_ext.scaled_dot_product_attention(q, k, k)
    assert not kernels.fwd_calls[-1]["causal"] and kernels.fwd_calls[-1]["window"] == (-1, -1)


def test_keys_no_row_sees_get_zero_gradient(kernels):
    torch.manual_seed(0)
    q, k, v = leaves(rnd(1, 2, 5, 64), rnd(1, 2, 12, 64), rnd(1, 2, 12, 64))
    flash_ext.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
    assert torch.all(k.grad[:, :, 5:] == 0) and torch.all(v.grad[:, :, 5:] == 0)
    assert v.grad[:, :, :5].abs().sum() > 0


def test_no_copies_for_strided_views(kernels):
    """q, k, v made as (b, h, s, d), or as views of a (b, s, 3, h, d) projection, reach the op
    as they are (same storage, strides transposed); the result is a view of the op's output."""
    torch.manual_seed(0)
    b, s, h, d = 2, 24, 4, 64
    made_bhsd = rnd(b, h, s, d), rnd(b, h, s, d), rnd(b, h, s, d)
    qkv = rnd(b, s, 3, h, d)  # e.g. a fused QKV projection, then viewed as SDPA wants it
    from_projection = tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
    for query, key, value in (made_bhsd, from_projection):
        out = flash_ext.scaled_dot_product_attention(query, key, value)
        call = kernels.fwd_calls[-1]
        for given, got in ((query, call["q"]), (key, call["k"]), (value, call["v"])):
            assert got.data_ptr() == given.data_ptr()
            assert got.stride() == given.transpose(1, 2).stride()
        assert out.shape == (b, h, s, d)
        assert out.data_ptr() == call["out"].data_ptr()
        assert out.transpose(1, 2).is_contiguous()


def test_dropout_and_scale_reach_attn_fwd(monkeypatch):
    """dropout_p goes to attn_fwd as given (applied whenever > 0, like torch's functional SDPA);
    with dropout attn_fwd returns (out, lse, rng_state) and SDPA returns out."""
    seen = {}

    def fake_attn_fwd(q, k, v, **kw):
        seen.update(kw)
        out = torch.zeros(q.shape, dtype=q.dtype)
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        return (out, lse, torch.zeros(2, dtype=torch.int64)) if kw["dropout_p"] > 0 else (out, lse)

    monkeypatch.setattr(flash_ext.sdpa, "attn_fwd", fake_attn_fwd)
    q = rnd(2, 4, 8, 64)
    out = flash_ext.scaled_dot_product_attention(q, q, q, dropout_p=0.25, scale=0.5)
    assert seen["dropout_p"] == 0.25 and seen["softmax_scale"] == 0.5
    assert out.shape == q.shape
    out = flash_ext.scaled_dot_product_attention(q, q, q)
    assert seen["dropout_p"] == 0.0 and seen["softmax_scale"] is None
    assert out.shape == q.shape


def test_positional_arguments_as_torch():
    import inspect
    mine = inspect.signature(flash_ext.scaled_dot_product_attention)
    assert list(mine.parameters) == ["query", "key", "value", "attn_mask", "dropout_p",
                                     "is_causal", "scale", "enable_gqa"]
    defaults = {n: p.default for n, p in mine.parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert defaults == dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False)


def test_compiles_in_one_graph(kernels):
    torch.manual_seed(0)
    q, k, v = leaves(rnd(1, 4, 12, 64), rnd(1, 2, 20, 64), rnd(1, 2, 20, 64))
    fn = torch.compile(lambda q, k, v: flash_ext.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True), fullgraph=True, backend="aot_eager")
    out = fn(q, k, v)
    out.float().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager = flash_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    eager.float().sum().backward()
    torch.testing.assert_close(out, eager)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_attn_mask_names_the_alternatives():
    q = rnd(1, 2, 8, 64)
    mask = torch.ones(8, 8, dtype=torch.bool)
    with pytest.raises(FlashExtNotImplementedError) as info:
        flash_ext.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    msg = str(info.value)
    for alternative in ("is_causal", "unpad_input", "flash_attn_varlen_func", "cu_seqlens",
                        "pad_input", "FlashMask"):
        assert alternative in msg, alternative
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, NotImplementedError)


@pytest.mark.parametrize("shapes,kw,match", [
    (((2, 8, 64), (2, 8, 64), (2, 8, 64)), {}, "query must be 4-D"),
    (((1, 4, 8, 64), (1, 2, 8, 64), (1, 2, 8, 64)), {}, "enable_gqa=True"),
    (((1, 4, 8, 64), (1, 3, 8, 64), (1, 3, 8, 64)), dict(enable_gqa=True),
     r"key/value heads \(3\) must divide .* \(4\)"),
    (((2, 4, 8, 64), (1, 4, 8, 64), (1, 4, 8, 64)), {}, "same batch size"),
    (((1, 4, 8, 64), (1, 4, 8, 64), (1, 4, 9, 64)), {}, "key and value must have the same"),
    (((1, 4, 8, 64), (1, 4, 8, 64), (1, 4, 8, 32)), {}, "same head dim"),
    (((1, 4, 8, 64), (1, 4, 8, 64), (1, 4, 8, 64)), dict(scale=0.0), "scale must be > 0"),
    (((1, 4, 8, 64), (1, 4, 8, 64), (1, 4, 8, 64)), dict(scale=-math.inf), "scale must be"),
])
def test_bad_inputs(shapes, kw, match):
    q, k, v = (rnd(*s) for s in shapes)
    with pytest.raises(FlashExtValueError, match=match) as info:
        flash_ext.scaled_dot_product_attention(q, k, v, **kw)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


def test_non_tensor():
    with pytest.raises(TypeError, match="key must be a torch.Tensor") as info:
        flash_ext.scaled_dot_product_attention(rnd(1, 2, 8, 64), None, rnd(1, 2, 8, 64))
    assert isinstance(info.value, FlashExtError)


def test_cpu_tensors_and_float32_rejected():
    q = rnd(1, 2, 8, 64)
    with pytest.raises(DeviceError, match="CUDA"):
        flash_ext.scaled_dot_product_attention(q, q, q)
    with pytest.raises(FlashExtError, match="dropout_p"):
        flash_ext.scaled_dot_product_attention(q, q, q, dropout_p=2.0)


def test_float32_rejected(meta_ok):
    q = rnd(1, 2, 8, 64, dtype=torch.float32)
    with pytest.raises(TypeError, match="float16 and bfloat16 only") as info:
        flash_ext.scaled_dot_product_attention(q, q, q)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("sq,sk", [(6, 0), (0, 6), (0, 0)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_sequences_as_torch(kernels, sq, sk, is_causal):
    """No key: output 0 (torch's too); no query: an empty output. Nothing is launched."""
    q, k, v = leaves(rnd(1, 2, sq, 64), rnd(1, 2, sk, 64), rnd(1, 2, sk, 64))
    out = flash_ext.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal)
    assert out.shape == want.shape and torch.equal(out.float(), want)
    assert kernels.fwd_calls == []
    out.float().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.all(t.grad == 0)
