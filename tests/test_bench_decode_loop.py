"""The decode-loop benchmark (flash_ext/bench_decode_loop.py): its cells and flags, the Llama
model's shapes, the SDPA backend against flash_attn_with_kvcache's reference (rotary on halves,
append, attention), greedy decoding through both backends' code paths on the CPU (the flash_ext
backend driven by the reference, which has flash_attn_with_kvcache's signature); on a GPU, the
real kernels, eager and CUDA graph."""

import json

import pytest
import torch

import flash_ext
from conftest import requires_cuda
from flash_ext import bench, reference
from flash_ext import bench_decode_loop as dl

TINY = dl.LlamaConfig(vocab=96, layers=2, heads_q=8, heads_kv=2, head_dim=32, intermediate=64,
                      rope_theta=10000.0)


def reference_kvcache(q, k_cache, v_cache, **kw):
    """flash_attn_with_kvcache through flash_ext.reference: the caches written in place, the
    output in q's dtype."""
    out, _, kc, vc = reference.kvcache_attention(q, k_cache, v_cache, **kw)
    k_cache.copy_(kc)
    v_cache.copy_(vc)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Flags and cells
# ---------------------------------------------------------------------------------------------


def test_decode_loop_flag():
    assert bench.parse_args(["--decode-loop"]).decode_loop is True
    assert bench.parse_args([]).decode_loop is False
    args = bench.parse_args(["--decode-loop", "--quick", "--out", "somewhere"])
    assert args.decode_loop and args.quick and args.out == "somewhere" and args.rounds == 1
    assert bench.parse_args(["--decode-loop"]).rounds == 3
    with pytest.raises(SystemExit):
        bench.parse_args(["--decode", "--decode-loop"])


def test_cells():
    quick = dl.make_cells(quick=True)
    assert [(c.batch, c.context, c.new_tokens) for c in quick] == \
        [(1, 2048, 128), (8, 2048, 128), (32, 2048, 128)]
    full = dl.make_cells(quick=False)
    assert {(c.batch, c.context) for c in full} == {(b, n) for b in (1, 8, 32)
                                                     for n in (2048, 8192)}
    assert all(c.new_tokens == 256 and c.prompt == c.context - 256 for c in full)
    assert full[0].name == "1 x 2k" and dl.Cell(2, 300, 10).name == "2 x 300"
    with pytest.raises(ValueError, match="no prompt"):
        dl.make_cells(quick=True, new_tokens=2048)


def test_main_decode_loop_quick_runs_the_quick_cells(monkeypatch, tmp_path):
    """main(--decode-loop --quick) hands the quick form to run_decode_loop, which builds the
    quick cell list (the GPU work itself replaced by a recorder)."""
    seen = {}

    def fake_run(quick=False, out_dir=None, rounds=None, **kw):
        seen.update(quick=quick, out_dir=out_dir, rounds=rounds,
                    cells=dl.make_cells(quick))
        return []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dl, "run_decode_loop", fake_run)
    assert bench.main(["--decode-loop", "--quick", "--out", str(tmp_path)]) == 0
    assert seen["quick"] is True and seen["out_dir"] == str(tmp_path) and seen["rounds"] == 1
    assert [c.batch for c in seen["cells"]] == [1, 8, 32]


# ---------------------------------------------------------------------------------------------
# Rotary: ours against what flash_attn_with_kvcache does (its reference)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_half_is_the_kvcache_rotary_on_halves(rotary_dim, dtype):
    torch.manual_seed(0)
    cos, sin = dl.rotary_tables(64, rotary_dim, 10000.0, "cpu", dtype)
    x = torch.randn(3, 5, 4, 32).to(dtype)
    positions = torch.arange(7, 12).expand(3, 5)
    want = reference.apply_rotary(x, cos, sin, positions, interleaved=False)
    assert torch.equal(dl.rotary_half(x, cos[7:12], sin[7:12]), want)
    # the interleaved convention is a different rotation: the test can tell them apart
    assert not torch.equal(want, reference.apply_rotary(x, cos, sin, positions,
                                                        interleaved=True))


