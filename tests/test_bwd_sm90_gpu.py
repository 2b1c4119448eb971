"""The Hopper (wgmma) backward, forced with FLASH_EXT_BWD_PATH=sm90, against the float32
reference autograd (criterion: see tests/test_bwd_gpu.py), and the cases it must refuse with a
clear error. Skipped without an sm90 GPU (the kernel is sm_90a only). Varlen batches:
tests/test_bwd_sm90_varlen_gpu.py."""

import pytest
import torch

from conftest import built_dtype, requires_cuda
from test_bwd_gpu import DTYPES, dname, flash_fwd_bwd, run_case

pytestmark = requires_cuda


def _is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


requires_sm90 = pytest.mark.skipif(not _is_sm90(), reason="the Hopper backward needs an sm90 GPU")


@pytest.fixture(autouse=True)
def _force_sm90(tuning):
    tuning.set("FLASH_EXT_BWD_PATH", "sm90")
    torch.manual_seed(0)


@requires_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [32, 64, 80, 128, 200, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (97, 97), (113, 203), (203, 113), (1025, 1025), (700, 2100)])
def test_sm90_core(dtype, d, causal, sq, sk):
    b, h = (1, 2) if max(sq, sk) >= 1025 else (2, 2)
    run_case(b, sq, sk, h, h, d, dtype, f"sm90 {dname(dtype)} d={d} {sq}x{sk} causal={causal}", causal=causal)


@requires_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kw", [dict(window=(0, 0)), dict(window=(16, 0)), dict(window=(-1, 8)),
                                dict(window=(100, 30)), dict(softcap=30.0), dict(softcap=5.0, causal=True),
                                dict(softmax_scale=0.3, causal=True)], ids=str)
@pytest.mark.parametrize("sq,sk", [(300, 300), (113, 530), (530, 113)])
def test_sm90_features(dtype, d, kw, sq, sk):
    run_case(2, sq, sk, 2, 2, d, dtype, f"sm90 d={d} {sq}x{sk} {kw}", **kw)


@requires_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("hkv", [4, 1])
@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (256, True)])
def test_sm90_gqa(dtype, hkv, d, causal):
    run_case(2, 333, 333, 8, hkv, d, dtype, f"sm90 gqa hkv={hkv} d={d}", causal=causal)


# GQA / MQA in both schedules of the Hopper backward (FLASH_EXT_SM90_BWD_GQA; auto chooses by
# csrc/tuning/heuristics.cpp choose_sm90_bwd_gqa_loop): one CTA per query head into expanded dK,
# dV buffers summed afterwards, or one CTA per KV head looping over its group's query heads.
@requires_sm90
@pytest.mark.parametrize("schedule", ["expand", "loop"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 2), (8, 1), (16, 2), (6, 2)])  # groups 2, 4, 8 (MQA), 8, 3
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(100, 30)), dict(window=(0, 0)),
                                dict(softcap=5.0, causal=True)], ids=str)
def test_sm90_gqa_schedules(schedule, dtype, d, hq, hkv, kw, tuning):
    tuning.set("FLASH_EXT_SM90_BWD_GQA", schedule)
    run_case(2, 333, 270, hq, hkv, d, dtype, f"sm90 gqa {schedule} {hq}/{hkv} d={d} {kw}", **kw)


@requires_sm90
@pytest.mark.parametrize("schedule", ["expand", "loop"])
@pytest.mark.parametrize("sq,sk,causal", [(2048, 2048, True), (1500, 1400, False), (200, 900, True)])
def test_sm90_gqa_schedules_long(schedule, sq, sk, causal, tuning):
    """The transformers shape's heads (8 / 2, d = 128, bf16) over many query and key blocks."""
    tuning.set("FLASH_EXT_SM90_BWD_GQA", schedule)
    run_case(1, sq, sk, 8, 2, 128, torch.bfloat16, f"sm90 gqa {schedule} {sq}x{sk}", causal=causal)


