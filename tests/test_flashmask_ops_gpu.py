"""FlashMask at the op level on the GPU: kernel A (flash_ext::flashmask_summary) against a plain
torch transcription of the normalization and summaries (docs/design-flashmask.md 2.1; the
layout of csrc/common/flashmask.h), and the sm80 forward with startend_row_indices against a
dense-mask reference. The public API's tests are tests/test_flashmask_gpu.py."""

import math

import pytest
import torch

from conftest import requires_cuda

CHUNK = 128  # nb's column padding and the rounding of R (csrc/common/flashmask.h)


def round_up(x, m):
    return (x + m - 1) // m * m


# ---------------------------------------------------------------------------------------------
# The contract in torch: normalized (s, e) intervals per column, nb entries, block summaries
# ---------------------------------------------------------------------------------------------


def normalized_intervals(raw, causal, R):
    """raw (..., C) int -> (ls, le, us, ue), each (...), int64: clamped into [0, R], ordered,
    an empty interval made (R, R)."""
    v = raw.long().clamp(0, R)
    C = raw.shape[-1]
    full = torch.full_like(v[..., 0], R)
    if causal:
        ls, le, us, ue = v[..., 0], (v[..., 1] if C == 2 else full), full, full
    elif C == 2:
        ls, le, us, ue = v[..., 0], full, torch.zeros_like(full), v[..., 1]
    else:
        ls, le, us, ue = v[..., 0], v[..., 1], v[..., 2], v[..., 3]
    le = torch.maximum(le, ls)
    ue = torch.maximum(ue, us)
    l_empty, u_empty = ls == le, us == ue
    ls, le = torch.where(l_empty, full, ls), torch.where(l_empty, full, le)
    us, ue = torch.where(u_empty, full, us), torch.where(u_empty, full, ue)
    return ls, le, us, ue


def padded_columns(raw_cols, causal, R, ncols):
    """(s, e) per column of one (sequence, mask head): raw_cols (L, C) -> (ncols, 4) int64 with
    the padding columns (0, R, R, R) after the L real ones."""
    out = torch.tensor([0, R, R, R], dtype=torch.long, device=raw_cols.device).repeat(ncols, 1)
    if raw_cols.shape[0] > 0:
        out[: raw_cols.shape[0]] = torch.stack(normalized_intervals(raw_cols, causal, R), -1)
    return out


def as_nb(se):
    return torch.stack([se[:, 0], se[:, 1] - se[:, 0], se[:, 2], se[:, 3] - se[:, 2]], -1)


def block_summaries(se, block_n):
    """(ncols, 4) (s, e) columns, ncols a multiple of block_n -> (blocks, 2, 4)."""
    g = se.view(-1, block_n, 4)
    skip = torch.stack([g[..., 0].amax(1), g[..., 1].amin(1), g[..., 2].amax(1), g[..., 3].amin(1)], -1)
    full = torch.stack([g[..., 0].amin(1), g[..., 1].amax(1), g[..., 2].amin(1), g[..., 3].amax(1)], -1)
    return torch.stack([skip, full], 1)


def random_bounds(shape_cols, C, sq, gen, device):
    """Random raw bounds, some out of [0, sq] and some intervals reversed (kernel A clamps and
    orders), many empty or full."""
    x = torch.randint(-3, sq + 4, shape_cols + (C,), generator=gen)
    pick = torch.rand(shape_cols + (C,), generator=gen)
    x = torch.where(pick < 0.15, torch.zeros_like(x), x)
    x = torch.where((pick > 0.85), torch.full_like(x, sq), x)
    return x.to(torch.int32).to(device)


CASES = [(True, 1), (True, 2), (False, 2), (False, 4)]


