"""Forward pass on the GPU against the PyTorch reference (skipped without a CUDA GPU).

Pass criterion (FlashAttention's): with ref = the float32 reference computed from the same
low-precision inputs and pt = the same reference computed in the input dtype (what plain
PyTorch gives),

    max|out - ref| <= 2 * max|pt - ref| + max|round(ref) - ref| + 1e-5

The middle term is the error of merely rounding the exact result to fp16/bf16, which any
correct output may carry; it matters only in cases where pt happens to be exact (e.g. one key
per row, where every correct implementation returns v). The relative error
||out - ref|| / ||ref|| is printed (pytest -s) and recorded as a test property.

lse: the kernel computes scores and the log-sum-exp in float32 from the exact products of the
fp16/bf16 inputs, so it differs from the float32 reference only by summation order and the
exp2/log approximations: a relative error of order 1e-6. We allow |lse - ref| <= 1e-3 +
1e-3 * |ref| (lse grows with the score magnitude, hence the relative part) and require the
-inf entries (rows that see no key) to match exactly.

The matrix is not a full Cartesian product: a core product (dtype x head dim x causal at two
seqlen pairs) plus targeted tests per feature, to stay within a few minutes on one GPU.
"""


import pytest
import torch

import flash_ext
from flash_ext.reference import attention_ref, attention_ref_varlen

from conftest import requires_cuda

pytestmark = requires_cuda

DTYPES = [torch.float16, torch.bfloat16]
HDIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
SEQLEN_PAIRS = [(1, 1), (97, 97), (113, 203), (1025, 1025), (2048, 2048), (113, 1025),
                (1025, 113), (1, 2048), (2048, 1)]


def _fwd_paths():
    """Both forward implementations where both can run: the sm80 kernel everywhere, the Hopper
    kernel on sm90 devices when the build has 90a."""
    paths = ["sm80"]
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 \
            and "90a" in flash_ext.build_info():
        paths += ["sm90"]
    return paths


@pytest.fixture(autouse=True, params=_fwd_paths())
def fwd_path(request, tuning):
    """Every test runs once per forward path (FLASH_EXT_FWD_PATH forces the dispatch)."""
    tuning.set("FLASH_EXT_FWD_PATH", request.param)
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def dname(dtype):
    return str(dtype).replace("torch.", "")


def rand_qkv(b, sq, sk, hq, hkv, d, dtype, magnitude=1.0):
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    if magnitude != 1.0:
        q, k = (q.float() * magnitude).to(dtype), (k.float() * magnitude).to(dtype)
    return q, k, v