def test_rotary_tables():
    cos, sin = dl.rotary_tables(16, 8, 10000.0, "cpu", torch.float32)
    assert cos.shape == sin.shape == (16, 4)
    assert torch.equal(cos[0], torch.ones(4)) and torch.equal(sin[0], torch.zeros(4))
    # position 3, pair 1: angle 3 * 10000^(-2/8)
    angle = 3 * 10000.0 ** (-2 / 8)
    assert cos[3, 1].item() == pytest.approx(torch.tensor(angle).cos().item(), rel=1e-6)
    assert sin[3, 1].item() == pytest.approx(torch.tensor(angle).sin().item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# One attention step: SDPA backend (eager and graph form) against the kvcache reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gqa", ["pack", "enable_gqa"])
@pytest.mark.parametrize("graph_form", [False, True])
def test_sdpa_step_is_flash_attn_with_kvcache(gqa, graph_form):
    """Rotary, append and attention of one token at position p: the SDPA backend's result and
    caches against reference.kvcache_attention with the arguments the flash_ext backend
    passes (causal, rotary_interleaved=False)."""
    torch.manual_seed(1)
    b, cap, hq, hkv, d, p = 3, 40, 8, 2, 32, 17
    model = dl.Llama(TINY, max_len=64, device="cpu", dtype=torch.float32)
    q = torch.randn(b, 1, hq, d)
    k, v = torch.randn(b, 1, hkv, d), torch.randn(b, 1, hkv, d)
    kc, vc = torch.randn(b, cap, hkv, d), torch.randn(b, cap, hkv, d)
    want, _, want_kc, want_vc = reference.kvcache_attention(
        q, kc, vc, k=k, v=v, rotary_cos=model.cos, rotary_sin=model.sin, cache_seqlens=p,
        causal=True, rotary_interleaved=False)
    backend = dl.SdpaBackend(gqa)
    position = dl.GraphPosition(b, p, "cpu") if graph_form else p
    got = backend.attend(q, k, v, kc, vc, backend.step_context(model, position, cap))
    assert got.shape == (b, 1, hq, d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)  # slot p written, nothing else


def test_flash_ext_backend_arguments():
    """The flash_ext backend's call: the new k, v, the model's tables, the length (an int eager,
    the int32 device lengths in graph form), causal, rotary on halves."""
    calls = []
    backend = dl.FlashExtBackend(attn_fn=lambda *a, **kw: calls.append((a, kw)) or "out")
    model = dl.Llama(TINY, max_len=64, device="cpu", dtype=torch.float32)
    q, k, v, kc, vc = (torch.zeros(1) for _ in range(5))
    assert backend.attend(q, k, v, kc, vc, backend.step_context(model, 9, 64)) == "out"
    pos = dl.GraphPosition(2, 9, "cpu")
    backend.attend(q, k, v, kc, vc, backend.step_context(model, pos, 64))
    (a0, kw0), (_, kw1) = calls
    assert a0 == (q, kc, vc) and kw0["k"] is k and kw0["v"] is v
    assert kw0["rotary_cos"] is model.cos and kw0["rotary_sin"] is model.sin
    assert kw0["cache_seqlens"] == 9 and kw0["causal"] is True
    assert kw0["rotary_interleaved"] is False
    assert kw1["cache_seqlens"] is pos.lens and pos.lens.dtype == torch.int32
    pos.advance()
    assert pos.lens.tolist() == [10, 10] and pos.pos.tolist() == [10]
    pos.reset(3)
    assert pos.lens.tolist() == [3, 3] and pos.pos.tolist() == [3]


@pytest.mark.parametrize("graph_form", [False, True])
def test_flash_ext_backend_arguments_pass_the_kvcache_checks(monkeypatch, graph_form):
    """The default geometry's q, k, v (strided views of the fused projection), the model's
    tables and the lengths the backend passes satisfy flash_attn_with_kvcache's input and value
    checks (run on the CPU with the device check off; the kernels need a GPU)."""
    from flash_ext import _validation
    monkeypatch.setattr(_validation, "check_devices", lambda *a, **kw: None)
    cfg = dl.LlamaConfig(vocab=64, layers=1, intermediate=64)
    model = dl.Llama(cfg, max_len=256, device="cpu")
    q, k, v = model._qkv(model.layers[0], torch.randn(3, 1, cfg.hidden).to(torch.bfloat16))
    assert not k.is_contiguous()  # views into the fused projection, passed as they are
    (kc, vc), = model.new_caches(3, 200)
    position = dl.GraphPosition(3, 150, "cpu") if graph_form else 150
    cos, sin, seqlens = dl.FlashExtBackend(lambda *a, **kw: None).step_context(model, position,
                                                                               200)
    assert _validation.check_kvcache_inputs(
        q, kc, vc, k, v, cos, sin, seqlens, None, None, None, None, True, (-1, -1), 0.0, None,
        0) == (200, 1)
    _validation.check_kvcache_values(q, kc, seqlens, None, None, None, 200, 1, cos.shape[0],
                                     True)
    # and the checks do look: a new token past the capacity
    full = 200 if not graph_form else torch.full((3,), 200, dtype=torch.int32)
    with pytest.raises(flash_ext.FlashExtError):
        _validation.check_kvcache_inputs(q, kc, vc, k, v, cos, sin, full, None, None, None,
                                         None, True, (-1, -1), 0.0, None, 0)
        _validation.check_kvcache_values(q, kc, full, None, None, None, 200, 1, cos.shape[0],
                                         True)


def test_sdpa_gqa_mode_checked():
    with pytest.raises(ValueError, match="pack"):
        dl.SdpaBackend("repeat")


# ---------------------------------------------------------------------------------------------
# The model on the CPU
# ---------------------------------------------------------------------------------------------


def test_model_shapes():
    model = dl.Llama(TINY, max_len=32, device="cpu", dtype=torch.bfloat16, seed=3)
    assert model.embed.shape == (96, 256) and model.lm_head.shape == (96, 256)
    assert len(model.layers) == 2
    assert model.layers[0]["wqkv"].shape == ((8 + 2 * 2) * 32, 256)
    assert model.layers[0]["w_gate_up"].shape == (128, 256)
    assert model.cos.shape == (32, 16) and model.cos.dtype == torch.bfloat16
    caches = model.new_caches(2, 24)
    assert len(caches) == 2 and caches[0][0].shape == (2, 24, 2, 32)
    with pytest.raises(ValueError, match="capacity"):
        model.new_caches(2, 33)
    prompts = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    first = model.prefill(prompts, caches)
    assert first.shape == (2,) and first.dtype == torch.int64
    assert 0 <= first.min() and first.max() < 96
    kc = caches[0][0]
    assert kc[:, :10].abs().sum() > 0 and kc[:, 10:].abs().sum() == 0
    nxt = model.decode_step(first, caches, dl.SdpaBackend(), 10)
    assert nxt.shape == (2,)
    assert kc[:, 10].abs().sum() > 0 and kc[:, 11:].abs().sum() == 0
    # the same seed gives the same weights
    again = dl.Llama(TINY, max_len=32, device="cpu", dtype=torch.bfloat16, seed=3)
    assert torch.equal(again.layers[1]["w_down"], model.layers[1]["w_down"])


def test_prefill_in_row_chunks_is_prefill_at_once():
    model = dl.Llama(TINY, max_len=32, device="cpu", dtype=torch.float32, seed=4)
    prompts = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(1))
    whole = model.new_caches(3, 16)
    first = model.prefill(prompts, whole)
    parts = model.new_caches(3, 16)
    firsts = [model.prefill(prompts[:2], parts, slice(0, 2)),
              model.prefill(prompts[2:], parts, slice(2, 3))]
    assert torch.equal(torch.cat(firsts), first)
    for (a, b), (c, d) in zip(whole, parts):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, d)


