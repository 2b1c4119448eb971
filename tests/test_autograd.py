"""Backward pass plumbing without a GPU: the bwd op's registration and fake kernel, attn_bwd's
input checks, the autograd registration of flash_ext::fwd (the one differentiable op, whose
``deterministic`` argument the backward reads), and torch.compile tracing a training step
(forward, loss, backward) into one graph.

The autograd engine initialises CUDA for CUDA tensors, even fake ones, so the tests that run a
backward use tensors on the "meta" device (the fake kernels are also the meta kernels), with the
Python layer's CUDA-device check relaxed by the ``meta_ok`` fixture. Fake-mode CUDA tensors are
used where no backward runs. The real kernels are exercised in test_bwd_gpu.py and
test_autograd_gpu.py."""

import pytest
import torch

import flash_ext
from flash_ext import _validation as V
from flash_ext._validation import DeviceError

from conftest import meta

BWD_ARGS = ("Tensor dout", "Tensor q", "Tensor k", "Tensor v", "Tensor out", "Tensor lse",
            "Tensor? cu_seqlens_q", "Tensor? cu_seqlens_k", "int max_seqlen_q",
            "int max_seqlen_k", "float softmax_scale", "bool causal", "int window_left",
            "int window_right", "float softcap", "bool deterministic")


# ---------------------------------------------------------------------------------------------
# Registration and fake kernels
# ---------------------------------------------------------------------------------------------


def test_bwd_op_registered():
    assert hasattr(torch.ops.flash_ext, "bwd")
    schema = str(torch.ops.flash_ext.bwd.default._schema)
    for arg in BWD_ARGS:
        assert arg in schema, schema
    assert "-> (Tensor dq, Tensor dk, Tensor dv)" in schema, schema


def test_fwd_op_carries_deterministic():
    schema = str(torch.ops.flash_ext.fwd.default._schema)
    assert ("Tensor? rng_state=None, bool deterministic=False, "
            "Tensor? startend_row_indices=None)") in schema, schema
    assert "-> (Tensor out, Tensor lse)" in schema, schema
    assert not hasattr(torch.ops.flash_ext, "attn")  # no second differentiable op


def test_no_not_implemented_backward_op_left():
    assert not hasattr(torch.ops.flash_ext, "_backward_not_implemented")


@pytest.mark.parametrize("hkv", [8, 2])
def test_fake_bwd_shapes(fake_mode, hkv):
    with fake_mode:
        qkv = torch.randn(2, 64, 3, 8, 64, dtype=torch.bfloat16, device="cuda")
        q = qkv[:, :, 0]  # strided: the gradients are contiguous anyway
        k = torch.randn(2, 96, hkv, 64, dtype=torch.bfloat16, device="cuda")
        out = torch.randn(2, 64, 8, 64, dtype=torch.bfloat16, device="cuda")
        lse = torch.randn(2, 8, 64, device="cuda")
        dq, dk, dv = torch.ops.flash_ext.bwd(out, q, k, k, out, lse, None, None, 0, 0, 0.125,
                                             True, -1, 0, 0.0, False)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    for g in (dq, dk, dv):
        assert g.dtype == torch.bfloat16 and g.is_contiguous() and g.device.type == "cuda"


def test_fake_bwd_varlen_shapes(fake_mode):
    with fake_mode:
        q = torch.randn(300, 8, 128, dtype=torch.float16, device="cuda")
        k = torch.randn(500, 1, 128, dtype=torch.float16, device="cuda")
        lse = torch.randn(8, 300, device="cuda")
        cu = torch.zeros(4, dtype=torch.int32, device="cuda")
        dq, dk, dv = torch.ops.flash_ext.bwd(q, q, k, k, q, lse, cu, cu, 200, 300, 0.1, False,
                                             -1, -1, 0.0, True)
    assert dq.shape == (300, 8, 128) and dk.shape == (500, 1, 128) and dv.shape == (500, 1, 128)
    assert dq.dtype == dk.dtype == dv.dtype == torch.float16