def assert_close_to_ref(out, lse, ref, ref_lse, pt, record=None, label=""):
    """FlashAttention's criterion for out, the float32 tolerance for lse, no NaN anywhere."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert lse.shape == ref_lse.shape, (lse.shape, ref_lse.shape)
    assert lse.dtype == torch.float32
    assert not out.isnan().any(), f"{label}: NaN in out"
    assert not lse.isnan().any(), f"{label}: NaN in lse"
    out32 = out.float()
    err = (out32 - ref).abs().max().item() if out.numel() else 0.0
    pt_err = (pt.float() - ref).abs().max().item() if out.numel() else 0.0
    round_err = (ref.to(out.dtype).float() - ref).abs().max().item() if out.numel() else 0.0
    bound = 2 * pt_err + round_err + 1e-5
    ref_norm = ref.norm().item()
    rel = (out32 - ref).norm().item() / ref_norm if ref_norm > 0 else (out32 - ref).norm().item()
    print(f"[{label}] max err {err:.3e} (pt {pt_err:.3e}, bound {bound:.3e}) rel {rel:.3e}")
    if record is not None:
        record("max_err", err)
        record("pt_max_err", pt_err)
        record("rel_err", rel)
    assert err <= bound, f"{label}: max|out - ref| = {err:.3e} > bound {bound:.3e} (pt {pt_err:.3e})"
    # -inf exactly where the reference has -inf (rows that see no key), then a tolerance.
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{label}: -inf mismatch"
    assert not torch.isposinf(lse).any()
    fin = torch.isfinite(ref_lse)
    if fin.any():
        diff = (lse[fin] - ref_lse[fin]).abs()
        tol = 1e-3 + 1e-3 * ref_lse[fin].abs()
        worst = (diff - tol).max().item()
        assert worst <= 0, f"{label}: lse off by {diff.max().item():.3e}"


def run_and_check(q, k, v, record=None, label="", **kw):
    out, lse = flash_ext.attn_fwd(q, k, v, **kw)
    ref_kw = {key: kw[key] for key in ("softmax_scale", "causal", "window_size", "softcap")
              if key in kw}
    ref, ref_lse = attention_ref(q, k, v, **ref_kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **ref_kw)
    assert out.dtype == q.dtype
    assert_close_to_ref(out, lse, ref, ref_lse, pt, record, label)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Core product: dtype x head dim x causal, at two seqlen pairs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 203), (1025, 1025)])
def test_core(dtype, d, causal, sq, sk, record_property):
    q, k, v = rand_qkv(2, sq, sk, 4, 4, d, dtype)
    run_and_check(q, k, v, record_property, f"{dname(dtype)} d={d} {sq}x{sk} causal={causal}",
                  causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SEQLEN_PAIRS)
def test_seqlens(dtype, d, causal, sq, sk, record_property):
    b = 1 if max(sq, sk) >= 2048 else 2
    q, k, v = rand_qkv(b, sq, sk, 4, 2, d, dtype)
    out, lse = run_and_check(q, k, v, record_property,
                             f"{dname(dtype)} d={d} {sq}x{sk} causal={causal}", causal=causal)
    if causal and sq > sk:
        # Bottom-right alignment: the first sq - sk rows see no key.
        assert torch.equal(out[:, : sq - sk], torch.zeros_like(out[:, : sq - sk]))
        assert torch.isneginf(lse[:, :, : sq - sk]).all()


# ---------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("hkv", [8, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_mha_gqa_mqa(dtype, hkv, causal, record_property):
    q, k, v = rand_qkv(2, 257, 300, 8, hkv, 128, dtype)
    run_and_check(q, k, v, record_property, f"hkv={hkv}", causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("sq,sk", [(97, 97), (113, 203), (203, 113), (1025, 1025), (1, 300)])
@pytest.mark.parametrize("window", [(0, 0), (16, 0), (-1, 8), (32, 32), (100, -1), (0, -1)])
def test_local_window(dtype, sq, sk, window, record_property):
    q, k, v = rand_qkv(2, sq, sk, 4, 2, 64, dtype)
    run_and_check(q, k, v, record_property, f"{sq}x{sk} window={window}", window_size=window)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_causal_with_window_left(dtype, record_property):
    q, k, v = rand_qkv(2, 300, 500, 4, 4, 96, dtype)
    out, lse = run_and_check(q, k, v, record_property, "causal+window", causal=True,
                             window_size=(64, 7))  # causal forces window_right = 0
    out2, lse2 = flash_ext.attn_fwd(q, k, v, window_size=(64, 0))
    torch.testing.assert_close(out, out2, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("sq,sk,kw", [
    (300, 100, dict(causal=True)),            # sq > sk: first 200 rows see nothing
    (200, 100, dict(window_size=(0, 0))),     # only the last 100 rows see one key each
    (256, 256, dict(window_size=(-1, -1))),   # control: nothing masked
    (128, 64, dict(window_size=(10, -1))),
])
def test_fully_masked_rows(dtype, sq, sk, kw):
    q, k, v = rand_qkv(2, sq, sk, 4, 2, 64, dtype)
    out, lse = run_and_check(q, k, v, None, f"masked {sq}x{sk} {kw}", **kw)
    visible = flash_ext.reference.local_mask(sq, sk, kw.get("window_size", (-1, -1)),
                                             kw.get("causal", False), device="cuda")
    empty = ~visible.any(1)
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[:, :, empty]).all()
    assert torch.isfinite(lse[:, :, ~empty]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap(dtype, causal, d, record_property):
    q, k, v = rand_qkv(2, 300, 400, 4, 2, d, dtype, magnitude=4.0)
    run_and_check(q, k, v, record_property, f"softcap d={d}", causal=causal, softcap=30.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("magnitude", [10.0, 30.0])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_large_magnitude(dtype, magnitude, d, record_property):
    q, k, v = rand_qkv(2, 513, 513, 4, 4, d, dtype, magnitude=magnitude)
    out, lse = run_and_check(q, k, v, record_property, f"x{magnitude} d={d}", causal=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_custom_scale(dtype, record_property):
    q, k, v = rand_qkv(2, 200, 200, 4, 4, 64, dtype)
    run_and_check(q, k, v, record_property, "scale", softmax_scale=0.3)


# ---------------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------------


def cu_of(lens):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device="cuda")


VARLEN_CASES = [
    ([0, 17, 300, 0, 1025], [0, 17, 300, 0, 1025]),
    ([0, 17, 300, 0, 1025], [5, 40, 0, 1, 1025]),  # seq 2 has queries but no keys
    ([1, 1, 1], [1000, 7, 1]),
    ([128, 64], [64, 128]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("lens_q,lens_k", VARLEN_CASES)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(32, 8)),
                                dict(causal=True, softcap=30.0)], ids=str)
@pytest.mark.parametrize("d", [64, 59])
def test_varlen(dtype, lens_q, lens_k, kw, d, record_property):
    hq, hkv = 8, 2
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype)
    cq, ck = cu_of(lens_q), cu_of(lens_k)
    out, lse = flash_ext.attn_fwd(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                  max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **kw)
    assert out.shape == q.shape and lse.shape == (hq, sum(lens_q))
    ref, ref_lse = attention_ref_varlen(q, k, v, cq, ck, **kw)
    pt, _ = attention_ref_varlen(q, k, v, cq, ck, upcast=False, **kw)
    assert_close_to_ref(out, lse, ref, ref_lse, pt, record_property, f"varlen {lens_q}/{lens_k}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_varlen_flash_attn_functions(dtype):
    lens = [0, 33, 250, 7]
    h, d = 4, 128
    qkv = torch.randn(sum(lens), 3, h, d, device="cuda", dtype=dtype)
    cu = cu_of(lens)
    out, lse, probs = flash_ext.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True,
                                                                 return_attn_probs=True)
    assert probs is None
    q, k, v = qkv.unbind(1)
    ref, ref_lse = attention_ref_varlen(q, k, v, cu, cu, causal=True)
    pt, _ = attention_ref_varlen(q, k, v, cu, cu, causal=True, upcast=False)
    assert_close_to_ref(out, lse, ref, ref_lse, pt, None, "varlen qkvpacked")
    out2 = flash_ext.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    out3 = flash_ext.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cu, cu, max(lens), max(lens),
                                                     causal=True)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)
    torch.testing.assert_close(out3, out, atol=0, rtol=0)


def test_varlen_bad_cu_seqlens_on_cuda():
    q = torch.randn(20, 2, 64, device="cuda", dtype=torch.float16)
    bad = torch.tensor([0, 15, 10, 20], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_ext.attn_fwd(q, q, q, cu_seqlens_q=bad, cu_seqlens_k=bad, max_seqlen_q=20,
                           max_seqlen_k=20)
    short = torch.tensor([0, 5, 19], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="must equal the number of tokens"):
        flash_ext.attn_fwd(q, q, q, cu_seqlens_q=short, cu_seqlens_k=short, max_seqlen_q=14,
                           max_seqlen_k=14)


def test_varlen_cuda_graph_capture():
    """No host sync on the op path: a varlen call can be captured in a CUDA graph."""
    lens = [5, 100, 0, 64]
    q = torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = cu_of(lens)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=100, max_seqlen_k=100, causal=True)
    expected, _ = flash_ext.attn_fwd(q, q, q, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flash_ext.attn_fwd(q, q, q, **kw)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = flash_ext.attn_fwd(q, q, q, **kw)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    expected, _ = flash_ext.attn_fwd(q, q, q, **kw)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Hopper kernel switches: the ping-pong modes (turns carried across tiles / off) on the
# persistent grid (where a CTA's turns run on over several tiles; masked calls claim tiles from
# a counter)
# ---------------------------------------------------------------------------------------------

# FLASH_EXT_SM90_* switch settings (set through flash_ext::set_tuning, tests/conftest.py):
# the defaults, then ping-pong forced on (the default has it off at d = 256 without a mask) and
# off. (The main-loop order is fixed per head dim at compile time: sm90/fwd_launch.cuh kLoopFor;
# the O epilogue, the grid, head sections and causal tiles aligned to end at seqlen_q are
# chosen by the host heuristics, csrc/tuning/heuristics.cpp.)
SM90_SWITCHES = [dict(), dict(PINGPONG="1"), dict(PINGPONG="0")]
SM90_SWITCH_NAMES = ("PINGPONG", "STREAM_K")
# Unset switches run at their defaults, except the stream-K tail: it changes the summation order
# of the tail tiles (so no bitwise match with the whole-tile walk); test_sm90_stream_k covers it.
SM90_SWITCH_DEFAULTS = dict(PINGPONG="auto", STREAM_K="0")


def _sm90_or_skip(fwd_path):
    if not (torch.cuda.get_device_capability()[0] == 9 and "90a" in flash_ext.build_info()):
        pytest.skip("needs an sm90 GPU and a build with 90a (the Hopper forward)")
    if fwd_path != "sm90":
        pytest.skip("sets the Hopper switches itself: runs once, under FLASH_EXT_FWD_PATH=sm90")


def _each_sm90_switch(tuning, run, check):
    """run() under every switch combination; check(out, lse, label) each result, and require
    all of them to be bitwise equal (the switches change the order of the warpgroups' GEMMs,
    never the arithmetic). The tuning fixture restores the switches afterwards."""
    first = None
    for env in SM90_SWITCHES:
        for name in SM90_SWITCH_NAMES:
            tuning.set(f"FLASH_EXT_SM90_{name}", env.get(name, SM90_SWITCH_DEFAULTS[name]))
        label = " ".join(f"{k}={v}" for k, v in env.items())
        out, lse = run()
        check(out, lse, label)
        if first is None:
            first = (label, out.clone(), lse.clone())
        else:
            assert torch.equal(out, first[1]), f"out under {label} differs from {first[0]}"
            assert torch.equal(lse, first[2]), f"lse under {label} differs from {first[0]}"


# (dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head dim, kwargs). Most have more tiles
# (128 query rows x head x batch) than an H100/H200 has SMs, so persistent CTAs run several
# tiles: they reuse their O tile in shared memory and the tile ring's slots.
SM90_SWITCH_CASES = [
    (torch.bfloat16, 3, 1000, 1000, 16, 16, 128, dict(causal=True)),
    (torch.float16, 3, 1000, 1000, 16, 16, 128, dict()),
    (torch.bfloat16, 2, 257, 257, 32, 8, 64, dict(causal=True)),             # GQA, odd seqlen
    (torch.bfloat16, 2, 1000, 1000, 16, 4, 64, dict(window_size=(128, 64))),  # local window
    (torch.bfloat16, 2, 1000, 257, 8, 1, 256, dict(causal=True)),  # MQA, sq > sk (tiles without keys); d = 256: O in Q's slab
    (torch.bfloat16, 2, 257, 1000, 16, 16, 256, dict()),
    (torch.bfloat16, 3, 300, 300, 16, 16, 96, dict(causal=True)),            # 64-byte swizzle
    (torch.bfloat16, 2, 1000, 1000, 8, 8, 80, dict(causal=True)),  # d = 80 in the 96 kernel
    (torch.float16, 2, 513, 700, 16, 16, 192, dict(window_size=(100, 0))),
    # 2 MB of K/V per head, 72 (head, batch) pairs: with a 50 MB L2 (H100, H200) the causal
    # order runs in 6 head sections (on both GPUs: 72 K/V streams need over a quarter of the
    # bandwidth, csrc/tuning/heuristics.cpp)
    (torch.bfloat16, 2, 2048, 2048, 36, 36, 256, dict(causal=True)),
    # GQA in sections of different sizes: 26 (K/V head, batch) pairs of 2 MB, at most 12 per
    # section, so 3 sections of 9, 9 and 8 K/V heads (18, 18, 16 query-head pairs), on the H100
    # (26 streams above a quarter of 3.35 TB/s); one section on the H200.
    (torch.bfloat16, 2, 2048, 2048, 26, 13, 256, dict(causal=True)),
    # Causal tiles aligned to end at seqlen_q: 9 x 128 - 1050 = 102, so the
    # first tile starts 64 rows before row 0; with sk > sq those rows would see keys (no output).
    (torch.bfloat16, 2, 1050, 1300, 8, 8, 128, dict(causal=True)),
    # A right window without a left one is aligned too (d = 64, 700 rows: 64 rows before row 0
    # on both tiles); sq > sk.
    (torch.float16, 2, 700, 500, 8, 2, 64, dict(window_size=(-1, 40))),
    # d = 128 without a mask: one key block per tile (each turn a tile boundary); GQA with
    # sk > sq; softcap with more tiles than SMs, a partial last tile and a partial key block.
    (torch.bfloat16, 2, 700, 100, 16, 16, 128, dict()),
    (torch.bfloat16, 2, 1000, 1300, 32, 4, 128, dict()),
    (torch.float16, 1, 4000, 333, 48, 48, 128, dict(softcap=15.0)),
]


def _case_id(c):
    return f"{dname(c[0])}-b{c[1]}-{c[2]}x{c[3]}-h{c[4]}/{c[5]}-d{c[6]}-{c[7]}"


def _check_case_under_switches(case, tuning, record_property, prefix=""):
    """One SM90_SWITCH_CASES-style case against the reference under every switch combination."""
    dtype, b, sq, sk, hq, hkv, d, kw = case
    q, k, v = rand_qkv(b, sq, sk, hq, hkv, d, dtype)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    _each_sm90_switch(tuning, lambda: flash_ext.attn_fwd(q, k, v, **kw),
                      lambda out, lse, label: assert_close_to_ref(out, lse, ref, ref_lse, pt,
                                                                  record_property, prefix + label))


@pytest.mark.parametrize("case", SM90_SWITCH_CASES, ids=_case_id)
def test_sm90_switches(case, fwd_path, tuning, record_property):
    _sm90_or_skip(fwd_path)
    _check_case_under_switches(case, tuning, record_property)


# Both tiles of d <= 64 and d = 256 forced (FLASH_EXT_SM90_FWD_TILE=alt / base) at every seqlen:
# alt is d <= 64 on 192 x 128 (three consumer warpgroups, the ping-pong turn going round) and
# d = 256 on 128 x 80 (key blocks not a power of 2); auto picks alt from s = 1k / 2k on.
SM90_ALT_TILE_CASES = [c for c in SM90_SWITCH_CASES if c[6] in (64, 256)] + [
    (torch.float16, 2, 1000, 1000, 12, 12, 64, dict()),
    (torch.bfloat16, 3, 193, 450, 8, 2, 48, dict(causal=True)),   # d = 48 in the 64 kernel; 1 + partial block
    (torch.bfloat16, 2, 700, 700, 8, 8, 256, dict(window_size=(90, 30))),
    (torch.float16, 2, 383, 161, 8, 8, 256, dict(causal=True, softcap=20.0)),
]


@pytest.mark.parametrize("case", SM90_ALT_TILE_CASES, ids=_case_id)
@pytest.mark.parametrize("tile", ["alt", "base"])
def test_sm90_alt_tiles(case, tile, fwd_path, tuning, record_property):
    _sm90_or_skip(fwd_path)
    tuning.set("FLASH_EXT_SM90_FWD_TILE", tile)
    _check_case_under_switches(case, tuning, record_property, prefix=f"{tile} tile ")


# Lazy rescaling (common/softmax.h): a row keeps a stale max while new blocks exceed it by at most
# 2^8. Keys scaled by a ramp, largest at key 0, which the kernel visits last (it walks key blocks
# from the end), so every row's max grows block after block: by less than the slack per block and
# far past it overall (about 20 in log2 units).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dname)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pingpong", ["auto", "0"])
def test_sm90_rescale_with_growing_max(dtype, causal, pingpong, fwd_path, tuning, record_property):
    _sm90_or_skip(fwd_path)
    tuning.set("FLASH_EXT_SM90_PINGPONG", pingpong)
    b, s, h, d = 2, 1000, 4, 128
    q, k, v = rand_qkv(b, s, s, h, h, d, dtype)
    ramp = torch.linspace(4.0, 0.1, s, device=k.device)[None, :, None, None]
    k = (k.float() * ramp).to(dtype)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    pt, _ = attention_ref(q, k, v, upcast=False, causal=causal)
    out, lse = flash_ext.attn_fwd(q, k, v, causal=causal)
    assert_close_to_ref(out, lse, ref, ref_lse, pt, record_property, f"PINGPONG={pingpong}")


# Stream-K tail (sm90/stream_k.h): without a mask, on the persistent grid, the key blocks of the
# last partial wave's tiles are split over all SMs and the pieces merged by the last to arrive.
# (dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head dim, kwargs, env). The tile of each
# case is fixed (FWD_TILE where a head dim has two), so the test knows whether the tail is split.
SM90_STREAM_K_CASES = [
    (torch.bfloat16, 1, 1000, 1000, 3, 3, 128, dict(), {}),       # one partial wave (24 tiles)
    (torch.float16, 3, 2048, 2048, 3, 3, 128, dict(), {}),        # whole tiles, then the tail
    (torch.bfloat16, 2, 1000, 1300, 8, 2, 128, dict(), {}),       # GQA, sk > sq, partial key block
    (torch.float16, 1, 700, 700, 5, 5, 128, dict(softcap=15.0), {}),
    (torch.bfloat16, 1, 1000, 1000, 3, 3, 128, dict(), dict(PINGPONG="0")),
    (torch.bfloat16, 1, 256, 8448, 1, 1, 128, dict(), {}),        # 2 tiles of 66 key blocks each
    (torch.float16, 1, 50, 20000, 1, 1, 128, dict(), {}),         # 1 tile over every SM
    (torch.bfloat16, 2, 1000, 1000, 4, 4, 64, dict(), dict(FWD_TILE="alt")),   # 192 rows, 3 WGs
    (torch.bfloat16, 2, 1000, 1000, 4, 4, 64, dict(), dict(FWD_TILE="base")),
    (torch.bfloat16, 1, 1000, 1000, 4, 4, 96, dict(), {}),
    (torch.float16, 1, 1000, 1000, 4, 4, 192, dict(), {}),
    (torch.bfloat16, 1, 1000, 1000, 6, 6, 256, dict(), dict(FWD_TILE="alt")),  # O in Q's slab, 128 x 80
    (torch.float16, 1, 1000, 999, 6, 6, 256, dict(), dict(FWD_TILE="base")),
]
# (kBlockM, kBlockN) of the Hopper kernel per (head dim, FWD_TILE): sm90/fwd_launch.cuh.
_SM90_TILE = {(64, "alt"): (192, 128), (64, "base"): (128, 128), (96, None): (128, 128),
              (128, None): (128, 128), (192, None): (128, 64), (256, "alt"): (128, 80),
              (256, "base"): (128, 64)}


def _stream_k_splits(b, sq, sk, hq, d, tile):
    """Whether the host splits the tail when forced (FLASH_EXT_SM90_STREAM_K=1): tiles not a
    multiple of the SMs, and at least one key block per SM in the tail."""
    block_m, block_n = _SM90_TILE[(d, tile)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = b * hq * -(-sq // block_m)
    tail = tiles % sms
    return tail > 0 and tail * -(-sk // block_n) >= sms


@pytest.mark.parametrize("case", SM90_STREAM_K_CASES, ids=lambda c: _case_id(c) + str(c[8]))
def test_sm90_stream_k(case, fwd_path, tuning, record_property):
    """Forced on: matches the reference, is deterministic (the pieces merge in CTA order, not
    arrival order), and differs in its bits from the whole-tile walk where the tail is split (so
    the split really ran). Auto (the default) matches the reference too."""
    _sm90_or_skip(fwd_path)
    dtype, b, sq, sk, hq, hkv, d, kw, env = case
    for name, value in env.items():
        tuning.set(f"FLASH_EXT_SM90_{name}", value)
    q, k, v = rand_qkv(b, sq, sk, hq, hkv, d, dtype)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    results = {}
    for mode in ("1", "1", "0", "auto"):
        tuning.set("FLASH_EXT_SM90_STREAM_K", mode)
        out, lse = flash_ext.attn_fwd(q, k, v, **kw)
        assert_close_to_ref(out, lse, ref, ref_lse, pt, record_property, f"STREAM_K={mode} {env}")
        if mode in results:
            assert torch.equal(out, results[mode][0]) and torch.equal(lse, results[mode][1]), \
                "STREAM_K=1: two runs differ (the merge order must not depend on arrival)"
        results[mode] = (out, lse)
    if _stream_k_splits(b, sq, sk, hq, d, env.get("FWD_TILE")):
        assert not torch.equal(results["1"][1], results["0"][1]), \
            "STREAM_K=1 gave the whole-tile walk's lse bit for bit: the tail was not split"


def test_sm90_stream_k_cuda_graph(fwd_path, tuning):
    """The stream-K tail in a CUDA graph: its workspace and the counters' memset are captured, and
    each replay (the counters zeroed again) matches an eager call on the new inputs bit for bit."""
    _sm90_or_skip(fwd_path)
    tuning.set("FLASH_EXT_SM90_STREAM_K", "1")
    b, s, h, d = 1, 1000, 3, 128
    q, k, v = rand_qkv(b, s, s, h, h, d, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_ext.attn_fwd(q, k, v)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = flash_ext.attn_fwd(q, k, v)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        g.replay()
        torch.cuda.synchronize()
        expected, expected_lse = flash_ext.attn_fwd(q, k, v)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        torch.testing.assert_close(lse, expected_lse, atol=0, rtol=0)




@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(64, 16))], ids=str)
def test_sm90_switches_varlen(kw, fwd_path, tuning):
    """Varlen stages O in shared memory and copies it out in 16-byte chunks (a TMA box would
    write into the next sequence's rows), under each switch combination."""
    _sm90_or_skip(fwd_path)
    lens_q = [0, 17, 300, 1000, 257, 1, 640]
    lens_k = [5, 17, 280, 1000, 300, 1, 640]
    hq, hkv, d = 16, 4, 128
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16)
    cq, ck = cu_of(lens_q), cu_of(lens_k)
    ref, ref_lse = attention_ref_varlen(q, k, v, cq, ck, **kw)
    pt, _ = attention_ref_varlen(q, k, v, cq, ck, upcast=False, **kw)
    _each_sm90_switch(
        tuning,
        lambda: flash_ext.attn_fwd(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                   max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **kw),
        lambda out, lse, label: assert_close_to_ref(out, lse, ref, ref_lse, pt, None,
                                                    f"varlen {label}"))


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_varlen_o_stays_inside_out(dtype, d, causal, fwd_path, tuning):
    """Varlen O copied out of shared memory in 16-byte chunks (every head dim's layout, d = 80 in
    the 96 kernel, d = 256 from registers), into out= a view of a NaN-filled buffer with extra
    columns and heads: every element of out written, nothing outside it; rows of a sequence's
    last tile past its end must not land in the next sequence."""
    _sm90_or_skip(fwd_path)
    lens_q = [0, 17, 300, 1000, 65, 1, 128]
    lens_k = [5, 17, 280, 1000, 300, 1, 128]
    hq, hkv = 6, 2
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype)
    cq, ck = cu_of(lens_q), cu_of(lens_k)
    ref, ref_lse = attention_ref_varlen(q, k, v, cq, ck, causal=causal)
    pt, _ = attention_ref_varlen(q, k, v, cq, ck, causal=causal, upcast=False)
    buf = torch.empty((sum(lens_q), hq + 1, d + 8), device="cuda", dtype=dtype)
    dst = buf[:, :hq, :d]

    def run():
        buf.fill_(float("nan"))
        out, lse = flash_ext.attn_fwd(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lens_q),
                                      max_seqlen_k=max(lens_k), causal=causal, out=dst)
        assert out.data_ptr() == dst.data_ptr()
        return out, lse

    def check(out, lse, label):
        assert not dst.isnan().any(), f"{label}: some output element was not written"
        assert buf[:, hq:].isnan().all(), f"{label}: wrote into the next head's slot"
        assert buf[..., d:].isnan().all(), f"{label}: wrote outside out's columns"
        assert_close_to_ref(dst, lse, ref, ref_lse, pt, None, f"varlen out= d={d} {label}")

    _each_sm90_switch(tuning, run, check)


