"""tools/trace_fwd.py's analysis of a timeline buffer (CPU: a synthetic buffer; the trace itself
needs a FLASH_EXT_SM90_TRACE=1 build and a Hopper GPU)."""

import pytest

import trace_fwd  # tools/ is on sys.path (conftest.py)


def test_layout_matches_header():
    lay = trace_fwd.Layout.from_header()
    assert (lay.ctas, lay.roles, lay.tiles, lay.events) == (256, 4, 32, 8)
    assert lay.cta_words == 4 + 4 * 32 * 8 and lay.words == 256 * lay.cta_words
    assert lay.slot(1, 2, 3) == lay.cta_words + 4 + (2 * 32 + 3) * 8
    assert len(set(lay.names[k] for k in ("kTileTop", "kQReady", "kFirstS", "kLoopDone", "kLastPV",
                                          "kStored", "kBlocks", "kTile"))) == 8


def _write_tile(buf, lay, cta, role, slot, times, blocks, tile):
    w = lay.slot(cta, role, slot)
    for name, t in times.items():
        buf[w + lay.names[name]] = t
    buf[w + lay.names["kBlocks"]] = blocks
    buf[w + lay.names["kTile"]] = tile


def test_analyze_synthetic_timeline():
    lay = trace_fwd.Layout.from_header()
    buf = [0] * lay.words
    # CTA 3: 2 GHz, 10 us; one consumer warpgroup, two tiles of 5 key blocks at 1000 cycles each
    base = 3 * lay.cta_words
    buf[base:base + 4] = [1000, 50_000, 21_000, 60_000]
    for slot, t0 in enumerate((2000, 10_000)):
        times = {"kTileTop": t0, "kQReady": t0 + 300, "kFirstS": t0 + 800, "kLoopDone": t0 + 4800,
                 "kLastPV": t0 + 5600, "kStored": t0 + 7000}
        _write_tile(buf, lay, 3, 1, slot, times, 5, 3 + 132 * slot)
        _write_tile(buf, lay, 3, 0, slot, {"kProdTop": t0 - 500, "kProdQ": t0 - 100}, 5, 3 + 132 * slot)
    # warpgroup 1 on the first tile, 600 cycles behind warpgroup 0
    _write_tile(buf, lay, 3, 2, 0, {"kTileTop": 2500, "kQReady": 2600, "kFirstS": 3400, "kLoopDone": 7400,
                                    "kLastPV": 8200, "kStored": 9000}, 5, 3)
    # a third tile without key blocks (a window): only its start and its store are stamped
    _write_tile(buf, lay, 3, 1, 2, {"kTileTop": 17_500, "kStored": 17_900}, 0, 9)
    # CTA 7 ends 2 us earlier and has no tiles
    base = 7 * lay.cta_words
    buf[base:base + 4] = [5, 50_000, 16_005, 58_000]
    res = trace_fwd.analyze(buf, lay)
    assert [c["cta"] for c in res["ctas"]] == [3, 7]
    assert res["wg1_behind"] == [600]
    assert res["ghz"] == pytest.approx(2.0)
    assert res["steady_cycles_per_block"] == pytest.approx(1000.0)
    t0, t1 = [t for t in res["tiles"] if t["wg"] == 0]
    assert (t0["q_wait"], t0["first_s"], t0["loop"], t0["last_pv"], t0["epilogue"]) == (300, 500, 4000, 800, 1400)
    assert t0["to_next"] == 1000 and t0["span"] == 8000 and t0["boundary"] == pytest.approx(3000.0)
    assert t0["q_after_issue"] == 400
    assert t1["to_next"] == 500 and t1["span"] == 7500 and len(res["tiles"]) == 3
    assert res["kernel_ns"] == 10_000
    assert res["idle_fraction"] == pytest.approx(1 - (10_000 + 8_000) / (2 * 10_000))
    assert res["cta_end_ns"] == [8_000, 10_000]
    text = trace_fwd.format_report("d=256 s=2048", res, [0.5, 0.51], 0.52)
    assert "1000 cycles per key block" in text and "boundary" in text and "10.0" in text
    assert "warpgroup 1's first S after warpgroup 0's, same tile: median 600" in text


def test_analyze_empty_buffer():
    lay = trace_fwd.Layout.from_header()
    res = trace_fwd.analyze([0] * lay.words, lay)
    assert res["ctas"] == [] and res["tiles"] == [] and res["idle_fraction"] is None
    assert "0 CTAs" in trace_fwd.format_report("x", res, [], 0.0)


def test_make_call_cells():
    """Each trace cell names a call (built, not run: CPU tensors); the varlen cell packs the mask
    bench's documents of every batch row; an unknown name is refused."""
    import torch
    import flash_ext
    from flash_ext import bench_mask
    b, s = 2, 2048
    q = torch.zeros(b, s, 2, 64)
    for mask in trace_fwd.MASKS:
        assert callable(trace_fwd.make_call(flash_ext, q, q, q, mask))
    call = trace_fwd.make_call(flash_ext, q, q, q, "varlen_doc")
    cu = [c.cell_contents for c in call.__closure__ if isinstance(c.cell_contents, torch.Tensor)
          and c.cell_contents.dtype == torch.int32]
    assert len(cu) == 1 and cu[0][-1].item() == b * s
    assert cu[0].numel() == 2 * len(bench_mask.doc_lengths(s)) + 1
    with pytest.raises(ValueError, match="unknown trace mask"):
        trace_fwd.make_call(flash_ext, q, q, q, "nope")
