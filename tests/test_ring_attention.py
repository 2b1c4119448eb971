"""Context parallelism (flash_ext.distributed) on the CPU: the layouts, the per-step plans, the
log-sum-exp merge, the ring emulated in one process with flash_ext.reference as the per-step
attention against the float32 reference on the full sequence (forward and backward), and the
real ring over torch.distributed (gloo, several processes). GPU versions:
tests/test_ring_attention_gpu.py."""

import itertools
import os
import tempfile

import pytest
import torch

from flash_ext import distributed as cp
from flash_ext.distributed import ReferenceBackend
from flash_ext.errors import FlashExtValueError
from flash_ext.reference import attention_ref, local_mask


# ----------------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------------

def test_zigzag_chunks():
    x = torch.arange(8).view(1, 8)
    assert cp.zigzag_shard(x, 2, 0).tolist() == [[0, 1, 6, 7]]
    assert cp.zigzag_shard(x, 2, 1).tolist() == [[2, 3, 4, 5]]
    assert cp.zigzag_shard(torch.arange(12), 3, 1, dim=0).tolist() == [2, 3, 8, 9]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("dim", [1, 2])
def test_shard_gather_round_trip(world, layout, dim):
    x = torch.randn(2, 24, 24, 3)
    shards = [cp.shard(x, world, r, layout, dim) for r in range(world)]
    assert all(s.shape[dim] == 24 // world for s in shards)
    assert torch.equal(cp.gather(shards, layout, dim), x)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_segments_describe_the_shard(world, layout):
    """shard_segments (what the ring's masks are computed from) lists the global positions
    that shard() puts on the rank, in local order."""
    pos = torch.arange(2 * world * 3)
    for r in range(world):
        local = cp.shard(pos, world, r, layout, dim=0)
        segs = cp.shard_segments(layout, local.numel(), world, r)
        assert torch.cat([torch.arange(s, s + n) for s, n in segs]).tolist() == local.tolist()


def test_layout_errors():
    with pytest.raises(FlashExtValueError, match="multiple of 4"):
        cp.zigzag_shard(torch.zeros(1, 6), 2, 0)
    with pytest.raises(FlashExtValueError, match="multiple of 4"):
        cp.contiguous_shard(torch.zeros(1, 6), 4, 0)
    with pytest.raises(FlashExtValueError, match="rank"):
        cp.zigzag_shard(torch.zeros(1, 8), 2, 2)
    with pytest.raises(FlashExtValueError, match="layout"):
        cp.shard(torch.zeros(1, 8), 2, 0, "striped")
    with pytest.raises(FlashExtValueError, match="even"):
        cp.shard_segments("zigzag", 5, 2, 0)


# ----------------------------------------------------------------------------------------------
# Step plans
# ----------------------------------------------------------------------------------------------

def _global_mask(pos_q, pos_k, causal, window):
    wl, wr = window
    if causal:
        wr = 0
    diff = pos_k[None, :] - pos_q[:, None]
    vis = torch.ones(diff.shape, dtype=torch.bool)
    if wl >= 0:
        vis &= diff >= -wl
    if wr >= 0:
        vis &= diff <= wr
    return vis


def _calls_mask(calls, sq, sk):
    """The (query, key) pairs the calls compute, with the kernels' mask; asserts that no pair
    is in two calls."""
    got = torch.zeros(sq, sk, dtype=torch.int64)
    for c in calls:
        m = local_mask(c.q_end - c.q_start, c.k_end - c.k_start,
                       (c.window_left, c.window_right))
        got[c.q_start:c.q_end, c.k_start:c.k_end] += m.long()
    assert got.max() <= 1, "a (query, key) pair is in two calls"
    return got.bool()


WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (2, 5), (7, 1), (20, 20)]


def test_plan_block_matches_the_global_mask():
    """Every block position, size and window: the trimmed call's kernel mask is the full
    sequence's mask restricted to the block, and the call has no row or column that sees
    nothing."""
    for q_pos, k_pos, sq, sk in itertools.product(range(0, 13, 3), range(0, 13, 4), (1, 4, 6),
                                                  (1, 3, 6)):
        for causal, window in itertools.product((False, True), WINDOWS):
            want = _global_mask(torch.arange(q_pos, q_pos + sq), torch.arange(k_pos, k_pos + sk),
                                causal, window)
            c = cp.plan_block(q_pos, sq, k_pos, sk, causal, window)
            if c is None:
                assert not want.any()
                continue
            got = _calls_mask([c], sq, sk)
            assert torch.equal(got, want), (q_pos, sq, k_pos, sk, causal, window, c)
            assert got[c.q_start:c.q_end].any(1).all() and got[:, c.k_start:c.k_end].any(0).all()
            assert c.window_left >= -1 and c.window_right >= -1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, -1)),
                                           (False, (-1, 1)),
                                           (False, (3, 9))])