@pytest.mark.parametrize("d,causal", [(80, True), (64, False), (192, True)])
def test_sm90_tma_store_stays_inside_out(d, causal, fwd_path, tuning):
    """out= a view into a NaN-filled buffer with extra rows and columns: the TMA store clips
    its boxes to out's rows (seqlen_q) and columns (head_dim < the kernel's 96 at d = 80), and
    every element of out is written."""
    _sm90_or_skip(fwd_path)
    b, sq, sk, h = 2, 300, 200, 4
    q, k, v = rand_qkv(b, sq, sk, h, h, d, torch.bfloat16)
    buf = torch.empty((b, sq + 16, h, d + 16), device="cuda", dtype=torch.bfloat16)
    dst = buf[:, 8: 8 + sq, :, :d]
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    pt, _ = attention_ref(q, k, v, causal=causal, upcast=False)

    def run():
        buf.fill_(float("nan"))
        out, lse = flash_ext.attn_fwd(q, k, v, causal=causal, out=dst)
        assert out.data_ptr() == dst.data_ptr()
        return out, lse

    def check(out, lse, label):
        assert not dst.isnan().any(), f"{label}: some output element was not written"
        assert buf[:, :8].isnan().all() and buf[:, 8 + sq:].isnan().all(), f"{label}: wrote outside out's rows"
        assert buf[..., d:].isnan().all(), f"{label}: wrote outside out's columns"
        assert_close_to_ref(dst, lse, ref, ref_lse, pt, None, f"out= {label}")

    _each_sm90_switch(tuning, run, check)


