"""Process bodies of the multi-process ring attention tests (tests/test_ring_attention.py over
gloo on CPU, tests/test_ring_attention_gpu.py over NCCL), in a module of their own so that
torch.multiprocessing's spawned children can import them without the test modules."""

import importlib.util
import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
if importlib.util.find_spec("flash_ext") is None:
    sys.path.append(os.path.dirname(_TESTS))  # a source checkout run without installing

import conftest  # noqa: E402,F401  (installs the stand-in op schemas where _C is not built)
import torch  # noqa: E402

# (causal, layout, hq, hkv, window_size, softcap): the cases every multi-process test runs.
CASES = [
    (False, "zigzag", 4, 4, (-1, -1), 0.0),
    (True, "zigzag", 4, 2, (-1, -1), 0.0),
    (True, "contiguous", 4, 1, (-1, -1), 0.0),
    (False, "contiguous", 2, 2, (-1, -1), 0.0),
    (True, "zigzag", 4, 2, (5, -1), 0.0),
    (False, "zigzag", 2, 1, (3, 4), 20.0),
]


def full_inputs(seed, batch, seqlen, hq, hkv, d, dtype, device):
    """The same full-sequence q, k, v and dout on every rank (the generator is seeded)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, seqlen, hq, d, generator=g)
    k = torch.randn(batch, seqlen, hkv, d, generator=g)
    v = torch.randn(batch, seqlen, hkv, d, generator=g)
    dout = torch.randn(batch, seqlen, hq, d, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def _init(rank, world, init_file, backend):
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    return dist


def _run_ring(q, k, v, dout, world, rank, layout, kwargs, backend=None):
    """This rank's ring out, lse, dq, dk, dv for its shard of the full inputs."""
    from flash_ext import distributed as cp
    ql, kl, vl, dl = (cp.shard(t, world, rank, layout).clone() for t in (q, k, v, dout))
    ql.requires_grad_()
    kl.requires_grad_()
    vl.requires_grad_()
    out, lse = cp.ring_flash_attn_func(ql, kl, vl, layout=layout, return_lse=True,
                                       backend=backend, **kwargs)
    out.backward(dl)
    return out.detach(), lse, ql.grad, kl.grad, vl.grad


def gloo_worker(rank, world, init_file):
    """CPU ring over gloo with flash_ext.reference as the per-step attention: equal to the
    emulated ring to the bit, and to the float32 reference on the full sequence."""
    from flash_ext import distributed as cp
    from flash_ext.reference import attention_ref
    dist = _init(rank, world, init_file, "gloo")
    try:
        backend = cp.ReferenceBackend()
        for n, (causal, layout, hq, hkv, window, softcap) in enumerate(CASES):
            kwargs = dict(causal=causal, window_size=window, softcap=softcap)
            q, k, v, dout = full_inputs(n, 2, 2 * world * 5, hq, hkv, 16, torch.float32, "cpu")
            got = _run_ring(q, k, v, dout, world, rank, layout, kwargs, backend)

            sh = [[cp.shard(t, world, r, layout) for r in range(world)] for t in (q, k, v, dout)]
            outs, lses = cp.emulated_ring_forward(*sh[:3], layout=layout, backend=backend,
                                                  **kwargs)
            grads = cp.emulated_ring_backward(sh[3], *sh[:3], outs, lses, layout=layout,
                                              backend=backend, **kwargs)
            emulated = (outs[rank], lses[rank], grads[0][rank], grads[1][rank], grads[2][rank])
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, emulated):
                assert torch.equal(a, b), f"case {n} rank {rank}: {name} differs from the emulation"

            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            ref_out, ref_lse = attention_ref(qr, kr, vr, **kwargs)
            ref_out.backward(dout)
            ref = [cp.shard(ref_out.detach(), world, rank, layout),
                   cp.shard(ref_lse, world, rank, layout, dim=2)]
            ref += [cp.shard(t.grad, world, rank, layout) for t in (qr, kr, vr)]
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
                torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5,
                                           msg=lambda m: f"case {n} rank {rank} {name}: {m}")
        _gloo_varlen(rank, world, backend)
    finally:
        dist.destroy_process_group()


def _varlen_inputs(seed, world, layout, hq, hkv, d, dtype, device, unit_mult=1):
    unit = (2 * world if layout == "zigzag" else world) * unit_mult
    lens = [2 * unit, unit, 0, 3 * unit]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = int(cu[-1])
    q = torch.randn(total, hq, d, generator=g)
    k = torch.randn(total, hkv, d, generator=g)
    v = torch.randn(total, hkv, d, generator=g)
    dout = torch.randn(total, hq, d, generator=g)
    return cu.to(device), [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def _run_varlen_ring(q, k, v, dout, cu, world, rank, layout, kwargs, backend=None):
    from flash_ext import distributed as cp
    ql, kl, vl, dl = (cp.shard_varlen(t, cu, world, rank, layout).clone()
                      for t in (q, k, v, dout))
    for t in (ql, kl, vl):
        t.requires_grad_()
    out, lse = cp.ring_flash_attn_varlen_func(ql, kl, vl, cu // world, layout=layout,
                                              return_lse=True, backend=backend, **kwargs)
    out.backward(dl)
    return out.detach(), lse, ql.grad, kl.grad, vl.grad


def _gloo_varlen(rank, world, backend):
    """The varlen ring over gloo against the varlen reference on the full documents."""
    from flash_ext import distributed as cp
    from flash_ext.reference import attention_ref_varlen
    for n, (causal, layout, hq, hkv, window, softcap) in enumerate(CASES):
        kwargs = dict(causal=causal, window_size=window, softcap=softcap)
        cu, (q, k, v, dout) = _varlen_inputs(n, world, layout, hq, hkv, 8, torch.float32, "cpu")
        got = _run_varlen_ring(q, k, v, dout, cu, world, rank, layout, kwargs, backend)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = attention_ref_varlen(qr, kr, vr, cu, cu, **kwargs)
        ref_out.backward(dout)
        ref = [cp.shard_varlen(ref_out.detach(), cu, world, rank, layout),
               cp.shard_varlen(ref_lse, cu, world, rank, layout, dim=1)]
        ref += [cp.shard_varlen(t.grad, cu, world, rank, layout) for t in (qr, kr, vr)]
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"varlen case {n} rank {rank} {name}: {m}")


