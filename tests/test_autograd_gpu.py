"""Autograd through flash_ext on the GPU (skipped without a CUDA GPU): the gradients of every
FlashAttention-compatible function and of attn_fwd against autograd through the PyTorch
reference, attn_bwd called directly (incl. dq/dk/dv= outputs), deterministic=True through
autograd, and torch.compile(fullgraph=True) of a training step against eager.

Pass criterion (FlashAttention's, as in test_bwd_gpu.py), per gradient: with ref = the gradient
of the float32 reference (float32 leaves made from the same low-precision inputs) and pt = the
gradient of the reference computed in the input dtype (upcast=False),

    max|g - ref| <= 2 * max|pt - ref| + max|round(ref) - ref| + 1e-4 * max|ref| + 1e-5

and no NaN anywhere.
"""

import pytest
import torch

import flash_ext
from flash_ext.reference import attention_ref, attention_ref_varlen

from conftest import requires_cuda

pytestmark = requires_cuda

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def dname(dtype):
    return str(dtype).replace("torch.", "")


def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def cu_of(lens):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device="cuda")


def leaf(t, dtype=None):
    return t.detach().to(dtype or t.dtype).clone().requires_grad_()


def reference_grads(ref_fn, inputs, dout, upcast):
    """Gradients of ref_fn(*leaves) (which returns out) for dout: float32 leaves if upcast,
    else leaves in the inputs' dtype."""
    leaves = [leaf(t, torch.float32 if upcast else None) for t in inputs]
    out = ref_fn(*leaves, upcast=upcast)
    out.backward(dout.to(out.dtype))
    return [t.grad for t in leaves]


def check(got, ref, pt, names, label):
    for name, g, r, p in zip(names, got, ref, pt):
        assert g is not None, f"{label}: no gradient for {name}"
        assert g.shape == r.shape, (label, name, g.shape, r.shape)
        assert not g.isnan().any(), f"{label}: NaN in {name}"
        if g.numel() == 0:
            continue
        err = (g.float() - r).abs().max().item()
        pt_err = (p.float() - r).abs().max().item()
        round_err = (r.to(g.dtype).float() - r).abs().max().item()
        bound = 2 * pt_err + round_err + 1e-4 * r.abs().max().item() + 1e-5
        print(f"[{label}] {name} max err {err:.3e} (pt {pt_err:.3e}, bound {bound:.3e})")
        assert err <= bound, f"{label}: {name} max err {err:.3e} > bound {bound:.3e}"


def run_and_check(fn, ref_fn, inputs, names, label, out_shape=None):
    """fn(*leaves) -> out (flash_ext, autograd); ref_fn(*inputs, upcast) -> out (reference);
    compares the gradients of the leaves."""
    leaves = [leaf(t) for t in inputs]
    out = fn(*leaves)
    assert out.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    got = [t.grad for t in leaves]
    for g, t in zip(got, inputs):
        assert g.dtype == t.dtype and g.shape == t.shape
    ref = reference_grads(ref_fn, inputs, dout, upcast=True)
    pt = reference_grads(ref_fn, inputs, dout, upcast=False)
    check(got, ref, pt, names, label)
    return got


def ref_batched(**kw):
    def f(q, k, v, upcast):
        return attention_ref(q, k, v, upcast=upcast, **kw)[0]
    return f


def ref_varlen(cq, ck, **kw):
    def f(q, k, v, upcast):
        return attention_ref_varlen(q, k, v, cq, ck, upcast=upcast, **kw)[0]
    return f


# ---------------------------------------------------------------------------------------------
# flash_attn_func and attn_fwd
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 59, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_flash_attn_func(dtype, d, causal, hq, hkv):
    q, k, v = rnd(2, 113, hq, d, dtype=dtype), rnd(2, 203, hkv, d, dtype=dtype), \
        rnd(2, 203, hkv, d, dtype=dtype)
    run_and_check(lambda q, k, v: flash_ext.flash_attn_func(q, k, v, causal=causal),
                  ref_batched(causal=causal), (q, k, v), ("dq", "dk", "dv"),
                  f"func {dname(dtype)} d={d} causal={causal} {hq}/{hkv}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("kw", [dict(softcap=30.0), dict(softcap=30.0, causal=True),
                                dict(window_size=(32, 8)), dict(window_size=(16, 0)),
                                dict(softmax_scale=0.3, causal=True)], ids=str)