@requires_sm90
@pytest.mark.parametrize("lpt", ["0", "1"])
@pytest.mark.parametrize("schedule", ["expand", "loop"])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,kw", [
    (2, 2048, 2048, 8, 2, 128, dict(causal=True)),  # several L2 sections, the last one short
    (2, 2048, 2048, 8, 8, 64, dict(causal=True)),
    (3, 1500, 1400, 4, 2, 128, dict()),  # forced on without a mask
    (2, 700, 900, 4, 1, 256, dict(causal=True)),
    (1, 300, 530, 4, 2, 128, dict(window=(100, 0))),
], ids=str)
def test_sm90_lpt_order(lpt, schedule, b, sq, sk, hq, hkv, d, kw, tuning):
    """The longest-first CTA order (FLASH_EXT_SM90_BWD_LPT=1, sm90/bwd_tile_order.h) and the 3-D
    grid (0) both give the reference's gradients: every (key block, head, batch) once."""
    tuning.set("FLASH_EXT_SM90_BWD_LPT", lpt)
    tuning.set("FLASH_EXT_SM90_BWD_GQA", schedule)
    run_case(b, sq, sk, hq, hkv, d, torch.bfloat16, f"sm90 lpt={lpt} {schedule} {hq}/{hkv} d={d} {kw}", **kw)


@requires_sm90
@pytest.mark.parametrize("d,kw", [(64, dict(causal=True)), (128, dict()), (256, dict(window=(200, 0)))], ids=str)
def test_sm90_gqa_schedules_agree(d, kw, tuning):
    """Both schedules give the same gradients up to the rounding of the expanded buffers (the
    loop sums the group in fp32 and rounds once, so it is the closer one to the reference)."""
    q = torch.randn(2, 700, 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 650, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 650, 2, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    grads = {}
    for schedule in ("expand", "loop"):
        tuning.set("FLASH_EXT_SM90_BWD_GQA", schedule)
        grads[schedule] = flash_fwd_bwd(q, k, v, dout, **kw)[2:]
    for name, a, b in zip(("dq", "dk", "dv"), grads["expand"], grads["loop"]):
        assert not b.isnan().any(), name
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < 1e-2, f"{name}: schedules differ by {rel:.2e} (relative norm)"


@requires_sm90
@pytest.mark.parametrize("sq,sk,kw", [(64, 200, dict(window=(0, -1))), (300, 20, dict(causal=True))], ids=str)
def test_sm90_rows_without_keys(sq, sk, kw):
    """Rows that see no key (lse = -inf) give zero dq and no NaN."""
    run_case(2, sq, sk, 2, 2, 128, torch.bfloat16, f"sm90 masked rows {sq}x{sk} {kw}", **kw)


@requires_sm90
def test_sm90_strided_inputs():
    """q, k, v as slices of one packed qkv tensor (non-contiguous head / batch strides)."""
    qkv = torch.randn(2, 257, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    dout = torch.randn_like(q)
    from test_bwd_gpu import check_grads, ref_grads
    _, _, dq, dk, dv = flash_fwd_bwd(q, k, v, dout, causal=True)
    ref = ref_grads(q, k, v, dout, upcast=True, causal=True)
    pt = ref_grads(q, k, v, dout, upcast=False, causal=True)
    check_grads((dq, dk, dv), ref, pt, "sm90 strided qkv")


@requires_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d,kw", [(64, dict()), (128, dict(causal=True)), (128, dict(window=(300, 50))),
                                  (256, dict(causal=True))], ids=str)
def test_sm90_agrees_with_sm80(dtype, d, kw, tuning):
    q = torch.randn(2, 1500, 4, d, device="cuda", dtype=dtype)
    k = torch.randn(2, 1400, 2, d, device="cuda", dtype=dtype)
    v = torch.randn(2, 1400, 2, d, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    sm90 = flash_fwd_bwd(q, k, v, dout, **kw)[2:]
    tuning.set("FLASH_EXT_BWD_PATH", "sm80")
    sm80 = flash_fwd_bwd(q, k, v, dout, **kw)[2:]
    for name, a, b in zip(("dq", "dk", "dv"), sm90, sm80):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2, msg=name)


