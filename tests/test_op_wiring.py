"""The Python layer's wiring to the one differentiable op, flash_ext::fwd, checked on the CPU.

A fixture gives the ``flash_ext`` ops CPU kernels for the duration of a test: fwd is
flash_ext.reference's attention, bwd its gradient written out (the reference's autograd checks
it), and both record the ``deterministic`` flag they receive. (The compiled extension has CUDA
kernels only, so these CPU kernels fit beside it as well as beside tests/stand_in_ops.py.) The
tests then follow attn_fwd and the FlashAttention-compatible functions through autograd and
torch.compile with real numbers: which op runs, with which arguments, the head-dim padding and
its slicing, the calls with nothing to launch, and that ``deterministic`` reaches the backward.
"""

import math

import pytest
import torch

import flash_ext
from flash_ext.reference import attention_ref, attention_ref_varlen, local_mask

from conftest import EXTENSION_BUILT


# ---------------------------------------------------------------------------------------------
# CPU kernels for the flash_ext ops
# ---------------------------------------------------------------------------------------------


def _reference_grads(dout, q, k, v, scale, causal, window_left, window_right, softcap):
    """dq, dk, dv of flash_ext.reference.attention_ref (batched, float32), written out:
    dP = dO V^T, dS = P (dP - rowsum(P dP)) (times 1 - tanh^2 under softcap), dQ = scale dS K,
    dK = scale dS^T Q, dV = P^T dO; GQA sums dK and dV over each group of query heads."""
    hq, hkv = q.shape[2], k.shape[2]
    group = hq // hkv
    qf, dof = q.float(), dout.float()
    kf = k.float().repeat_interleave(group, dim=2)
    vf = v.float().repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf * scale, kf)
    if softcap > 0:
        tanh = torch.tanh(s / softcap)
        s = tanh * softcap
    if causal or window_left >= 0 or window_right >= 0:
        visible = local_mask(q.shape[1], k.shape[1], (window_left, window_right), causal)
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, vf)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    if softcap > 0:
        ds = ds * (1 - tanh * tanh)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dk = dk.unflatten(2, (hkv, group)).sum(3)
    dv = dv.unflatten(2, (hkv, group)).sum(3)
    return dq, dk, dv


class CpuKernels:
    """CPU kernels for flash_ext::fwd, fwd_out and bwd; ``calls`` lists (op, deterministic)."""

    def __init__(self):
        self.calls = []
        self.lib = torch.library.Library("flash_ext", "IMPL")
        self.lib.impl("fwd", self.fwd, "CPU")
        self.lib.impl("fwd_out", self.fwd_out, "CPU")
        self.lib.impl("bwd", self.bwd, "CPU")

    def fwd(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, window_left, window_right, softcap, dropout_p=0.0,
            rng_state=None, deterministic=False, startend_row_indices=None, seqused_k=None,
            alibi_slopes=None):
        assert seqused_k is None, "tests/test_paged_prefill.py covers seqused_k"
        assert alibi_slopes is None, "tests/test_alibi*.py cover alibi_slopes"
        assert startend_row_indices is None, "the CPU kernels have no FlashMask"
        self.calls.append(("fwd", deterministic))
        out, lse = self._forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                 window_left, window_right, softcap, dropout_p)
        return out, lse

    def fwd_out(self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_left, window_right, softcap, dropout_p=0.0,
                rng_state=None, startend_row_indices=None, seqused_k=None, alibi_slopes=None):
        assert seqused_k is None, "tests/test_paged_prefill.py covers seqused_k"
        assert alibi_slopes is None, "tests/test_alibi*.py cover alibi_slopes"
        assert startend_row_indices is None, "the CPU kernels have no FlashMask"
        self.calls.append(("fwd_out", None))
        o, lse = self._forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                               window_left, window_right, softcap, dropout_p)
        out.copy_(o)
        return lse

    @staticmethod
    def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left,
                 window_right, softcap, dropout_p):
        assert dropout_p == 0.0, "the CPU kernels have no dropout"
        assert q.shape[-1] % 8 == 0, "the op takes head dims padded to a multiple of 8"
        kw = dict(softmax_scale=softmax_scale, causal=causal,
                  window_size=(window_left, window_right), softcap=softcap)
        if cu_seqlens_q is None:
            out, lse = attention_ref(q, k, v, **kw)
        else:
            out, lse = attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
        return out.to(q.dtype).contiguous(), lse.contiguous()

    def bwd(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
            deterministic, dropout_p=0.0, rng_state=None, startend_row_indices=None,
            alibi_slopes=None):
        assert startend_row_indices is None, "the CPU kernels have no FlashMask"
        assert alibi_slopes is None, "tests/test_alibi*.py cover alibi_slopes"
        self.calls.append(("bwd", deterministic))
        assert dropout_p == 0.0, "the CPU kernels have no dropout"
        args = (softmax_scale, causal, window_left, window_right, softcap)
        if cu_seqlens_q is None:
            grads = _reference_grads(dout, q, k, v, *args)
        else:
            grads = tuple(torch.zeros(t.shape) for t in (q, k, v))
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            for i in range(len(cq) - 1):
                rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
                g = _reference_grads(dout[None, rq], q[None, rq], k[None, rk], v[None, rk], *args)
                for dst, src, rows in zip(grads, g, (rq, rk, rk)):
                    dst[rows] = src[0]
        return tuple(g.to(q.dtype).contiguous() for g in grads)

    def ops(self, name):
        return [c for c in self.calls if c[0] == name]