def test_fake_fwd_deterministic_shapes(fake_mode):
    with fake_mode:
        q = torch.randn(2, 64, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(2, 96, 2, 64, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.flash_ext.fwd(q, k, k, None, None, 0, 0, 0.125, True, -1, 0, 0.0,
                                           0.0, None, True)
    assert out.shape == q.shape and out.is_contiguous() and out.dtype == q.dtype
    assert lse.shape == (2, 8, 64) and lse.dtype == torch.float32


@pytest.mark.parametrize("d", [64, 59])
def test_attn_bwd_under_fake_mode(fake_mode, d):
    """attn_bwd's Python path (padding, slicing, dq/dk/dv=) with fake CUDA tensors."""
    with fake_mode:
        q = torch.randn(2, 64, 8, d, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(2, 96, 2, d, dtype=torch.bfloat16, device="cuda")
        lse = torch.randn(2, 8, 64, device="cuda")
        dq, dk, dv = flash_ext.attn_bwd(q, q, k, k, q, lse, causal=True)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
        buf = torch.empty(2, 96, 4, d, dtype=torch.bfloat16, device="cuda")
        dk_out, dv_out = buf[:, :, :2], buf[:, :, 2:]
        dq2, dk2, dv2 = flash_ext.attn_bwd(q, q, k, k, q, lse, dk=dk_out, dv=dv_out)
        assert dk2 is dk_out and dv2 is dv_out and dq2.shape == q.shape


# ---------------------------------------------------------------------------------------------
# attn_bwd input checks (all before any launch)
# ---------------------------------------------------------------------------------------------


def cpu_case(b=2, sq=16, sk=24, hq=4, hkv=2, d=64, dtype=torch.float16):
    q = torch.randn(b, sq, hq, d).to(dtype)
    k = torch.randn(b, sk, hkv, d).to(dtype)
    v = torch.randn(b, sk, hkv, d).to(dtype)
    out = torch.randn(b, sq, hq, d).to(dtype)
    lse = torch.randn(b, hq, sq)
    return dict(dout=torch.randn(b, sq, hq, d).to(dtype), q=q, k=k, v=v, out=out, lse=lse)


def check_bwd(c, **kw):
    return V.check_bwd_inputs(c["dout"], c["q"], c["k"], c["v"], c["out"], c["lse"],
                              require_cuda=False, **kw)


def test_attn_bwd_cpu_tensors_raise_device_error():
    c = cpu_case()
    with pytest.raises(DeviceError, match="flash_ext needs CUDA tensors; got dout on cpu"):
        flash_ext.attn_bwd(**c)
    with pytest.raises(RuntimeError):  # DeviceError is a RuntimeError too
        flash_ext.attn_bwd(**c)


def test_good_bwd_inputs_pass():
    c = cpu_case()
    assert check_bwd(c) is False
    check_bwd(c, dq=torch.empty_like(c["q"]), dk=torch.empty_like(c["k"]),
              dv=torch.empty_like(c["v"]).transpose(1, 2).contiguous().transpose(1, 2))


@pytest.mark.parametrize("shape", [(2, 8, 4, 64), (2, 16, 4, 32), (2, 16, 2, 64), (16, 4, 64)])
def test_dout_wrong_shape(shape):
    c = cpu_case()
    c["dout"] = torch.randn(*shape).half()
    with pytest.raises(ValueError, match=r"dout must have q's shape \(2, 16, 4, 64\)"):
        check_bwd(c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dout_wrong_dtype(dtype):
    c = cpu_case()
    c["dout"] = c["dout"].to(dtype)
    with pytest.raises(TypeError, match="dout must have q's dtype"):
        check_bwd(c)


def test_dout_on_other_device_or_not_a_tensor():
    c = cpu_case()
    c["dout"] = c["dout"].to("meta")
    with pytest.raises(DeviceError, match="same device"):
        check_bwd(c)
    c = cpu_case()
    c["dout"] = c["dout"].tolist()
    with pytest.raises(TypeError, match="dout must be a torch.Tensor"):
        check_bwd(c)
    c = cpu_case()
    c["dout"] = None
    with pytest.raises(TypeError, match="dout must be a torch.Tensor"):
        check_bwd(c)


def test_out_wrong_shape_or_dtype():
    c = cpu_case()
    c["out"] = c["out"][:, :8]
    with pytest.raises(ValueError, match="out must have q's shape"):
        check_bwd(c)
    c = cpu_case()
    c["out"] = c["out"].float()
    with pytest.raises(TypeError, match="out must have q's dtype"):
        check_bwd(c)


def test_lse_checks():
    c = cpu_case()
    c["lse"] = c["lse"].half()
    with pytest.raises(TypeError, match="lse must be float32"):
        check_bwd(c)
    c = cpu_case()
    c["lse"] = c["lse"].transpose(1, 2)  # (b, sq, hq): the wrong layout
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, nheads_q, seqlen_q\)"):
        check_bwd(c)


def test_varlen_lse_shape():
    q = torch.randn(40, 4, 64).half()
    k = torch.randn(50, 2, 64).half()
    cq = torch.tensor([0, 10, 40], dtype=torch.int32)
    ck = torch.tensor([0, 25, 50], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=30, max_seqlen_k=25,
              require_cuda=False)
    assert V.check_bwd_inputs(q, q, k, k, q, torch.randn(4, 40), **kw) is True
    with pytest.raises(ValueError, match=r"lse must have shape \(nheads_q, total_q\) = \(4, 40\)"):
        V.check_bwd_inputs(q, q, k, k, q, torch.randn(1, 4, 40), **kw)


def test_grad_outputs_checked():
    c = cpu_case()
    with pytest.raises(ValueError, match="dk must have k's shape"):
        check_bwd(c, dk=torch.empty_like(c["q"]))
    with pytest.raises(TypeError, match="dq must have q's dtype"):
        check_bwd(c, dq=torch.empty_like(c["q"]).float())
    with pytest.raises(DeviceError, match="same device"):
        check_bwd(c, dv=torch.empty_like(c["v"], device="meta"))


def test_bwd_reuses_forward_checks():
    c = cpu_case()
    with pytest.raises(ValueError, match="softcap must be finite"):
        check_bwd(c, softcap=float("nan"))
    with pytest.raises(ValueError, match="window_size"):
        check_bwd(c, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softmax_scale must be > 0"):
        check_bwd(c, softmax_scale=0.0)
    c["k"] = c["k"][:, :, :1].repeat(1, 1, 3, 1)  # 4 query heads, 3 kv heads
    c["v"] = c["k"]
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        check_bwd(c)


# ---------------------------------------------------------------------------------------------
# Autograd through the real registrations (meta tensors: the engine runs, kernels are fakes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 59])
@pytest.mark.parametrize("hkv", [4, 1])
def test_attn_fwd_backward_shapes(meta_ok, d, hkv):
    q = meta(2, 64, 4, d, requires_grad=True)
    k = meta(2, 96, hkv, d, requires_grad=True)
    v = meta(2, 96, hkv, d, requires_grad=True)
    out, lse = flash_ext.attn_fwd(q, k, v, causal=True, deterministic=True)
    assert out.requires_grad and not lse.requires_grad  # lse carries no gradient
    out.float().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype


def test_packed_and_varlen_backward_shapes(meta_ok):
    qkv = meta(2, 32, 3, 4, 64, requires_grad=True)
    flash_ext.flash_attn_qkvpacked_func(qkv, causal=True).sum().backward()
    assert qkv.grad.shape == qkv.shape
    q = meta(100, 4, 40, requires_grad=True)
    kv = meta(120, 2, 2, 40, requires_grad=True)
    cq = torch.empty(3, dtype=torch.int32, device="meta")
    out = flash_ext.flash_attn_varlen_kvpacked_func(q, kv, cq, cq, 70, 60)
    out.sum().backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape


def test_empty_inputs_have_zero_gradients(meta_ok):
    q = meta(2, 5, 4, 64, requires_grad=True)
    k = meta(2, 0, 4, 64, requires_grad=True)
    out, _ = flash_ext.attn_fwd(q, k, k)
    assert out.requires_grad
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_raw_fwd_op_is_differentiable(meta_ok):
    q = meta(2, 64, 4, 64, requires_grad=True)
    out, lse = torch.ops.flash_ext.fwd(q, q, q, None, None, 0, 0, 0.125, False, -1, -1, 0.0)
    assert not lse.requires_grad
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_no_graph_without_grad(meta_ok):
    q = meta(2, 64, 4, 64, requires_grad=True)
    with torch.no_grad():
        out, _ = flash_ext.attn_fwd(q, q, q)
    assert not out.requires_grad


def test_dropout_is_differentiable(meta_ok):
    """Dropout is implemented (tests/test_dropout.py, test_dropout_gpu.py); out-of-range values
    are still rejected."""
    q = meta(2, 64, 4, 64, requires_grad=True)
    out = flash_ext.flash_attn_func(q, q, q, dropout_p=0.1)
    out.float().sum().backward()
    assert q.grad.shape == q.shape
    with pytest.raises(ValueError, match="dropout_p"):
        flash_ext.flash_attn_func(q, q, q, dropout_p=1.5)


# ---------------------------------------------------------------------------------------------
# torch.compile of a training step (meta tensors, aot_eager-style backend recording the graphs)
# ---------------------------------------------------------------------------------------------


class AttnLinear(torch.nn.Module):
    def __init__(self, d_model=256, heads=4, device="meta", deterministic=True):
        super().__init__()
        self.heads, self.deterministic = heads, deterministic
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, device=device, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(d_model, d_model, device=device, dtype=torch.bfloat16)

    def forward(self, x):
        b, s, dm = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, dm // self.heads).unbind(2)
        o = flash_ext.flash_attn_func(q, k, v, causal=True, deterministic=self.deterministic)
        return self.proj(o.reshape(b, s, dm))


class Graphs:
    """An AOTAutograd backend keeping the forward and backward graphs, running them eagerly."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func
        self.fw, self.bw = [], []

        def fw(gm, _):
            self.fw.append(gm)
            return make_boxed_func(gm.forward)

        def bw(gm, _):
            self.bw.append(gm)
            return make_boxed_func(gm.forward)
        self.backend = aot_autograd(fw_compiler=fw, bw_compiler=bw)

    @staticmethod
    def nodes(graphs, op):
        return [n for g in graphs for n in g.graph.nodes
                if n.op == "call_function" and n.target in (op, op.default)]

    @staticmethod
    def arg(node, name):
        """A graph node's argument by its schema name (defaults left out of the node filled)."""
        schema = node.target._schema
        for i, a in enumerate(schema.arguments):
            if a.name == name:
                if i < len(node.args):
                    return node.args[i]
                return node.kwargs.get(name, a.default_value)
        raise KeyError(name)


def _loss(m, x):
    return m(x).float().pow(2).mean()


def test_compile_forward_and_loss_then_backward(meta_ok):
    """The usual pattern: compile forward + loss in one graph; the backward graph that
    AOTAutograd compiles holds flash_ext::bwd, with fwd's deterministic=True carried over."""
    m = AttnLinear()
    x = meta(2, 128, 256)
    rec = Graphs()
    loss = torch.compile(_loss, fullgraph=True, backend=rec.backend)(m, x)
    loss.backward()
    assert m.qkv.weight.grad is not None and m.qkv.weight.grad.shape == m.qkv.weight.shape
    assert len(rec.fw) == 1 and len(rec.bw) == 1
    fwd = Graphs.nodes(rec.fw, torch.ops.flash_ext.fwd)
    assert len(fwd) == 1 and Graphs.arg(fwd[0], "deterministic") is True
    bwd = Graphs.nodes(rec.bw, torch.ops.flash_ext.bwd)
    assert len(bwd) == 1 and Graphs.arg(bwd[0], "deterministic") is True


def test_explain_training_forward_no_graph_breaks(meta_ok):
    m = AttnLinear(deterministic=False)
    x = meta(2, 64, 256)
    explanation = torch._dynamo.explain(_loss)(m, x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "trace_autograd_ops"),
                    reason="this torch cannot trace Tensor.backward() (no trace_autograd_ops)")
def test_compile_full_training_step_one_graph(meta_ok, monkeypatch):
    """forward, loss and loss.backward() in one fullgraph=True graph (torch's
    trace_autograd_ops): flash_ext::fwd and flash_ext::bwd in the same graph."""
    monkeypatch.setattr(torch._dynamo.config, "trace_autograd_ops", True)
    m = AttnLinear()
    x = meta(2, 128, 256)

    def step(m, x):
        loss = _loss(m, x)
        loss.backward()
        return loss.detach()

    rec = Graphs()
    loss = torch.compile(step, fullgraph=True, backend=rec.backend)(m, x)
    assert loss.shape == ()
    assert m.qkv.weight.grad is not None and m.proj.bias.grad is not None
    graphs = rec.fw + rec.bw
    fwd = Graphs.nodes(graphs, torch.ops.flash_ext.fwd)
    assert len(fwd) == 1 and Graphs.arg(fwd[0], "deterministic") is True
    bwd = Graphs.nodes(graphs, torch.ops.flash_ext.bwd)
    assert len(bwd) == 1 and Graphs.arg(bwd[0], "deterministic") is True