# ---------------------------------------------------------------------------------------------
# Outputs: every element written, nothing outside touched
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 59])  # 59: computed into a padded temp, then copied
@pytest.mark.parametrize("causal", [False, True])
def test_out_poisoned_slice_of_bigger_buffer(dtype, d, causal):
    b, sq, sk, h = 2, 300, 200, 4
    q, k, v = rand_qkv(b, sq, sk, h, h, d, dtype)
    buf = torch.full((b, sq + 16, h, d), float("nan"), device="cuda", dtype=dtype)
    dst = buf[:, 8: 8 + sq]
    out, lse = flash_ext.attn_fwd(q, k, v, causal=causal, out=dst)
    assert out.data_ptr() == dst.data_ptr()
    assert not dst.isnan().any(), "some output element was not written"
    assert buf[:, :8].isnan().all() and buf[:, 8 + sq:].isnan().all(), "wrote outside out"
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    pt, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    assert_close_to_ref(dst, lse, ref, ref_lse, pt, None, "out=")


def test_out_poisoned_varlen():
    lens_q, lens_k = [0, 17, 300, 0, 1025], [5, 40, 0, 1, 1025]
    q = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), 4, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    _, lse = flash_ext.attn_fwd(q, k, k, cu_seqlens_q=cu_of(lens_q), cu_seqlens_k=cu_of(lens_k),
                                max_seqlen_q=1025, max_seqlen_k=1025, causal=True, out=out)
    assert not out.isnan().any() and not lse.isnan().any()
    rows = slice(17, 317)  # sequence 2: queries, no keys
    assert torch.equal(out[rows], torch.zeros_like(out[rows]))
    assert torch.isneginf(lse[:, rows]).all()


