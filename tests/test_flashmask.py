"""FlashMask on the CPU (docs/design-flashmask.md 10.1): the dense form against a loop over
FlashMask's documented construction and literal matrices, every builder against its own dense
rule, the block classification (flash_ext/_flashmask_blocks.py) for soundness and exactness,
the input checks (class, message, no op called), the reference's fully masked rows, and the
public functions against the reference through CPU stand-ins of the ops' kernels."""

import math
import random

import pytest
import torch

import flash_ext
from flash_ext import _flashmask_blocks as B
from flash_ext import _validation as V
from flash_ext import flashmask_masks as M
from flash_ext import ops
from flash_ext.errors import DeviceError, FlashExtTypeError, FlashExtValueError
from flash_ext.reference import (attention_ref, attention_ref_varlen, flashmask_visible,
                                 flashmask_visible_varlen)

from conftest import EXTENSION_BUILT

CASES = [(True, 1), (True, 2), (False, 2), (False, 4)]


def random_bounds(b, hm, sq, sk, causal, c, gen=None):
    """Valid random bounds (b, hm, sk, C): values in [0, sq], ordered pairs."""
    def r(*shape):
        return torch.randint(0, sq + 1, shape, generator=gen)
    x = r(b, hm, sk, c)
    if c == 4 or (causal and c == 2):
        lo = torch.minimum(x[..., 0::2], x[..., 1::2])
        hi = torch.maximum(x[..., 0::2], x[..., 1::2])
        x = torch.stack([lo, hi], dim=-1).flatten(-2)
    return x.to(torch.int32)


def dense_loop(sri, causal):
    """FlashMask's documented dense construction (sq == sk), transcribed as a loop: start from
    all visible, then per column j mask rows [LTS, LTE or the end), and either the rows above the
    diagonal (causal) or [UTS or 0, UTE)."""
    b, hm, s, c = sri.shape
    vis = torch.ones(b, hm, s, s, dtype=torch.bool)
    for bi in range(b):
        for h in range(hm):
            for j in range(s):
                col = [int(x) for x in sri[bi, h, j]]
                lts = col[0]
                lte = col[1] if (c == 4 or (causal and c == 2)) else s
                vis[bi, h, lts:lte, j] = False
                if causal:
                    vis[bi, h, :j, j] = False
                else:
                    uts, ute = (col[2], col[3]) if c == 4 else (0, col[1])
                    vis[bi, h, uts:ute, j] = False
    return vis


@pytest.mark.parametrize("causal,c", CASES)
def test_visible_matches_documented_loop(causal, c, seed):
    for s in (1, 6, 23):
        sri = random_bounds(2, 3, s, s, causal, c)
        assert torch.equal(flashmask_visible(sri, s, causal), dense_loop(sri, causal))


def _rows(text):
    return torch.tensor([[ch == "1" for ch in line.split()] for line in text.strip().splitlines()])


LITERALS = [
    (True, [[2, 2, 5, 5, 5, 5]], """
1 . . . . .
1 1 . . . .
. . 1 . . .
. . 1 1 . .
. . 1 1 1 .
. . . . . ."""),
    (True, [[2, 2, 6, 6, 6, 6], [4, 4, 6, 6, 6, 6]], """
1 . . . . .
1 1 . . . .
. . 1 . . .
. . 1 1 . .
1 1 1 1 1 .
1 1 1 1 1 1"""),
    (False, [[3, 3, 3, 6, 6, 6], [0, 0, 0, 3, 3, 5]], """
1 1 1 . . .
1 1 1 . . .
1 1 1 . . .
. . . 1 1 .
. . . 1 1 .
. . . 1 1 1"""),
    (False, [[6, 3, 4, 5, 6, 6], [6, 6, 6, 6, 6, 6], [0, 0, 0, 1, 1, 1], [0, 0, 0, 2, 3, 4]], """
1 1 1 1 1 1
1 1 1 . . .
1 1 1 1 . .
1 . 1 1 1 .
1 . . 1 1 1
1 . . . 1 1"""),
]


@pytest.mark.parametrize("causal,cols,text", LITERALS, ids=["c1", "c2", "nc2", "nc4"])
def test_visible_literal_matrices(causal, cols, text):
    sri = torch.tensor(cols, dtype=torch.int32).T.reshape(1, 1, 6, len(cols))
    want = _rows(text)
    assert torch.equal(flashmask_visible(sri, 6, causal)[0, 0], want)
    assert torch.equal(dense_loop(sri, causal)[0, 0], want)


