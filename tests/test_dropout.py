"""Attention dropout without a GPU: the pure-PyTorch Philox4x32 against Random123's known-answer
vectors, the mask scheme against an independent scalar implementation, argument validation,
and the op schemas / fake kernels / autograd and torch.compile plumbing (meta and fake tensors).
The kernels themselves are tested in test_dropout_gpu.py."""

import math

import pytest
import torch

import flash_ext
from flash_ext import _philox
from flash_ext import _validation as V

from conftest import meta

# Random123's kat_vectors (tests/kat_vectors in the Random123 distribution): name, rounds,
# counter (4 words), key (2 words), expected output (4 words).
KAT = """
philox4x32 7 00000000 00000000 00000000 00000000 00000000 00000000   5f6fb709 0d893f64 4f121f81 4f730a48
philox4x32 7 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   5207ddc2 45165e59 4d8ee751 8c52f662
philox4x32 7 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   4dfccaba 190a87f0 c47362ba b6b5242a
philox4x32 10 00000000 00000000 00000000 00000000 00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
philox4x32 10 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
philox4x32 10 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
"""
KAT_CASES = [line.split() for line in KAT.strip().splitlines()]


@pytest.mark.parametrize("case", KAT_CASES, ids=lambda c: f"R{c[1]}-{c[2]}")
def test_philox_known_answers(case):
    rounds = int(case[1])
    ctr, key, want = ([int(x, 16) for x in case[i:j]] for i, j in ((2, 6), (6, 8), (8, 12)))
    got = _philox.philox4x32(torch.tensor([ctr[0]]), ctr[1], ctr[2], ctr[3], key[0], key[1],
                             rounds=rounds)
    assert [int(w) for w in got] == want


def test_philox_vectorized_matches_elementwise():
    g = torch.Generator().manual_seed(1)
    c = torch.randint(0, 2**32, (4, 50), generator=g, dtype=torch.int64)
    batch = _philox.philox4x32(c[0], c[1], c[2], c[3], 0x12345678, 0x9ABCDEF0)
    for i in range(0, 50, 7):
        one = _philox.philox4x32(c[0, i:i + 1], c[1, i:i + 1], c[2, i:i + 1], c[3, i:i + 1],
                                 0x12345678, 0x9ABCDEF0)
        assert [int(w[i]) for w in batch] == [int(w) for w in one]


# An independent scalar implementation with Python ints, following csrc/common/dropout.h.
def _philox_int(ctr, key, rounds=10):
    m = 0xFFFFFFFF
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for i in range(rounds):
        if i:
            k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & m, (p0 >> 32) ^ c3 ^ k1, p0 & m
    return c0, c1, c2, c3


def _keep_int(seed, offset, bh, row, col, p):
    m = 0xFFFFFFFF
    ctr = (col >> 1, ((row >> 4) << 3) | (row & 7), bh, offset & m)
    key = (seed & m, ((seed >> 32) + (offset >> 32)) & m)
    word = _philox_int(ctr, key)[((row >> 3) & 1) * 2 + (col & 1)]
    return word >= math.floor(p * 2**32 + 0.5)


@pytest.mark.parametrize("seed,offset", [(0, 0), (42, 4), (2**63 + 12345, 2**32 + 8),
                                         (-7, 123456)])
def test_mask_matches_scalar_scheme(seed, offset):
    p = 0.37
    state = torch.tensor([seed if seed < 2**63 else seed - 2**64, offset], dtype=torch.int64)
    b, h, sq, sk = 2, 3, 41, 35
    mask = _philox.dropout_keep_mask(state, b, h, sq, sk, p)
    assert mask.shape == (b, h, sq, sk) and mask.dtype == torch.bool
    s, o = seed & (2**64 - 1), offset
    g = torch.Generator().manual_seed(seed & 0xFFFF)
    for _ in range(60):
        bb, hh, i, j = (int(torch.randint(0, n, (1,), generator=g)) for n in (b, h, sq, sk))
        assert bool(mask[bb, hh, i, j]) == _keep_int(s, o, bb * h + hh, i, j, p), (bb, hh, i, j)


def test_mask_is_a_function_of_position_only():
    """A bigger problem's mask holds the smaller one's in its corner (per (batch, head) index):
    the mask cannot depend on the sequence lengths, i.e. on tiles or grid shapes."""
    state = torch.tensor([1234, 56], dtype=torch.int64)
    small = _philox.dropout_keep_mask(state, 2, 4, 70, 33, 0.5)
    big = _philox.dropout_keep_mask(state, 2, 4, 130, 200, 0.5)
    assert torch.equal(big[:, :, :70, :33], small)


