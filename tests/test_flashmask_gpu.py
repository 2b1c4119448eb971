"""FlashMask on the GPU (docs/design-flashmask.md 10.2): flashmask_attention forward and backward
against the float32 reference with the dense mask (flash_ext.reference.flashmask_visible), with
FlashAttention's criterion as tests/test_fwd_gpu.py and test_bwd_gpu.py apply it:

    max|x - ref| <= 2 * max|pt - ref| + max|round(ref) - ref| + eps

(pt: the same reference in the input dtype). lse within 1e-3 + 1e-3 |ref|, -inf exactly where
the reference has it. Also: fully masked rows and batches, the kernel-A op
flash_ext::flashmask_summary against flash_ext/_flashmask_blocks.py bit for bit, the builders
against flash_ext's window and varlen kernels, torch.compile. Both forward dispatches
(FLASH_EXT_FWD_PATH=sm80 and auto) where marked.
"""


import pytest
import torch

import flash_ext
from flash_ext import _flashmask_blocks as B
from flash_ext import flashmask_masks as M
from flash_ext.reference import (attention_ref, attention_ref_varlen, flashmask_visible,
                                 flashmask_visible_varlen)

from conftest import requires_cuda

pytestmark = requires_cuda

DTYPES = [torch.float16, torch.bfloat16]
CASES = [(True, 1), (True, 2), (False, 2), (False, 4)]


def dname(dtype):
    return str(dtype).replace("torch.", "")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["sm80", "auto"], ids=lambda p: f"fwd_{p}")
def fwd_path(request, tuning):
    """FLASH_EXT_FWD_PATH for the tests that take this fixture (FlashMask calls run the sm80
    kernels on every GPU until the Hopper mask policy lands; auto must agree)."""
    tuning.set("FLASH_EXT_FWD_PATH", request.param)
    return request.param


def random_bounds(b, hm, sq, sk, causal, c, device="cuda"):
    x = torch.randint(0, sq + 1, (b, hm, sk, c), device=device)
    if c == 4 or (causal and c == 2):
        lo = torch.minimum(x[..., 0::2], x[..., 1::2])
        hi = torch.maximum(x[..., 0::2], x[..., 1::2])
        x = torch.stack([lo, hi], dim=-1).flatten(-2)
    return x.to(torch.int32)


def _max_err(x, ref):
    return (x.float() - ref).abs().max().item() if x.numel() else 0.0


def check(name, got, ref, pt, label, grad=False):
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert not got.isnan().any(), f"{label}: NaN in {name}"
    if got.numel() == 0:
        return
    err, pt_err = _max_err(got, ref), _max_err(pt, ref)
    round_err = _max_err(ref.to(got.dtype), ref)
    bound = 2 * pt_err + round_err + 1e-5 + (1e-4 * ref.abs().max().item() if grad else 0.0)
    print(f"[{label}] {name} max err {err:.3e} (pt {pt_err:.3e}, bound {bound:.3e})")
    assert err <= bound, f"{label}: {name} max err {err:.3e} > bound {bound:.3e}"


def check_lse(lse, ref_lse, label):
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{label}: -inf mismatch"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        diff = (lse[fin] - ref_lse[fin]).abs()
        assert (diff <= 1e-3 + 1e-3 * ref_lse[fin].abs()).all(), f"{label}: lse off by " \
            f"{diff.max().item():.3e}"