@pytest.mark.parametrize("causal,c", CASES)
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (1, 7)])
def test_visible_sq_ne_sk(causal, c, sq, sk, seed):
    sri = random_bounds(1, 2, sq, sk, causal, c)
    got = flashmask_visible(sri, sq, causal)
    for h in range(2):
        for i in range(sq):
            for j in range(sk):
                col = [int(x) for x in sri[0, h, j]]
                if causal:
                    lo, hi, us, ue = col[0], (col[1] if c == 2 else sq), 0, 0
                else:
                    lo, hi, us, ue = (col[0], sq, 0, col[1]) if c == 2 else col
                masked = lo <= i < hi or us <= i < ue or (causal and j > i + sk - sq)
                assert bool(got[0, h, i, j]) == (not masked), (h, i, j, col)


# ---------------------------------------------------------------------------------------------
# Builders against their own dense rules
# ---------------------------------------------------------------------------------------------


def _segment_ids(lens, s):
    ids, start = torch.empty(s, dtype=torch.long), torch.empty(s, dtype=torch.long)
    pos = 0
    for n, length in enumerate(list(lens) + [s - sum(lens)]):
        ids[pos:pos + length] = n
        start[pos:pos + length] = pos
        pos += length
    return ids, start


def _check_builder(result, rule, s, causal_want):
    sri, causal = result
    assert causal is causal_want
    assert sri.dtype == torch.int32 and sri.shape[:3] == (1, 1, s)
    assert int(sri.min()) >= 0 and int(sri.max()) <= s
    i = torch.arange(s).view(s, 1)
    j = torch.arange(s).view(1, s)
    assert torch.equal(flashmask_visible(sri, s, causal)[0, 0], rule(i, j))


def _random_lens(rng, s, max_parts=6, allow_empty=True):
    cuts = sorted(rng.randint(0, s) for _ in range(rng.randint(0, max_parts)))
    lens = [b - a for a, b in zip([0] + cuts, cuts + [s])]
    if allow_empty and rng.random() < 0.5:
        lens.insert(rng.randint(0, len(lens)), 0)
    return lens


SIZES = [1, 2, 7, 129, 300]