def test_mask_keep_rate_and_extremes():
    state = torch.tensor([7, 0], dtype=torch.int64)
    for p in (0.1, 0.5, 0.9):
        mask = _philox.dropout_keep_mask(state, 2, 2, 128, 128, p)
        n = mask.numel()
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(mask.float().mean().item() - (1 - p)) < 5 * sigma
    assert _philox.dropout_keep_mask(state, 1, 2, 30, 30, 0.0).all()
    assert not _philox.dropout_keep_mask(state, 1, 2, 30, 30, 1.0).any()


def test_mask_depends_on_seed_offset_and_head():
    a = _philox.dropout_keep_mask(torch.tensor([1, 0]), 1, 2, 64, 64, 0.5)
    b = _philox.dropout_keep_mask(torch.tensor([2, 0]), 1, 2, 64, 64, 0.5)
    c = _philox.dropout_keep_mask(torch.tensor([1, 4]), 1, 2, 64, 64, 0.5)
    d = _philox.dropout_keep_mask(torch.tensor([1, 2**32]), 1, 2, 64, 64, 0.5)
    for other in (b, c, d):
        assert (a != other).float().mean() > 0.4
    assert (a[0, 0] != a[0, 1]).float().mean() > 0.4
    assert torch.equal(a, _philox.dropout_keep_mask(torch.tensor([1, 0]), 1, 2, 64, 64, 0.5))


def test_threshold_rounding():
    assert _philox.dropout_threshold(0.0) == 0
    assert _philox.dropout_threshold(0.5) == 2**31
    assert _philox.dropout_threshold(1.0) == 2**32
    assert _philox.dropout_threshold(0.1) == math.floor(0.1 * 2**32 + 0.5)


def test_reference_with_mask_equals_manual():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 16, generator=g) for _ in range(3))
    keep = _philox.dropout_keep_mask(torch.tensor([3, 4]), 1, 2, 9, 9, 0.25)
    out, lse = flash_ext.reference.attention_ref(q, k, v, causal=True, dropout_p=0.25,
                                                 dropout_mask=keep)
    out0, lse0 = flash_ext.reference.attention_ref(q, k, v, causal=True)
    assert torch.equal(lse, lse0)
    s = torch.einsum("bqhd,bkhd->bhqk", q / 4.0, k)
    s = s.masked_fill(~flash_ext.reference.local_mask(9, 9, causal=True), float("-inf"))
    pr = torch.softmax(s, -1) * keep / 0.75
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", pr, v))


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), float("inf")])
def test_dropout_p_out_of_range(p):
    with pytest.raises(ValueError, match="dropout_p"):
        V.check_dropout(p)


@pytest.mark.parametrize("p", ["0.1", None, True])
def test_dropout_p_wrong_type(p):
    with pytest.raises((TypeError, ValueError), match="dropout_p"):
        V.check_dropout(p)


def test_rng_state_checks():
    V.check_dropout(0.1, torch.tensor([1, 2], dtype=torch.int64))
    with pytest.raises(ValueError, match="rng_state"):
        V.check_dropout(0.1, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="rng_state"):
        V.check_dropout(0.1, torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="rng_state"):
        V.check_dropout(0.1, [1, 2])
    with pytest.raises(ValueError, match="rng_state"):
        V.check_dropout(0.1, None, need_rng_state=True)
    V.check_dropout(0.0, None, need_rng_state=True)


@pytest.mark.parametrize("p", [-0.5, 1.01])
def test_flash_attn_func_dropout_out_of_range(meta_ok, p):
    q = meta(2, 64, 4, 64)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_ext.flash_attn_func(q, q, q, dropout_p=p)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_ext.attn_fwd(q, q, q, dropout_p=p)


def test_dropout_is_accepted(meta_ok):
    q = meta(2, 64, 4, 64, requires_grad=True)
    out = flash_ext.flash_attn_func(q, q, q, dropout_p=0.1, causal=True)
    assert out.shape == q.shape
    out.float().sum().backward()
    assert q.grad.shape == q.shape
    res = flash_ext.attn_fwd(q, q, q, dropout_p=0.1)
    assert len(res) == 3 and res[2].dtype == torch.int64 and res[2].shape == (2,)
    assert res[2].device.type == "cpu"
    assert len(flash_ext.attn_fwd(q, q, q)) == 2  # no dropout: (out, lse) as before


def test_attn_bwd_dropout_needs_rng_state(meta_ok):
    q = meta(2, 64, 4, 64)
    lse = meta(2, 4, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="rng_state"):
        flash_ext.attn_bwd(q, q, q, q, q, lse, dropout_p=0.2)
    dq, dk, dv = flash_ext.attn_bwd(q, q, q, q, q, lse, dropout_p=0.2,
                                    rng_state=torch.tensor([1, 2]))
    assert dq.shape == q.shape