def test_flash_attn_func_features(dtype, kw):
    scale = 4.0 if kw.get("softcap") else 1.0  # large scores, so that the cap matters
    q, k, v = rnd(2, 150, 4, 64, dtype=dtype, scale=scale), \
        rnd(2, 250, 2, 64, dtype=dtype, scale=scale), rnd(2, 250, 2, 64, dtype=dtype)
    run_and_check(lambda q, k, v: flash_ext.flash_attn_func(q, k, v, **kw), ref_batched(**kw),
                  (q, k, v), ("dq", "dk", "dv"), f"func {dname(dtype)} {kw}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 59])
def test_attn_fwd(dtype, d):
    q, k, v = rnd(2, 97, 4, d, dtype=dtype), rnd(2, 97, 1, d, dtype=dtype), \
        rnd(2, 97, 1, d, dtype=dtype)

    def fn(q, k, v):
        out, lse = flash_ext.attn_fwd(q, k, v, causal=True, window_size=(40, -1))
        assert not lse.requires_grad and lse.dtype == torch.float32
        return out
    run_and_check(fn, ref_batched(causal=True, window_size=(40, -1)), (q, k, v),
                  ("dq", "dk", "dv"), f"attn_fwd {dname(dtype)} d={d}")


def test_strided_inputs_and_grad_outputs():
    """q, k, v as strided views of one projection and a non-contiguous dout."""
    x = rnd(2, 128, 3, 4, 64)
    qkv = leaf(x)
    q, k, v = qkv.unbind(2)
    out = flash_ext.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn(2, 4, 128, 64, device="cuda", dtype=out.dtype).transpose(1, 2)
    out.backward(dout)
    q2, k2, v2 = (leaf(t) for t in x.unbind(2))
    flash_ext.flash_attn_func(q2, k2, v2, causal=True).backward(dout.contiguous())
    torch.testing.assert_close(qkv.grad, torch.stack([q2.grad, k2.grad, v2.grad], dim=2),
                               atol=1e-2, rtol=1e-2)


def test_only_some_inputs_require_grad():
    q, k, v = rnd(1, 64, 2, 64), rnd(1, 64, 2, 64), rnd(1, 64, 2, 64)
    v = leaf(v)
    flash_ext.flash_attn_func(q, k, v).float().sum().backward()
    assert v.grad is not None and v.grad.shape == v.shape
    ref = reference_grads(ref_batched(), (q, k, v), torch.ones_like(q), upcast=True)[2]
    torch.testing.assert_close(v.grad.float(), ref, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# Packed layouts and varlen
# ---------------------------------------------------------------------------------------------


def _stack_ref(ref_fn, split):
    """A reference taking the packed tensor: split it, call ref_fn on q, k, v."""
    def f(packed_or_q, *rest, upcast):
        return ref_fn(*split(packed_or_q, *rest), upcast=upcast)
    return f


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("causal", [False, True])
def test_kvpacked(dtype, causal):
    q, kv = rnd(2, 100, 6, 64, dtype=dtype), rnd(2, 180, 2, 3, 64, dtype=dtype)
    run_and_check(lambda q, kv: flash_ext.flash_attn_kvpacked_func(q, kv, causal=causal),
                  _stack_ref(ref_batched(causal=causal), lambda q, kv: (q, *kv.unbind(2))),
                  (q, kv), ("dq", "dkv"), f"kvpacked {dname(dtype)} causal={causal}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 59])
def test_qkvpacked(dtype, d):
    qkv = rnd(2, 130, 3, 4, d, dtype=dtype)
    run_and_check(lambda qkv: flash_ext.flash_attn_qkvpacked_func(qkv, causal=True),
                  _stack_ref(ref_batched(causal=True), lambda qkv: qkv.unbind(2)),
                  (qkv,), ("dqkv",), f"qkvpacked {dname(dtype)} d={d}")


LENS_Q = [0, 17, 130, 1, 64]  # an empty sequence, a single token, ...
LENS_K = [5, 40, 130, 0, 64]  # ... a sequence with queries but no keys


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 59])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, softcap=20.0),
                                dict(window_size=(16, 4))], ids=str)