def test_op_allocated_outputs_fully_written():
    """With deterministic-mode memory filling, torch.empty returns NaN-filled memory, so any
    element the kernel forgets to write (out or lse) shows up as NaN."""
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        q, k, v = rand_qkv(2, 333, 211, 8, 2, 96, torch.float16)
        out, lse = flash_ext.attn_fwd(q, k, v, causal=True)
        lens = [0, 17, 300, 0, 60]
        qv = torch.randn(sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16)
        outv, lsev = flash_ext.attn_fwd(qv, qv, qv, cu_seqlens_q=cu_of(lens),
                                        cu_seqlens_k=cu_of(lens), max_seqlen_q=300,
                                        max_seqlen_k=300)
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.utils.deterministic.fill_uninitialized_memory = prev_fill
    for t in (out, lse, outv, lsev):
        assert not t.isnan().any()


# ---------------------------------------------------------------------------------------------
# Strides
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_non_contiguous_inputs(dtype, record_property):
    b, s, h, d = 2, 250, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=dtype)
    q = qkv[:, :, 0]                       # slice of a packed tensor
    k = torch.randn(b, h, s, d, device="cuda", dtype=dtype).transpose(1, 2)  # (b, s, h, d) view
    v = torch.randn(b, h, s, d, device="cuda", dtype=dtype).transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    run_and_check(q, k, v, record_property, "strided", causal=True)
    out, lse, _ = flash_ext.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    ref, ref_lse = attention_ref(*qkv.unbind(2), causal=True)
    pt, _ = attention_ref(*qkv.unbind(2), causal=True, upcast=False)
    assert_close_to_ref(out, lse, ref, ref_lse, pt, None, "qkvpacked")


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_odd_strides_and_offsets(dtype, record_property):
    b, s, h, d = 2, 130, 4, 64
    # Row stride 68 elements (not a multiple of 8): attn_fwd must copy before the launch.
    q = torch.randn(b, s, h, d + 4, device="cuda", dtype=dtype)[..., :d]
    # Storage offset of 4 elements (8 bytes): rows not 16-byte aligned.
    flat = torch.randn(b * s * h * d + 4, device="cuda", dtype=dtype)
    k = flat[4:].view(b, s, h, d)
    v = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    run_and_check(q, k, v, record_property, "odd strides")