def _bound_check(label, got, ref32, flash_full, partials=1):
    """FlashAttention's criterion, for a sum of ring steps: the ring's error against the float32
    reference is at most twice flash_ext's own (on the full sequence) plus one rounding to the
    input dtype per partial result (each step's kernel returns its out / dq / dk / dv share in the
    input dtype before the float32 merge: `partials` = world size) and a small absolute term."""
    err = (got.float() - ref32).abs().max().item()
    own = (flash_full.float() - ref32).abs().max().item()
    rounding = (ref32.to(got.dtype).float() - ref32).abs().max().item()
    bound = 2 * own + partials * rounding + 1e-4 * ref32.abs().max().item() + 1e-5
    assert err <= bound, f"{label}: max err {err:.3e} > bound {bound:.3e} (flash_ext {own:.3e})"


def nccl_worker(rank, world, init_file, seqlen, dtype_name):
    """NCCL ring with flash_ext's kernels on GPU ``rank``: forward equal to the emulated ring
    (same kernels, same merge order) to the bit; out and grads within FlashAttention's error
    criterion of the float32 reference, relative to flash_ext's one-GPU error."""
    import flash_ext
    from flash_ext import distributed as cp
    from flash_ext.reference import attention_ref
    torch.cuda.set_device(rank)
    dist = _init(rank, world, init_file, "nccl")
    dtype = getattr(torch, dtype_name)
    try:
        for n, (causal, layout, hq, hkv, window, softcap) in enumerate(CASES):
            kwargs = dict(causal=causal, window_size=window, softcap=softcap)
            q, k, v, dout = full_inputs(n, 2, seqlen, hq, hkv, 64, dtype, "cuda")
            got = _run_ring(q, k, v, dout, world, rank, layout, kwargs)

            with torch.no_grad():
                sh = [[cp.shard(t, world, r, layout).contiguous() for r in range(world)]
                      for t in (q, k, v)]
                outs, lses = cp.emulated_ring_forward(*sh, layout=layout, **kwargs)
            assert torch.equal(got[0], outs[rank]), f"case {n}: out differs from the emulation"
            assert torch.equal(got[1], lses[rank]), f"case {n}: lse differs from the emulation"

            qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
            f_out, f_lse = flash_ext.attn_fwd(qf, kf, vf, **kwargs)
            f_out.backward(dout)
            qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
            r_out, r_lse = attention_ref(qr, kr, vr, **kwargs)
            r_out.backward(dout.float())

            def mine(t, dim=1):
                return cp.shard(t, world, rank, layout, dim)
            _bound_check(f"case {n} rank {rank} out", got[0], mine(r_out.detach()),
                         mine(f_out.detach()), partials=world)
            torch.testing.assert_close(got[1], mine(f_lse, 2), atol=1e-3, rtol=1e-3)
            for name, g, r, f in zip(("dq", "dk", "dv"), got[2:], (qr, kr, vr), (qf, kf, vf)):
                _bound_check(f"case {n} rank {rank} {name}", g, mine(r.grad), mine(f.grad), partials=world)
        _nccl_varlen(rank, world, dtype)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _nccl_varlen(rank, world, dtype):
    """The varlen NCCL ring against flash_ext's varlen attention on the full documents."""
    import flash_ext
    from flash_ext import distributed as cp
    from flash_ext.reference import attention_ref_varlen
    for n, (causal, layout, hq, hkv, window, softcap) in enumerate(CASES):
        kwargs = dict(causal=causal, window_size=window, softcap=softcap)
        cu, (q, k, v, dout) = _varlen_inputs(n, world, layout, hq, hkv, 64, dtype, "cuda",
                                             unit_mult=64)
        got = _run_varlen_ring(q, k, v, dout, cu, world, rank, layout, kwargs)
        mx = int((cu[1:] - cu[:-1]).max())
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        f_out, _ = flash_ext.attn_fwd(qf, kf, vf, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      max_seqlen_q=mx, max_seqlen_k=mx, **kwargs)
        f_out.backward(dout)
        qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
        r_out, r_lse = attention_ref_varlen(qr, kr, vr, cu, cu, **kwargs)
        r_out.backward(dout.float())

        def mine(t, dim=0):
            return cp.shard_varlen(t, cu, world, rank, layout, dim)
        _bound_check(f"varlen case {n} rank {rank} out", got[0], mine(r_out.detach()),
                     mine(f_out.detach()), partials=world)
        torch.testing.assert_close(got[1], mine(r_lse, 1), atol=1e-3, rtol=1e-3)
        for name, g, r, f in zip(("dq", "dk", "dv"), got[2:], (qr, kr, vr), (qf, kf, vf)):
            _bound_check(f"varlen case {n} rank {rank} {name}", g, mine(r.grad), mine(f.grad), partials=world)
