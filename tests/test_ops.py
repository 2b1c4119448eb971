"""The registered ops, their fake kernels and torch.compile tracing (CPU only).

No GPU needed: FakeTensorMode makes tensors with device='cuda' that carry shapes, dtypes and
strides but no data, so fake kernels and Dynamo tracing run on a CPU-only machine. The real
kernels are exercised in test_fwd_gpu.py. The backward's plumbing is tested in test_autograd.py."""

import pytest
import torch

import flash_ext

from conftest import requires_ext


def test_ops_registered():
    for name in ("fwd", "fwd_out", "build_info"):
        assert hasattr(torch.ops.flash_ext, name), f"torch.ops.flash_ext.{name} is not registered"
    schema = str(torch.ops.flash_ext.fwd.default._schema)
    for arg in ("Tensor q", "Tensor? cu_seqlens_q", "int max_seqlen_q", "float softmax_scale",
                "bool causal", "int window_left", "int window_right", "float softcap",
                "bool deterministic=False"):
        assert arg in schema, schema
    schema_out = str(torch.ops.flash_ext.fwd_out.default._schema)
    assert "Tensor(a!) out" in schema_out, schema_out


@requires_ext
def test_build_info_is_a_string():
    info = torch.ops.flash_ext.build_info()
    assert isinstance(info, str) and info
    assert flash_ext.build_info() == info
    for key in ("archs=", "hdims=", "dtypes="):
        assert key in info, info


def test_version():
    assert flash_ext.__version__ == "0.1.0"
    assert flash_ext.reference.attention_ref is not None


def _fake_qkv(mode, b=2, sq=64, sk=96, hq=8, hkv=2, d=64, dtype=torch.bfloat16):
    with mode:
        q = torch.randn(b, sq, hq, d, dtype=dtype, device="cuda")
        k = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
        v = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
    return q, k, v


def test_fake_fwd_shapes(fake_mode):
    q, k, v = _fake_qkv(fake_mode)
    with fake_mode:
        out, lse = torch.ops.flash_ext.fwd(q, k, v, None, None, 0, 0, 0.125, True, -1, 0, 0.0)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert out.is_contiguous()
    assert lse.shape == (2, 8, 64) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_fake_fwd_varlen_shapes(fake_mode):
    with fake_mode:
        q = torch.randn(300, 8, 128, dtype=torch.float16, device="cuda")
        k = torch.randn(500, 1, 128, dtype=torch.float16, device="cuda")
        cu = torch.zeros(4, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.flash_ext.fwd(q, k, k, cu, cu, 200, 300, 0.1, False, -1, -1, 0.0)
    assert out.shape == (300, 8, 128) and out.dtype == torch.float16
    assert lse.shape == (8, 300) and lse.dtype == torch.float32


def test_fake_fwd_out_shapes(fake_mode):
    q, k, v = _fake_qkv(fake_mode)
    with fake_mode:
        out = torch.empty_like(q)
        lse = torch.ops.flash_ext.fwd_out(q, k, v, out, None, None, 0, 0, 0.125, False, -1, -1, 0.0)
    assert lse.shape == (2, 8, 64) and lse.dtype == torch.float32


def test_fake_output_is_contiguous_for_strided_q(fake_mode):
    with fake_mode:
        qkv = torch.randn(2, 32, 3, 4, 64, dtype=torch.float16, device="cuda")
        q, k, v = qkv.unbind(2)
        out, lse = torch.ops.flash_ext.fwd(q, k, v, None, None, 0, 0, 0.125, False, -1, -1, 0.0)
    assert out.shape == q.shape and out.is_contiguous()


@pytest.mark.parametrize("d", [59, 64, 111, 256])
def test_attn_fwd_under_fake_mode(fake_mode, d):
    """attn_fwd's Python path (padding, slicing, out=) with fake CUDA tensors."""
    q, k, v = _fake_qkv(fake_mode, d=d)
    with fake_mode:
        out, lse = flash_ext.attn_fwd(q, k, v, causal=True)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (2, 8, 64) and lse.dtype == torch.float32
        buf = torch.empty(2, 70, 8, d, dtype=q.dtype, device="cuda")
        dst = buf[:, 3:67]
        o2, lse2 = flash_ext.attn_fwd(q, k, v, out=dst)
        assert o2 is dst and lse2.shape == (2, 8, 64)


def test_attn_fwd_varlen_under_fake_mode(fake_mode):
    with fake_mode:
        q = torch.randn(100, 4, 40, dtype=torch.float16, device="cuda")
        k = torch.randn(120, 2, 40, dtype=torch.float16, device="cuda")
        cq = torch.tensor([0, 30, 100], dtype=torch.int32, device="cuda")
        ck = torch.tensor([0, 60, 120], dtype=torch.int32, device="cuda")
        out, lse = flash_ext.attn_fwd(q, k, k, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=70,
                                      max_seqlen_k=60)
    assert out.shape == (100, 4, 40) and lse.shape == (4, 100)


def test_outputs_track_gradients(fake_mode):
    """With inputs requiring grad, the op's outputs have a grad_fn (the registered autograd
    formula) rather than being silently detached."""
    q, k, v = _fake_qkv(fake_mode)
    with fake_mode:
        q.requires_grad_(True)
        out, lse = flash_ext.attn_fwd(q, k, v)
    assert out.requires_grad and out.grad_fn is not None


# ---------------------------------------------------------------------------------------------
# torch.compile: Dynamo must trace attn_fwd and flash_attn_func into one graph (fullgraph=True)
# ---------------------------------------------------------------------------------------------


class Attn(torch.nn.Module):
    def forward(self, q, k, v):
        o1, lse = flash_ext.attn_fwd(q, k, v, causal=True, window_size=(32, -1))
        o2 = flash_ext.flash_attn_func(q, k, v, softcap=20.0)
        o3 = flash_ext.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2))
        return o1 + o2 + o3, lse


