"""The benchmark: metrics, table, progress, peers, plot and host-time code on the CPU (stand-in
backends and timings); one end-to-end run on a GPU."""

import contextlib
import json
import sys
import types

import pytest

from conftest import requires_cuda
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
    monkeypatch.setattr(bench, "backend_scope", lambda name: contextlib.nullcontext())
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


# ---------------------------------------------------------------- progress


def test_format_duration():
    assert bench.format_duration(0) == "0:00"
    assert bench.format_duration(59.6) == "1:00"
    assert bench.format_duration(62) == "1:02"
    assert bench.format_duration(3725) == "1:02:05"
    assert bench.format_duration(-3) == "0:00"


def test_eta_and_progress_line():
    assert bench.eta_seconds(10.0, 0, 5) is None
    assert bench.eta_seconds(10.0, 2, 5) == pytest.approx(15.0)
    assert bench.eta_seconds(10.0, 5, 5) == 0.0
    line = bench.progress_line(3, 54, 42.0, "fwd bf16 d=64: flash_ext 400.0")
    # 42 s for 3 cases: 14 s each, 51 left = 714 s = 11:54
    assert line == "case  3/54, 0:42 elapsed, ETA 11:54: fwd bf16 d=64: flash_ext 400.0"
    assert bench.progress_line(0, 7, 0.0) == "case 0/7, 0:00 elapsed, ETA ?"


