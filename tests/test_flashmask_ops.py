"""FlashMask at the op level, CPU only: the trailing ``startend_row_indices`` argument of fwd,
fwd_out and bwd, the flashmask_summary testing op's schema and fake shapes, and the autograd
formula handing the forward's bounds to bwd. (The kernels: tests/test_flashmask_ops_gpu.py.)"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flash_ext  # noqa: F401  (registers the fake kernels)




@pytest.mark.parametrize("name", ["fwd", "fwd_out", "bwd"])
def test_attention_ops_take_bounds_after_their_old_arguments(name):
    """startend_row_indices follows each op's earlier arguments (positional for the Python
    layer), optional and None by default; later optional tensors (seqused_k) come after it."""
    args = getattr(torch.ops.flash_ext, name).default._schema.arguments
    names = [a.name for a in args]
    i = names.index("startend_row_indices")
    assert names[i - 1] == {"fwd": "deterministic", "fwd_out": "rng_state", "bwd": "rng_state"}[name]
    assert str(args[i].type) == "Optional[Tensor]" and args[i].default_value is None
    assert args[i].kwarg_only is False


def test_flashmask_summary_schema():
    schema = str(torch.ops.flash_ext.flashmask_summary.default._schema)
    assert schema == ("flash_ext::flashmask_summary(Tensor startend_row_indices, int seqlen_q, "
                      "int seqlen_k, Tensor? cu_seqlens_k, bool causal, int block_n) "
                      "-> (Tensor nb, Tensor kbs)"), schema


@pytest.mark.parametrize("block_n", [32, 64, 128])
def test_fake_flashmask_summary_shapes(fake_mode, block_n):
    with fake_mode:
        bounds = torch.empty(3, 2, 300, 4, dtype=torch.int32, device="cuda")
        nb, kbs = torch.ops.flash_ext.flashmask_summary(bounds, 250, 300, None, False, block_n)
    # sk_pad = 384: 3 * 384 columns, 3 * 384 / block_n blocks
    assert nb.shape == (2, 3 * 384, 4) and nb.dtype == torch.int32 and nb.device.type == "cuda"
    assert kbs.shape == (2, 3 * 384 // block_n, 2, 4) and kbs.dtype == torch.int32


@pytest.mark.parametrize("block_n", [32, 64, 128])
def test_fake_flashmask_summary_varlen_shapes(fake_mode, block_n):
    with fake_mode:
        bounds = torch.empty(1, 1000, 2, dtype=torch.int32, device="cuda")
        cu = torch.empty(5, dtype=torch.int32, device="cuda")  # batch 4
        nb, kbs = torch.ops.flash_ext.flashmask_summary(bounds, 400, 600, cu, True, block_n)
    assert nb.shape == (1, 1000 + 128 * 4, 4) and nb.dtype == torch.int32
    assert kbs.shape == (1, 1000 // block_n + 4 + 1, 2, 4) and kbs.dtype == torch.int32


def test_fake_ops_with_bounds(fake_mode):
    with fake_mode:
        q = torch.randn(2, 64, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(2, 96, 2, 64, dtype=torch.bfloat16, device="cuda")
        bounds = torch.empty(2, 2, 96, 2, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.flash_ext.fwd(q, k, k, None, None, 0, 0, 0.125, True, -1, 0, 0.0,
                                           startend_row_indices=bounds)
        lse2 = torch.ops.flash_ext.fwd_out(q, k, k, torch.empty_like(q), None, None, 0, 0, 0.125,
                                           True, -1, 0, 0.0, 0.0, None, bounds)
        dq, dk, dv = torch.ops.flash_ext.bwd(out, q, k, k, out, lse, None, None, 0, 0, 0.125,
                                             True, -1, 0, 0.0, False, 0.0, None, bounds)
    assert out.shape == q.shape and lse.shape == (2, 8, 64) and lse2.shape == (2, 8, 64)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


class _RecordBwd(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bwd_calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.flash_ext.bwd.default:
            self.bwd_calls.append((args, kwargs))
        return func(*args, **kwargs)


def test_autograd_passes_bounds_to_bwd():
    """The formula of fwd (csrc/ops_autograd.cpp with the build, tests/stand_in_ops.py without)
    calls bwd with the forward's bounds (meta tensors: the engine runs, the kernels are fakes)."""
    q = torch.empty(2, 64, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    bounds = torch.empty(2, 1, 64, 1, dtype=torch.int32, device="meta")
    out, lse = torch.ops.flash_ext.fwd(q, q, q, None, None, 0, 0, 0.125, True, -1, 0, 0.0, 0.0,
                                       None, False, bounds)
    rec = _RecordBwd()
    with rec:
        out.float().sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    assert len(rec.bwd_calls) == 1
    args, kwargs = rec.bwd_calls[0]
    passed = kwargs.get("startend_row_indices", args[18] if len(args) > 18 else None)
    assert passed is not None and passed.shape == bounds.shape and passed.dtype == torch.int32


def test_autograd_without_bounds_passes_none():
    q = torch.empty(2, 64, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out, _ = torch.ops.flash_ext.fwd(q, q, q, None, None, 0, 0, 0.125, True, -1, 0, 0.0)
    rec = _RecordBwd()
    with rec:
        out.float().sum().backward()
    args, kwargs = rec.bwd_calls[0]
    assert kwargs.get("startend_row_indices", args[18] if len(args) > 18 else None) is None