def _decode(model, prefilled, backend, first, start, steps, graph_form):
    """Greedy tokens of one backend from copies of the prefilled caches, eager or with the graph
    form's device position (stepped by hand: no capture on the CPU)."""
    caches = [(k.clone(), v.clone()) for k, v in prefilled]
    if not graph_form:
        return dl.greedy_eager(model, caches, backend, first, start, steps), caches
    pos = dl.GraphPosition(first.shape[0], start, "cpu")
    tok, out = first, []
    for _ in range(steps):
        tok = model.decode_step(tok, caches, backend, pos)
        out.append(tok)
        pos.advance()
    return torch.stack(out, 1), caches


def test_greedy_tokens_agree_across_backends_on_cpu():
    """The same weights decode the same tokens through the SDPA backend and the flash_ext
    backend's code path (flash_attn_with_kvcache's reference in place of the kernel), eager and
    in graph form, and leave the same caches."""
    model = dl.Llama(TINY, max_len=48, device="cpu", dtype=torch.float32, seed=5)
    b, prompt, steps, cap = 2, 20, 12, 40
    prompts = torch.randint(0, 96, (b, prompt), generator=torch.Generator().manual_seed(2))
    caches = model.new_caches(b, cap)
    first = model.prefill(prompts, caches)
    runs = {(name, graph): _decode(model, caches, backend, first, prompt, steps, graph)
            for name, backend in (("sdpa", dl.SdpaBackend()),
                                  ("ext", dl.FlashExtBackend(reference_kvcache)))
            for graph in (False, True)}
    ref_tokens, ref_caches = runs[("sdpa", False)]
    assert ref_tokens.shape == (b, steps)
    assert len(set(ref_tokens.flatten().tolist())) > 1  # a loop that decodes something
    for key, (tokens, cs) in runs.items():
        assert dl.first_divergence(tokens, ref_tokens) is None, key
        for (k, v), (rk, rv) in zip(cs, ref_caches):
            torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
            assert k[:, prompt + steps:].abs().sum() == 0  # nothing past the last step