@pytest.mark.parametrize("d", [1, 8, 59])
def test_small_and_padded_head_dims(d, record_property):
    q, k, v = rand_qkv(2, 77, 91, 4, 2, d, torch.bfloat16)
    out, lse = run_and_check(q, k, v, record_property, f"d={d}", causal=True)
    assert out.shape[-1] == d


def test_empty_inputs():
    q = torch.randn(2, 0, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 10, 4, 64, device="cuda", dtype=torch.float16)
    out, lse = flash_ext.attn_fwd(q, k, k)
    assert out.shape == q.shape and lse.shape == (2, 4, 0)
    q = torch.randn(2, 5, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 0, 4, 64, device="cuda", dtype=torch.float16)
    out, lse = flash_ext.attn_fwd(q, k, k)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


# ---------------------------------------------------------------------------------------------
# FlashAttention-compatible API, torch.compile, gradients, memory
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_flash_attn_func_matches_attn_fwd(dtype):
    q, k, v = rand_qkv(2, 200, 300, 8, 2, 128, dtype)
    out, lse = flash_ext.attn_fwd(q, k, v, causal=True, softcap=5.0)
    o1 = flash_ext.flash_attn_func(q, k, v, causal=True, softcap=5.0)
    o2, lse2, probs = flash_ext.flash_attn_func(q, k, v, causal=True, softcap=5.0,
                                                return_attn_probs=True)
    o3 = flash_ext.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), causal=True,
                                            softcap=5.0)
    for o in (o1, o2, o3):
        torch.testing.assert_close(o, out, atol=0, rtol=0)
    torch.testing.assert_close(lse2, lse, atol=0, rtol=0)
    assert probs is None