# ---------------------------------------------------------------------------------------------
# Op registration, fake kernels, autograd and torch.compile
# ---------------------------------------------------------------------------------------------


def test_schemas_carry_dropout():
    for op in ("fwd", "fwd_out", "bwd"):
        schema = str(getattr(torch.ops.flash_ext, op).default._schema)
        assert "float dropout_p=0." in schema and "Tensor? rng_state=None" in schema, schema
    fwd = str(torch.ops.flash_ext.fwd.default._schema)
    assert "bool deterministic=False" in fwd, fwd
    rs = torch.ops.flash_ext.dropout_rng_state.default
    assert torch.Tag.nondeterministic_seeded in rs.tags
    mask = str(torch.ops.flash_ext.dropout_mask.default._schema)
    assert "float dropout_p" in mask and "-> Tensor" in mask


def test_fake_dropout_ops(fake_mode):
    with fake_mode:
        q = torch.randn(2, 64, 8, 64, dtype=torch.bfloat16, device="cuda")
        rs = torch.ops.flash_ext.dropout_rng_state(q)
        mask = torch.ops.flash_ext.dropout_mask(q, rs, 2, 8, 64, 96, 0.1)
        out, lse = torch.ops.flash_ext.fwd(q, q, q, None, None, 0, 0, 0.125, False, -1, -1, 0.0,
                                           0.1, rs)
        dq, dk, dv = torch.ops.flash_ext.bwd(q, q, q, q, out, lse, None, None, 0, 0, 0.125, False,
                                             -1, -1, 0.0, False, 0.1, rs)
    assert rs.shape == (2,) and rs.dtype == torch.int64 and rs.device.type == "cpu"
    assert mask.shape == (2, 8, 64, 96) and mask.dtype == torch.bool and mask.device.type == "cuda"
    assert out.shape == q.shape and lse.shape == (2, 8, 64) and dq.shape == q.shape


def test_attn_fwd_dropout_under_fake_mode(fake_mode):
    with fake_mode:
        q = torch.randn(2, 64, 8, 60, dtype=torch.bfloat16, device="cuda")
        out, lse, rs = flash_ext.attn_fwd(q, q, q, dropout_p=0.3, causal=True)
        out2, lse2, rs2 = flash_ext.attn_fwd(q, q, q, dropout_p=0.3, rng_state=rs)
    assert out.shape == q.shape and rs.shape == (2,) and rs2 is rs


def test_autograd_passes_rng_state_to_bwd(meta_ok):
    """fwd's autograd formula (C++ in the build, tests/stand_in_ops.py without it) hands the
    forward's dropout_p and rng_state to bwd: recorded where the dispatcher calls bwd."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.flash_ext.bwd.default:
                seen["args"] = args
            return func(*args, **(kwargs or {}))

    q = meta(2, 64, 4, 64, requires_grad=True)
    state = torch.tensor([11, 22], dtype=torch.int64)
    out, _, rs = flash_ext.attn_fwd(q, q, q, dropout_p=0.25, rng_state=state)
    assert rs is state
    with Record():
        out.float().sum().backward()
    assert seen["args"][-2] == 0.25 and seen["args"][-1] is state


class _DropoutAttn(torch.nn.Module):
    def __init__(self, d_model=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, device="meta", dtype=torch.bfloat16)

    def forward(self, x):
        b, s, dm = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, dm // self.heads).unbind(2)
        o = flash_ext.flash_attn_func(q, k, v, dropout_p=0.1, causal=True)
        o2 = flash_ext.flash_attn_func(q, k, v, dropout_p=0.1, causal=True)  # not merged
        return (o + o2).float().pow(2).mean()


def test_compile_training_with_dropout(meta_ok):
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    m = _DropoutAttn()
    x = meta(2, 128, 256)
    loss = torch.compile(m, fullgraph=True,
                         backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))(x)
    loss.backward()
    assert m.qkv.weight.grad is not None

    def nodes(op):
        return [n for g in graphs for n in g.graph.nodes
                if n.op == "call_function" and n.target in (op, op.default)]

    assert len(nodes(torch.ops.flash_ext.dropout_rng_state)) == 2  # two draws, not CSE'd
    fwd = nodes(torch.ops.flash_ext.fwd)
    assert len(fwd) == 2 and all(0.1 in n.args for n in fwd)
    bwd = nodes(torch.ops.flash_ext.bwd)
    assert len(bwd) == 2 and all(0.1 in n.args for n in bwd)