def test_first_divergence():
    a = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert dl.first_divergence(a, a.clone()) is None
    b = a.clone()
    b[1, 2] = 0
    b[0, 3] = 0
    assert dl.first_divergence(a, b) == 2


def test_table_lines():
    res = {f"{b}_{m}": dict(tokens_per_s=1000.0 * (i + 1), ms_per_step=1.5,
                            first_divergence_vs_sdpa_eager=(None if i < 3 else 7))
           for i, (m, b) in enumerate((m, b) for m in dl.MODES for b in dl.BACKENDS)}
    row = dict(batch=8, context=2048, new_tokens=128, results=res, x_sdpa_eager=0.5,
               x_sdpa_graph=0.75)
    header, line = dl.table_header(dl.MODES), dl.format_row(row, dl.MODES)
    assert "eager ext" in header and "graph sdpa" in header
    assert line.split()[:3] == ["8", "2048", "128"]
    assert "0.50" in line and "0.75" in line and line.endswith("same/same/@7")


def test_sdpa_choice_names_a_backend():
    model = dl.Llama(TINY, max_len=16, device="cpu", dtype=torch.float32)
    for masked in (False, True):
        for gqa in ("pack", "enable_gqa"):
            assert dl.sdpa_choice(model, 2, 16, masked, gqa) in (
                "MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION",
                "OVERRIDEABLE")


# ---------------------------------------------------------------------------------------------
# GPU: the real kernels, eager and CUDA graph
# ---------------------------------------------------------------------------------------------


@requires_cuda
def test_decode_loop_gpu(tmp_path):
    """A small cell end to end: both backends, eager and graph, tokens against eager SDPA, the
    JSON written."""
    cfg = dl.LlamaConfig(vocab=512, layers=2, heads_q=8, heads_kv=2, head_dim=128,
                         intermediate=512)
    rows = dl.run_decode_loop(out_dir=str(tmp_path), cfg=cfg, cells=[dl.Cell(4, 512, 32)],
                              rounds=2, warmup_steps=2)
    (row,) = rows
    for key in ("flash_ext_eager", "sdpa_eager", "flash_ext_graph", "sdpa_graph"):
        r = row["results"][key]
        assert r["tokens_per_s"] > 0 and len(r["rounds_ms"]) == 2
        div = r["first_divergence_vs_sdpa_eager"]  # bf16 near-ties may flip a token: reported
        assert div is None or 0 <= div < 32
    assert row["results"]["sdpa_eager"]["first_divergence_vs_sdpa_eager"] is None
    assert row["x_sdpa_eager"] > 0 and row["x_sdpa_graph"] > 0
    meta = json.loads((tmp_path / "bench_decode_loop.json").read_text())
    assert meta["rows"][0]["batch"] == 4 and meta["model"]["layers"] == 2