def test_step_plans_cover_the_mask(world, layout, causal, window):
    """Over all steps, a rank's calls compute exactly its rows of the full mask, each pair
    once."""
    local = 2 * 4
    n = local * world
    pos = torch.arange(n)
    want_full = _global_mask(pos, pos, causal, window)
    for r in range(world):
        plans = cp.step_plans(layout, local, world, r, causal, window)
        q_pos = cp.shard(pos, world, r, layout, dim=0)
        for i, calls in enumerate(plans):
            k_pos = cp.shard(pos, world, (r - i) % world, layout, dim=0)
            want = want_full[q_pos][:, k_pos]
            assert torch.equal(_calls_mask(calls, local, local), want), (r, i, calls)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_causal_is_balanced(world):
    """Zigzag + causal: the diagonal step is one causal call on the whole shard; every other
    step one unmasked call of c x 2c or 2c x c (c = half the shard) on every rank."""
    local = 2 * 8
    c = local // 2
    for r in range(world):
        plans = cp.step_plans("zigzag", local, world, r, True, (-1, -1))
        assert plans[0] == [cp.BlockCall(0, local, 0, local, -1, 0)]
        for i in range(1, world):
            src = (r - i) % world
            want = (cp.BlockCall(0, local, 0, c) if src < r else cp.BlockCall(c, local, 0, local))
            assert plans[i] == [want], (r, i, plans[i])


def test_contiguous_causal_skips_later_shards():
    plans = cp.step_plans("contiguous", 6, 3, 1, True, (-1, -1))
    assert plans == [[cp.BlockCall(0, 6, 0, 6, -1, 0)], [cp.BlockCall(0, 6, 0, 6)], []]


# ----------------------------------------------------------------------------------------------
# Merge
# ----------------------------------------------------------------------------------------------

def test_merge_equals_attention_over_all_keys(seed):
    q, k, v = torch.randn(2, 5, 3, 8), torch.randn(2, 12, 3, 8), torch.randn(2, 12, 3, 8)
    full_out, full_lse = attention_ref(q, k, v)
    parts = [attention_ref(q, k[:, a:b], v[:, a:b]) for a, b in ((0, 3), (3, 4), (4, 12))]
    out, lse = cp.merge_partials([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(out, full_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-5)


def test_merge_handles_rows_that_saw_nothing(seed):
    o1, o2 = torch.randn(1, 3, 2, 4), torch.zeros(1, 3, 2, 4)
    l1 = torch.tensor([[[0.5, float("-inf"), 2.0], [float("-inf")] * 3]])
    l2 = torch.full_like(l1, float("-inf"))
    out, lse = cp.merge_partials([o1, o2], [l1, l2])
    assert not out.isnan().any() and not lse.isnan().any()
    # One side empty: the other side unchanged; both empty: out 0, lse -inf.
    seen = ~torch.isneginf(l1)
    assert torch.equal(lse[seen], l1[seen])
    assert torch.isneginf(lse[~seen]).all()
    rows = seen.transpose(1, 2).unsqueeze(-1).expand_as(o1)
    torch.testing.assert_close(out[rows], o1[rows])
    assert (out[~rows] == 0).all()
    # Large lse values (no overflow: weights are taken relative to the max).
    out, lse = cp.merge_partials([o1, o1], [l1 + 1e4, l1 + 1e4])
    torch.testing.assert_close(lse[seen], l1[seen] + 1e4 + torch.log(torch.tensor(2.0)))
    torch.testing.assert_close(out[rows], o1[rows])


# ----------------------------------------------------------------------------------------------
# Emulated ring vs the full-sequence reference
# ----------------------------------------------------------------------------------------------

def _emulate_and_compare(world, layout, causal, hq, hkv, window=(-1, -1), softcap=0.0,
                         softmax_scale=None, chunk=3, batch=2, d=16):
    torch.manual_seed(world * 100 + hkv)
    n = 2 * world * chunk
    q, k, v = torch.randn(batch, n, hq, d), torch.randn(batch, n, hkv, d), \
        torch.randn(batch, n, hkv, d)
    dout = torch.randn(batch, n, hq, d)
    kw = dict(causal=causal, window_size=window, softcap=softcap, softmax_scale=softmax_scale)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = attention_ref(qr, kr, vr, **kw)
    ref_out.backward(dout)

    def sh(t):
        return [cp.shard(t, world, r, layout) for r in range(world)]
    backend = ReferenceBackend()
    outs, lses = cp.emulated_ring_forward(sh(q), sh(k), sh(v), layout=layout, backend=backend,
                                          **kw)
    dqs, dks, dvs = cp.emulated_ring_backward(sh(dout), sh(q), sh(k), sh(v), outs, lses,
                                              layout=layout, backend=backend, **kw)
    tol = dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cp.gather(outs, layout), ref_out.detach(), **tol)
    torch.testing.assert_close(cp.gather(lses, layout, dim=2), ref_lse, **tol)
    torch.testing.assert_close(cp.gather(dqs, layout), qr.grad, **tol)
    torch.testing.assert_close(cp.gather(dks, layout), kr.grad, **tol)
    torch.testing.assert_close(cp.gather(dvs, layout), vr.grad, **tol)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_emulated_ring_matches_full_attention(world, layout, causal, hq, hkv):
    _emulate_and_compare(world, layout, causal, hq, hkv)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal,window,softcap,scale", [
    (True, (4, -1), 0.0, None), (False, (2, 7), 0.0, None), (False, (0, 0), 0.0, None),
    (False, (-1, 3), 15.0, 0.3), (True, (-1, -1), 5.0, None)])
