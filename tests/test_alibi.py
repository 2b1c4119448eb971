"""ALiBi on the prefill functions: argument checks on the CPU (no kernels needed). The GPU
results are in tests/test_alibi_gpu.py."""

import pytest
import torch

import flash_ext
from flash_ext import _validation
from flash_ext.errors import FlashExtError


def _qkv(b=2, s=16, hq=4, hkv=2, d=64):
    q = torch.randn(b, s, hq, d, dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv, d, dtype=torch.bfloat16)
    return q, k, k.clone()


def _check(slopes, softcap=0.0, **kw):
    q, k, v = _qkv()
    return _validation.check_fwd_inputs(q, k, v, softcap=softcap, alibi_slopes=slopes,
                                        require_cuda=False, **kw)


@pytest.mark.parametrize("shape", [(4,), (2, 4)])
def test_good_slopes_pass(shape):
    _check(torch.rand(shape))


@pytest.mark.parametrize("slopes,cls,words", [
    (torch.rand(4, dtype=torch.float64), TypeError, "float32"),
    (torch.rand(4).half(), TypeError, "float32"),
    (torch.rand(3), ValueError, "(nheads,) = (4,) or (batch, nheads) = (2, 4)"),
    (torch.rand(2, 4, 1), ValueError, "(nheads,)"),
    (torch.rand(4, 2).t(), ValueError, "contiguous"),
    ([0.5] * 4, TypeError, "torch.Tensor"),
])
def test_bad_slopes(slopes, cls, words):
    with pytest.raises(cls) as e:
        _check(slopes)
    assert isinstance(e.value, FlashExtError) and isinstance(e.value, RuntimeError)
    assert words in str(e.value)


def test_slopes_with_softcap_pass():
    _check(torch.rand(4), softcap=30.0)


def test_slopes_with_dropout_not_supported():
    with pytest.raises(NotImplementedError, match="dropout"):
        _check(torch.rand(4), dropout_p=0.1, rng_state=torch.tensor([1, 2], dtype=torch.int64))


def test_varlen_batch_from_cu_seqlens():
    q = torch.randn(10, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(12, 2, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=7,
              require_cuda=False)
    _validation.check_fwd_inputs(q, k, k, alibi_slopes=torch.rand(2, 4), **kw)
    with pytest.raises(ValueError, match=r"\(batch, nheads\) = \(2, 4\)"):
        _validation.check_fwd_inputs(q, k, k, alibi_slopes=torch.rand(3, 4), **kw)
