"""FlashMask in the sm80 backward kernels, called directly through torch.ops.flash_ext.bwd with
the trailing startend_row_indices argument (skipped without a CUDA GPU).

The forward is not under test here: out and lse come from a float32 dense reference (out rounded
to the input dtype, as a kernel would store it), so a failure points at the backward alone. The
dense mask is built inline from the contract's semantics (docs/design-flashmask.md 1.1-1.3):
column j masks rows [LTS, LTE) and [UTS, UTE) (C = 1: LT to the end; C = 2 non-causal: LT to the
end and UT from 0), plus the bottom-right causal rule when causal.

Pass criterion, as tests/test_bwd_gpu.py: for dq, dk, dv, with ref the gradient of the float32
reference and pt the same reference computed in the input dtype,
    max|g - ref| <= 2 max|pt - ref| + max|round(ref) - ref| + 1e-4 max|ref| + 1e-5,
no NaN, and exact zeros where the mask leaves nothing (fully masked rows, unseen keys).

Every test runs on each sm80 backward kernel that has the FlashMask mode: v1, v2 and the small
tile (FLASH_EXT_BWD_SMALL_TILE=1), on the Hopper backward's FlashMask mode forced with
FLASH_EXT_BWD_PATH=sm90 (sm90 GPUs only; not the deterministic tests, which that kernel does not
run; varlen included), plus the default dispatch (the Hopper backward on sm90 where it applies, else sm80).
The GQA tests also run the Hopper backward with each GQA schedule forced (FLASH_EXT_SM90_BWD_GQA:
expanded buffers, or one CTA per KV head looping over its group, whose FlashMask head is the
group's: its KV head's bounds or the shared ones).
"""

import math

import pytest
import torch

from conftest import requires_cuda

pytestmark = requires_cuda

DTYPES = [torch.float16, torch.bfloat16]
# (FLASH_EXT_BWD_PATH, FLASH_EXT_BWD_VARIANT, FLASH_EXT_BWD_SMALL_TILE, FLASH_EXT_SM90_BWD_GQA)
# per fixture value.
BWD_CONFIGS = {"sm80_v1": ("sm80", "1", "0", "auto"), "sm80_v2": ("sm80", "2", "0", "auto"),
               "sm80_small": ("sm80", "1", "1", "auto"), "sm90": ("sm90", "2", "0", "auto"),
               "sm90_gqa_expand": ("sm90", "2", "0", "expand"), "sm90_gqa_loop": ("sm90", "2", "0", "loop"),
               "auto": ("auto", "2", "0", "auto")}


@pytest.fixture(autouse=True, params=list(BWD_CONFIGS), ids=lambda c: f"bwd_{c}")
def bwd_config(request, tuning):
    path, variant, small, gqa = BWD_CONFIGS[request.param]
    if gqa != "auto" and request.function.__name__ != "test_gqa":
        pytest.skip("the GQA schedule matters only where heads_q > heads_kv (test_gqa)")
    if path == "sm90":
        if torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("the Hopper backward needs an sm90 GPU")
        callspec = getattr(request.node, "callspec", None)
        deterministic = callspec is not None and callspec.params.get("deterministic", False)
        if deterministic or request.function.__name__ == "test_deterministic":
            pytest.skip("the Hopper backward has no deterministic mode")
    tuning.set("FLASH_EXT_BWD_PATH", path)
    tuning.set("FLASH_EXT_BWD_VARIANT", variant)
    tuning.set("FLASH_EXT_BWD_SMALL_TILE", small)
    tuning.set("FLASH_EXT_SM90_BWD_GQA", gqa)
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _ops():
    import flash_ext  # noqa: F401  (registers the ops)
    return torch.ops.flash_ext


