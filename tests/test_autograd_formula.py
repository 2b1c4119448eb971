"""fwd's autograd formula rule by rule, on meta tensors (no GPU): in the build its C++
Autograd-key kernel (csrc/ops_autograd.cpp), without it the stand-in's Python copy
(tests/stand_in_ops.py). What bwd receives is recorded where the dispatcher calls it."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flash_ext  # noqa: F401  (loads the ops and their fake kernels)
from conftest import EXTENSION_BUILT, meta, requires_ext

SCALE = 0.125


class RecordBwd(TorchDispatchMode):
    """Keeps the arguments of every flash_ext::bwd call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.flash_ext.bwd.default:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


def fwd(q, k, v, **kw):
    a = dict(cu_q=None, cu_k=None, mq=0, mk=0, causal=True, wl=-1, wr=0, softcap=0.0,
             dropout_p=0.0, rng_state=None, deterministic=False)
    a.update(kw)
    return torch.ops.flash_ext.fwd(q, k, v, a["cu_q"], a["cu_k"], a["mq"], a["mk"], SCALE,
                                   a["causal"], a["wl"], a["wr"], a["softcap"], a["dropout_p"],
                                   a["rng_state"], a["deterministic"])


@requires_ext
def test_formula_is_the_cpp_kernel():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flash_ext::fwd", "Autograd")
    q = meta(1, 16, 2, 64, requires_grad=True)
    out, _ = fwd(q, q, q)
    assert "CppNode" in type(out.grad_fn).__name__ or "FwdFunction" in out.grad_fn.name()


@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_gets_the_forward_arguments(deterministic):
    q = meta(2, 32, 4, 64, requires_grad=True)
    k = meta(2, 48, 2, 64, requires_grad=True)
    v = meta(2, 48, 2, 64, requires_grad=True)
    state = torch.tensor([5, 7], dtype=torch.int64)
    out, lse = fwd(q, k, v, wl=16, softcap=30.0, dropout_p=0.2, rng_state=state,
                   deterministic=deterministic)
    assert out.requires_grad and not lse.requires_grad
    rec = RecordBwd()
    with rec:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert len(rec.calls) == 1
    a = rec.calls[0]
    assert a[1] is not None and a[1].shape == q.shape and a[4].shape == out.shape
    assert tuple(a[5].shape) == (2, 4, 32)  # lse
    assert a[8:16] == (0, 0, SCALE, True, 16, 0, 30.0, deterministic)
    assert a[16] == 0.2 and a[17] is state
    # GQA: dk, dv have k's and v's shapes (2 K/V heads), not the query heads'.
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_unaligned_dout_is_copied_aligned_is_not():
    q = meta(1, 16, 2, 64, requires_grad=True)
    out, _ = fwd(q, q, q)
    rec = RecordBwd()
    with rec:
        out.sum().backward()  # the gradient of sum() is a stride-0 expand: copied
    dout = rec.calls[0][0]
    assert dout.stride(-1) == 1 and all(s % 8 == 0 for s in dout.stride()[:-1])

    q.grad = None
    out, _ = fwd(q, q, q)
    g = meta(1, 16, 2, 64)
    with rec:
        torch.autograd.grad(out, q, g)
    assert rec.calls[1][0] is g  # already aligned: passed as is

    out, _ = fwd(q, q, q)
    wide = meta(1, 16, 2, 72)[..., :64]  # row stride 72 (a multiple of 8): read in place
    with rec:
        torch.autograd.grad(out, q, wide)
    assert rec.calls[2][0].stride() == wide.stride()

    out, _ = fwd(q, q, q)
    odd = meta(1, 16, 2, 68)[..., :64]  # row stride 68: copied
    with rec:
        torch.autograd.grad(out, q, odd)
    assert rec.calls[3][0].is_contiguous()


@pytest.mark.parametrize("case", ["no_keys", "no_rows", "varlen_max_zero"])
def test_nothing_to_do_gives_zero_gradients_without_bwd(case):
    if case == "no_keys":
        q, k = meta(2, 8, 2, 64, requires_grad=True), meta(2, 0, 2, 64, requires_grad=True)
        kw = {}
    elif case == "no_rows":
        q, k = meta(2, 0, 2, 64, requires_grad=True), meta(2, 8, 2, 64, requires_grad=True)
        kw = {}
    else:
        q, k = meta(8, 2, 64, requires_grad=True), meta(8, 2, 64, requires_grad=True)
        cu = torch.empty(3, dtype=torch.int32, device="meta")
        kw = dict(cu_q=cu, cu_k=cu, mq=0, mk=4)
    out, _ = fwd(q, k, k, **kw)
    rec = RecordBwd()
    with rec:
        dq, dk = torch.autograd.grad(out, (q, k), torch.ones_like(out))
    assert rec.calls == []
    assert dq.shape == q.shape and dk.shape == k.shape


def test_no_graph_without_grad_mode():
    q = meta(1, 16, 2, 64, requires_grad=True)
    with torch.no_grad():
        out, lse = fwd(q, q, q)
    assert out.grad_fn is None and not out.requires_grad and not lse.requires_grad


def test_only_inputs_that_require_grad_get_one():
    q = meta(1, 16, 2, 64, requires_grad=True)
    k = meta(1, 16, 2, 64)
    out, _ = fwd(q, k, k)
    (dq,) = torch.autograd.grad(out.float().sum(), (q,))
    assert dq.shape == q.shape and k.grad is None


@pytest.mark.skipif(EXTENSION_BUILT, reason="the stand-in's Python formula only exists without the build")
def test_stand_in_registers_python_formula():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flash_ext::fwd", "Autograd")


def test_compiled_autograd_runs_the_formula():
    """torch.compile's compiled autograd takes fwd's node (a C++ node with a non-differentiable
    output would fail its internal assert: lse is returned detached instead)."""
    from torch._dynamo import compiled_autograd
    q = meta(2, 64, 4, 64, requires_grad=True)
    out, lse = fwd(q, q, q)
    assert not lse.requires_grad
    with compiled_autograd._enable(torch.compile(backend="eager")):
        out.float().sum().backward()
    assert q.grad.shape == q.shape