class Recorder:
    """A Dynamo backend that keeps the FX graphs it receives and runs them eagerly."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [n.target for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]

    def count_fwd(self):
        fwd = torch.ops.flash_ext.fwd
        return sum(1 for t in self.targets() if t is fwd or t is fwd.default)


@pytest.mark.parametrize("d", [64, 60])
def test_compile_fullgraph(fake_mode, d):
    q, k, v = _fake_qkv(fake_mode, d=d)
    rec = Recorder()
    fn = torch.compile(Attn(), fullgraph=True, backend=rec)
    with fake_mode:
        out, lse = fn(q, k, v)
    assert out.shape == q.shape and lse.shape == (2, 8, 64)
    assert len(rec.graphs) == 1
    assert rec.count_fwd() == 3, rec.targets()


def test_compile_aot_eager(fake_mode):
    q, k, v = _fake_qkv(fake_mode)
    fn = torch.compile(Attn(), fullgraph=True, backend="aot_eager")
    with fake_mode:
        out, lse = fn(q, k, v)
    assert out.shape == q.shape


def test_compile_varlen_fullgraph(fake_mode):
    rec = Recorder()

    @torch.compile(fullgraph=True, backend=rec)
    def f(q, k, v, cq, ck):
        return flash_ext.flash_attn_varlen_func(q, k, v, cq, ck, 64, 80, causal=True,
                                                return_attn_probs=True)

    with fake_mode:
        q = torch.randn(100, 4, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(120, 4, 64, dtype=torch.bfloat16, device="cuda")
        cq = torch.tensor([0, 36, 100], dtype=torch.int32, device="cuda")
        ck = torch.tensor([0, 40, 120], dtype=torch.int32, device="cuda")
        out, lse, probs = f(q, k, k, cq, ck)
    assert out.shape == (100, 4, 64) and lse.shape == (4, 100) and probs is None
    assert rec.count_fwd() == 1, rec.targets()


def test_explain_no_graph_breaks(fake_mode):
    q, k, v = _fake_qkv(fake_mode)
    explanation = torch._dynamo.explain(Attn())(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compile_fullgraph_detects_graph_breaks(fake_mode):
    """Control: the fullgraph check above can fail."""
    q, k, v = _fake_qkv(fake_mode)

    def broken(q, k, v):
        out, _ = flash_ext.attn_fwd(q, k, v)
        torch._dynamo.graph_break()
        return out

    fn = torch.compile(broken, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="(?i)graph.break"):
        with fake_mode:
            fn(q, k, v)