def test_varlen(dtype, d, kw):
    cq, ck = cu_of(LENS_Q), cu_of(LENS_K)
    q, k, v = rnd(sum(LENS_Q), 4, d, dtype=dtype), rnd(sum(LENS_K), 2, d, dtype=dtype), \
        rnd(sum(LENS_K), 2, d, dtype=dtype)
    mq, mk = max(LENS_Q), max(LENS_K)
    grads = run_and_check(
        lambda q, k, v: flash_ext.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, **kw),
        ref_varlen(cq, ck, **kw), (q, k, v), ("dq", "dk", "dv"), f"varlen {dname(dtype)} {kw}")
    # The sequence with queries but no keys: its rows get dq = 0.
    s = sum(LENS_Q[:3])
    assert torch.equal(grads[0][s:s + 1], torch.zeros_like(grads[0][s:s + 1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_varlen_packed(dtype):
    lens = [33, 0, 100, 7]
    cu, m = cu_of(lens), max(lens)
    qkv = rnd(sum(lens), 3, 4, 64, dtype=dtype)
    run_and_check(
        lambda qkv: flash_ext.flash_attn_varlen_qkvpacked_func(qkv, cu, m, causal=True),
        _stack_ref(ref_varlen(cu, cu, causal=True), lambda qkv: qkv.unbind(1)),
        (qkv,), ("dqkv",), f"varlen qkvpacked {dname(dtype)}")
    q, kv = rnd(sum(lens), 4, 64, dtype=dtype), rnd(sum(lens), 2, 2, 64, dtype=dtype)
    run_and_check(
        lambda q, kv: flash_ext.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, m, m),
        _stack_ref(ref_varlen(cu, cu), lambda q, kv: (q, *kv.unbind(1))),
        (q, kv), ("dq", "dkv"), f"varlen kvpacked {dname(dtype)}")


def test_empty_calls_give_zero_gradients():
    q, k = leaf(rnd(2, 5, 4, 64)), leaf(rnd(2, 0, 4, 64))
    out = flash_ext.flash_attn_func(q, k, k)
    out.float().sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == k.shape
    q, k = leaf(rnd(2, 0, 4, 64)), leaf(rnd(2, 7, 4, 64))
    flash_ext.flash_attn_func(q, k, k).float().sum().backward()
    assert q.grad.shape == q.shape and torch.equal(k.grad, torch.zeros_like(k))


# ---------------------------------------------------------------------------------------------
# attn_bwd called directly
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 59, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_attn_bwd(dtype, d, causal):
    q, k, v = rnd(2, 140, 8, d, dtype=dtype), rnd(2, 160, 2, d, dtype=dtype), \
        rnd(2, 160, 2, d, dtype=dtype)
    dout = rnd(2, 140, 8, d, dtype=dtype)
    out, lse = flash_ext.attn_fwd(q, k, v, causal=causal)
    dq, dk, dv = flash_ext.attn_bwd(dout, q, k, v, out, lse, causal=causal)
    ref_fn = ref_batched(causal=causal)
    ref = reference_grads(ref_fn, (q, k, v), dout, upcast=True)
    pt = reference_grads(ref_fn, (q, k, v), dout, upcast=False)
    check((dq, dk, dv), ref, pt, ("dq", "dk", "dv"), f"attn_bwd {dname(dtype)} d={d}")

    # Into given (strided) tensors; deterministic, so equal bitwise to autograd's deterministic
    # result below.
    dq_buf = torch.full((2, 140, 9, d), 7.0, device="cuda", dtype=dtype)
    dkv_buf = torch.full((2, 160, 2, 2, d), 7.0, device="cuda", dtype=dtype)
    dq_o, dk_o, dv_o = dq_buf[:, :, 1:], dkv_buf[:, :, 0], dkv_buf[:, :, 1]
    res = flash_ext.attn_bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                             dq=dq_o, dk=dk_o, dv=dv_o)
    assert res[0] is dq_o and res[1] is dk_o and res[2] is dv_o
    assert torch.equal(dq_buf[:, :, 0], torch.full_like(dq_buf[:, :, 0], 7.0))
    lq, lk, lv = leaf(q), leaf(k), leaf(v)
    flash_ext.flash_attn_func(lq, lk, lv, causal=causal, deterministic=True).backward(dout)
    assert torch.equal(lq.grad, dq_o) and torch.equal(lk.grad, dk_o) and torch.equal(lv.grad, dv_o)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_attn_bwd_varlen(dtype):
    lens_q, lens_k = [10, 0, 77], [20, 5, 60]
    cq, ck = cu_of(lens_q), cu_of(lens_k)
    q = rnd(sum(lens_q), 4, 64, dtype=dtype)
    k, v = rnd(sum(lens_k), 4, 64, dtype=dtype), rnd(sum(lens_k), 4, 64, dtype=dtype)
    dout = torch.randn_like(q)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=77, max_seqlen_k=60, causal=True)
    out, lse = flash_ext.attn_fwd(q, k, v, **kw)
    grads = flash_ext.attn_bwd(dout, q, k, v, out, lse, **kw)
    ref_fn = ref_varlen(cq, ck, causal=True)
    check(grads, reference_grads(ref_fn, (q, k, v), dout, True),
          reference_grads(ref_fn, (q, k, v), dout, False), ("dq", "dk", "dv"),
          f"attn_bwd varlen {dname(dtype)}")