@requires_cuda
@pytest.mark.parametrize("causal,C", CASES)
@pytest.mark.parametrize("block_n", [32, 64, 128])
@pytest.mark.parametrize("sq,sk", [(200, 300), (128, 128), (1, 77), (513, 1000)])
def test_summary_batched_matches_transcription(causal, C, block_n, sq, sk):
    gen = torch.Generator().manual_seed(sq * 7 + sk + C + block_n)
    b, hm = 2, 3
    # Strided bounds: made (hm, b, sk, C) then viewed (b, hm, sk, C).
    bounds = random_bounds((hm, b, sk), C, sq, gen, "cuda").permute(1, 0, 2, 3)
    nb, kbs = torch.ops.flash_ext.flashmask_summary(bounds, sq, sk, None, causal, block_n)
    R, sk_pad = round_up(sq, CHUNK), round_up(sk, CHUNK)
    assert nb.shape == (hm, b * sk_pad, 4) and kbs.shape == (hm, b * sk_pad // block_n, 2, 4)
    for g in range(hm):
        for bi in range(b):
            se = padded_columns(bounds[bi, g].cpu(), causal, R, sk_pad)
            got_nb = nb[g, bi * sk_pad:(bi + 1) * sk_pad].cpu().long()
            torch.testing.assert_close(got_nb, as_nb(se), atol=0, rtol=0)
            nblk = sk_pad // block_n
            got_kbs = kbs[g, bi * nblk:(bi + 1) * nblk].cpu().long()
            torch.testing.assert_close(got_kbs, block_summaries(se, block_n), atol=0, rtol=0)


@requires_cuda
@pytest.mark.parametrize("causal,C", CASES)
@pytest.mark.parametrize("block_n", [32, 64, 128])
def test_summary_varlen_matches_transcription(causal, C, block_n):
    gen = torch.Generator().manual_seed(11 * C + block_n + causal)
    lens_k = [130, 0, 1, 64, 300, 257]
    cu = [0]
    for L in lens_k:
        cu.append(cu[-1] + L)
    total_k, batch, hm, max_sq = cu[-1], len(lens_k), 2, 190
    bounds = random_bounds((hm, total_k), C, max_sq, gen, "cuda")
    cu_k = torch.tensor(cu, dtype=torch.int32, device="cuda")
    nb, kbs = torch.ops.flash_ext.flashmask_summary(bounds, max_sq, max(lens_k), cu_k, causal, block_n)
    assert nb.shape == (hm, total_k + CHUNK * batch, 4)
    assert kbs.shape == (hm, total_k // block_n + batch + 1, 2, 4)
    R = round_up(max_sq, CHUNK)
    for g in range(hm):
        for bi, L in enumerate(lens_k):
            ncols = round_up(L, CHUNK)
            se = padded_columns(bounds[g, cu[bi]:cu[bi] + L].cpu(), causal, R, ncols)
            col0 = cu[bi] + CHUNK * bi
            torch.testing.assert_close(nb[g, col0:col0 + ncols].cpu().long(), as_nb(se), atol=0, rtol=0)
            nblk = (L + block_n - 1) // block_n  # the sequence's own blocks (the used slots)
            blk0 = cu[bi] // block_n + bi
            want = block_summaries(se, block_n)[:nblk]
            torch.testing.assert_close(kbs[g, blk0:blk0 + nblk].cpu().long(), want, atol=0, rtol=0)


@requires_cuda
def test_summary_rejects_bad_structure():
    b = torch.zeros(1, 1, 64, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.flash_ext.flashmask_summary(b.long(), 64, 64, None, True, 64)
    with pytest.raises(RuntimeError, match="C = 1"):
        c4 = b[..., :1].expand(1, 1, 64, 4).contiguous()
        torch.ops.flash_ext.flashmask_summary(c4, 64, 64, None, True, 64)
    with pytest.raises(RuntimeError, match="C = 2"):
        torch.ops.flash_ext.flashmask_summary(b[..., :1].contiguous(), 64, 64, None, False, 64)
    with pytest.raises(RuntimeError, match="32, 64 or 128"):
        torch.ops.flash_ext.flashmask_summary(b, 64, 64, None, True, 48)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        strided = torch.zeros(1, 1, 2, 64, dtype=torch.int32, device="cuda").transpose(2, 3)
        torch.ops.flash_ext.flashmask_summary(strided, 64, 64, None, True, 64)


# ---------------------------------------------------------------------------------------------
# The sm80 forward with startend_row_indices against a dense-mask reference
# ---------------------------------------------------------------------------------------------


def dense_masked(bounds_se, causal, sq, sk):
    """bool (hm, sq, sk), True = masked: the intervals of each column and the causal rule
    (bottom-right aligned). bounds_se: (ls, le, us, ue) each (hm, sk)."""
    ls, le, us, ue = (x[:, None, :] for x in bounds_se)
    i = torch.arange(sq, device=ls.device)[None, :, None]
    masked = ((ls <= i) & (i < le)) | ((us <= i) & (i < ue))
    if causal:
        j = torch.arange(sk, device=ls.device)[None, None, :]
        masked = masked | (j > i + sk - sq)
    return masked


def masked_attention_ref(q, k, v, masked, softmax_scale, softcap=0.0):
    """fp32 attention, q (sq, hq, d), k, v (sk, hkv, d), masked bool (hq, sq, sk). Returns out
    (sq, hq, d) and lse (hq, sq); a row that sees nothing gets out 0 and lse -inf."""
    hq, hkv = q.shape[1], k.shape[1]
    kc = k.float().repeat_interleave(hq // hkv, dim=1)
    vc = v.float().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float() * softmax_scale, kc)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.einsum("hqk,khd->qhd", p, vc), lse


def check_close(out, lse, ref, ref_lse):
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = ~torch.isinf(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-3, rtol=1e-3)


def doc_bounds(sk, sq, causal, C, gen, device):
    """Document-like bounds for one mask head: a few random segments; masked below each
    document's end (LTS), and with C = 4 / non-causal, an upper band too."""
    cuts = sorted(set(torch.randint(1, max(sk, 2), (3,), generator=gen).tolist())) + [sk]
    raw, start = [], 0
    for end in cuts:
        for _ in range(start, end):
            lts = min(round(end * sq / sk), sq)
            if causal:
                raw.append([lts] if C == 1 else [lts, min(lts + sq // 4, sq)])
            elif C == 2:
                raw.append([lts, round(start * sq / sk)])
            else:
                raw.append([lts, sq, 0, round(start * sq / sk)])
        start = end
    return torch.tensor(raw, dtype=torch.int32, device=device)


@requires_cuda
@pytest.mark.parametrize("causal,C", CASES)
@pytest.mark.parametrize("d", [64, 128, 32])
@pytest.mark.parametrize("sq,sk", [(300, 300), (190, 450), (512, 256)])
@pytest.mark.parametrize("hkv,hm", [(2, 2), (2, 1)])
def test_fwd_matches_dense_reference(causal, C, d, sq, sk, hkv, hm):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(sq + sk + d + C)
    b, hq, dtype = 2, 4, torch.bfloat16
    q = torch.randn(b, sq, hq, d, dtype=dtype, device="cuda")
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
    bounds = torch.stack([torch.stack([doc_bounds(sk, sq, causal, C, gen, "cuda") for _ in range(hm)])
                          for _ in range(b)])  # (b, hm, sk, C)
    scale = 1.0 / math.sqrt(d)
    out, lse = torch.ops.flash_ext.fwd(q, k, v, None, None, 0, 0, scale, causal, -1, 0 if causal else -1,
                                       0.0, 0.0, None, False, bounds)
    R = round_up(sq, CHUNK)
    for bi in range(b):
        masked = dense_masked(normalized_intervals(bounds[bi], causal, R), causal, sq, sk)  # (hm, sq, sk)
        masked = masked.repeat_interleave(hq // hm, dim=0)
        ref, ref_lse = masked_attention_ref(q[bi], k[bi], v[bi], masked, scale)
        check_close(out[bi], lse[bi], ref, ref_lse)


@requires_cuda
@pytest.mark.parametrize("causal,C", [(True, 2), (False, 4)])
def test_fwd_varlen_softcap_fully_masked_rows(causal, C):
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k = [100, 257, 1, 64], [100, 300, 40, 1]
    cq, ck = [0], [0]
    for a, c in zip(lens_q, lens_k):
        cq.append(cq[-1] + a)
        ck.append(ck[-1] + c)
    hq, hkv, d, dtype = 4, 2, 128, torch.float16
    q = torch.randn(cq[-1], hq, d, dtype=dtype, device="cuda")
    k = torch.randn(ck[-1], hkv, d, dtype=dtype, device="cuda")
    v = torch.randn(ck[-1], hkv, d, dtype=dtype, device="cuda")
    max_sq = max(lens_q)
    per_seq = [doc_bounds(L, sqi, causal, C, gen, "cuda") if L > 0 else torch.zeros(0, C, dtype=torch.int32,
                                                                                      device="cuda")
               for sqi, L in zip(lens_q, lens_k)]
    bounds = torch.cat(per_seq)[None].repeat(hkv, 1, 1).contiguous()  # (hm = hkv, total_k, C)
    bounds[1, :, 0] = 0  # head 1: LTS = 0 masks whole columns from row 0 (rows see nothing)
    cu_q = torch.tensor(cq, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(ck, dtype=torch.int32, device="cuda")
    scale, softcap = 0.09, 30.0
    out, lse = torch.ops.flash_ext.fwd(q, k, v, cu_q, cu_k, max_sq, max(lens_k), scale, causal, -1,
                                       0 if causal else -1, softcap, 0.0, None, False, bounds)
    R = round_up(max_sq, CHUNK)
    for i, (sqi, ski) in enumerate(zip(lens_q, lens_k)):
        bse = normalized_intervals(bounds[:, ck[i]:ck[i + 1]], causal, R)
        masked = dense_masked(bse, causal, sqi, ski).repeat_interleave(hq // hkv, dim=0)
        qs, ks, vs = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        ref, ref_lse = masked_attention_ref(qs, ks, vs, masked, scale, softcap)
        check_close(out[cq[i]:cq[i + 1]], lse[:, cq[i]:cq[i + 1]], ref, ref_lse)
    assert torch.isinf(lse[2:]).any()  # mask head 1's query heads have fully masked rows
    assert (out[:, 2:][torch.isinf(lse[2:]).T] == 0).all()


@requires_cuda
def test_fwd_checks_bounds_structure():
    q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16, device="cuda")
    good = torch.full((1, 1, 64, 1), 64, dtype=torch.int32, device="cuda")

    def call(bounds, causal=True, wl=-1, wr=0, dropout_p=0.0):
        rng = torch.tensor([0, 0], dtype=torch.int64) if dropout_p > 0 else None
        return torch.ops.flash_ext.fwd(q, q, q, None, None, 0, 0, 0.125, causal, wl, wr, 0.0, dropout_p, rng,
                                       False, bounds)

    call(good)  # the reference call passes
    with pytest.raises(RuntimeError, match="int32"):
        call(good.long())
    with pytest.raises(RuntimeError, match="C = 2"):
        call(good, causal=False)
    with pytest.raises(RuntimeError, match="heads"):
        call(good.expand(1, 3, 64, 1))
    with pytest.raises(RuntimeError, match="seqlen_k"):
        call(good[:, :, :32])
    with pytest.raises(RuntimeError, match="dropout"):
        call(good, dropout_p=0.1)
    with pytest.raises(RuntimeError, match="window"):
        call(good, wl=16)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        call(good.cpu())


@requires_cuda
@pytest.mark.parametrize("d", [128, 256])
def test_forced_sm90_path_flashmask(tuning, d):
    """The Hopper forward runs FlashMask at every head dim it has (at d = 256 with the
    low-register mask): equal to the sm80 kernel's result within bf16 rounding."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    torch.manual_seed(0)
    q = torch.randn(1, 200, 2, d, dtype=torch.bfloat16, device="cuda")
    bounds = torch.randint(0, 201, (1, 1, 200, 1), dtype=torch.int32, device="cuda")
    bounds = torch.maximum(bounds, torch.arange(200, device="cuda", dtype=torch.int32).view(1, 1, 200, 1))
    args = (q, q, q, None, None, 0, 0, d ** -0.5, True, -1, 0, 0.0, 0.0, None, False, bounds)
    tuning.set("FLASH_EXT_FWD_PATH", "sm80")
    o80, l80 = torch.ops.flash_ext.fwd(*args)
    tuning.set("FLASH_EXT_FWD_PATH", "sm90")
    o90, l90 = torch.ops.flash_ext.fwd(*args)
    torch.testing.assert_close(o90, o80, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(l90, l80, atol=1e-3, rtol=1e-3)

