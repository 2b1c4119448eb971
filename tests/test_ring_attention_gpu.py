"""Context parallelism with flash_ext's kernels (GPU): the ring emulated on one GPU against
flash_ext on the full sequence, and the real ring over NCCL in one process per GPU (2 or more
GPUs). The arithmetic itself is tested on the CPU in tests/test_ring_attention.py.

Criterion (as tests/test_bwd_gpu.py): the ring's max error against the float32 reference is
at most twice flash_ext's own error on the full sequence, plus the error of rounding the
reference to the dtype and a small absolute term."""

import os
import tempfile

import pytest
import torch

from conftest import requires_cuda
from flash_ext import distributed as cp

import ring_workers


def _full(world, layout, causal, hq, hkv, d, dtype, window=(-1, -1), softcap=0.0, chunk=96):
    import flash_ext
    from flash_ext.reference import attention_ref
    n = 2 * world * chunk
    q, k, v, dout = ring_workers.full_inputs(world * 10 + hkv, 2, n, hq, hkv, d, dtype, "cuda")
    kw = dict(causal=causal, window_size=window, softcap=softcap)

    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    f_out, _ = flash_ext.attn_fwd(qf, kf, vf, **kw)
    f_out.backward(dout)
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    r_out, r_lse = attention_ref(qr, kr, vr, **kw)
    r_out.backward(dout.float())

    def sh(t):
        return [cp.shard(t, world, r, layout) for r in range(world)]
    with torch.no_grad():
        outs, lses = cp.emulated_ring_forward(sh(q), sh(k), sh(v), layout=layout, **kw)
        dqs, dks, dvs = cp.emulated_ring_backward(sh(dout), sh(q), sh(k), sh(v), outs, lses,
                                                  layout=layout, **kw)
    got = [cp.gather(outs, layout), cp.gather(dqs, layout), cp.gather(dks, layout),
           cp.gather(dvs, layout)]
    for name, g, r, f in zip(("out", "dq", "dk", "dv"), got, (r_out, qr.grad, kr.grad, vr.grad),
                             (f_out, qf.grad, kf.grad, vf.grad)):
        ring_workers._bound_check(f"{name} world={world} {layout} causal={causal}", g,
                                  r.detach(), f.detach(), partials=world)
    torch.testing.assert_close(cp.gather(lses, layout, dim=2), r_lse, atol=1e-3, rtol=1e-3)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 128), (8, 2, 64)])
def test_emulated_ring_with_kernels(dtype, world, layout, causal, hq, hkv, d):
    _full(world, layout, causal, hq, hkv, d, dtype)


@requires_cuda
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal,window,softcap", [(True, (100, -1), 0.0),
                                                   (False, (40, 70), 0.0),
                                                   (True, (-1, -1), 30.0)])
@pytest.mark.parametrize("d", [96, 256])
def test_emulated_ring_with_kernels_window_softcap(world, causal, window, softcap, d):
    _full(world, "zigzag", causal, 4, 2, d, torch.bfloat16, window, softcap)


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs 2 or more GPUs ({torch.cuda.device_count()} found)")
@pytest.mark.skipif(not torch.distributed.is_available() or
                    not torch.distributed.is_nccl_available(),
                    reason="torch.distributed with NCCL is not available")
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_ring_over_nccl(dtype_name):
    """One process per GPU (up to 4): each rank's out, lse, dq, dk, dv against flash_ext on the
    full sequence; the forward equal to the emulated ring to the bit."""
    import torch.multiprocessing as mp
    world = min(torch.cuda.device_count(), 4)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(ring_workers.nccl_worker,
                 args=(world, os.path.join(tmp, "init"), 2 * world * 512, dtype_name),
                 nprocs=world, join=True)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (90, -1))])
def test_emulated_varlen_ring_with_kernels(dtype, world, layout, causal, window):
    """Packed documents (one of them empty): the emulated varlen ring with the kernels against
    flash_ext's varlen attention on the full documents."""
    import flash_ext
    from flash_ext.reference import attention_ref_varlen
    kw = dict(causal=causal, window_size=window)
    cu, (q, k, v, dout) = ring_workers._varlen_inputs(world, world, layout, 8, 2, 128, dtype,
                                                       "cuda", unit_mult=40)
    mx = int((cu[1:] - cu[:-1]).max())
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    f_out, _ = flash_ext.attn_fwd(qf, kf, vf, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx,
                                  max_seqlen_k=mx, **kw)
    f_out.backward(dout)
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    r_out, r_lse = attention_ref_varlen(qr, kr, vr, cu, cu, **kw)
    r_out.backward(dout.float())

    def sh(t):
        return [cp.shard_varlen(t, cu, world, r, layout) for r in range(world)]
    with torch.no_grad():
        outs, lses = cp.emulated_ring_forward(sh(q), sh(k), sh(v), layout=layout,
                                              cu_seqlens=cu // world, **kw)
        grads = cp.emulated_ring_backward(sh(dout), sh(q), sh(k), sh(v), outs, lses,
                                          layout=layout, cu_seqlens=cu // world, **kw)
    got = [outs] + list(grads)
    for name, g, r, f in zip(("out", "dq", "dk", "dv"), got, (r_out, qr.grad, kr.grad, vr.grad),
                             (f_out, qf.grad, kf.grad, vf.grad)):
        ring_workers._bound_check(f"varlen {name} world={world} {layout} causal={causal}",
                                  cp.gather_varlen(g, cu, layout), r.detach(), f.detach(), partials=world)
    torch.testing.assert_close(cp.gather_varlen(lses, cu, layout, dim=1), r_lse, atol=1e-3,
                               rtol=1e-3)