def test_attn_bwd_errors_before_launch():
    q = rnd(1, 16, 2, 64)
    out, lse = flash_ext.attn_fwd(q, q, q)
    with pytest.raises(ValueError, match="dout must have q's shape"):
        flash_ext.attn_bwd(out[:, :8], q, q, q, out, lse)
    with pytest.raises(TypeError, match="dout must have q's dtype"):
        flash_ext.attn_bwd(out.half(), q, q, q, out, lse)
    with pytest.raises(ValueError, match="lse must have shape"):
        flash_ext.attn_bwd(out, q, q, q, out, lse.transpose(1, 2))
    with pytest.raises(flash_ext._validation.DeviceError, match="got dout on cpu"):
        flash_ext.attn_bwd(out.cpu(), q, q, q, out, lse)


# ---------------------------------------------------------------------------------------------
# Deterministic mode through autograd
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_deterministic_bitwise_through_autograd(dtype):
    q, k, v = rnd(2, 1025, 8, 64, dtype=dtype), rnd(2, 1025, 2, 64, dtype=dtype), \
        rnd(2, 1025, 2, 64, dtype=dtype)
    dout = rnd(2, 1025, 8, 64, dtype=dtype)

    def grads():
        lq, lk, lv = leaf(q), leaf(k), leaf(v)
        flash_ext.flash_attn_func(lq, lk, lv, causal=True, deterministic=True).backward(dout)
        return lq.grad, lk.grad, lv.grad

    first = grads()
    for _ in range(3):
        for a, b in zip(first, grads()):
            assert torch.equal(a, b), "deterministic=True is not bitwise reproducible"


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------


class AttnBlock(torch.nn.Module):
    def __init__(self, d_model=256, heads=4, head_dim=64, deterministic=False):
        super().__init__()
        self.heads, self.head_dim, self.deterministic = heads, head_dim, deterministic
        self.qkv = torch.nn.Linear(d_model, 3 * heads * head_dim)
        self.proj = torch.nn.Linear(heads * head_dim, d_model)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        o = flash_ext.flash_attn_func(q, k, v, causal=True, deterministic=self.deterministic)
        return x + self.proj(o.reshape(b, s, -1))


def _model(head_dim):
    torch.manual_seed(0)
    return torch.nn.Sequential(AttnBlock(head_dim=head_dim, deterministic=True),
                               AttnBlock(head_dim=head_dim, deterministic=True)).cuda().bfloat16()


def _loss(model, x):
    return model(x).float().pow(2).mean()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_close(got, ref, tol=2e-2):
    """Relative error in norm per parameter (bf16 parameters; inductor rounds differently)."""
    for n in ref:
        assert got[n] is not None and got[n].shape == ref[n].shape, n
        err = (got[n].float() - ref[n].float()).norm().item()
        size = ref[n].float().norm().item()
        print(f"{n}: |got - ref| / |ref| = {err / max(size, 1e-30):.2e}")
        assert size > 0 and err <= tol * size, f"{n}: relative error {err / size:.2e} > {tol}"


@pytest.mark.parametrize("head_dim", [64, 59])
def test_compile_training_step_matches_eager(head_dim):
    """torch.compile(fullgraph=True) of forward + loss; loss.backward() runs the compiled
    backward (AOTAutograd). Deterministic attention: compiled and eager agree closely."""
    x = rnd(2, 256, 256)
    eager = _model(head_dim)
    _loss(eager, x).backward()
    ref = _grads(eager)
    model = _model(head_dim)
    compiled = torch.compile(_loss, fullgraph=True)
    loss = compiled(model, x)
    loss.backward()
    assert_grads_close(_grads(model), ref)


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "trace_autograd_ops"),
                    reason="this torch cannot trace Tensor.backward() (no trace_autograd_ops)")
def test_compile_full_training_step_with_backward(monkeypatch):
    """forward, loss and loss.backward() in one fullgraph=True graph (torch's
    trace_autograd_ops)."""
    monkeypatch.setattr(torch._dynamo.config, "trace_autograd_ops", True)
    x = rnd(2, 256, 256)
    eager = _model(64)
    _loss(eager, x).backward()
    ref = _grads(eager)
    model = _model(64)

    @torch.compile(fullgraph=True)
    def step(model, x):
        loss = _loss(model, x)
        loss.backward()
        return loss.detach()

    step(model, x)
    assert_grads_close(_grads(model), ref)
