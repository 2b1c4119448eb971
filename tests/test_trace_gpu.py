"""The trace build's timeline (FLASH_EXT_SM90_TRACE=1, csrc/sm90/fwd_trace.h) on a Hopper GPU:
the stamps are ordered as the kernel runs, every tile is stored exactly once, and tracing does
not change the output. Skipped (with the reason) without a GPU, on other GPUs, and in every
build that is not a trace build."""

import pytest
import torch

import flash_ext
import trace_fwd  # tools/ is on sys.path (conftest.py)
from conftest import requires_cuda

pytestmark = requires_cuda


def _trace_or_skip():
    if torch.cuda.get_device_capability()[0] != 9 or "90a" not in flash_ext.build_info():
        pytest.skip("needs an sm90 GPU and a build with 90a (the Hopper forward)")
    if not hasattr(torch.ops.flash_ext, "sm90_trace_buffer"):
        pytest.skip("not a trace build (FLASH_EXT_SM90_TRACE=1 at build time)")


def _traced(call, lay):
    buf = torch.zeros(lay.words, dtype=torch.int64, device="cuda")
    torch.ops.flash_ext.sm90_trace_buffer(buf)
    try:
        out = call()
        torch.cuda.synchronize()
    finally:
        torch.ops.flash_ext.sm90_trace_buffer(None)
    return out, buf.cpu().tolist()


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_trace_timeline(d, causal):
    _trace_or_skip()
    if f"{d}" not in flash_ext.build_info().split("hdims=")[1].split()[0].split(","):
        pytest.skip(f"head dim {d} is not in this build")
    lay = trace_fwd.Layout.from_header()
    torch.manual_seed(0)
    b, s, h = 2, 1024, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = lambda: flash_ext.attn_fwd(q, k, v, causal=causal)  # noqa: E731
    plain = call()
    traced, buf = _traced(call, lay)
    # the trace only writes the buffer
    for a, t in zip(plain, traced):
        assert torch.equal(a, t)
    ev = lay.names
    ctas = 0
    stored = {}
    for c in range(lay.ctas):
        base = c * lay.cta_words
        clk0, ns0, clk1, ns1 = buf[base:base + 4]
        if ns0 == 0:
            assert clk0 == 0 and all(x == 0 for x in buf[base:base + lay.cta_words])
            continue
        ctas += 1
        assert clk1 > clk0 and ns1 >= ns0
        for role in range(1, lay.roles):
            for k_slot in range(lay.tiles):
                w = lay.slot(c, role, k_slot)
                e = buf[w:w + lay.events]
                if e[ev["kTileTop"]] == 0:
                    assert all(x == 0 for x in e[:6])
                    break
                assert clk0 <= e[ev["kTileTop"]] <= e[ev["kQReady"]] <= e[ev["kFirstS"]] <= \
                    e[ev["kLoopDone"]] <= clk1, (c, role, k_slot, e)
                assert e[ev["kBlocks"]] >= 1
                if e[ev["kStored"]]:
                    assert e[ev["kLoopDone"]] <= e[ev["kLastPV"]] <= e[ev["kStored"]] <= clk1
                    stored.setdefault(role, []).append(e[ev["kTile"]])
        # the producer's slots hold the same tiles in the same order
        prod = [buf[lay.slot(c, 0, j) + ev["kTile"]] for j in range(lay.tiles)
                if buf[lay.slot(c, 0, j) + ev["kProdTop"]]]
        cons = [buf[lay.slot(c, 1, j) + ev["kTile"]] for j in range(lay.tiles)
                if buf[lay.slot(c, 1, j) + ev["kTileTop"]]]
        assert prod == cons, (c, prod, cons)
    assert ctas > 0
    # every tile stored once by each consumer warpgroup (stream-K: by its last piece only)
    roles = sorted(stored)
    assert roles and all(sorted(stored[r]) == sorted(stored[roles[0]]) for r in roles)
    tiles = sorted(stored[roles[0]])
    assert tiles == sorted(set(tiles)) and tiles[0] == 0 and len(tiles) == tiles[-1] + 1
    res = trace_fwd.analyze(buf, lay)
    assert res["ghz"] and 0.5 < res["ghz"] < 3.0
    assert len(res["tiles"]) == len(tiles) * len(roles)