@pytest.fixture
def cpu_kernels(meta_ok):
    """CPU kernels on the flash_ext ops, and the Python layer accepting CPU tensors."""
    kernels = CpuKernels()
    yield kernels
    kernels.lib._destroy()


def leaf(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype).requires_grad_(True)


def expected(fn, inputs, dout):
    """The reference's output and gradients (float32 autograd from the same inputs)."""
    leaves = [t.detach().float().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(dout.float())
    return out, [t.grad for t in leaves]


def close(actual, want, dtype=torch.float16):
    torch.testing.assert_close(actual.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert actual.dtype == dtype


# ---------------------------------------------------------------------------------------------
# The op: schema, fake kernel and autograd registration (torch.library.opcheck)
# ---------------------------------------------------------------------------------------------


def test_fwd_schema_has_deterministic():
    schema = torch.ops.flash_ext.fwd.default._schema
    names = [a.name for a in schema.arguments]
    # Optional tensors appended after deterministic (startend_row_indices, seqused_k, ...)
    # default to None.
    assert names[12:15] == ["dropout_p", "rng_state", "deterministic"], schema
    assert names[15:17] == ["startend_row_indices", "seqused_k"], schema
    assert all(a.default_value is None for a in schema.arguments[15:]), schema
    det = schema.arguments[14]
    assert str(det.type) == "bool" and det.default_value is False, schema
    assert [r.name for r in schema.returns] == ["out", "lse"], schema


def test_one_differentiable_op():
    """No Python custom op beside the compiled ones."""
    assert not hasattr(torch.ops.flash_ext, "attn")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_opcheck_fwd(cpu_kernels, deterministic, varlen):
    """Schema, fake kernel (outputs' metadata equal to the real kernel's), autograd registration
    and AOT dispatch of flash_ext::fwd with the deterministic argument."""
    torch.manual_seed(0)
    if varlen:
        q, k, v = leaf(30, 4, 64), leaf(40, 2, 64), leaf(40, 2, 64)
        cq = torch.tensor([0, 10, 30], dtype=torch.int32)
        ck = torch.tensor([0, 25, 40], dtype=torch.int32)
        args = (q, k, v, cq, ck, 20, 25, 0.125, True, -1, 0, 0.0, 0.0, None, deterministic)
    else:
        qkv = leaf(2, 24, 3, 4, 64)
        q, k, v = qkv.unbind(2)  # strided q: out is contiguous anyway
        args = (q, k, v, None, None, 0, 0, 0.125, False, 16, -1, 5.0, 0.0, None, deterministic)
    torch.library.opcheck(torch.ops.flash_ext.fwd.default, args, atol=2e-2, rtol=2e-2)
    assert ("bwd", deterministic) in cpu_kernels.calls


def test_opcheck_bwd(cpu_kernels):
    torch.manual_seed(0)
    q, k = torch.randn(2, 16, 4, 64).half(), torch.randn(2, 20, 2, 64).half()
    out, lse = torch.ops.flash_ext.fwd(q, k, k, None, None, 0, 0, 0.125, True, -1, 0, 0.0)
    torch.library.opcheck(torch.ops.flash_ext.bwd.default,
                          (out, q, k, k, out, lse, None, None, 0, 0, 0.125, True, -1, 0, 0.0, True),
                          test_utils=("test_schema", "test_faketensor"))


def test_fake_kernel_takes_deterministic(fake_mode):
    with fake_mode:
        q = torch.randn(2, 64, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(2, 96, 2, 64, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.flash_ext.fwd(q, k, k, None, None, 0, 0, 0.125, True, -1, 0, 0.0,
                                           deterministic=True)
    assert out.shape == q.shape and out.is_contiguous() and out.dtype == q.dtype
    assert lse.shape == (2, 8, 64) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_raw_fwd_deterministic_reaches_bwd(cpu_kernels):
    q = leaf(1, 16, 2, 64)
    out, lse = torch.ops.flash_ext.fwd(q, q, q, None, None, 0, 0, 0.125, False, -1, -1, 0.0,
                                       deterministic=True)
    assert not lse.requires_grad
    out.float().sum().backward()
    assert cpu_kernels.calls == [("fwd", True), ("bwd", True)]
    out, _ = torch.ops.flash_ext.fwd(q, q, q, None, None, 0, 0, 0.125, False, -1, -1, 0.0)
    out.float().sum().backward()
    assert cpu_kernels.calls[2:] == [("fwd", False), ("bwd", False)]


# ---------------------------------------------------------------------------------------------
# attn_fwd and the FlashAttention-compatible functions through autograd
# ---------------------------------------------------------------------------------------------


CASES = {
    "d64": dict(),
    "d59-padded": dict(d=59),
    "gqa-causal": dict(hkv=1, causal=True),
    "window-softcap": dict(window_size=(5, 3), softcap=4.0, sq=20, sk=12),
    "scale": dict(softmax_scale=0.3, d=40),
}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_attn_fwd_matches_reference(cpu_kernels, case, deterministic):
    torch.manual_seed(0)
    c = dict(b=2, sq=17, sk=23, hq=4, hkv=2, d=64)
    c.update(CASES[case])
    kw = {n: c.pop(n) for n in ("causal", "window_size", "softcap", "softmax_scale") if n in c}
    q = leaf(c["b"], c["sq"], c["hq"], c["d"])
    k, v = leaf(c["b"], c["sk"], c["hkv"], c["d"]), leaf(c["b"], c["sk"], c["hkv"], c["d"])
    out, lse = flash_ext.attn_fwd(q, k, v, deterministic=deterministic, **kw)
    assert out.requires_grad and not lse.requires_grad
    dout = torch.randn(out.shape).half()
    out.backward(dout)
    want, grads = expected(lambda q, k, v: attention_ref(q, k, v, **kw)[0], (q, k, v), dout)
    close(out, want)
    torch.testing.assert_close(lse, attention_ref(q.detach(), k.detach(), v.detach(), **kw)[1])
    for t, g in zip((q, k, v), grads):
        close(t.grad, g)
    assert cpu_kernels.calls == [("fwd", deterministic), ("bwd", deterministic)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_attn_fwd_varlen_matches_reference(cpu_kernels, deterministic):
    torch.manual_seed(0)
    lens_q, lens_k = [0, 7, 12, 3], [5, 9, 0, 6]  # an empty sequence; one with no keys
    cq = torch.tensor([0, 0, 7, 19, 22], dtype=torch.int32)
    ck = torch.tensor([0, 5, 14, 14, 20], dtype=torch.int32)
    q, k, v = leaf(22, 4, 40), leaf(20, 2, 40), leaf(20, 2, 40)
    kw = dict(causal=True)
    out, lse = flash_ext.attn_fwd(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                  max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                  deterministic=deterministic, **kw)
    dout = torch.randn(out.shape).half()
    out.backward(dout)
    want, grads = expected(lambda q, k, v: attention_ref_varlen(q, k, v, cq, ck, **kw)[0],
                           (q, k, v), dout)
    close(out, want)
    for t, g in zip((q, k, v), grads):
        close(t.grad, g)
    assert cpu_kernels.calls == [("fwd", deterministic), ("bwd", deterministic)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_attn_functions_pass_deterministic(cpu_kernels, deterministic):
    torch.manual_seed(0)
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    calls = {
        "func": lambda: flash_ext.flash_attn_func(leaf(2, 8, 4, 64), leaf(2, 8, 2, 64),
                                                  leaf(2, 8, 2, 64), deterministic=deterministic),
        "kvpacked": lambda: flash_ext.flash_attn_kvpacked_func(
            leaf(2, 8, 4, 64), leaf(2, 8, 2, 2, 64), deterministic=deterministic),
        "qkvpacked": lambda: flash_ext.flash_attn_qkvpacked_func(
            leaf(2, 8, 3, 4, 64), deterministic=deterministic),
        "varlen": lambda: flash_ext.flash_attn_varlen_func(
            leaf(16, 4, 64), leaf(16, 2, 64), leaf(16, 2, 64), cu, cu, 10, 10,
            deterministic=deterministic),
        "varlen_kvpacked": lambda: flash_ext.flash_attn_varlen_kvpacked_func(
            leaf(16, 4, 64), leaf(16, 2, 2, 64), cu, cu, 10, 10, deterministic=deterministic),
        "varlen_qkvpacked": lambda: flash_ext.flash_attn_varlen_qkvpacked_func(
            leaf(16, 3, 4, 64), cu, 10, deterministic=deterministic, return_attn_probs=True)[0],
    }
    for name, call in calls.items():
        cpu_kernels.calls.clear()
        call().float().sum().backward()
        assert cpu_kernels.calls == [("fwd", deterministic), ("bwd", deterministic)], name


def test_no_grad_calls_fwd_once(cpu_kernels):
    q = torch.randn(1, 8, 2, 64).half()
    with torch.no_grad():
        out, _ = flash_ext.attn_fwd(q.requires_grad_(True), q, q)
    assert not out.requires_grad and cpu_kernels.calls == [("fwd", False)]
    q = q.detach()
    flash_ext.attn_fwd(q, q, q, out=torch.empty_like(q))
    assert cpu_kernels.calls[1:] == [("fwd_out", None)]


def test_lse_gets_no_gradient_and_out_alone_backprops(cpu_kernels):
    q = leaf(1, 8, 2, 64)
    out, lse = flash_ext.attn_fwd(q, q, q)
    assert lse.grad_fn is None
    (out.float().sum() + lse.sum()).backward()  # lse is a constant to autograd
    assert q.grad is not None and q.grad.isfinite().all()


# ---------------------------------------------------------------------------------------------
# Calls with nothing to launch: out 0, lse -inf, zero gradients, no kernel
# ---------------------------------------------------------------------------------------------


EMPTY = {
    "no-key": ((2, 5, 4, 59), (2, 0, 2, 59), {}),
    "no-query-row": ((2, 0, 4, 64), (2, 7, 2, 64), {}),
    "no-batch": ((0, 5, 4, 64), (0, 7, 2, 64), {}),
    "varlen-no-key": ((9, 4, 64), (0, 2, 64),
                      dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
                           cu_seqlens_k=torch.tensor([0, 0, 0], dtype=torch.int32),
                           max_seqlen_q=5, max_seqlen_k=0)),
    "varlen-no-query-row": ((0, 4, 64), (6, 2, 64),
                            dict(cu_seqlens_q=torch.tensor([0, 0, 0], dtype=torch.int32),
                                 cu_seqlens_k=torch.tensor([0, 2, 6], dtype=torch.int32),
                                 max_seqlen_q=0, max_seqlen_k=4)),
}


def _lse_shape(q, varlen):
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


@pytest.mark.parametrize("case", list(EMPTY))
def test_nothing_to_launch_is_differentiable(cpu_kernels, case):
    qs, ks, kw = EMPTY[case]
    q, k, v = leaf(*qs), leaf(*ks), leaf(*ks)
    out, lse = flash_ext.attn_fwd(q, k, v, deterministic=True, **kw)
    assert out.requires_grad and not lse.requires_grad
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert torch.equal(out, torch.zeros_like(out))
    assert lse.dtype == torch.float32 and lse.shape == _lse_shape(q, "cu_seqlens_q" in kw)
    assert (lse == float("-inf")).all()
    out.float().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.dtype == t.dtype
        assert torch.equal(t.grad, torch.zeros_like(t))
    assert cpu_kernels.calls == []  # nothing launched, forward or backward


@pytest.mark.parametrize("case", list(EMPTY))
def test_nothing_to_launch_without_grad(cpu_kernels, case):
    qs, ks, kw = EMPTY[case]
    q, k = torch.randn(*qs).half(), torch.randn(*ks).half()
    out, lse = flash_ext.attn_fwd(q, k, k, **kw)
    assert not out.requires_grad and torch.equal(out, torch.zeros_like(q))
    assert (lse == float("-inf")).all()
    dst = torch.full_like(q, float("nan"))
    out2, _ = flash_ext.attn_fwd(q, k, k, out=dst, **kw)
    assert out2 is dst and torch.equal(dst, torch.zeros_like(q))
    assert cpu_kernels.calls == []


def test_nothing_to_launch_compiles(cpu_kernels):
    """The trivial result stays in one torch.compile graph, with its zero gradients."""
    fn = torch.compile(lambda q, k, v: flash_ext.attn_fwd(q, k, v, deterministic=True)[0],
                       fullgraph=True, backend="aot_eager")
    q, k = leaf(2, 5, 4, 64), leaf(2, 0, 2, 64)
    out = fn(q, k, k)
    out.float().sum().backward()
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(q.grad, torch.zeros_like(q))
    assert cpu_kernels.calls == []


# ---------------------------------------------------------------------------------------------
# torch.compile with real numbers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("deterministic", [False, True])
def test_compiled_training_step_matches_eager(cpu_kernels, deterministic):
    torch.manual_seed(0)

    def step(q, k, v):
        out = flash_ext.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        return out.float().pow(2).sum()

    q, k, v = leaf(2, 12, 4, 59), leaf(2, 12, 2, 59), leaf(2, 12, 2, 59)
    step(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    cpu_kernels.calls.clear()
    torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v).backward()
    for t, g in zip((q, k, v), eager):
        torch.testing.assert_close(t.grad, g)
    assert ("fwd", deterministic) in cpu_kernels.calls
    assert ("bwd", deterministic) in cpu_kernels.calls


@pytest.mark.skipif(not EXTENSION_BUILT, reason="the stand-in schema is this file's own")
def test_compiled_extension_schema_matches_stand_in():
    """The schemas tests/stand_in_ops.py defines for checkouts without a build are the built
    extension's."""
    import stand_in_ops
    for schema, tags in stand_in_ops.SCHEMAS:
        name = schema.split("(", 1)[0]
        real = getattr(torch.ops.flash_ext, name).default
        want = torch._C.parse_schema("flash_ext::" + schema)
        assert str(real._schema) == str(want), (real._schema, want)
        assert all(tag in real.tags for tag in tags), name