class AttnModule(torch.nn.Module):
    def forward(self, q, k, v):
        o1, lse = flash_ext.attn_fwd(q, k, v, causal=True)
        o2 = flash_ext.flash_attn_func(q, k, v, window_size=(64, 64))
        return o1 * 2 + o2, lse


@pytest.mark.parametrize("d", [128, 59])
def test_torch_compile_fullgraph(d):
    q, k, v = rand_qkv(2, 256, 256, 4, 2, d, torch.bfloat16)
    mod = AttnModule()
    expected, expected_lse = mod(q, k, v)
    compiled = torch.compile(mod, fullgraph=True)
    out, lse = compiled(q, k, v)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("api", ["attn_fwd", "flash_attn_func", "qkvpacked", "varlen"])
def test_gradients_flow(api):
    """Smoke test: every entry point is differentiable (accuracy: test_autograd_gpu.py)."""
    q, k, v = rand_qkv(2, 64, 64, 4, 4, 64, torch.float16)
    q.requires_grad_(True)
    if api == "attn_fwd":
        out = flash_ext.attn_fwd(q, k, v)[0]
    elif api == "flash_attn_func":
        out = flash_ext.flash_attn_func(q, k, v, causal=True)
    elif api == "qkvpacked":
        qkv = torch.stack([q, k, v], dim=2)
        out = flash_ext.flash_attn_qkvpacked_func(qkv)
    else:
        cu = cu_of([64, 64])
        out = flash_ext.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                               cu, cu, 64, 64)
    assert out.requires_grad
    out.float().sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape and q.grad.isfinite().all()