def test_main_prints_progress_to_stderr(monkeypatch, tmp_path, capsys):
    # main's loop on the CPU with stand-in timings: one progress line per case on stderr, the
    # table on stdout, a footnote for the peer that failed, the JSON written.
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda *a: "stand-in GPU")
    monkeypatch.setattr(bench, "detect_peers", lambda names: ({"fa2": "2.0"}, {"fa3": "ImportError: no"}))

    def fake_run_config(cfg, reps, warmup, rounds, backends, **kw):
        row = bench.Row(cfg.name, cfg.dtype, cfg.headdim, cfg.seqlen, cfg.batch, cfg.heads,
                        cfg.causal, cfg.direction)
        for b in backends:
            row.tflops[b] = None if b == "fa2" else 100.0
        row.errors["fa2"] = "RuntimeError: head dim not supported"
        return row

    monkeypatch.setattr(bench, "run_config", fake_run_config)
    monkeypatch.setattr(bench, "write_plot", lambda *a: False)
    assert bench.main(["--directions", "fwd", "--dtypes", "bf16", "--hdims", "64,128",
                       "--seqlens", "1k", "--causal", "true", "--no-host-time",
                       "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    progress = [l for l in err.splitlines() if l.startswith("case ")]
    assert [l.split(",")[0] for l in progress] == ["case 1/2", "case 2/2"]
    assert "ETA" in progress[0] and "fa2 n/a" in progress[0]
    assert "peer fa2: FlashAttention-2" in out and "peer fa3: FlashAttention-3 not timed" in out
    assert "n/a[1]" in out and "[1] fa2 (2 configs): RuntimeError: head dim not supported" in out
    assert "host time" not in out
    meta = json.loads((tmp_path / "bench_fwd.json").read_text())
    assert meta["peers"]["found"] == {"fa2": "2.0"} and len(meta["rows"]) == 2


# ---------------------------------------------------------------- peers


def _fake_attention(q, k, v, causal=False):
    """A differentiable stand-in peer on (b, s, h, d) tensors returning (out, lse) like FA4."""
    import torch
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float()).to(q.dtype)
    return out, s.logsumexp(-1)


def test_detect_peers(monkeypatch):
    real_import = bench.importlib.import_module
    fa2 = types.ModuleType("flash_attn")
    fa2.__version__ = "2.8.3"
    fa2.flash_attn_func = _fake_attention

    def fake_import(name):
        if name == "flash_attn":
            return fa2
        if name == "flash_attn_interface":
            raise ModuleNotFoundError("No module named 'flash_attn_interface'")
        if name == "flash_attn.cute":
            raise OSError("undefined symbol: _ZN3c10 (built for another torch)")
        return real_import(name)

    monkeypatch.setattr(bench.importlib, "import_module", fake_import)
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    found, missing = bench.detect_peers()
    assert found == {"fa2": "2.8.3"}
    assert missing == {"fa3": "ModuleNotFoundError: No module named 'flash_attn_interface'",
                       "fa4": "OSError: undefined symbol: _ZN3c10 (built for another torch)"}
    assert bench.detect_peers(["fa3"]) == ({}, {"fa3": missing["fa3"]})
    assert bench.detect_peers([]) == ({}, {})
    # a module without the function does not count as found
    monkeypatch.delattr(fa2, "flash_attn_func")
    found, missing = bench.detect_peers(["fa2"])
    assert found == {} and missing["fa2"].startswith("AttributeError")
    with pytest.raises(ValueError, match="unknown peer"):
        bench.load_peer("fa9")


def test_peer_backend_fn_on_cpu(monkeypatch):
    # a peer that returns (out, lse) runs in every direction, on the bench's own inputs
    import torch
    mod = types.ModuleType("flash_attn_interface")
    calls = []

    def fa3(q, k, v, causal=False):
        calls.append((q.shape, causal))
        return _fake_attention(q, k, v, causal)

    mod.flash_attn_func = fa3
    monkeypatch.setitem(sys.modules, "flash_attn_interface", mod)
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    out, _ = bench.make_backend_fn("fa3", "fwd", q, k, v, True)()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    for direction in ("bwd", "fwdbwd"):
        grads = bench.make_backend_fn("fa3", direction, q, k, v, True)()
        assert [g.shape for g in grads] == [q.shape] * 3 and all(g.abs().sum() > 0 for g in grads)
    assert calls and all(c == (q.shape, True) for c in calls)


def test_sdpa_backend_fn_gets_transposed_views():
    import torch
    q, k, v = (torch.randn(2, 16, 3, 8) for _ in range(3))
    dq, dk, dv = bench.make_backend_fn("sdpa_flash", "fwdbwd", q, k, v, False)()
    assert dq.shape == (2, 3, 16, 8)  # the gradients of SDPA's (b, h, s, d) leaves
    out = bench.make_backend_fn("sdpa_flash", "fwd", q, k, v, False)()
    assert out.shape == (2, 3, 16, 8)


def test_run_config_peer_failure_is_a_cell_not_an_abort(monkeypatch):
    made = []

    def fake_make(name, direction, q, k, v, causal):
        made.append(name)
        if name == "fa3":
            raise RuntimeError("FlashAttention-3 needs sm90\nmore detail")
        return lambda: name

    def fake_time_ms(fn, reps, warmup, warmup_s=0.0):
        if fn() == "fa4":  # fails at its first timing, after it was made
            raise MemoryError("out of memory")
        return 2.0 if fn() == "fa2" else 1.0

    monkeypatch.setattr(bench, "make_backend_fn", fake_make)
    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    monkeypatch.setattr(bench, "extra_memory_mib", lambda fn: 0.0)
    monkeypatch.setattr(bench, "backend_scope", lambda name: contextlib.nullcontext())
    monkeypatch.setattr(bench.Config, "batch", property(lambda self: 1))
    monkeypatch.setattr(bench.Config, "heads", property(lambda self: 1))
    backends = bench.BACKEND_NAMES + ("fa2", "fa3", "fa4")
    row = bench.run_config(bench.Config("bf16", 64, 1024, True), reps=1, warmup=0, rounds=3,
                           device="cpu", backends=backends)
    assert row.errors == {"fa3": "RuntimeError: FlashAttention-3 needs sm90",
                          "fa4": "MemoryError: out of memory"}
    assert made.count("fa3") == 1  # not retried in later rounds
    assert row.tflops["fa3"] is None and row.tflops["fa4"] is None
    assert row.ratio_to("fa2") == pytest.approx(2.0) and row.ratio_flash == pytest.approx(1.0)
    assert {s["backend"] for s in row.samples} == {"flash_ext", "flash_ext_sm80", "sdpa_flash",
                                                  "sdpa_cudnn", "fa2"}
    assert row.to_json()["ratios_ext_over"]["fa2"] == pytest.approx(2.0)


# ---------------------------------------------------------------- table with peers


def test_format_table_with_peers_and_footnotes():
    r1 = bench.Row("fwd bf16 d=64 s=1024", "bf16", 64, 1024, 16, 32, True, "fwd",
                   tflops={"flash_ext": 300.0, "flash_ext_sm80": 150.0, "sdpa_flash": 200.0,
                           "sdpa_cudnn": 250.0, "fa2": 200.0, "fa3": 240.0, "fa4": None},
                   errors={"fa4": "RuntimeError: not on this GPU"})
    r2 = bench.Row("fwd bf16 d=256 s=1024", "bf16", 256, 1024, 16, 8, True, "fwd",
                   tflops={"flash_ext": 400.0, "flash_ext_sm80": None, "sdpa_flash": 200.0,
                           "sdpa_cudnn": None, "fa2": None, "fa3": 400.0, "fa4": None},
                   errors={"fa4": "RuntimeError: not on this GPU", "sdpa_cudnn": "RuntimeError: x",
                           "fa2": "RuntimeError: d=256 backward"})
    text = bench.format_table([r1, r2])
    lines = text.splitlines()
    header = lines[0].split()
    assert header == ["config", "flash_ext", "ext_sm80", "sdpa_flash", "sdpa_cudnn", "fa2", "fa3",
                      "fa4", "ext/flash", "ext/cudnn", "ext/fa2", "ext/fa3", "ext/fa4",
                      "sm80/flash", "extra", "MiB"]
    c1 = dict(zip(header[1:], lines[2].split()[4:]))  # the config name is 4 words
    assert c1["fa4"] == "n/a[1]" and c1["ext/fa2"] == "1.50" and c1["ext/fa3"] == "1.25"
    assert c1["ext/fa4"] == "n/a" and c1["ext/cudnn"] == "1.20" and c1["sm80/flash"] == "0.75"
    c2 = dict(zip(header[1:], lines[3].split()[4:]))
    assert c2["ext_sm80"] == "-" and c2["sdpa_cudnn"] == "n/a[2]" and c2["fa2"] == "n/a[3]"
    assert c2["fa4"] == "n/a[1]" and c2["ext/fa3"] == "1.00" and c2["ext/cudnn"] == "n/a"
    notes = lines[lines.index("") + 2:]
    assert notes == ["  [1] fa4 (2 configs): RuntimeError: not on this GPU",
                     "  [2] sdpa_cudnn (1 config): RuntimeError: x",
                     "  [3] fa2 (1 config): RuntimeError: d=256 backward"]
    # peers that never ran get no column; an explicit list wins
    assert "fa2" not in bench.format_table([bench.Row("c", "bf16", 64, 1, 1, 1, False, "fwd")])
    assert bench.format_table([r1], backends=["flash_ext", "fa3"]).splitlines()[0].split()[:3] == [
        "config", "flash_ext", "fa3"]


# ---------------------------------------------------------------- arguments


def test_parse_peers_host_time_and_plot(monkeypatch):
    a = bench.parse_args([])
    assert a.peers == ["fa2", "fa3", "fa4"] and a.host_time and a.plot is None
    assert bench.parse_args(["--peers", "auto"]).peers == ["fa2", "fa3", "fa4"]
    assert bench.parse_args(["--peers", "none"]).peers == []
    assert bench.parse_args(["--peers", "fa4, fa2,fa4"]).peers == ["fa4", "fa2"]
    assert bench.parse_args(["--no-host-time"]).host_time is False
    for bad in ("fa5", "fa2,,"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--peers", bad])
    monkeypatch.setattr(bench, "have_matplotlib", lambda: True)
    assert bench.parse_args(["--plot", "x.png"]).plot == "x.png"
    monkeypatch.setattr(bench, "have_matplotlib", lambda: False)
    assert bench.parse_args([]).plot is None  # the default plot is skipped later, with a message
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot", "x.png"])


# ---------------------------------------------------------------- plot


def _plot_rows():
    rows = []
    for direction in ("fwd", "bwd"):
        for hd in (64, 128):
            for s in (512, 1024, 4096):
                errors = {"fa3": "RuntimeError: no"} if hd == 128 else {}
                rows.append(bench.Row(f"{direction} d={hd} s={s}", "bf16", hd, s, 1, 1, True, direction,
                                      tflops={"flash_ext": 300.0, "sdpa_flash": 200.0,
                                              "sdpa_cudnn": 330.0, "fa2": 150.0,
                                              "fa3": None if errors else 310.0},
                                      errors=errors))
    return rows


def test_write_plot_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install '.[bench]')")
    path = tmp_path / "ratios.png"
    assert bench.write_plot(str(path), _plot_rows()) is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_write_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = tmp_path / "ratios.png"
    assert bench.write_plot(str(path), _plot_rows()) is False
    assert not path.exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_seqlen_label():
    assert [bench._seqlen_label(s) for s in (512, 1024, 16384, 1000)] == ["512", "1k", "16k", "1000"]


# ---------------------------------------------------------------- host time


def test_host_us_per_call_times_the_host_only():
    import time
    calls, syncs = [], []
    us = bench.host_us_per_call(lambda: calls.append(1), calls=10, repeats=3, warmup=2,
                                sync=lambda: (syncs.append(1), time.sleep(0.01)))
    assert len(calls) == 2 + 10 * 3 and len(syncs) == 2 * 3
    assert 0 < us < 500  # 10 ms of sync per batch would be 1000 us per call if it were timed
    us = bench.host_us_per_call(lambda: time.sleep(0.002), calls=5, repeats=1, warmup=0,
                                sync=lambda: None)
    assert 1900 < us < 20000


def test_measure_host_time_on_cpu(monkeypatch):
    # the measurement loop on CPU tensors: SDPA runs there; flash_ext (stand-in ops or CPU
    # tensors) fails and is reported, not raised
    import functools
    import torch
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench, "host_us_per_call",
                        functools.partial(bench.host_us_per_call, calls=2, repeats=1, warmup=1,
                                          sync=lambda: None))
    times, errors = bench.measure_host_time(["flash_ext", "sdpa_flash"], device="cpu")
    assert times["sdpa_flash"] > 0 and "flash_ext" in errors and "flash_ext" not in times
    text = bench.format_host_time(times, errors)
    assert text.startswith("host time per call (CPU us): flash_ext fwd+bwd step vs SDPA flash")
    assert "flash_ext    n/a (" in text