def dense_masked(bounds, sq, causal):
    """bounds (hm, sk, C) int -> bool (hm, sq, sk): True where FlashMask masks the entry."""
    b = bounds.long()
    rows = torch.arange(sq, device=bounds.device)[None, :, None]
    col = lambda i: b[:, None, :, i]  # noqa: E731
    c = bounds.shape[-1]
    end = torch.full_like(col(0), sq)
    if causal:
        ls, le = col(0), (end if c == 1 else col(1))
        us = ue = end
    elif c == 2:
        ls, le, us, ue = col(0), end, torch.zeros_like(end), col(1)
    else:
        ls, le, us, ue = col(0), col(1), col(2), col(3)
    return ((rows >= ls) & (rows < le)) | ((rows >= us) & (rows < ue))


def visible_of(bounds, sq, sk, hq, causal):
    """bounds (hm, sk, C) of one sequence -> bool (hq, sq, sk) visibility."""
    masked = dense_masked(bounds, sq, causal)
    vis = ~masked.repeat_interleave(hq // bounds.shape[0], dim=0)
    if causal:
        i = torch.arange(sq, device=bounds.device)[:, None]
        j = torch.arange(sk, device=bounds.device)[None, :]
        vis = vis & (j <= i + sk - sq)
    return vis


def ref_attention(q, k, v, vis, scale, cdt):
    """One sequence: q (sq, hq, d), k, v (sk, hkv, d), vis (hq, sq, sk). Scores and P @ V in
    `cdt`, softmax in float32 (rounded to cdt when cdt is low precision). Rows that see nothing
    give out 0, lse -inf and zero gradients (no NaN through autograd). Returns (out, lse)."""
    hq, hkv = q.shape[1], k.shape[1]
    kc = k.to(cdt).repeat_interleave(hq // hkv, dim=1)
    vc = v.to(cdt).repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(cdt) * scale, kc).float()
    any_row = vis.any(-1, keepdim=True)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s.detach(), dim=-1)
    p = torch.softmax(torch.where(any_row, s, torch.zeros_like(s)), dim=-1) * any_row
    out = torch.einsum("hqk,khd->qhd", p.to(cdt), vc)
    return out, lse


def reference(q, k, v, dout, vis_list, scale, cu_q, cu_k, upcast):
    """Sequences given by cu_q / cu_k over the packed (total, h, d) tensors; returns out, lse
    (hq, total_q), and the gradients of q, k, v."""
    cdt = torch.float32 if upcast else q.dtype
    qr, kr, vr = (t.detach().to(cdt).requires_grad_() for t in (q, k, v))
    outs, lses = [], []
    for i, vis in enumerate(vis_list):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        o, l = ref_attention(qr[q0:q1], kr[k0:k1], vr[k0:k1], vis, scale, cdt)
        outs.append(o)
        lses.append(l)
    out = torch.cat(outs)
    out.backward(dout.to(out.dtype))
    return out.detach(), torch.cat(lses, dim=1), (qr.grad, kr.grad, vr.grad)


def check(got, ref, pt, label):
    for name, g, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        assert g.shape == r.shape, (name, g.shape, r.shape)
        assert not g.isnan().any(), f"{label}: NaN in {name}"
        err = (g.float() - r).abs().max().item()
        pt_err = (p.float() - r).abs().max().item()
        round_err = (r.to(g.dtype).float() - r).abs().max().item()
        bound = 2 * pt_err + round_err + 1e-4 * r.abs().max().item() + 1e-5
        assert err <= bound, f"{label}: {name} max err {err:.3e} > bound {bound:.3e} (pt {pt_err:.3e})"


def random_bounds(hm, sk, sq, c, causal):
    """Random valid bounds (hm, sk, c) int32: values in [0, sq], each interval ordered."""
    def interval():
        a, b = (torch.randint(0, sq + 1, (hm, sk), device="cuda") for _ in range(2))
        return torch.minimum(a, b), torch.maximum(a, b)
    ls, le = interval()
    if c == 1:
        return ls[..., None].int()
    if c == 2:  # causal: (LTS, LTE); non-causal: (LTS, UTE) with LT to the end, UT from row 0
        return torch.stack([ls, le] if causal else [le, ls], -1).int()
    us, ue = interval()
    return torch.stack([ls, le, us, ue], -1).int()