def test_out_with_grad_is_rejected():
    q, k, v = rand_qkv(1, 16, 16, 2, 2, 64, torch.float16)
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        flash_ext.attn_fwd(q, k, v, out=torch.empty_like(q))
    with torch.no_grad():
        flash_ext.attn_fwd(q, k, v, out=torch.empty_like(q))


def test_no_quadratic_memory():
    b, s, h, d = 2, 8192, 16, 128
    q, k, v = rand_qkv(b, s, s, h, h, d, torch.bfloat16)
    flash_ext.attn_fwd(q, k, v)  # first call: warm up (lazy init, kernel loading)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = flash_ext.attn_fwd(q, k, v, causal=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    extra = peak - before - out.numel() * out.element_size() - lse.numel() * lse.element_size()
    # One N x N fp32 score matrix per head would be 2 * 16 * 8192^2 * 4 bytes = 8 GiB.
    assert extra < 8 * 2**20, f"attn_fwd allocated {extra / 2**20:.1f} MiB beyond its outputs"


def test_build_info_lists_capabilities():
    info = flash_ext.build_info()
    assert "hdims=" in info and "dtypes=" in info


def test_op_level_errors_raise_and_do_not_crash():
    """The C++ ops' own checks (reached when the Python layer is bypassed) raise RuntimeError with
    their full message. Messages with several parts (numbers, shapes) once crashed the process
    on the GPU machine (csrc/api/errors.h, FLASH_EXT_CHECK)."""
    ops = torch.ops.flash_ext
    q = torch.randn(1, 64, 3, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"heads of q \(3\) must be a multiple of heads of k/v \(2\)"):
        ops.fwd(q, k, k, None, None, 0, 0, 0.125, False, -1, -1, 0.0)
    base = torch.randn(1, 64, 2, 68, device="cuda", dtype=torch.bfloat16)[..., :64]
    with pytest.raises(RuntimeError, match=r"q strides must be multiples of 8 elements.*\[8704, 136, 68, 1\]"):
        ops.fwd(base, base, base, None, None, 0, 0, 0.125, False, -1, -1, 0.0)
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = ops.fwd(q, q, q, None, None, 0, 0, 0.125, False, -1, -1, 0.0)
    with pytest.raises(RuntimeError, match=r"lse must be \(batch, heads_q, seqlen_q\); got \[1, 2, 32\]"):
        ops.bwd(out, q, q, q, out, lse[..., :32].contiguous(), None, None, 0, 0, 0.125, False, -1, -1, 0.0, False)