@requires_cuda
def test_flash_ext_graph_replays_eager_tokens_gpu():
    """flash_ext's decode step captured in a CUDA graph decodes eager flash_ext's tokens: the
    same kernels on the same inputs (the split count depends on the capacity, not on whether
    the lengths are an int or a tensor), so the same bits and the same greedy tokens."""
    cfg = dl.LlamaConfig(vocab=64, layers=2, heads_q=8, heads_kv=2, head_dim=64,
                         intermediate=256)
    model = dl.Llama(cfg, max_len=256, device="cuda", dtype=torch.bfloat16, seed=6)
    prompts = torch.randint(0, 64, (3, 100), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.inference_mode():
        caches = model.new_caches(3, 256)
        first = model.prefill(prompts, caches)
        ext = dl.FlashExtBackend()
        eager = dl.greedy_eager(model, caches, ext, first, 100, 24).clone()
        eager_caches = [(k.clone(), v.clone()) for k, v in caches]
        graph = dl.GraphDecoder(model, caches, ext, first, 100, 24).run().clone()
    assert torch.equal(graph, eager)
    for (k, v), (ek, ev) in zip(caches, eager_caches):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_run_decode_loop_on_cpu(tmp_path, capsys):
    """The whole section on the CPU (eager only; the flash_ext backend through the reference):
    progress, table, JSON, tokens/s, and the tokens of both backends the same."""
    backends = {"flash_ext": dl.FlashExtBackend(reference_kvcache), "sdpa": dl.SdpaBackend()}
    rows = dl.run_decode_loop(out_dir=str(tmp_path), cfg=TINY, cells=[dl.Cell(2, 24, 6),
                                                                       dl.Cell(1, 32, 4)],
                              rounds=2, warmup_steps=1, graphs=False, device="cpu",
                              backends=backends)
    assert [(r["batch"], r["context"], r["prompt"]) for r in rows] == [(2, 24, 18), (1, 32, 28)]
    for row in rows:
        assert set(row["results"]) == {"flash_ext_eager", "sdpa_eager"}
        for r in row["results"].values():
            assert len(r["rounds_ms"]) == 2 and r["loop_ms"] > 0
            assert r["tokens_per_s"] == pytest.approx(
                row["batch"] * row["new_tokens"] / (r["loop_ms"] * 1e-3))
        # bf16 here: a near-tie may flip a token (the float32 test above asks for equality)
        div = row["results"]["flash_ext_eager"]["first_divergence_vs_sdpa_eager"]
        assert div is None or 0 <= div < row["new_tokens"]
        assert row["results"]["sdpa_eager"]["first_divergence_vs_sdpa_eager"] is None
        assert row["x_sdpa_eager"] == pytest.approx(
            row["results"]["flash_ext_eager"]["tokens_per_s"]
            / row["results"]["sdpa_eager"]["tokens_per_s"])
    captured = capsys.readouterr()
    assert "case 2/2" in captured.err and "tokens vs sdpa_eager" in captured.out
    meta = json.loads((tmp_path / "bench_decode_loop.json").read_text())
    assert meta["device"] == "cpu" and meta["model"]["heads_kv"] == 2 and len(meta["rows"]) == 2
    with pytest.raises(ValueError, match="backends"):
        dl.run_decode_loop(cfg=TINY, cells=[dl.Cell(1, 8, 2)], graphs=False, device="cpu",
                           backends={"sdpa": dl.SdpaBackend()})