def run(seqs, hq, hkv, hm, d, dtype, bounds_list, causal, deterministic=False, varlen=False,
        label=""):
    """seqs: [(sq, sk)] per sequence (batched: all equal). bounds_list: per sequence (hm, sk, C).
    Returns (dq, dk, dv) of the op, packed like q, k, v."""
    ops = _ops()
    scale = 1.0 / math.sqrt(d)
    cu_q = [0]
    cu_k = [0]
    for sq, sk in seqs:
        cu_q.append(cu_q[-1] + sq)
        cu_k.append(cu_k[-1] + sk)
    tq, tk = cu_q[-1], cu_k[-1]
    q = torch.randn(tq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(tk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(tk, hkv, d, device="cuda", dtype=dtype)
    dout = torch.randn(tq, hq, d, device="cuda", dtype=dtype)
    vis_list = [visible_of(bd, sq, sk, hq, causal) for bd, (sq, sk) in zip(bounds_list, seqs)]
    out32, lse, ref = reference(q, k, v, dout, vis_list, scale, cu_q, cu_k, upcast=True)
    _, _, pt = reference(q, k, v, dout, vis_list, scale, cu_q, cu_k, upcast=False)
    out = out32.to(dtype)
    wr = 0 if causal else -1
    if varlen:
        cq = torch.tensor(cu_q, device="cuda", dtype=torch.int32)
        ck = torch.tensor(cu_k, device="cuda", dtype=torch.int32)
        bounds = torch.cat(bounds_list, dim=1)  # (hm, total_k, C)
        max_sq, max_sk = max(s for s, _ in seqs), max(s for _, s in seqs)
        args = (dout, q, k, v, out, lse, cq, ck, max_sq, max_sk)
        shape = lambda t: t  # noqa: E731
    else:
        b = len(seqs)
        sq, sk = seqs[0]
        bounds = torch.stack(bounds_list)  # (b, hm, sk, C)
        args = tuple(t.view(b, -1, *t.shape[1:]) for t in (dout, q, k, v, out)) + \
            (lse.view(hq, b, sq).transpose(0, 1).contiguous(), None, None, 0, 0)
        shape = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    grads = ops.bwd(*args, scale, causal, -1, wr, 0.0, deterministic,
                    startend_row_indices=bounds)
    got = tuple(shape(g) for g in grads)
    check(got, ref, pt, label)
    if deterministic:
        again = tuple(shape(g) for g in ops.bwd(*args, scale, causal, -1, wr, 0.0, True,
                                                  startend_row_indices=bounds))
        for g, a in zip(got, again):
            assert torch.equal(g, a), f"{label}: deterministic backward differs between runs"
    return got, vis_list


def dname(dtype):
    return str(dtype).replace("torch.", "")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,c", [(True, 1), (True, 2), (False, 2), (False, 4)])
@pytest.mark.parametrize("sq,sk", [(300, 300), (257, 520), (520, 257)])
def test_random_bounds(dtype, d, causal, c, sq, sk):
    """Random bounds: every block class (skip, full, partial) occurs, boundaries off block edges."""
    bl = [random_bounds(2, sk, sq, c, causal) for _ in range(2)]
    run([(sq, sk)] * 2, 4, 2, 2, d, dtype, bl, causal, label=f"{sq}x{sk} C={c} causal={causal}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("width", [64, 200])
def test_sliding_window_by_bounds(dtype, d, width):
    """Causal C=1 with LTS = j + width: a band, so each key block skips the query blocks below
    it, sees full blocks inside it and partial ones on its two edges."""
    sq = sk = 700
    lts = (torch.arange(sk, device="cuda") + width).clamp(max=sq).int().view(1, sk, 1)
    run([(sq, sk)] * 2, 2, 2, 1, d, dtype, [lts, lts], True, label=f"band {width}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128])
def test_document_mask_block_aligned(dtype, d):
    """Causal document mask with documents on and off 128-row boundaries: whole key blocks skip
    most query blocks (the prefetch must target the next visited block) and many are full."""
    sq = sk = 1000
    starts = [0, 128, 384, 390, 640, 1000]
    lts = torch.empty(sk, dtype=torch.int32, device="cuda")
    for a, e in zip(starts[:-1], starts[1:]):
        lts[a:e] = e
    bl = [lts.view(1, sk, 1)]
    run([(sq, sk)], 4, 4, 1, d, dtype, bl, True, label="document")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fully_masked_rows_and_unseen_keys(dtype, d):
    """Rows 250.. see nothing (LTS = 250 for every column, causal C=1) and keys 128..255 are
    masked in every row (LTS = 0): dq of those rows and dk, dv of those keys are exactly 0."""
    sq = sk = 300
    lts = torch.full((1, sk, 1), 250, dtype=torch.int32, device="cuda")
    lts[:, 128:256] = 0
    got, vis = run([(sq, sk)], 4, 2, 1, d, dtype, [lts], True, label="masked rows")
    dq, dk, dv = got
    empty_rows = ~vis[0].any(-1).any(0)  # (sq,) rows no head sees anything from
    unseen = ~vis[0].any(1).any(0)       # (sk,)
    assert empty_rows[250:].all() and unseen[128:256].all()
    assert torch.equal(dq[empty_rows], torch.zeros_like(dq[empty_rows]))
    assert torch.equal(dk[unseen], torch.zeros_like(dk[unseen]))
    assert torch.equal(dv[unseen], torch.zeros_like(dv[unseen]))


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
# groups 2, 4, 8 (MQA); bounds per KV head (hm = hkv) or shared (hm = 1)
@pytest.mark.parametrize("hq,hkv,hm", [(4, 2, 2), (8, 2, 1), (8, 2, 2), (8, 1, 1), (16, 2, 2)])
@pytest.mark.parametrize("causal,c", [(True, 2), (False, 4)])
def test_gqa(dtype, d, hq, hkv, hm, causal, c):
    sq, sk = 333, 400
    bl = [random_bounds(hm, sk, sq, c, causal) for _ in range(2)]
    run([(sq, sk)] * 2, hq, hkv, hm, d, dtype, bl, causal, label=f"gqa {hq}/{hkv} hm={hm} d={d}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("causal,c", [(True, 1), (False, 2), (False, 4)])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])  # the Hopper backward: 128-key blocks, 64 at d = 256
def test_varlen(dtype, causal, c, deterministic, d):
    seqs = [(100, 100), (1, 300), (257, 129), (0, 5), (400, 400)]
    bl = [random_bounds(2, sk, sq, c, causal) for sq, sk in seqs]
    run(seqs, 4, 2, 2, d, dtype, bl, causal, deterministic=deterministic, varlen=True,
        label=f"varlen C={c} det={deterministic} d={d}")


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa_loop"])
@pytest.mark.parametrize("name", ["causal_doc", "shared_question", "sliding_window", "prefix_lm"])
def test_order_by_count(name, heads, bwd_config, tuning):
    """Fixed-length FlashMask calls (d <= 128, auto) launch one 1-D grid whose CTAs run longest
    first or in the 3-D grid's order as kernel A's counts decide on the GPU (at 2048: prefix LM
    the grid's order, the other three longest first; test_bwd_order_rule_on_bench_masks checks
    the rule at 8k): both must cover every key block once, also where the GQA group loop makes
    the units KV heads."""
    if bwd_config not in ("sm90", "auto"):
        pytest.skip("the CTA order is the Hopper backward's")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward needs an sm90 GPU")
    from flash_ext import bench_mask as BM
    hq, hkv = heads
    if hq != hkv:
        tuning.set("FLASH_EXT_SM90_BWD_GQA", "loop")
    s, b = 2048, 2
    sri, causal, _ = BM.build_mask(name, s, device="cuda")
    bl = [sri[0].expand(1, s, sri.shape[-1]).contiguous() for _ in range(b)]
    run([(s, s)] * b, hq, hkv, 1, 128, torch.bfloat16, bl, causal, label=f"order by count {name} {hq}/{hkv}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic(dtype, d):
    sq, sk = 400, 600
    bl = [random_bounds(2, sk, sq, 4, False) for _ in range(2)]
    run([(sq, sk)] * 2, 4, 2, 2, d, dtype, bl, False, deterministic=True, label="deterministic")