@pytest.mark.parametrize("s", SIZES)
def test_causal_document(s):
    rng = random.Random(s)
    for lens in ([s], [1] * s, _random_lens(rng, s), _random_lens(rng, s)[:-1]):
        doc, _ = _segment_ids(lens, s)
        _check_builder(M.causal_document(lens, s),
                       lambda i, j: (doc[i] == doc[j]) & (j <= i), s, True)
    cu = torch.tensor([0, s // 2, s], dtype=torch.int32)
    assert torch.equal(M.causal_document(cu_seqlens=cu)[0], M.causal_document([s // 2, s - s // 2])[0])


def test_causal_document_batch():
    sri, causal = M.causal_document([[3, 5], [8], [0, 1, 7]])
    assert causal and sri.shape == (3, 1, 8, 1)
    for row, lens in enumerate([[3, 5], [8], [0, 1, 7]]):
        assert torch.equal(sri[row], M.causal_document(lens, 8)[0][0])


@pytest.mark.parametrize("s", SIZES)
def test_shared_question(s):
    rng = random.Random(s + 1)
    for _ in range(4):
        parts = _random_lens(rng, s, 5)
        qn, answers = parts[0], parts[1:]
        if rng.random() < 0.5 and answers:
            answers = answers[:-1]  # leftover tokens: a sample of their own
        seg, _ = _segment_ids([qn] + answers, s)
        n_seg = len(answers) + 1
        sample = torch.where(seg < n_seg, torch.zeros_like(seg), torch.ones_like(seg))
        in_q = (seg == 0) | (seg >= n_seg)

        def rule(i, j):
            return (j <= i) & (sample[i] == sample[j]) & (in_q[j] | (seg[i] == seg[j]))
        _check_builder(M.shared_question(qn, answers, s), rule, s, True)


def test_shared_question_packed():
    s = 40
    sri, causal = M.shared_question([4, 3], [[5, 6], [2, 0, 7]], s)
    seg_lens = [4, 5, 6, 3, 2, 0, 7]
    seg, _ = _segment_ids(seg_lens, s)
    seg_sample = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    seg_q = torch.tensor([1, 0, 0, 1, 0, 0, 0, 1], dtype=torch.bool)
    sample, in_q = seg_sample[seg], seg_q[seg]
    _check_builder((sri, causal), lambda i, j: (j <= i) & (sample[i] == sample[j])
                   & (in_q[j] | (seg[i] == seg[j])), s, True)


@pytest.mark.parametrize("s", SIZES)
def test_prefix_lm(s):
    rng = random.Random(s + 2)
    for _ in range(4):
        lens = _random_lens(rng, s)
        prefixes = [rng.randint(0, n + 2) for n in lens]
        doc, start = _segment_ids(lens, s)
        plen = torch.tensor(prefixes + [0])[doc]
        plen = torch.minimum(plen, torch.tensor(s))

        def rule(i, j):
            return (doc[i] == doc[j]) & ((j < start[j] + plen[j]) | (j <= i))
        _check_builder(M.prefix_lm(prefixes, lens, s), rule, s, False)
    doc, start = _segment_ids([s], s)
    p = s // 4
    _check_builder(M.prefix_lm(p, seqlen=s), lambda i, j: (j < p) | (j <= i), s, False)


@pytest.mark.parametrize("s", SIZES)
def test_sliding_window(s):
    for w in (0, 1, 5, s, 2 * s + 3):
        _check_builder(M.sliding_window(w, s), lambda i, j: (i - w <= j) & (j <= i), s, True)
    for wl, wr in ((0, 0), (3, 1), (1, 4), (s, 2)):
        _check_builder(M.sliding_window((wl, wr), s, causal=False),
                       lambda i, j: (i - wl <= j) & (j <= i + wr), s, False)


@pytest.mark.parametrize("s", SIZES)
def test_global_sliding_window(s):
    for g, w in ((0, 2), (1, 1), (3, 0), (s, 1), (2, s + 4)):
        _check_builder(M.global_sliding_window(g, w, s),
                       lambda i, j: (i < g) | (j < g) | ((i - j).abs() <= w), s, False)


@pytest.mark.parametrize("s", SIZES)
def test_causal_blockwise(s):
    rng = random.Random(s + 3)
    for lens in ([s], _random_lens(rng, s), _random_lens(rng, s)[:-1]):
        blk, _ = _segment_ids(lens, s)
        last = int(blk[-1])
        _check_builder(M.causal_blockwise(lens, s),
                       lambda i, j: (j <= i) & ((blk[i] == blk[j]) | (blk[i] == last)), s, True)


def test_builders_reject_bad_sizes():
    with pytest.raises(FlashExtValueError, match="sum to 9, more than seqlen"):
        M.causal_document([4, 5], 8)
    with pytest.raises(FlashExtValueError, match="must be >= 0"):
        M.causal_document([4, -1], 8)
    with pytest.raises(FlashExtValueError, match="needs causal=False"):
        M.sliding_window((2, 3), 8)
    with pytest.raises(FlashExtValueError, match="share seqlen, C and causal"):
        M.stack([M.causal_document([4], 4), M.sliding_window(2, 4, causal=False)])


# ---------------------------------------------------------------------------------------------
# Block classification
# ---------------------------------------------------------------------------------------------


def _classes(sri, sq, sk, causal, bm, bn):
    """(class per (m, n) pair, interval mask over nb's columns) for a batch-1, hm-1 mask."""
    nb = B.normalize(sri, sq, sk, causal)
    kbs = B.summaries(nb, sk, bn, batch=1, seqlen_q=sq)
    masked = B.interval_mask(nb, sq)[0]  # (sq, cols)
    nm, nn = -(-sq // bm), kbs.shape[1]
    out = torch.empty(nm, nn, dtype=torch.long)
    for m in range(nm):
        r0, r1 = m * bm, min(m * bm + bm, sq)
        out[m] = B.classify(kbs[0, :, 0], kbs[0, :, 1], r0, r1)
    return out, masked


def _pair_truth(masked, m, n, bm, bn, sq):
    r0, r1 = m * bm, min(m * bm + bm, sq)
    cols = masked.shape[1]
    blk = masked[r0:r1, n * bn:min(n * bn + bn, cols)]
    pad = n * bn + bn > cols  # columns past nb's end are padding: masked
    return bool(blk.all()), bool((~blk).all()) and not pad


@pytest.mark.parametrize("causal,c", CASES)
@pytest.mark.parametrize("bm,bn", [(64, 64), (128, 80), (128, 128), (64, 128)])
def test_block_tests_sound(causal, c, bm, bn, seed):
    gen = torch.Generator().manual_seed(bm + bn + c)
    for sq, sk in ((200, 200), (130, 300), (300, 70)):
        # Random bounds, and random bounds snapped to a coarse grid (whole blocks masked).
        for snap in (1, 32):
            sri = (random_bounds(1, 1, sq, sk, causal, c, gen) // snap * snap).to(torch.int32)
            classes, masked = _classes(sri, sq, sk, causal, bm, bn)
            for m in range(classes.shape[0]):
                for n in range(classes.shape[1]):
                    all_masked, none_masked = _pair_truth(masked, m, n, bm, bn, sq)
                    if classes[m, n] == B.SKIP:
                        assert all_masked, (m, n)
                    if classes[m, n] == B.FULL:
                        assert none_masked, (m, n)


@pytest.mark.parametrize("bm", [64, 128])
def test_query_runs_match_classify(bm, seed):
    """The Hopper backward's runs (FlashMaskQueryRuns) give fm_classify's class for every query
    block: on the summaries of random masks and on random summaries (any order of the values)."""
    gen = torch.Generator().manual_seed(bm)
    pairs = []
    for causal, c in CASES:
        for sq, sk in ((200, 200), (130, 300), (300, 70), (64, 256), (1000, 128)):
            for snap in (1, 32, 64):
                sri = (random_bounds(1, 1, sq, sk, causal, c, gen) // snap * snap).to(torch.int32)
                kbs = B.summaries(B.normalize(sri, sq, sk, causal), sk, 128, batch=1, seqlen_q=sq)
                pairs += [(kbs[0, n, 0], kbs[0, n, 1], sq) for n in range(kbs.shape[1])]
    for i in range(3000):
        sq = int(torch.randint(1, 700, (1,), generator=gen))
        skip = torch.randint(0, sq + 200, (4,), generator=gen)
        if i % 2:  # UT's end touching LT's start (both_cover's edge)
            skip[3] = skip[0]
        pairs.append((skip, torch.randint(0, sq + 200, (4,), generator=gen), sq))
    for skip, full, sq in pairs:
        runs = B.query_runs(skip, full, bm, sq)
        for m in range(-(-sq // bm)):
            want = int(B.classify(skip, full, m * bm, min(m * bm + bm, sq)))
            assert B.runs_class(runs, m) == want, (skip.tolist(), full.tolist(), sq, m)


def test_interval_mask_is_the_dense_mask(seed):
    for causal, c in CASES:
        sri = random_bounds(2, 1, 150, 190, causal, c)
        nb = B.normalize(sri, 150, 190, causal)
        masked = B.interval_mask(nb, 150)  # (1, 150, 2 * 256)
        for b in range(2):
            want = _intervals_only(sri[b, 0], 150, causal)
            assert torch.equal(masked[0, :, b * 256:b * 256 + 190], want)
            assert masked[0, :, b * 256 + 190:(b + 1) * 256].all()


def _intervals_only(sri_col, sq, causal):
    """Masked (sq, sk) by the intervals alone (no causal rule)."""
    from flash_ext.reference import flashmask_intervals
    ls, le, us, ue = (t.unsqueeze(0) for t in flashmask_intervals(sri_col, sq, causal))
    i = torch.arange(sq).unsqueeze(1)
    return ((ls <= i) & (i < le)) | ((us <= i) & (i < ue))


def _aligned_masks(a, s):
    """Builders whose boundaries fall on multiples of a (the block size), s a multiple of a."""
    return [M.causal_document([a, 3 * a, 0, s - 4 * a], s),
            M.shared_question(a, [2 * a, a, a], s),
            M.prefix_lm([a, 2 * a], [2 * a, s - 2 * a], s),
            M.global_sliding_window(a, 2 * a - 1, s),
            M.causal_blockwise([a, 2 * a, a], s),
            M.sliding_window(2 * a - 1, s),
            M.sliding_window((a - 1, 2 * a - 1), s, causal=False)]


@pytest.mark.parametrize("a", [64, 80, 128])
def test_block_tests_exact_on_aligned_builders(a):
    s = 8 * a
    for sri, causal in _aligned_masks(a, s):
        classes, masked = _classes(sri, s, s, causal, a, a)
        for m in range(classes.shape[0]):
            for n in range(classes.shape[1]):
                all_masked, none_masked = _pair_truth(masked, m, n, a, a, s)
                assert (classes[m, n] == B.SKIP) == all_masked, (causal, m, n)
                assert (classes[m, n] == B.FULL) == none_masked, (causal, m, n)


def test_normalize_layout_and_values():
    R = 128
    sri = torch.tensor([[[[0], [3], [5], [9]]]], dtype=torch.int32)  # causal C=1, sq = 5
    nb = B.normalize(sri, 5, 4, True)
    assert nb.shape == (1, 128, 4) and nb.dtype == torch.int32
    assert nb[0, 0].tolist() == [0, R, R, 0]
    assert nb[0, 1].tolist() == [3, R - 3, R, 0]
    assert nb[0, 3].tolist() == [9, R - 9, R, 0]  # clamped into [0, R], not [0, sq]
    assert nb[0, 4:].tolist() == [[0, R, R, 0]] * 124
    # Non-causal C=2: UT [0, UTE); an empty UT (UTE = 0) becomes (R, R).
    nb = B.normalize(torch.tensor([[[[2, 0], [7, 3]]]], dtype=torch.int32), 7, 2, False)
    assert nb[0, 0].tolist() == [2, R - 2, R, 0]
    assert nb[0, 1].tolist() == [7, R - 7, 0, 3]  # [sq, R): rows past seqlen_q only
    # C=4 with LTS == LTE: empty.
    nb = B.normalize(torch.tensor([[[[4, 4, 1, 2]]]], dtype=torch.int32), 7, 1, False)
    assert nb[0, 0].tolist() == [R, 0, 1, 1]


def test_summaries_varlen_layout():
    lens_q, lens_k = [5, 0, 200, 64], [70, 0, 130, 64]
    cu_k = torch.tensor([0, 70, 70, 200, 264], dtype=torch.int32)
    hm, mq = 2, 200
    sri = torch.cat([random_bounds(1, hm, lq, lk, True, 2)[0] for lq, lk in zip(lens_q, lens_k)],
                    dim=1)
    nb = B.normalize(sri, mq, 130, True, cu_seqlens_k=cu_k)
    assert nb.shape == (hm, 264 + 128 * 4, 4)
    for bn in (64, 128):
        kbs = B.summaries(nb, 130, bn, cu_seqlens_k=cu_k)
        assert kbs.shape == (hm, 264 // bn + 4 + 1, 2, 4)
        for b in range(4):
            k0, n = int(cu_k[b]), lens_k[b]
            one = B.normalize(sri[:, k0:k0 + n].unsqueeze(0), mq, n, True)
            c0 = k0 + 128 * b
            width = -(-n // 128) * 128
            assert torch.equal(nb[:, c0:c0 + width], one[:, :width])
            nblk = -(-n // bn)
            want = B.summaries(one, n, bn, batch=1)[:, :nblk]
            blk0 = k0 // bn + b
            assert torch.equal(kbs[:, blk0:blk0 + nblk], want)
        cols, blocks = B.used_slots(130, bn, 4, cu_k, 264)
        assert len(set(cols.tolist())) == len(cols) and len(set(blocks.tolist())) == len(blocks)


# ---------------------------------------------------------------------------------------------
# Input checks: class, message, and no op called
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_op(monkeypatch, meta_ok):
    """The ops replaced by a recorder that fails the test when called."""
    calls = []

    def record(*args, **kwargs):
        calls.append(args)
        raise AssertionError("an op was called for bad input")
    monkeypatch.setattr(ops, "_fwd", record)
    monkeypatch.setattr(ops, "_fwd_out", record)
    monkeypatch.setattr(ops, "_bwd", record)
    return calls


def _qkv(b=2, sq=16, sk=24, hq=4, hkv=2, d=64):
    return (torch.randn(b, sq, hq, d).half(), torch.randn(b, sk, hkv, d).half(),
            torch.randn(b, sk, hkv, d).half())


def _good(b=2, hm=2, sk=24, c=1, fill=3):
    return torch.full((b, hm, sk, c), fill, dtype=torch.int32)


BAD = [
    ("dtype", lambda: _good().to(torch.int64), {}, FlashExtTypeError, "must be int32; got int64"),
    ("not a tensor", lambda: [[3]], {}, FlashExtTypeError, "must be a torch.Tensor; got list"),
    ("rank", lambda: _good()[0], {}, FlashExtValueError,
     r"must be 4-D \(batch, nheads_mask, seqlen_k, C\); got shape \(2, 24, 1\)"),
    ("batch", lambda: _good(b=3), {}, FlashExtValueError, r"must have k's batch size \(2\)"),
    ("seqlen_k", lambda: _good(sk=16), {}, FlashExtValueError,
     r"one row per key column \(seqlen_k = 24\)"),
    ("heads", lambda: _good(hm=4), {}, FlashExtValueError,
     r"must have 1 or nheads_kv \(2\) mask heads; got 4"),
    ("C=4 causal", lambda: _good(c=4), {}, FlashExtValueError,
     "startend_row_indices has C = 4, which needs causal=False"),
    ("C=1 non-causal", lambda: _good(c=1), {"causal": False}, FlashExtValueError,
     "has C = 1, which needs causal=True"),
    ("C=3", lambda: _good(c=3), {}, FlashExtValueError, "got C = 3"),
    ("device", lambda: _good().to("meta"), {}, DeviceError, "must be on q's device"),
    ("last dim", lambda: torch.zeros(2, 2, 24, 8, dtype=torch.int32)[..., ::2], {"causal": False},
     FlashExtValueError, "last dimension of startend_row_indices must be contiguous"),
    ("negative", lambda: _good().index_put_((torch.tensor(1), torch.tensor(0), torch.tensor(5),
                                             torch.tensor(0)), torch.tensor(-1, dtype=torch.int32)),
     {}, FlashExtValueError, r"must lie in \[0, seqlen_q\]; got LTS = -1 at \(1, 0, 5\)"),
    ("above sq", lambda: _good(c=2, fill=17), {}, FlashExtValueError,
     r"must lie in \[0, seqlen_q\]; got LTS = 17 at \(0, 0, 0\) \(seqlen_q = 16"),
    ("LTS > LTE", lambda: torch.cat([_good(fill=5), _good(fill=4)], -1), {}, FlashExtValueError,
     "must have LTS <= LTE; got LTS = 5 > LTE = 4"),
    ("UTS > UTE", lambda: torch.cat([_good(fill=1), _good(fill=2), _good(fill=9),
                                     _good(fill=8)], -1),
     {"causal": False}, FlashExtValueError, "must have UTS <= UTE; got UTS = 9 > UTE = 8"),
    ("causal type", lambda: _good(), {"causal": 1}, FlashExtTypeError, "causal must be a bool"),
]


@pytest.mark.parametrize("name,make,kw,cls,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_bounds_raise_before_any_op(no_op, name, make, kw, cls, msg):
    q, k, v = _qkv()
    with pytest.raises(cls, match=msg):
        flash_ext.flashmask_attention(q, k, v, make(), **kw)
    assert no_op == []


def test_bad_varlen_bounds(no_op):
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 6, 20], dtype=torch.int32)
    q, k, v = torch.randn(12, 4, 32).half(), torch.randn(20, 2, 32).half(), \
        torch.randn(20, 2, 32).half()
    sri = torch.full((2, 20, 1), 5, dtype=torch.int32)
    args = (cu_q, cu_k, 7, 14)
    with pytest.raises(FlashExtValueError, match=r"must be 3-D \(nheads_mask, total_k, C\)"):
        flash_ext.flashmask_attention_varlen(q, k, v, sri[None], *args)
    with pytest.raises(FlashExtValueError, match=r"one row per key column \(total_k = 20\)"):
        flash_ext.flashmask_attention_varlen(q, k, v, sri[:, :19], *args)
    # Column 6 belongs to the third sequence (seqlen_q 7): 5 is fine there; 8 is not. Column 2
    # is in the first sequence (seqlen_q 5): 6 is out of range there.
    bad = sri.clone()
    bad[1, 8, 0] = 8
    with pytest.raises(FlashExtValueError, match=r"LTS = 8 at \(1, 8\) \(its sequence's "
                                                 r"seqlen_q = 7"):
        flash_ext.flashmask_attention_varlen(q, k, v, bad, *args)
    bad = sri.clone()
    bad[0, 2, 0] = 6
    with pytest.raises(FlashExtValueError, match=r"LTS = 6 at \(0, 2\) \(its sequence's "
                                                 r"seqlen_q = 5"):
        flash_ext.flashmask_attention_varlen(q, k, v, bad, *args)
    with pytest.raises(FlashExtValueError, match="needs cu_seqlens_q and cu_seqlens_k"):
        flash_ext.flashmask_attention_varlen(q, k, v, sri, None, cu_k, 7, 14)
    assert no_op == []


def test_q_k_v_checks_come_first(no_op):
    q, k, v = _qkv()
    with pytest.raises(FlashExtTypeError, match="float16 and bfloat16 only"):
        flash_ext.flashmask_attention(q.float(), k, v, _good().long())
    assert no_op == []


def test_value_check_policy(monkeypatch):
    """CPU bounds: always checked. A check that passed is remembered per (tensor, version):
    an in-place write makes the next call check again."""
    q, k, _ = _qkv()
    sri = _good()
    calls = []
    real = V._check_flashmask_values
    monkeypatch.setattr(V, "_check_flashmask_values",
                        lambda *a: (calls.append(1), real(*a))[1])
    V.check_flashmask_inputs("f", sri, q, k, True, False)
    V.check_flashmask_inputs("f", sri, q, k, True, False)
    assert len(calls) == 1
    sri[0, 0, 0, 0] = 99
    with pytest.raises(FlashExtValueError, match="LTS = 99"):
        V.check_flashmask_inputs("f", sri, q, k, True, False)
    # The switch applies to CUDA tensors only; for CPU tensors the values are always read.
    monkeypatch.setattr(V, "CHECK_FLASHMASK_VALUES", False)
    with pytest.raises(FlashExtValueError, match="LTS = 99"):
        V.check_flashmask_inputs("f", sri, q, k, True, False)
    assert V.should_check_values(sri, V.CHECK_FLASHMASK_VALUES)
    # Under FakeTensorMode (as torch.compile traces) no value is read.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        fs = mode.from_tensor(sri)
        V.check_flashmask_inputs("f", fs, fq, fk, True, False)


# ---------------------------------------------------------------------------------------------
# The reference's fully masked rows
# ---------------------------------------------------------------------------------------------


def test_reference_fully_masked_rows(seed):
    sri = torch.tensor([2, 2, 5, 5, 5, 5], dtype=torch.int32).view(1, 1, 6, 1)  # row 5: nothing
    sri = sri.repeat(2, 1, 1, 1)
    sri[1] = 0  # batch row 1: every row masked
    mask = flashmask_visible(sri, 6, True)
    q, k, v = (torch.randn(2, 6, 4, 16, requires_grad=True) for _ in range(3))
    out, lse = attention_ref(q, k, v, causal=True, attn_mask=mask)
    (out * torch.randn_like(out)).sum().backward()
    for t in (out, lse, q.grad, k.grad, v.grad):
        assert not t.isnan().any()
    assert (out[0, 5] == 0).all() and torch.isneginf(lse[0, :, 5]).all()
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    assert (q.grad[0, 5] == 0).all() and (q.grad[1] == 0).all()
    assert (k.grad[1] == 0).all() and (v.grad[1] == 0).all()
    assert torch.isfinite(lse[0, :, :5]).all()


def test_reference_mask_heads_and_varlen(seed):
    """attn_mask with hm = hkv mask heads follows the query-head groups; attention_ref_varlen
    hands each sequence its own mask."""
    sri = random_bounds(1, 2, 9, 9, False, 4)
    mask = flashmask_visible(sri, 9, False)
    q, k, v = torch.randn(1, 9, 4, 8), torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8)
    out, lse = attention_ref(q, k, v, attn_mask=mask)
    for h in range(4):
        o, l_ = attention_ref(q[:, :, h:h + 1], k[:, :, h // 2:h // 2 + 1],
                              v[:, :, h // 2:h // 2 + 1], attn_mask=mask[:, h // 2:h // 2 + 1])
        torch.testing.assert_close(out[:, :, h:h + 1], o)
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    vsri = torch.cat([random_bounds(1, 2, n, n, True, 1)[0] for n in (4, 0, 5)], dim=1)
    masks = flashmask_visible_varlen(vsri, cu, cu, True)
    o, l_ = attention_ref_varlen(q[0], k[0], v[0], cu, cu, causal=True, attn_mask=masks)
    o2, l2 = attention_ref(q[:, 4:], k[:, 4:], v[:, 4:], causal=True, attn_mask=masks[2])
    torch.testing.assert_close(o[4:], o2[0])


# ---------------------------------------------------------------------------------------------
# The public functions against the reference, through CPU kernels standing in for the ops'
# ---------------------------------------------------------------------------------------------


def _dense_from_op_args(sri, cu_q, cu_k, q, k, causal):
    if cu_q is None:
        return flashmask_visible(sri, q.shape[1], causal)
    return flashmask_visible_varlen(sri, cu_q, cu_k, causal)


def _cpu_fwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, wl, wr, softcap, dropout_p=0.0,
             rng_state=None, deterministic=False, startend_row_indices=None, seqused_k=None,
             alibi_slopes=None):
    assert startend_row_indices is not None and dropout_p == 0.0
    assert (wl, wr) == ((-1, 0) if causal else (-1, -1))
    assert q.shape[-1] % 8 == 0
    mask = _dense_from_op_args(startend_row_indices, cu_q, cu_k, q, k, causal)
    kw = dict(softmax_scale=scale, causal=causal, softcap=softcap, attn_mask=mask)
    if cu_q is None:
        out, lse = attention_ref(q, k, v, **kw)
    else:
        out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, **kw)
    return out.to(q.dtype), lse


def _cpu_bwd(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, causal, wl, wr, softcap,
             deterministic, dropout_p=0.0, rng_state=None, startend_row_indices=None,
             alibi_slopes=None):
    assert startend_row_indices is not None
    with torch.enable_grad():
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        o, _ = _cpu_fwd(qf, kf, vf, cu_q, cu_k, mq, mk, scale, causal, wl, wr, softcap,
                        startend_row_indices=startend_row_indices)
        dq, dk, dv = torch.autograd.grad(o, (qf, kf, vf), dout.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def cpu_kernels(meta_ok):
    """CPU kernels for the stand-in fwd / bwd ops (the reference, with the dense mask made from
    the op's startend_row_indices): the Python layer and the autograd formula run unchanged."""
    if EXTENSION_BUILT:
        pytest.skip("the stand-in ops are not in use (the extension is built)")
    lib = torch.library.Library("flash_ext", "IMPL")
    lib.impl("fwd", _cpu_fwd, "CPU")
    lib.impl("bwd", _cpu_bwd, "CPU")
    yield
    lib._destroy()


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    out.backward(dout)
    return out, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal,c", CASES)
@pytest.mark.parametrize("hq,hkv,hm,d", [(2, 2, 1, 64), (4, 1, 1, 40), (4, 2, 2, 16)])
def test_api_matches_reference(cpu_kernels, causal, c, hq, hkv, hm, d, seed):
    b, sq, sk = 2, 11, 11 if causal else 13
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hkv, d, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(b, sq, hq, d, dtype=torch.bfloat16)
    sri = random_bounds(b, hm, sq, sk, causal, c)
    kw = dict(causal=causal, softcap=5.0 if c == 2 else 0.0)
    got = _grads(lambda q, k, v: flash_ext.flashmask_attention(q, k, v, sri, return_lse=True,
                                                               **kw), q, k, v, dout)
    mask = flashmask_visible(sri, sq, causal)
    want = _grads(lambda q, k, v: attention_ref(q.float(), k.float(), v.float(), attn_mask=mask,
                                                **kw), q, k, v, dout.float())
    for g, w in zip(got, want):
        assert not g.isnan().any()
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
    out = flash_ext.flashmask_attention(q, k, v, sri, **kw)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


def test_api_varlen_matches_reference(cpu_kernels, seed):
    lens_q, lens_k = [5, 0, 9], [7, 0, 9]
    cu_q = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 7, 16], dtype=torch.int32)
    q = torch.randn(14, 4, 24, dtype=torch.float16)
    k, v = (torch.randn(16, 2, 24, dtype=torch.float16) for _ in range(2))
    dout = torch.randn(14, 4, 24, dtype=torch.float16)
    for causal, c in CASES:
        sri = torch.cat([random_bounds(1, 2, lq, lk, causal, c)[0]
                         for lq, lk in zip(lens_q, lens_k)], dim=1)
        got = _grads(lambda q, k, v: flash_ext.flashmask_attention_varlen(
            q, k, v, sri, cu_q, cu_k, 9, 9, causal=causal, return_lse=True), q, k, v, dout)
        masks = flashmask_visible_varlen(sri, cu_q, cu_k, causal)
        want = _grads(lambda q, k, v: attention_ref_varlen(
            q.float(), k.float(), v.float(), cu_q, cu_k, causal=causal, attn_mask=masks),
            q, k, v, dout.float())
        assert got[1].shape == (4, 14)
        for g, w in zip(got, want):
            assert not g.isnan().any()
            torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)


def test_api_builder_and_empty_inputs(cpu_kernels, seed):
    sri, causal = M.causal_document([[3, 4, 1]] * 2)
    q = torch.randn(2, 8, 2, 32, dtype=torch.bfloat16)
    out, lse = flash_ext.flashmask_attention(q, q, q, sri, causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 2, 8)
    # No key: nothing to launch, out 0 and lse -inf, as attn_fwd.
    empty_k = torch.randn(2, 0, 2, 32, dtype=torch.bfloat16)
    out, lse = flash_ext.flashmask_attention(
        q, empty_k, empty_k, torch.zeros(2, 1, 0, 1, dtype=torch.int32), return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_api_op_arguments(monkeypatch, meta_ok):
    """What reaches flash_ext::fwd: the causal flag, window (-1, 0) / (-1, -1), no dropout, the
    bounds as the trailing argument, a head dim padded to a multiple of 8."""
    seen = []

    def fake(*args):
        seen.append(args)
        q = args[0]
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    monkeypatch.setattr(ops, "_fwd", fake)
    q = torch.randn(1, 4, 2, 12).half()
    sri = torch.zeros(1, 1, 4, 2, dtype=torch.int32)
    out = flash_ext.flashmask_attention(q, q, q, sri, causal=False, softmax_scale=0.5,
                                        softcap=-1.0)
    assert out.shape == (1, 4, 2, 12)
    args = seen[0]
    assert args[0].shape[-1] == 16
    assert args[3:] == (None, None, 0, 0, 0.5, False, -1, -1, 0.0, 0.0, None, False, sri)
    flash_ext.flashmask_attention(q[..., :8].contiguous(), q[..., :8].contiguous(),
                                  q[..., :8].contiguous(), sri[..., :1].contiguous())
    assert seen[1][3:12] == (None, None, 0, 0, 1 / math.sqrt(8), True, -1, 0, 0.0)


def test_api_traces_under_torch_compile(cpu_kernels, seed):
    """fullgraph: no graph break from the checks or the wiring; equal to eager."""
    sri, causal = M.sliding_window(3, 10)
    q = torch.randn(1, 10, 2, 16, dtype=torch.bfloat16)

    def f(q, k, v, sri):
        return flash_ext.flashmask_attention(q, k, v, sri, causal=True)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, q, q, sri), f(q, q, q, sri))