def test_format_host_time():
    text = bench.format_host_time({"flash_ext": 150.0, "sdpa_flash": 200.0, "fa2": 100.0},
                                  {"fa4": "RuntimeError: no"})
    lines = text.splitlines()
    assert lines[0] == "host time per call (CPU us): flash_ext fwd+bwd step vs SDPA flash"
    assert "b=1 s=128 h=2 d=128 causal bf16" in lines[1]
    assert lines[2].split() == ["flash_ext", "150.0", "us"]
    assert lines[3].split()[:3] == ["sdpa_flash", "200.0", "us"] and lines[3].endswith("0.75")
    assert lines[4].endswith("fa2: 1.50") and lines[5] == "  fa4          n/a (RuntimeError: no)"


# ---------------------------------------------------------------- GPU


@requires_cuda
def test_bench_end_to_end_gpu(tmp_path, capsys):
    # one small config per direction with every peer that imports, the host times and the plot
    plot = tmp_path / "r.png"
    args = ["--directions", "fwd,bwd,fwdbwd", "--dtypes", "bf16", "--hdims", "128",
            "--seqlens", "1k", "--causal", "true", "--reps", "3", "--warmup", "1",
            "--rounds", "1", "--out", str(tmp_path)]
    if bench.have_matplotlib():
        args += ["--plot", str(plot)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    meta = json.loads((tmp_path / "bench_fwd_bwd_fwdbwd.json").read_text())
    assert len(meta["rows"]) == 3
    for row in meta["rows"]:
        assert row["tflops"]["flash_ext"] > 0 and row["tflops"]["sdpa_flash"] > 0, row["errors"]
        for peer in meta["peers"]["found"]:  # each peer that loaded has a number or a reason
            assert (row["tflops"][peer] or 0) > 0 or peer in row["errors"]
    host = meta["host_time_us"]["fwdbwd_step"]
    assert host["flash_ext"] > 0 and host["sdpa_flash"] > 0, meta["host_time_us"]["errors"]
    assert "host time per call (CPU us)" in out
    if bench.have_matplotlib():
        assert plot.read_bytes()[:4] == b"\x89PNG"


def test_decode_flag():
    from flash_ext import bench
    assert bench.parse_args(["--decode"]).decode is True
    assert bench.parse_args([]).decode is False
    import flash_ext.bench_decode as bd
    assert (8, 65536) in bd.DECODE_SHAPES and bd.PAGE_SIZES == (16, 256)