def _run_with_grads(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return out, lse, [t.grad for t in leaves]


def compare(fn, ref_fn, q, k, v, label, backward=True):
    """fn(q, k, v) -> (out, lse); ref_fn(q, k, v, upcast) -> (out, lse). Forward and gradients
    against the reference (float32) and plain low precision."""
    dout = torch.randn_like(q)
    if backward:
        out, lse, grads = _run_with_grads(fn, (q, k, v), dout)
        ref, ref_lse, ref_grads = _run_with_grads(  # float32 leaves: float32 gradients
            lambda *t: ref_fn(*t, True), (q.float(), k.float(), v.float()), dout.float())
        pt, _, pt_grads = _run_with_grads(lambda *t: ref_fn(*t, False), (q, k, v), dout)
    else:
        out, lse = fn(q, k, v)
        ref, ref_lse = ref_fn(q.float(), k.float(), v.float(), True)
        pt, _ = ref_fn(q, k, v, False)
    assert out.dtype == q.dtype
    check("out", out, ref, pt, label)
    check_lse(lse, ref_lse, label)
    if backward:
        for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
            check(name, g, r, p, label, grad=True)
    return out, lse


def run_batched(q, k, v, sri, causal, label, softcap=0.0, backward=True, softmax_scale=None):
    mask = flashmask_visible(sri, q.shape[1], causal)

    def fn(q, k, v):
        return flash_ext.flashmask_attention(q, k, v, sri, causal=causal, softcap=softcap,
                                             softmax_scale=softmax_scale, return_lse=True)

    def ref_fn(q, k, v, upcast):
        return attention_ref(q, k, v, causal=causal, softcap=softcap, attn_mask=mask,
                             upcast=upcast, softmax_scale=softmax_scale)
    return compare(fn, ref_fn, q, k, v, label, backward)


def qkv(b, sq, sk, hq, hkv, d, dtype):
    return (torch.randn(b, sq, hq, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype))


# ---------------------------------------------------------------------------------------------
# Random bounds: every (causal, C), both forward dispatches
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("causal,c", CASES)
@pytest.mark.parametrize("sq,sk", [(300, 300), (200, 333)])
def test_random_bounds(fwd_path, dtype, causal, c, sq, sk):
    q, k, v = qkv(2, sq, sk, 4, 2, 128, dtype)
    sri = random_bounds(2, 2, sq, sk, causal, c)
    run_batched(q, k, v, sri, causal, f"{fwd_path} {dname(dtype)} causal={causal} C={c} "
                f"{sq}x{sk}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,c", [(True, 2), (False, 4)])
def test_head_dims(dtype, d, causal, c):
    q, k, v = qkv(1, 257, 257, 2, 2, d, dtype)
    run_batched(q, k, v, random_bounds(1, 2, 257, 257, causal, c), causal,
                f"{dname(dtype)} d={d} causal={causal} C={c}")


@pytest.mark.parametrize("d", [32, 96, 192, 40])
def test_more_head_dims(d):
    q, k, v = qkv(1, 190, 190, 2, 1, d, torch.bfloat16)
    run_batched(q, k, v, random_bounds(1, 1, 190, 190, False, 2), False, f"d={d}")


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("hm_is_hkv", [False, True], ids=["hm1", "hm_hkv"])
def test_gqa_and_mask_heads(hq, hkv, hm_is_hkv):
    hm = hkv if hm_is_hkv else 1
    q, k, v = qkv(2, 211, 211, hq, hkv, 64, torch.bfloat16)
    run_batched(q, k, v, random_bounds(2, hm, 211, 211, True, 1), True,
                f"hq={hq} hkv={hkv} hm={hm}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("causal,c", [(True, 1), (False, 2)])
def test_softcap(dtype, causal, c):
    q, k, v = qkv(1, 170, 170, 2, 2, 128, dtype)
    q, k = q * 3, k * 3  # scores large enough for the cap to matter
    run_batched(q, k, v, random_bounds(1, 2, 170, 170, causal, c), causal,
                f"softcap {dname(dtype)} causal={causal}", softcap=30.0)


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------


BUILDERS = ["causal_document", "shared_question", "prefix_lm", "sliding_window",
            "sliding_window_nc", "global_sliding_window", "causal_blockwise"]


def _builders(s):
    return {
        "causal_document": M.causal_document([s // 5, 0, 1, s // 3], s, device="cuda"),
        "shared_question": M.shared_question(s // 4, [s // 8] * 5, s, device="cuda"),
        "prefix_lm": M.prefix_lm([s // 8, 0], [s // 2, s // 3], s, device="cuda"),
        "sliding_window": M.sliding_window(97, s, device="cuda"),
        "sliding_window_nc": M.sliding_window((50, 131), s, causal=False, device="cuda"),
        "global_sliding_window": M.global_sliding_window(7, 90, s, device="cuda"),
        "causal_blockwise": M.causal_blockwise([s // 3, 1, s // 4], s, device="cuda"),
    }


def run_builder(name, d, label, **kw):
    """One builder's mask over 1000 tokens, 4 q / 2 kv heads, bf16."""
    s = 1000
    sri, causal = _builders(s)[name]
    q, k, v = qkv(1, s, s, 4, 2, d, torch.bfloat16)
    run_batched(q, k, v, sri.expand(1, 2, s, sri.shape[-1]).contiguous(), causal, f"{label} {name}", **kw)


@pytest.mark.parametrize("name", BUILDERS)
def test_builders(fwd_path, name):
    run_builder(name, 64, fwd_path)


def _long_masks(s):
    """Masks over s = 6000 tokens (47 key blocks of 128, 94 of 64) whose runs of skipped and
    partial blocks cross 32-block boundaries: the Hopper consumers classify 32 key blocks per
    window (sm90/fwd_mask.h), the producer block by block."""
    return {
        "causal_document": M.causal_document([4200, 30, 1, 1769], s, device="cuda"),
        "shared_question": M.shared_question(s // 3, [s // 7] * 4, s, device="cuda"),
        "prefix_lm": M.prefix_lm(s // 2, None, s, device="cuda"),
        "sliding_window": M.sliding_window(1100, s, device="cuda"),
        "global_sliding_window": M.global_sliding_window(70, 700, s, device="cuda"),
        "causal_blockwise": M.causal_blockwise([4100, 1000, 900], s, device="cuda"),
        "random_c4": (random_bounds(1, 1, s, s, False, 4), False),
    }


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("name", ["causal_document", "shared_question", "prefix_lm", "sliding_window",
                                  "global_sliding_window", "causal_blockwise", "random_c4"])
def test_long_masks(fwd_path, name, d):
    s = 6000
    sri, causal = _long_masks(s)[name]
    q, k, v = qkv(1, s, s, 4, 2, d, torch.bfloat16)
    run_batched(q, k, v, sri.expand(1, 1, s, sri.shape[-1]).contiguous(), causal,
                f"{fwd_path} long {name} d={d}", backward=False)


@pytest.mark.parametrize("order", ["auto", "rule", "one"])
@pytest.mark.parametrize("name", ["causal_document", "sliding_window", "shared_question", "prefix_lm"])
def test_sectioned_tile_order(fwd_path, name, order, tuning):
    """64 (head, batch) pairs of 2048 keys: the Hopper forward's L2 rule cuts the tiles into
    sections, and the sparse masks (causal document, sliding window) switch to one section on the
    GPU from kernel A's count (sm90/tile_scheduler.h): every order (auto, the host's sections
    forced, one section forced: FLASH_EXT_SM90_FM_FWD_SECTIONS) must cover every tile once.
    (Whether the switch fires shows only in time: the outputs are the same either way.)"""
    if fwd_path == "sm80":
        pytest.skip("the tile order is the Hopper forward's")
    tuning.set("FLASH_EXT_SM90_FM_FWD_SECTIONS", order)
    s = 2048
    sri, causal = {  # kept pairs / causal's: ~0.21, ~0.27, ~0.56, ~1.2
        "causal_document": M.causal_document([500, 300, 1, 400, 347, 500], s, device="cuda"),
        "sliding_window": M.sliding_window(300, s, device="cuda"),
        "shared_question": M.shared_question(s // 4, [s // 8] * 6, s, device="cuda"),
        "prefix_lm": M.prefix_lm(s // 2, None, s, device="cuda"),
    }[name]
    q, k, v = qkv(8, s, s, 8, 8, 128, torch.bfloat16)
    run_batched(q, k, v, sri.expand(8, 1, s, sri.shape[-1]).contiguous(), causal,
                f"{fwd_path} sectioned {name} {order}", backward=False)


# ---------------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------------


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device="cuda")


@pytest.mark.parametrize("causal,c", CASES)
def test_varlen(fwd_path, causal, c):
    lens_q, lens_k = [130, 0, 7, 300], [130, 0, 20, 260] if not causal else [130, 0, 7, 300]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    hq, hkv, d = 4, 2, 64
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sri = torch.cat([random_bounds(1, hkv, lq, lk, causal, c)[0]
                     for lq, lk in zip(lens_q, lens_k)], dim=1)
    masks = flashmask_visible_varlen(sri, cu_q, cu_k, causal)
    mq, mk = max(lens_q), max(lens_k)

    def fn(q, k, v):
        return flash_ext.flashmask_attention_varlen(q, k, v, sri, cu_q, cu_k, mq, mk,
                                                    causal=causal, return_lse=True)

    def ref_fn(q, k, v, upcast):
        return attention_ref_varlen(q, k, v, cu_q, cu_k, causal=causal, attn_mask=masks,
                                    upcast=upcast)
    compare(fn, ref_fn, q, k, v, f"{fwd_path} varlen causal={causal} C={c}")


# ---------------------------------------------------------------------------------------------
# Fully masked rows and batches
# ---------------------------------------------------------------------------------------------


def fully_masked_bounds(s):
    """Causal C = 1 bounds for 3 batch rows of s tokens: in row 0 the queries >= 200 see no key,
    in row 1 none sees any, row 2 is plain causal."""
    sri = torch.full((3, 1, s, 1), s, dtype=torch.int32, device="cuda")
    sri[0, 0, :, 0] = torch.arange(1, s + 1, device="cuda").clamp(max=200)  # rows >= 200: none
    sri[1] = 0  # batch row 1: every row masked
    return sri


def assert_fully_masked(out, lse):
    """The rows of fully_masked_bounds that see no key: output 0 and lse -inf."""
    assert (out[0, 200:] == 0).all() and torch.isneginf(lse[0, :, 200:]).all()
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_fully_masked_rows_and_batches(fwd_path, dtype):
    s = 260
    sri = fully_masked_bounds(s)
    q, k, v = (t.requires_grad_() for t in qkv(3, s, s, 2, 1, 128, dtype))
    out, lse = flash_ext.flashmask_attention(q, k, v, sri, return_lse=True)
    out.backward(torch.randn_like(out))
    for t in (out, lse, q.grad, k.grad, v.grad):
        assert not t.isnan().any()
    assert_fully_masked(out, lse)
    assert (q.grad[0, 200:] == 0).all() and (q.grad[1] == 0).all()
    assert (k.grad[1] == 0).all() and (v.grad[1] == 0).all()
    assert torch.isfinite(lse[0, :, :200]).all() and torch.isfinite(lse[2]).all()


# ---------------------------------------------------------------------------------------------
# Kernel A against the Python transcription, bit for bit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal,c", CASES)
@pytest.mark.parametrize("sq,sk", [(300, 300), (257, 520), (520, 257), (1000, 130)])
def test_kept_pairs_count(causal, c, sq, sk):
    """Kernel A's count of the pairs the bounds keep (the Hopper forward's tile order reads it)
    equals the dense mask's, over random bounds (padding columns past sk included)."""
    op = getattr(torch.ops.flash_ext, "flashmask_kept_pairs", None)
    if op is None:
        pytest.skip("this build has no flash_ext::flashmask_kept_pairs op")
    sri = random_bounds(2, 2, sq, sk, causal, c)
    vis = flashmask_visible(sri, sq, causal)  # (b, hm, sq, sk)
    pairs, sum_sq, flag = op(sri, sq, sk, causal)
    assert int(pairs.item()) == int(vis.sum())
    cols = vis.sum(2).double()  # (b, hm, sk): kept rows per column
    pad = (-sk) % 128
    chunks = torch.nn.functional.pad(cols, (0, pad)).reshape(*cols.shape[:2], -1, 128).sum(-1)
    want_sq = float((chunks ** 2).sum())
    torch.testing.assert_close(sum_sq.item(), want_sq, rtol=1e-12, atol=0)
    # The backward's order flag that kernel A's last CTA wrote, against the rule on the host
    # (api/flashmask.cpp): under 80% of causal's pairs (bottom-right aligned) and a CV over 0.4.
    # (The causal count is the geometry's, whatever the bounds' causal flag.)
    causal_unit = sum(sq - min(max(j - (sk - sq), 0), sq) for j in range(sk))
    below = int(0.8 * causal_unit * 2 * 2)  # x mask heads x batch rows
    p = int(vis.sum())
    longest_first = p < below and chunks.numel() / (1 + 0.4 ** 2) * want_sq > float(p) ** 2
    assert bool(flag.item()) == longest_first, (p, below, want_sq)


@pytest.mark.parametrize("name,longest_first", [("causal_doc", True), ("shared_question", True),
                                                ("prefix_lm", False), ("sliding_window", False)])
def test_bwd_order_rule_on_bench_masks(name, longest_first):
    """The Hopper backward's CTA order as kernel A's last CTA chooses it (api/flashmask.cpp, the
    testing op returns the flag it wrote) for the bench's 8k masks: longest first in one section
    below 80% of causal's pairs where the 128-column chunks' counts vary (coefficient of variation
    > 0.4), the 3-D grid's order else: causal document and shared question take it; prefix LM
    (denser than causal) and the sliding window (even chunks) do not (the H100 A/B behind it:
    docs/perf-notes.md)."""
    op = getattr(torch.ops.flash_ext, "flashmask_kept_pairs", None)
    if op is None:
        pytest.skip("this build has no flash_ext::flashmask_kept_pairs op")
    from flash_ext import bench_mask as BM
    s, b = 8192, 2
    sri, causal, _ = BM.build_mask(name, s, device="cuda")
    sri = sri.expand(b, -1, -1, -1).contiguous()
    pairs, sum_sq, chosen = (t.item() for t in op(sri, s, s, causal))
    causal_pairs = s * (s + 1) / 2 * b * sri.shape[1]
    chunks = b * sri.shape[1] * (s // 128)
    stats = (name, pairs / causal_pairs, (chunks * sum_sq / pairs ** 2 - 1) ** 0.5)  # density, CV
    assert bool(chosen) == longest_first, stats


def _summary_op():
    op = getattr(torch.ops.flash_ext, "flashmask_summary", None)
    if op is None:
        pytest.skip("this build has no flash_ext::flashmask_summary op")
    return op


@pytest.mark.parametrize("causal,c", CASES)
@pytest.mark.parametrize("block_n", [64, 128])
def test_summary_op_matches_python(causal, c, block_n):
    op = _summary_op()
    for b, hm, sq, sk in ((2, 2, 300, 333), (1, 1, 128, 128), (3, 1, 5, 1000)):
        sri = random_bounds(b, hm, sq, sk, causal, c)
        sri[0, 0, :3, 0] = torch.tensor([0, sq, sq // 2], dtype=torch.int32)
        nb, kbs = op(sri, sq, sk, None, causal, block_n)
        want_nb = B.normalize(sri.cpu(), sq, sk, causal)
        want_kbs = B.summaries(want_nb, sk, block_n, batch=b, seqlen_q=sq)
        assert nb.shape == want_nb.shape and kbs.shape == want_kbs.shape
        cols, blocks = B.used_slots(sk, block_n, b)
        assert torch.equal(nb.cpu()[:, cols], want_nb[:, cols])
        assert torch.equal(kbs.cpu()[:, blocks], want_kbs[:, blocks])
    # Strided bounds (a view of a wider tensor) read in place.
    wide = random_bounds(2, 4, 300, 333, causal, c)
    view = wide[:, ::2]
    nb, kbs = op(view, 300, 333, None, causal, block_n)
    cols, _ = B.used_slots(333, block_n, 2)
    assert torch.equal(nb.cpu()[:, cols], B.normalize(view.cpu(), 300, 333, causal)[:, cols])


@pytest.mark.parametrize("block_n", [64, 128])
def test_summary_op_varlen(block_n):
    op = _summary_op()
    lens_q, lens_k = [5, 0, 200, 64, 129], [70, 0, 130, 64, 300]
    cu_k = _cu(lens_k)
    for causal, c in CASES:
        sri = torch.cat([random_bounds(1, 2, lq, lk, causal, c)[0]
                         for lq, lk in zip(lens_q, lens_k)], dim=1)
        nb, kbs = op(sri, max(lens_q), max(lens_k), cu_k, causal, block_n)
        want_nb = B.normalize(sri.cpu(), max(lens_q), max(lens_k), causal, cu_k.cpu())
        want_kbs = B.summaries(want_nb, max(lens_k), block_n, cu_k.cpu())
        assert nb.shape == want_nb.shape and kbs.shape == want_kbs.shape
        cols, blocks = B.used_slots(max(lens_k), block_n, len(lens_k), cu_k.cpu(), sum(lens_k))
        assert torch.equal(nb.cpu()[:, cols], want_nb[:, cols])
        assert torch.equal(kbs.cpu()[:, blocks], want_kbs[:, blocks])


def _fwd_tiles_want(sri, sq, sk, causal, block_m, block_n):
    """The Hopper forward's tile table (flashmask/flashmask_fwd_tiles.h) from the Python summaries:
    per (mask head, batch row, query block) the first and one past the last key block of the causal
    range that the summaries do not skip ((0, 0) if all are), and the order: grouped by the walk's
    first key block, the group with the longest walk first (ties: the later first block), the later
    query block first within a group."""
    b, hm = sri.shape[0], sri.shape[1]
    nb = B.normalize(sri.cpu(), sq, sk, causal)
    kbs = B.summaries(nb, sk, block_n, batch=b, seqlen_q=sq)  # (hm, blocks, 2, 4)
    bpb = -(-sk // 128) * 128 // block_n
    m_blocks = -(-sq // block_m)
    rng = torch.zeros(hm, b, m_blocks, 2, dtype=torch.int32)
    order = torch.zeros(hm, b, m_blocks, dtype=torch.int32)
    for g in range(hm):
        for bb in range(b):
            summ = kbs[g, bb * bpb:(bb + 1) * bpb]
            counts = []
            for m in range(m_blocks):
                r0, r1 = m * block_m, min(m * block_m + block_m, sq)
                hi = -(-sk // block_n)
                if causal:
                    last_col = r1 - 1 + sk - sq
                    hi = min(hi, 0 if last_col < 0 else last_col // block_n + 1)
                cls = B.classify(summ[:hi, 0], summ[:hi, 1], r0, r1)
                kept = (cls != B.SKIP).nonzero().flatten().tolist()
                rng[g, bb, m] = torch.tensor([kept[0], kept[-1] + 1] if kept else [0, 0])
                counts.append(len(kept))
            first = rng[g, bb, :, 0].tolist()
            longest = [max(c for f, c in zip(first, counts) if f == first[m]) for m in range(m_blocks)]
            order[g, bb] = torch.tensor(sorted(range(m_blocks), key=lambda m: (-longest[m], -first[m], -m)))
    return rng, order


@pytest.mark.parametrize("causal,c", CASES)
@pytest.mark.parametrize("block_n", [64, 128])
def test_fwd_tiles_op_matches_python(causal, c, block_n):
    """The tile table's kernels (flashmask_fwd_tiles.cu) against the Python transcription, exactly:
    random bounds (ranges of every length, empty ones, walks of equal length), a document mask
    (its groups are its documents, the longest first) and shapes with a partial last query block
    and more keys than queries or fewer."""
    op = getattr(torch.ops.flash_ext, "flashmask_fwd_tiles", None)
    if op is None:
        pytest.skip("this build has no flash_ext::flashmask_fwd_tiles op")
    cases = [(random_bounds(2, 2, sq, sk, causal, c), sq, sk)
             for sq, sk in ((300, 333), (128, 128), (1000, 5000), (4100, 700))]
    if causal and c == 1:
        doc = M.causal_document([700, 130, 1, 1500, 1765], 4096, device="cuda")[0]
        cases.append((doc.expand(2, 1, 4096, 1).contiguous(), 4096, 4096))
    for sri, sq, sk in cases:
        rng, order = op(sri, sq, sk, causal, 128, block_n)
        want_rng, want_order = _fwd_tiles_want(sri, sq, sk, causal, 128, block_n)
        assert torch.equal(rng.cpu(), want_rng), (sq, sk)
        assert torch.equal(order.cpu(), want_order), (sq, sk)
    with pytest.raises(RuntimeError, match="block_m must be"):
        op(cases[0][0], 300, 333, causal, 100, block_n)


@pytest.mark.parametrize("tiles", ["table", "scan"])
@pytest.mark.parametrize("name", ["causal_document", "sliding_window", "shared_question", "prefix_lm"])
def test_fwd_tiles_table_or_scan(fwd_path, name, tiles, tuning):
    """The Hopper forward with its tile table (ranges and the longest-first order) and with the
    scans it replaces (FLASH_EXT_SM90_FM_FWD_TILES): every tile once, with the same key blocks."""
    if fwd_path == "sm80":
        pytest.skip("the tile table is the Hopper forward's")
    tuning.set("FLASH_EXT_SM90_FM_FWD_TILES", tiles)
    s = 3000
    sri, causal = {
        "causal_document": M.causal_document([900, 1, 129, 1000, 970], s, device="cuda"),
        "sliding_window": M.sliding_window(300, s, device="cuda"),
        "shared_question": M.shared_question(s // 4, [s // 8] * 6, s, device="cuda"),
        "prefix_lm": M.prefix_lm(s // 2, None, s, device="cuda"),
    }[name]
    q, k, v = qkv(2, s, s, 4, 2, 128, torch.bfloat16)
    run_batched(q, k, v, sri.expand(2, 1, s, sri.shape[-1]).contiguous(), causal,
                f"{fwd_path} tiles {tiles} {name}", backward=False)


# ---------------------------------------------------------------------------------------------
# Against flash_ext's own window and varlen kernels
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("w", [0, 100, 513])
def test_sliding_window_equals_local_attention(w):
    s = 777
    q, k, v = qkv(2, s, s, 4, 2, 128, torch.bfloat16)
    sri, causal = M.sliding_window(w, s, device="cuda")
    sri = sri.expand(2, 1, s, 1).contiguous()
    out, lse = flash_ext.flashmask_attention(q, k, v, sri, causal=causal, return_lse=True)
    want, want_lse, _ = flash_ext.flash_attn_func(q, k, v, causal=True, window_size=(w, 0),
                                                  return_attn_probs=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, window_size=(w, 0))
    pt, _ = attention_ref(q, k, v, causal=True, window_size=(w, 0), upcast=False)
    check("out", out, ref, pt, f"window {w}")
    check("local out", want, ref, pt, f"window {w}")
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


def test_causal_document_equals_varlen():
    lens = [300, 1, 0, 650, 73]
    s = sum(lens)
    cu = _cu(lens)
    q, k, v = qkv(1, s, s, 4, 4, 64, torch.bfloat16)
    sri, causal = M.causal_document(lens, device="cuda")
    out, lse = flash_ext.flashmask_attention(q, k, v, sri, causal=causal, return_lse=True)
    want, want_lse, _ = flash_ext.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max(lens),
                                                         max(lens), causal=True,
                                                         return_attn_probs=True)
    ref, ref_lse = attention_ref_varlen(q[0], k[0], v[0], cu, cu, causal=True)
    pt, _ = attention_ref_varlen(q[0], k[0], v[0], cu, cu, causal=True, upcast=False)
    check("out", out[0], ref, pt, "causal document")
    check("varlen out", want, ref, pt, "causal document")
    torch.testing.assert_close(lse[0], want_lse, atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------


def test_torch_compile_fullgraph_equals_eager():
    s = 300
    sri, causal = M.prefix_lm(64, [200, 100], s, device="cuda")
    q, k, v = qkv(1, s, s, 2, 2, 64, torch.bfloat16)
    dout = torch.randn_like(q)

    def f(q, k, v, sri):
        return flash_ext.flashmask_attention(q, k, v, sri, causal=causal)
    compiled = torch.compile(f, fullgraph=True)
    got = _run_with_grads(lambda *t: (compiled(*t, sri), None), (q, k, v), dout)
    want = _run_with_grads(lambda *t: (f(*t, sri), None), (q, k, v), dout)
    assert torch.equal(got[0], want[0])  # the forward is deterministic
    for g, w in zip(got[2], want[2]):  # the backward may add in another order (atomics)
        torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# Value checks on CUDA bounds; CUDA graphs
# ---------------------------------------------------------------------------------------------


def test_value_check_once_per_version(monkeypatch):
    from flash_ext import _validation as V
    calls = []
    real = V._check_flashmask_values
    monkeypatch.setattr(V, "_check_flashmask_values", lambda *a: (calls.append(1), real(*a))[1])
    q, k, v = qkv(1, 64, 64, 2, 2, 64, torch.bfloat16)
    sri = random_bounds(1, 2, 64, 64, True, 1)
    for _ in range(3):
        flash_ext.flashmask_attention(q, k, v, sri)
    assert len(calls) == 1
    sri[0, 0, 0, 0] = 65  # an in-place write: checked again, and rejected before any launch
    with pytest.raises(flash_ext.FlashExtValueError, match="LTS = 65"):
        flash_ext.flashmask_attention(q, k, v, sri)
    monkeypatch.setattr(V, "CHECK_FLASHMASK_VALUES", False)
    sri[0, 0, 0, 0] = 0
    flash_ext.flashmask_attention(q, k, v, sri)
    assert len(calls) == 2


def test_cuda_graph_replay_with_new_bounds():
    """A call captures in a CUDA graph (no value check, no host sync while capturing); bounds
    changed in place between replays take effect."""
    s = 256
    q, k, v = qkv(1, s, s, 2, 1, 64, torch.bfloat16)
    sri = M.causal_document([100, 156], s, device="cuda")[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_ext.flashmask_attention(q, k, v, sri)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_ext.flashmask_attention(q, k, v, sri)
    for lens in ([100, 156], [30, 200, 26]):
        sri.copy_(M.causal_document(lens, s, device="cuda")[0])
        graph.replay()
        torch.cuda.synchronize()
        want = flash_ext.flashmask_attention(q, k, v, sri.clone())
        assert torch.equal(out, want), lens


# ---------------------------------------------------------------------------------------------
# The Hopper forward at d = 256 (sm90/fwd_mask.h FlashMaskPolicyLowRegs on the 128 x 64 tile),
# forced. The backward runs as auto chooses.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def hopper_d256(tuning):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper forward needs an sm90 GPU")
    tuning.set("FLASH_EXT_FWD_PATH", "sm90")
    return "sm90"


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("causal,c", CASES)
@pytest.mark.parametrize("sq,sk", [(300, 300), (200, 333), (700, 650)])
def test_hopper_d256_random_bounds(hopper_d256, dtype, causal, c, sq, sk):
    """Random bounds: nearly every block partial, key counts that end inside a block."""
    q, k, v = qkv(2, sq, sk, 4, 2, 256, dtype)
    run_batched(q, k, v, random_bounds(2, 2, sq, sk, causal, c), causal,
                f"sm90 d=256 {dname(dtype)} causal={causal} C={c} {sq}x{sk}",
                backward=False)


@pytest.mark.parametrize("name", BUILDERS)
def test_hopper_d256_builders(hopper_d256, name):
    """Structured masks: skipped, full and partial blocks side by side, walked by next_block."""
    run_builder(name, 256, "sm90 d=256", backward=False)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("hm_is_hkv", [False, True], ids=["hm1", "hm_hkv"])
def test_hopper_d256_gqa_and_mask_heads(hopper_d256, hq, hkv, hm_is_hkv):
    hm = hkv if hm_is_hkv else 1
    q, k, v = qkv(2, 211, 211, hq, hkv, 256, torch.bfloat16)
    run_batched(q, k, v, random_bounds(2, hm, 211, 211, True, 1), True,
                f"sm90 d=256 hq={hq} hkv={hkv} hm={hm}", backward=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("causal,c", CASES)
def test_hopper_d256_softcap(hopper_d256, dtype, causal, c):
    q, k, v = qkv(1, 170, 170, 2, 2, 256, dtype)
    q, k = q * 3, k * 3  # scores large enough for the cap to matter
    run_batched(q, k, v, random_bounds(1, 2, 170, 170, causal, c), causal,
                f"sm90 d=256 softcap {dname(dtype)} causal={causal} C={c}",
                softcap=30.0, backward=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_hopper_d256_fully_masked_rows_and_batches(hopper_d256, dtype):
    s = 260
    sri = fully_masked_bounds(s)
    q, k, v = qkv(3, s, s, 2, 1, 256, dtype)
    out, lse = flash_ext.flashmask_attention(q, k, v, sri, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert_fully_masked(out, lse)
    assert torch.isfinite(lse[0, :, :200]).all() and torch.isfinite(lse[2]).all()
    ref, ref_lse = attention_ref(q.float(), k.float(), v.float(), causal=True,
                                 attn_mask=flashmask_visible(sri, s, True))
    pt, _ = attention_ref(q, k, v, causal=True, attn_mask=flashmask_visible(sri, s, True),
                          upcast=False)
    check("out", out, ref, pt, "sm90 d=256 fully masked")
    check_lse(lse, ref_lse, "sm90 d=256 fully masked")


def test_hopper_d256_alt_tile_request_keeps_the_base_tile(hopper_d256, tuning):
    """FLASH_EXT_SM90_FWD_TILE=alt does not reach FlashMask calls (the 128 x 80 tile has no
    FlashMask kernel): the same result, bit for bit, as the base tile."""
    s = 700
    sri, causal = M.causal_document([s // 5, 0, 1, s // 3], s, device="cuda")
    q, k, v = qkv(1, s, s, 4, 2, 256, torch.bfloat16)
    sri = sri.expand(1, 2, s, sri.shape[-1]).contiguous()
    outs = []
    for tile in ("base", "alt"):
        tuning.set("FLASH_EXT_SM90_FWD_TILE", tile)
        outs.append(flash_ext.flashmask_attention(q, k, v, sri, causal=causal, return_lse=True))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_d256_auto_runs_the_hopper_forward(tuning):
    """auto routes a d = 256 FlashMask forward to the Hopper kernel: bit-equal to the forced
    sm90 path (the sm80 kernel adds in another order)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper forward needs an sm90 GPU")
    s = 1000
    sri, causal = M.shared_question(s // 4, [s // 8] * 5, s, device="cuda")
    q, k, v = qkv(1, s, s, 4, 2, 256, torch.bfloat16)
    sri = sri.expand(1, 2, s, sri.shape[-1]).contiguous()
    outs = {}
    for path in ("auto", "sm90", "sm80"):
        tuning.set("FLASH_EXT_FWD_PATH", path)
        outs[path] = flash_ext.flashmask_attention(q, k, v, sri, causal=causal, return_lse=True)
    assert torch.equal(outs["auto"][0], outs["sm90"][0])
    assert torch.equal(outs["auto"][1], outs["sm90"][1])
    # else the test could not tell the kernels apart
    assert not (torch.equal(outs["sm90"][0], outs["sm80"][0]) and torch.equal(outs["sm90"][1], outs["sm80"][1]))
    torch.testing.assert_close(outs["sm90"][0], outs["sm80"][0], atol=2e-2, rtol=2e-2)
