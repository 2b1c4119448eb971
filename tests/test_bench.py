"""The benchmark's metric and formatting code (CPU only; the timing itself needs a GPU)."""

import json

import pytest

from flash_ext import bench


def test_flops():
    assert bench.attention_flops(1, 1, 1, 1, 1, causal=False) == 4
    assert bench.attention_flops(2, 16, 1024, 1024, 128, causal=False) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.attention_flops(2, 16, 1024, 1024, 128, causal=True) == 2 * 2 * 16 * 1024 * 1024 * 128
    with pytest.raises(KeyError):
        bench.attention_flops(1, 1, 1, 1, 1, False, direction="sideways")


def test_flops_directions():
    fwd = bench.attention_flops(2, 16, 1024, 1024, 128, causal=True)
    assert bench.attention_flops(2, 16, 1024, 1024, 128, True, direction="bwd") == 2.5 * fwd
    assert bench.attention_flops(2, 16, 1024, 1024, 128, True, direction="fwdbwd") == 3.5 * fwd
    c = bench.Config("bf16", 64, 1024, False, "bwd")
    assert c.flops == 2.5 * bench.Config("bf16", 64, 1024, False).flops
    assert c.name.startswith("bwd ")


def test_tflops_and_ratio():
    assert bench.tflops_per_s(1e12, 1000.0) == pytest.approx(1.0)
    assert bench.tflops_per_s(5e12, 10.0) == pytest.approx(500.0)
    assert bench.tflops_per_s(1e12, None) is None and bench.tflops_per_s(1e12, 0.0) is None
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(None, 2.0) is None and bench.ratio(1.0, None) is None
    assert bench.ratio(1.0, 0.0) is None


def test_config_shapes():
    c = bench.Config("bf16", 128, 4096, True)
    assert (c.batch, c.heads) == (4, 16)
    assert c.flops == 4 * 4 * 16 * 4096 * 4096 * 128 / 2
    assert "bf16" in c.name and "d=128" in c.name and "causal" in c.name
    assert bench.Config("fp16", 64, 16384, False).batch == 1


def test_make_configs():
    cfgs = bench.make_configs(["bf16", "fp16"], [64, 128], [1024, 2048], [False, True])
    assert len(cfgs) == 16 and len(set(cfgs)) == 16
    assert {c.direction for c in cfgs} == {"fwd"}
    cfgs = bench.make_configs(["bf16"], [64], [1024, 2048], [False], ["fwd", "bwd", "fwdbwd"])
    assert [c.direction for c in cfgs] == ["fwd", "fwd", "bwd", "bwd", "fwdbwd", "fwdbwd"]