def test_emulated_ring_windows_softcap_scale(world, layout, causal, window, softcap, scale):
    _emulate_and_compare(world, layout, causal, 4, 2, window, softcap, scale)


def test_emulated_ring_rows_that_see_nothing_stay_finite():
    """A window of (0, 0): each row sees only itself, so most steps have nothing for most rows
    and the merge meets -inf lse everywhere off the diagonal."""
    _emulate_and_compare(4, "zigzag", False, 2, 2, window=(0, 0), chunk=2)


# ----------------------------------------------------------------------------------------------
# The ring over torch.distributed (gloo, CPU processes)
# ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.distributed.is_available() or not
                    torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.parametrize("world", [2, 3])
def test_ring_over_gloo_matches_emulation_and_reference(world):
    """ring_flash_attn_func in ``world`` processes (gloo, reference attention): out, lse, dq,
    dk, dv equal to the emulated ring to the bit and to the full-sequence reference."""
    import torch.multiprocessing as mp
    import ring_workers
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(ring_workers.gloo_worker, args=(world, os.path.join(tmp, "init")),
                 nprocs=world, join=True)


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------

def test_ring_argument_errors():
    q = torch.zeros(1, 6, 4, 8)
    emulate = cp.emulated_ring_forward
    with pytest.raises(FlashExtValueError, match="layout"):
        emulate([q], [q], [q], layout="striped", backend=ReferenceBackend())
    with pytest.raises(FlashExtValueError, match="even"):
        emulate([q[:, :5]], [q[:, :5]], [q[:, :5]], backend=ReferenceBackend())
    with pytest.raises(FlashExtValueError, match="multiple"):
        emulate([q], [q[:, :, :3]], [q[:, :, :3]], backend=ReferenceBackend())
    with pytest.raises(FlashExtValueError, match="local sequence length"):
        emulate([q], [q[:, :4]], [q[:, :4]], backend=ReferenceBackend())
    with pytest.raises(FlashExtValueError, match="4-D"):
        emulate([q[0]], [q], [q], backend=ReferenceBackend())
    with pytest.raises(ValueError):
        emulate([q], [q], [q], window_size=(-2, 0), backend=ReferenceBackend())
    with pytest.raises(FlashExtValueError, match="one q, k and v shard"):
        emulate([q, q], [q], [q], backend=ReferenceBackend())


