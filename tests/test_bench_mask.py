"""The mask section of the benchmark (flash_ext/bench_mask.py) on the CPU: argument parsing
through python -m flash_ext.bench's parser, the cell list, the masks and their densities, the
table; one short end-to-end run on a GPU."""

import argparse

import pytest
import torch

from conftest import requires_cuda
from flash_ext import bench, bench_mask
from flash_ext.reference import flashmask_visible


def test_parse_mask_defaults_and_grid():
    args = bench.parse_args(["--mask", "causal_doc,shared_question,prefix_lm,sliding_window",
                             "--seqlens", "8k,16k,32k", "--hdims", "128,256"])
    assert args.mask == ["causal_doc", "shared_question", "prefix_lm", "sliding_window"]
    assert args.seqlens == [8192, 16384, 32768] and args.hdims == [128, 256]
    assert args.directions == ["fwd", "bwd"] and args.mask_peers == ["flex", "sdpa", "causal"]
    cells = bench_mask.mask_cells(args.mask, args.seqlens, args.hdims)
    assert len(cells) == 24
    assert cells[0] == bench_mask.MaskCell("causal_doc", 8192, 128)
    assert (cells[0].batch, cells[0].heads) == (2, 16)
    c = bench_mask.MaskCell("sliding_window", 32768, 256)
    assert (c.batch, c.heads) == (1, 8) and c.name == "sliding_window d=256 s=32768 b=1 h=8"


def test_parse_mask_quick_and_defaults():
    args = bench.parse_args(["--mask", "all", "--quick"])
    assert args.mask == list(bench_mask.TARGET_MASKS)
    assert args.seqlens == [8192] and args.hdims == [128]
    args = bench.parse_args(["--mask", "global_sliding_window", "--directions", "fwd",
                             "--mask-peers", "flex"])
    assert args.seqlens == [8192, 16384, 32768] and args.directions == ["fwd"]
    assert args.mask_peers == ["flex"]
    # Without --mask nothing changes for the main bench.
    assert bench.parse_args([]).mask is None


@pytest.mark.parametrize("argv,msg", [(["--mask", "diagonal"], "unknown mask 'diagonal'"),
                                      (["--mask", "all", "--mask-peers", "fa3"],
                                       "unknown mask peer 'fa3'")])
def test_parse_mask_errors(argv, msg, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert msg in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        bench_mask.parse_masks(",")


@pytest.mark.parametrize("name", bench_mask.MASKS)
def test_masks_and_density(name):
    s = 1000
    sri, causal, params = bench_mask.build_mask(name, s)
    assert sri.shape[:3] == (1, 1, s) and sri.dtype == torch.int32 and params
    dense = flashmask_visible(sri, s, causal)[0, 0]
    u, dens, block_dens = bench_mask.mask_density(sri, causal, block=128, rows_per_chunk=256)
    assert u == int(dense.sum()) and dens == pytest.approx(u / s / s)
    pad = torch.nn.functional.pad(dense, (0, 24, 0, 24)).view(8, 128, 8, 128)
    assert block_dens == pytest.approx(float(pad.any(dim=3).any(dim=1).float().mean()))


def test_doc_lengths():
    for s in (8192, 32768):
        lens = bench_mask.doc_lengths(s)
        assert sum(lens) == s and lens == bench_mask.doc_lengths(s)
        assert all(s // 10 <= n <= s // 3 for n in lens[:-1]) and lens[-1] >= 1


def test_row_tflops_and_table():
    row = bench_mask.MaskRow("causal_doc d=128 s=8192 b=2 h=16", "causal_doc", 8192, 128, 2, 16,
                             "bwd", {}, unmasked=10**8, density=0.1, block_density=0.11,
                             ms={"flash_ext": 1.0, "flex": 1.5, "sdpa": None, "causal": 2.0},
                             errors={"sdpa": "too big"},
                             memory_mib={"flash_ext": 0.5, "flex": 0.1, "sdpa": 128.0})
    bench_mask.row_tflops(row)
    assert row.tflops["flash_ext"] == pytest.approx(4 * 128 * 16 * 2 * 2.5 * 1e8 / 1e-3 / 1e12)
    causal_entries = 8192 * 8193 / 2
    assert row.tflops["causal"] == pytest.approx(4 * 128 * 16 * 2 * 2.5 * causal_entries
                                                 / 2e-3 / 1e12)
    assert row.speedup("flex") == pytest.approx(1.5) and row.speedup("sdpa") is None
    text = bench_mask.format_mask_table([row], ["flex", "sdpa", "causal"])
    assert "1.50" in text and "sdpa: too big" in text and "0.50/0.10/128.00" in text
    assert row.to_json()["speedup"]["flex"] == pytest.approx(1.5)


@requires_cuda
def test_mask_section_end_to_end(tmp_path):
    args = bench.parse_args(["--mask", "causal_doc", "--seqlens", "1024", "--hdims", "64",
                             "--mask-peers", "sdpa,causal", "--out", str(tmp_path)])
    assert bench_mask.run_mask(args) == 0
    assert (tmp_path / "bench_mask.json").exists()