def test_parse_args_quick_and_lists():
    a = bench.parse_args(["--quick"])
    assert a.dtypes == ["bf16"] and a.seqlens == [1024, 4096, 16384] and a.hdims == [64, 128, 256]
    assert a.causal_modes == [False, True] and a.reps <= 10
    a = bench.parse_args(["--dtypes", "fp16", "--seqlens", "1k,8192", "--hdims", "64",
                          "--causal", "true", "--reps", "7", "--out", "x"])
    assert a.dtypes == ["fp16"] and a.seqlens == [1024, 8192] and a.hdims == [64]
    assert a.causal_modes == [True] and a.reps == 7 and a.out == "x"
    a = bench.parse_args([])
    assert a.dtypes == ["bf16", "fp16"] and a.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert a.rounds == 3 and bench.parse_args(["--quick"]).rounds == 1
    assert bench.parse_args(["--quick", "--rounds", "5"]).rounds == 5
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
    assert a.warmup_s == 0.0 and bench.parse_args(["--warmup-s", "1.5"]).warmup_s == 1.5
    with pytest.raises(SystemExit):
        bench.parse_args(["--warmup-s", "-1"])
    assert a.directions == ["fwd", "bwd", "fwdbwd"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtypes", "fp32"])


def test_rotated_order():
    names = ("a", "b", "c")
    assert [bench.rotated(names, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_balanced_order_is_serially_balanced(n):
    names = tuple("abcdefg"[:n])
    period = bench.balanced_period(n)
    assert period in (n, 2 * n)
    rows = [bench.balanced(names, r) for r in range(period)]
    assert all(sorted(row) == list(names) for row in rows)
    assert bench.balanced(names, period) == rows[0]
    # timed in sequence (cyclically), every name follows every name, itself included, equally
    # often: the boundaries between rounds are a name after itself
    seq = [x for row in rows for x in row]
    pairs = {}
    for a, b in zip(seq, seq[1:] + seq[:1]):
        pairs[(a, b)] = pairs.get((a, b), 0) + 1
    assert len(pairs) == n * n and set(pairs.values()) == {period // n}, pairs
    assert all(prev[-1] == row[0] for prev, row in zip(rows[-1:] + rows[:-1], rows))


def test_williams_fallback():
    for n in (4, 5, 8):
        rows = bench._williams_rows(n)
        pairs = {}
        for row in rows:
            assert sorted(row) == list(range(n))
            for a, b in zip(row, row[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + 1
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
    assert len(bench._serially_balanced_rows(8)) == 8  # the search gives up: the Williams rows


def test_balanced_order_of_the_backends():
    period = bench.balanced_period(len(bench.BACKEND_NAMES))
    assert period == 8
    seq = [x for r in range(period) for x in bench.balanced(bench.BACKEND_NAMES, r)]
    after = {name: sorted(seq[i - 1] for i in range(len(seq)) if seq[i] == name)
             for name in bench.BACKEND_NAMES}
    for name, prev in after.items():
        assert prev == sorted(bench.BACKEND_NAMES * 2), (name, prev)
    # the rotated order this replaced: sdpa_cudnn always right after sdpa_flash
    rot = [bench.rotated(bench.BACKEND_NAMES, r) for r in range(4)]
    assert {row[i - 1] for row in rot for i in range(1, 4) if row[i] == "sdpa_cudnn"} == {"sdpa_flash"}
    assert bench.balanced(("x",), 3) == ["x"]


def test_parse_order_and_gap():
    a = bench.parse_args([])
    assert a.order == "balanced" and a.gap_s == 0.0
    a = bench.parse_args(["--order", "rotated", "--gap-s", "0.25"])
    assert a.order == "rotated" and a.gap_s == 0.25 and bench.ORDERS[a.order] is bench.rotated
    for bad in (["--order", "random"], ["--gap-s", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_carryover_table():
    import carryover  # tools/ is on sys.path (conftest.py)
    samples = [  # b is 10% slower right after a, in both rounds
        {"round": 0, "backend": "a", "after": None, "ms": 1.0},
        {"round": 0, "backend": "b", "after": "a", "ms": 2.2},
        {"round": 1, "backend": "b", "after": "a", "ms": 2.2},
        {"round": 1, "backend": "a", "after": "b", "ms": 1.0},
        {"round": 2, "backend": "a", "after": "a", "ms": 1.0},
        {"round": 2, "backend": "b", "after": "c", "ms": 2.0},
        {"round": 3, "backend": "b", "after": "c", "ms": 2.0},
        {"round": 3, "backend": "b", "after": "c", "ms": 2.0},
    ]
    table = carryover.carryover_table([{"samples": samples}, {"samples": []}, {}])
    assert table[("b", "a")] == pytest.approx([1.1, 1.1])
    assert table[("b", "c")] == pytest.approx([1.0, 1.0, 1.0])
    assert table[("a", "none")] == [1.0]
    text = carryover.format_carryover(table)
    assert "1.100 (2)" in text and text.splitlines()[0].split()[-1] == "none"
    assert "-" in carryover.format_carryover(table, min_n=3).splitlines()[2]


def test_run_config_records_every_turn(monkeypatch):
    # run_config's bookkeeping on the CPU: stand-in backends whose time depends on the one timed
    # right before (a carryover of +10% after flash_ext), so the samples' "after" must be right.
    last = []

    def fake_time_ms(fn, reps, warmup, warmup_s=0.0):
        name = fn()
        ms = {"flash_ext": 1.0, "flash_ext_sm80": 2.0, "sdpa_flash": 2.0, "sdpa_cudnn": 1.0}[name]
        ms *= 1.1 if last and last[-1] == "flash_ext" else 1.0
        last.append(name)
        return ms

    monkeypatch.setattr(bench, "make_backend_fn", lambda name, *a: (lambda: name))
    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    monkeypatch.setattr(bench, "extra_memory_mib", lambda fn: 0.0)
    cfg = bench.Config("bf16", 64, 1024, False)
    monkeypatch.setattr(bench.Config, "batch", property(lambda self: 1))
    monkeypatch.setattr(bench.Config, "heads", property(lambda self: 1))
    row = bench.run_config(cfg, reps=1, warmup=0, rounds=8, device="cpu")
    assert len(row.samples) == 32 and [s["backend"] for s in row.samples] == last
    assert row.samples[0]["after"] is None
    assert all(s["after"] == p["backend"] for p, s in zip(row.samples, row.samples[1:]))
    assert all(s["ms"] == pytest.approx(1.1 * {"flash_ext": 1, "sdpa_cudnn": 1}.get(s["backend"], 2))
               for s in row.samples if s["after"] == "flash_ext")
    # balanced: over 8 rounds cuDNN follows flash_ext in 2 of its 8 turns, so its median is 1.0
    assert row.ms["sdpa_cudnn"] == pytest.approx(1.0)
    rot = bench.run_config(cfg, reps=1, warmup=0, rounds=8, device="cpu", order="rotated")
    # rotated: flash_ext_sm80 always right after flash_ext but in the rounds it starts
    assert rot.ms["flash_ext_sm80"] == pytest.approx(2.2)


def test_row_json_keeps_samples():
    r = bench.Row("c", "bf16", 64, 1024, 16, 32, False, "fwd")
    r.samples.append({"round": 0, "backend": "flash_ext", "after": None, "ms": 0.5})
    assert json.loads(json.dumps(r.to_json()))["samples"][0]["ms"] == 0.5


def test_parse_directions():
    assert bench.parse_args(["--quick"]).directions == ["fwd", "bwd", "fwdbwd"]
    assert bench.parse_args(["--directions", "bwd"]).directions == ["bwd"]
    assert bench.parse_args(["--directions", "fwdbwd, fwd,fwd"]).directions == ["fwdbwd", "fwd"]
    for bad in ("sideways", ",", "fwd,back"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--directions", bad])


def test_make_backend_fn_rejects_unknown():
    import torch
    x = torch.zeros(1, 8, 1, 8)
    with pytest.raises(ValueError, match="unknown direction"):
        bench.make_backend_fn("flash_ext", "sideways", x, x, x, False)
    with pytest.raises(ValueError, match="unknown backend"):
        bench.make_backend_fn("nope", "fwd", x, x, x, False)


def test_format_table_and_json():
    r1 = bench.Row("fwd bf16 d=128 s=4096", "bf16", 128, 4096, 4, 16, False, "fwd",
                   tflops={"flash_ext": 400.0, "sdpa_flash": 320.0, "sdpa_cudnn": None},
                   extra_mib=0.0)
    r2 = bench.Row("fwd bf16 d=256 s=4096", "bf16", 256, 4096, 4, 8, True, "fwd",
                   tflops={"flash_ext": 300.0, "sdpa_flash": 300.0, "sdpa_cudnn": 600.0})
    text = bench.format_table([r1, r2])
    lines = text.splitlines()
    assert len(lines) == 4
    for col in bench.TABLE_COLUMNS:
        assert col in lines[0]
    assert "400.0" in lines[2] and "1.25" in lines[2] and lines[2].split()[-2] == "-"
    assert "0.50" in lines[3] and "1.00" in lines[3]
    j = r1.to_json()
    assert j["ratio_ext_over_flash"] == pytest.approx(1.25) and j["ratio_ext_over_cudnn"] is None
    json.dumps(j)
    assert bench.format_table([]).count("\n") == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU path")
def test_main_without_gpu_exits_cleanly(tmp_path, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_write_plot_or_skip(tmp_path, capsys):
    row = bench.Row("fwd bf16 d=64 s=1024", "bf16", 64, 1024, 16, 32, False, "fwd",
                    tflops={"flash_ext": 100.0, "sdpa_flash": 90.0, "sdpa_cudnn": None})
    path = tmp_path / "p.png"
    if bench.write_plot(str(path), [row]):
        assert path.stat().st_size > 0
    else:
        assert "matplotlib is not installed" in capsys.readouterr().out