# ----------------------------------------------------------------------------------------------
# torch.compile around the ring
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def single_rank_group():
    """A one-process gloo group (the ring with world = 1: no communication)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}",
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_compile_breaks_the_graph_at_the_ring(single_rank_group):
    """torch.compile of a block that calls the ring: the ring runs eagerly (one graph break),
    the result and the gradients equal the eager ones."""
    backend = ReferenceBackend()

    def block(x, w):
        h = torch.tanh(x @ w).view(1, 8, 2, 4)
        out = cp.ring_flash_attn_func(h, h, h, causal=True, backend=backend)
        return (out.flatten(2) @ w.T).square().sum()

    torch.manual_seed(0)
    x, w = torch.randn(1, 8, 8), torch.randn(8, 8, requires_grad=True)
    eager = block(x, w)
    (g_eager,) = torch.autograd.grad(eager, w)
    explain = torch._dynamo.explain(block)(x, w)
    assert explain.graph_break_count >= 1
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager")(x, w)
    (g_compiled,) = torch.autograd.grad(compiled, w)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(g_compiled, g_eager)


# ----------------------------------------------------------------------------------------------
# Packed documents (varlen)
# ----------------------------------------------------------------------------------------------

def _doc_lengths(world, layout):
    unit = 2 * world if layout == "zigzag" else world
    return [2 * unit, unit, 0, 3 * unit, unit]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_varlen_shard_gather_round_trip(world, layout):
    lens = _doc_lengths(world, layout)
    cu = torch.tensor([0] + lens).cumsum(0)
    x = torch.randn(int(cu[-1]), 3, 2)
    shards = [cp.shard_varlen(x, cu, world, r, layout) for r in range(world)]
    assert all(s.shape[0] == int(cu[-1]) // world for s in shards)
    # Each document's shard is its own shard().
    r = world - 1
    off = 0
    for a, n in zip(cu.tolist(), lens):
        torch.testing.assert_close(shards[r][off:off + n // world],
                                   cp.shard(x[a:a + n], world, r, layout, dim=0))
        off += n // world
    assert torch.equal(cp.gather_varlen(shards, cu, layout), x)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (3, -1), 0.0), (False, (2, 5), 8.0)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_emulated_varlen_ring_matches_full_attention(world, layout, causal, window, softcap,
                                                     hq, hkv):
    from flash_ext.reference import attention_ref_varlen
    torch.manual_seed(world)
    lens = _doc_lengths(world, layout)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    total, d = int(cu[-1]), 8
    q, k, v = torch.randn(total, hq, d), torch.randn(total, hkv, d), torch.randn(total, hkv, d)
    dout = torch.randn(total, hq, d)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = attention_ref_varlen(qr, kr, vr, cu, cu, **kw)
    ref_out.backward(dout)

    def sh(t):
        return [cp.shard_varlen(t, cu, world, r, layout) for r in range(world)]
    backend = ReferenceBackend()
    local_cu = cu // world
    outs, lses = cp.emulated_ring_forward(sh(q), sh(k), sh(v), layout=layout, cu_seqlens=local_cu,
                                          backend=backend, **kw)
    dqs, dks, dvs = cp.emulated_ring_backward(sh(dout), sh(q), sh(k), sh(v), outs, lses,
                                              layout=layout, cu_seqlens=local_cu,
                                              backend=backend, **kw)
    tol = dict(atol=2e-5, rtol=2e-5)

    def full(shards, dim=0):
        return cp.gather_varlen(shards, cu, layout, dim)
    torch.testing.assert_close(full(outs), ref_out.detach(), **tol)
    torch.testing.assert_close(full(lses, 1), ref_lse, **tol)
    torch.testing.assert_close(full(dqs), qr.grad, **tol)
    torch.testing.assert_close(full(dks), kr.grad, **tol)
    torch.testing.assert_close(full(dvs), vr.grad, **tol)


def test_varlen_zigzag_causal_one_call_per_step():
    """Zigzag causal over packed documents: one varlen call per step; the diagonal step takes
    the shards as they are (no gather)."""
    world, lens = 4, [16, 8, 24]
    plans = cp.varlen_step_plans([n // world for n in lens], "zigzag", world, 1, True, (-1, -1),
                                 "cpu")
    assert all(len(p) == 1 for p in plans)
    diag = plans[0][0]
    assert diag.q_index is None and diag.k_index is None
    assert (diag.window_left, diag.window_right) == (-1, 0)
    assert diag.cu_q.tolist() == [0, 4, 6, 12]
    src0 = plans[1][0]  # key shard of rank 0 < 1: every query, each document's first key half
    assert src0.q_index is None and src0.k_index.tolist() == [0, 1, 4, 6, 7, 8]


def test_varlen_argument_errors():
    q = torch.zeros(8, 2, 8)
    with pytest.raises(FlashExtValueError, match="even"):
        cp.emulated_ring_forward([q], [q], [q], cu_seqlens=[0, 3, 8], backend=ReferenceBackend())
    with pytest.raises(FlashExtValueError, match="end at"):
        cp.emulated_ring_forward([q], [q], [q], cu_seqlens=[0, 4, 6], backend=ReferenceBackend())
    with pytest.raises(FlashExtValueError, match="3-D"):
        cp.emulated_ring_forward([q[None]], [q], [q], cu_seqlens=[0, 8],
                                 backend=ReferenceBackend())