@requires_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(16, 0)), dict(window=(-1, 8)),
                                dict(window=(100, 30)), dict(softcap=5.0, causal=True)], ids=str)
@pytest.mark.parametrize("sq,sk,hq,hkv", [(300, 300, 2, 2), (113, 530, 4, 2), (530, 113, 2, 1), (1025, 1025, 2, 2)])
def test_sm90_deterministic(dtype, d, kw, sq, sk, hq, hkv):
    """deterministic=True on the Hopper backward (dQ added in descending key-block order,
    sm90/bwd_dq_order.h): against the reference, GQA / MQA through the expand schedule."""
    run_case(1, sq, sk, hq, hkv, d, dtype, f"sm90 deterministic d={d} {sq}x{sk} {hq}/{hkv} {kw}",
             deterministic=True, **kw)


@requires_sm90
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(300, 0)), dict(window=(-1, 200))], ids=str)
def test_sm90_deterministic_is_bitwise(kw):
    """Repeated deterministic backwards give the same bits: 1024 CTAs (more than an H100 holds at
    once, so CTAs wait for CTAs launched before them) of up to 64 query blocks each, whose fp32 dQ
    sums would otherwise land in a different order on every run."""
    dt = built_dtype()
    q, k, v, dout = (torch.randn(4, 4096, 8, 128, device="cuda", dtype=dt) for _ in range(4))
    runs = [flash_fwd_bwd(q, k, v, dout, deterministic=True, **kw)[2:] for _ in range(3)]
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs {kw}"


@requires_sm90
@pytest.mark.parametrize("case", ["d=192", "dropout"])
def test_sm90_refuses_unsupported(case):
    """Forcing the Hopper backward where it does not apply is a clear error, not a crash."""
    d = 192 if case == "d=192" else 64
    q = torch.randn(1, 64, 2, d, device="cuda", dtype=built_dtype())
    kw = {}
    if case == "dropout":
        import flash_ext
        out, lse, rng = flash_ext.attn_fwd(q, q, q, dropout_p=0.1)
        with pytest.raises(RuntimeError, match="FLASH_EXT_BWD_PATH=sm90"):
            flash_ext.attn_bwd(torch.randn_like(q), q, q, q, out, lse, dropout_p=0.1, rng_state=rng)
        return
    with pytest.raises(RuntimeError, match="FLASH_EXT_BWD_PATH=sm90"):
        flash_fwd_bwd(q, q, q, torch.randn_like(q), **kw)


@requires_sm90
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_sm90_bwd_cuda_graph_replay(varlen):
    """The backward's three kernels (preprocess, main, dQ convert; the later two launched as
    programmatic dependents, common/pdl.h) capture in a CUDA graph, and replays on new inputs give
    the eager gradients: bitwise in deterministic mode, within the dQ reductions' order otherwise."""
    ops = torch.ops.flash_ext
    dt, d = built_dtype(), 128
    if varlen:
        lens = [300, 5, 700, 129]
        cu = torch.tensor([0, 300, 305, 1005, 1134], device="cuda", dtype=torch.int32)
        shape, extra = (sum(lens), 4, d), (cu, cu, max(lens), max(lens))
    else:
        shape, extra = (2, 777, 4, d), (None, None, 0, 0)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dt) for _ in range(4))
    scale, det = d ** -0.5, not varlen  # deterministic: fixed length only

    def step():
        out, lse = ops.fwd(q, k, v, *extra, scale, True, -1, 0, 0.0)
        return ops.bwd(dout, q, k, v, out, lse, *extra, scale, True, -1, 0, 0.0, det)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step()
    for _ in range(2):
        for t in (q, k, v, dout):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
            if det:
                assert torch.equal(got, ref), name
            else:
                torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2, msg=name)
