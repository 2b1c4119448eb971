"""The decode-loop section of ``python -m flash_ext.bench --decode-loop``: tokens per second of a
greedy decode loop of a small Llama-architecture model (random init, bf16) whose attention is
flash_ext.flash_attn_with_kvcache against torch's scaled_dot_product_attention (issue 26's last
benchmark item).

The model is written here in plain torch (no transformers): token embedding, ``layers`` blocks
of RMSNorm -> attention (GQA, rotary embedding on GPT-NeoX halves) -> residual, RMSNorm ->
SwiGLU MLP -> residual, then a final RMSNorm and the LM head; weights drawn from one seeded
generator. Each layer has a static KV cache (batch, context, kv heads, head dim). Both backends
run the same weights, the same caches and the same rotary tables:

- flash_ext: one flash_attn_with_kvcache call per layer appends the new k, v at the current
  length, rotates q and the new k there, and attends (causal, half-split rotary).
- sdpa: rotary in torch (float32, rounded to bf16, the tables the flash_ext call reads), the new
  k, v written into the caches, then SDPA of the single query token over the valid prefix. The
  query heads that share a KV head are packed as that head's query rows ((b, kv heads, group,
  d) against (b, kv heads, keys, d)): exact for one query token, and SDPA needs neither
  ``enable_gqa`` nor a copy of the caches (``sdpa_gqa="enable_gqa"`` passes the heads as they
  are with ``enable_gqa=True`` instead).

A cell (batch, context): random prompts of context - new_tokens tokens per row (all rows the
same length), prefilled once with SDPA (causal, shared by every variant so that only decode
differs), then each variant greedily decodes new_tokens tokens from the same first token,
starting again at the prompt's end (the slots it writes are the same for every variant):

- eager: a Python loop of decode steps (flash_ext gets the length as an int: no tensor to check
  on the host; SDPA slices the cache prefix).
- graph: one decode step captured in a CUDA graph and replayed; the lengths live in device
  tensors bumped inside the graph (flash_ext: int32 cache_seqlens; SDPA: attends over the whole
  cache with a boolean mask of the valid prefix built from a device position).

Times: CUDA events around the whole loop of new_tokens steps (embedding, layers, LM head,
argmax), after an untimed warm-up loop (by default a whole one, so that every cache length
has been seen once: per-shape setup such as a library's plan cache stays out of the timed
loops); the median of ``rounds`` loops. tokens/s = batch x new_tokens / seconds. The greedy
tokens of every variant are compared with eager SDPA's: the first step at
which any row differs is reported (bf16 near-ties can flip a token late; reported, not failed).

Grid: batch 1, 8, 32 x context 2k, 8k, 256 new tokens, 3 rounds; --quick: batch 1, 8, 32 x
context 2k, 128 new tokens, 1 round. Output: progress on stderr, the table on stdout,
bench_decode_loop.json in --out.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

BACKENDS = ("flash_ext", "sdpa")
MODES = ("eager", "graph")
FULL_BATCHES = (1, 8, 32)
FULL_CONTEXTS = (2048, 8192)
QUICK_BATCHES = (1, 8, 32)
QUICK_CONTEXTS = (2048,)
PREFILL_CHUNK_TOKENS = 16384  # rows prefilled together: bounds the MLP's activations


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-architecture decoder; the default has Llama-3-8B's layer geometry (GQA 32 / 8
    heads of 128, SwiGLU 14336) with few layers and Llama-2's vocabulary."""
    vocab: int = 32000
    layers: int = 4
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def hidden(self) -> int:
        return self.heads_q * self.head_dim


@dataclass(frozen=True)
class Cell:
    batch: int
    context: int     # cache capacity: prompt + new tokens
    new_tokens: int

    @property
    def prompt(self) -> int:
        return self.context - self.new_tokens

    @property
    def name(self) -> str:
        return f"{self.batch} x {self.context // 1024}k" if self.context % 1024 == 0 \
            else f"{self.batch} x {self.context}"


def make_cells(quick: bool, new_tokens: Optional[int] = None) -> List[Cell]:
    n = new_tokens if new_tokens is not None else (128 if quick else 256)
    batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if quick else (FULL_BATCHES, FULL_CONTEXTS)
    cells = [Cell(b, c, n) for c in contexts for b in batches]
    for c in cells:
        if c.prompt < 1:
            raise ValueError(f"context {c.context} leaves no prompt before {n} new tokens")
    return cells


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class Llama:
    """Weights (random, seeded), rotary tables and the forward pieces; attention is the
    backend's."""

    def __init__(self, cfg: LlamaConfig, max_len: int, device="cuda", dtype=torch.bfloat16,
                 seed: int = 0):
        self.cfg, self.max_len, self.device, self.dtype = cfg, max_len, device, dtype
        g = torch.Generator(device=device).manual_seed(seed)
        h, d = cfg.hidden, cfg.head_dim

        def linear(out_f, in_f):  # std 1/sqrt(fan_in): activations stay O(1) through layers
            w = torch.randn(out_f, in_f, generator=g, device=device, dtype=torch.float32)
            return (w / math.sqrt(in_f)).to(dtype)

        self.embed = torch.randn(cfg.vocab, h, generator=g, device=device,
                                 dtype=torch.float32).to(dtype)
        self.layers = []
        for _ in range(cfg.layers):
            self.layers.append(dict(
                attn_norm=torch.ones(h, device=device, dtype=dtype),
                wqkv=linear((cfg.heads_q + 2 * cfg.heads_kv) * d, h),
                wo=linear(h, cfg.heads_q * d),
                mlp_norm=torch.ones(h, device=device, dtype=dtype),
                w_gate_up=linear(2 * cfg.intermediate, h),
                w_down=linear(h, cfg.intermediate)))
        self.final_norm = torch.ones(h, device=device, dtype=dtype)
        self.lm_head = linear(cfg.vocab, h)
        self.cos, self.sin = rotary_tables(max_len, d, cfg.rope_theta, device, dtype)

    def new_caches(self, batch: int, capacity: Optional[int] = None) -> List[tuple]:
        """Zeroed (k, v) caches (batch, capacity, kv heads, head dim) per layer; capacity at
        most max_len (the rotary tables' rows)."""
        capacity = self.max_len if capacity is None else capacity
        if not 0 < capacity <= self.max_len:
            raise ValueError(f"cache capacity {capacity} outside [1, {self.max_len}]")
        shape = (batch, capacity, self.cfg.heads_kv, self.cfg.head_dim)
        return [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                 torch.zeros(shape, device=self.device, dtype=self.dtype))
                for _ in self.layers]

    def rms_norm(self, x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.eps)
        return xf.to(x.dtype) * w

    def _qkv(self, layer, x):
        cfg = self.cfg
        b, s = x.shape[:2]
        qkv = F.linear(self.rms_norm(x, layer["attn_norm"]), layer["wqkv"])
        q, k, v = qkv.split([cfg.heads_q * cfg.head_dim, cfg.heads_kv * cfg.head_dim,
                             cfg.heads_kv * cfg.head_dim], dim=-1)
        return (q.view(b, s, cfg.heads_q, cfg.head_dim), k.view(b, s, cfg.heads_kv, cfg.head_dim),
                v.view(b, s, cfg.heads_kv, cfg.head_dim))

    def _rest_of_block(self, layer, x, attn):
        b, s = x.shape[:2]
        x = x + F.linear(attn.reshape(b, s, -1), layer["wo"])
        gate, up = F.linear(self.rms_norm(x, layer["mlp_norm"]), layer["w_gate_up"]).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, layer["w_down"])

    def _next_tokens(self, x):
        """Greedy choice from the last position's logits: (b,) int64."""
        logits = F.linear(self.rms_norm(x[:, -1], self.final_norm), self.lm_head)
        return logits.argmax(-1)

    def prefill(self, tokens: torch.Tensor, caches, rows: slice = slice(None)):
        """tokens (b, s) at positions 0..s-1 into caches[rows, :s] (SDPA, causal); returns the
        first greedy tokens (b,)."""
        s = tokens.shape[1]
        x = self.embed[tokens]
        cos, sin = self.cos[:s], self.sin[:s]
        for layer, (kc, vc) in zip(self.layers, caches):
            q, k, v = self._qkv(layer, x)
            q, k = rotary_half(q, cos, sin), rotary_half(k, cos, sin)
            kc[rows, :s] = k
            vc[rows, :s] = v
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=True,
                                                  enable_gqa=True).transpose(1, 2)
            x = self._rest_of_block(layer, x, attn)
        return self._next_tokens(x)

    def decode_step(self, tokens: torch.Tensor, caches, backend, position) -> torch.Tensor:
        """One token per row (tokens (b,)) at ``position`` (an int, or the backend's device
        position for graphs); appends to the caches; returns the next greedy tokens (b,)."""
        x = self.embed[tokens].unsqueeze(1)
        ctx = backend.step_context(self, position, caches[0][0].shape[1])
        for layer, (kc, vc) in zip(self.layers, caches):
            q, k, v = self._qkv(layer, x)
            x = self._rest_of_block(layer, x, backend.attend(q, k, v, kc, vc, ctx))
        return self._next_tokens(x)


def rotary_tables(max_len: int, rotary_dim: int, theta: float, device, dtype):
    """cos, sin (max_len, rotary_dim / 2) in dtype: angle of position p, pair i =
    p * theta^(-2i / rotary_dim). The layout flash_attn_with_kvcache reads."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float64)
                         / rotary_dim)
    angles = torch.arange(max_len, device=device, dtype=torch.float64).unsqueeze(1) * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, s, h, d) rotated on GPT-NeoX halves (pairs (i, i + rd/2), rd = 2 * cos.shape[-1])
    by the rows cos, sin (s, rd/2) (token t uses row t); float32 math, rounded to x's dtype, the
    columns past rd unchanged: what flash_attn_with_kvcache does with rotary_interleaved=False."""
    half = cos.shape[-1]
    c = cos.float().view(1, cos.shape[0], 1, half)
    s = sin.float().view(1, sin.shape[0], 1, half)
    xf = x.float()
    a, b = xf[..., :half], xf[..., half:2 * half]
    out = torch.cat([a * c - b * s, a * s + b * c, xf[..., 2 * half:]], dim=-1)
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Attention backends (one query token per row, all rows at the same position)
# ----------------------------------------------------------------------------------------------


class GraphPosition:
    """The decode position in device tensors, for graphs: int32 (b,) lengths (flash_ext's
    cache_seqlens) and int64 (1,) position (SDPA's index and mask), bumped together."""

    def __init__(self, batch: int, start: int, device):
        self.lens = torch.full((batch,), start, dtype=torch.int32, device=device)
        self.pos = torch.full((1,), start, dtype=torch.int64, device=device)

    def reset(self, start: int):
        self.lens.fill_(start)
        self.pos.fill_(start)

    def advance(self):
        self.lens += 1
        self.pos += 1


class FlashExtBackend:
    """flash_attn_with_kvcache: append + rotary + attention in one call per layer. ``attn_fn``
    is that function (a stand-in with its signature for CPU tests)."""
    name = "flash_ext"

    def __init__(self, attn_fn: Optional[Callable] = None):
        if attn_fn is None:
            import flash_ext
            attn_fn = flash_ext.flash_attn_with_kvcache
        self.attn_fn = attn_fn

    def step_context(self, model, position, capacity: int):
        seqlens = position if isinstance(position, int) else position.lens
        return model.cos, model.sin, seqlens

    def attend(self, q, k, v, k_cache, v_cache, ctx):
        cos, sin, seqlens = ctx
        return self.attn_fn(q, k_cache, v_cache, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                            cache_seqlens=seqlens, causal=True, rotary_interleaved=False)


class SdpaBackend:
    """Rotary in torch, the new k, v written into the caches, SDPA over the valid prefix (eager)
    or over the whole cache with a boolean mask (graphs: static shapes)."""
    name = "sdpa"

    def __init__(self, gqa: str = "pack"):
        if gqa not in ("pack", "enable_gqa"):
            raise ValueError(f"sdpa gqa must be 'pack' or 'enable_gqa', got {gqa!r}")
        self.gqa = gqa
        self._slots = None

    def step_context(self, model, position, capacity: int):
        if isinstance(position, int):
            p = position
            return model.cos[p:p + 1], model.sin[p:p + 1], p, None
        pos = position.pos
        if self._slots is None or self._slots.shape[0] != capacity \
                or self._slots.device != pos.device:
            self._slots = torch.arange(capacity, device=pos.device)
        mask = (self._slots <= pos).view(1, 1, 1, capacity)
        return model.cos.index_select(0, pos), model.sin.index_select(0, pos), pos, mask

    def attend(self, q, k, v, k_cache, v_cache, ctx):
        cos, sin, p, mask = ctx
        q, k = rotary_half(q, cos, sin), rotary_half(k, cos, sin)
        if mask is None:
            k_cache[:, p:p + 1] = k
            v_cache[:, p:p + 1] = v
            keys, values = k_cache[:, :p + 1], v_cache[:, :p + 1]
        else:
            k_cache.index_copy_(1, p, k)
            v_cache.index_copy_(1, p, v)
            keys, values = k_cache, v_cache
        return sdpa_one_token(q, keys, values, mask, self.gqa)


def sdpa_one_token(q, keys, values, mask=None, gqa: str = "pack"):
    """SDPA of q (b, 1, hq, d) against keys, values (b, n, hkv, d) (views of the caches),
    optionally masked by a boolean (1, 1, 1, n); returns (b, 1, hq, d). With "pack" the group of
    query heads sharing a KV head become that head's query rows (query head h uses KV head
    h // (hq // hkv)); exact because every row sees the same keys."""
    b, _, hq, d = q.shape
    hkv = keys.shape[2]
    kt, vt = keys.transpose(1, 2), values.transpose(1, 2)
    if gqa == "pack":
        out = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), kt, vt,
                                             attn_mask=mask)
        return out.reshape(b, 1, hq, d)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=mask,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def sdpa_choice(model, batch: int, length: int, masked: bool, gqa: str) -> str:
    """The SDPA backend torch picks for one decode attention call of this shape (its private
    chooser; "unknown" where it is missing)."""
    try:
        from torch.nn.attention import SDPBackend
        cfg = model.cfg
        dev, dt = model.device, model.dtype
        kt = torch.empty(batch, cfg.heads_kv, length, cfg.head_dim, device=dev, dtype=dt)
        if gqa == "pack":
            q = torch.empty(batch, cfg.heads_kv, cfg.heads_q // cfg.heads_kv, cfg.head_dim,
                            device=dev, dtype=dt)
        else:
            q = torch.empty(batch, cfg.heads_q, 1, cfg.head_dim, device=dev, dtype=dt)
        mask = torch.ones(1, 1, 1, length, device=dev, dtype=torch.bool) if masked else None
        return SDPBackend(torch._fused_sdp_choice(q, kt, kt, attn_mask=mask,
                                                  enable_gqa=gqa != "pack")).name
    except Exception:
        return "unknown"


# ----------------------------------------------------------------------------------------------
# Decode loops
# ----------------------------------------------------------------------------------------------


def greedy_eager(model: Llama, caches, backend, first: torch.Tensor, start: int,
                 steps: int) -> torch.Tensor:
    """steps greedy tokens (b, steps) from ``first`` (b,) at positions start, start + 1, ...;
    no host sync inside the loop."""
    out = torch.empty(first.shape[0], steps, dtype=torch.int64, device=first.device)
    tok = first
    for i in range(steps):
        tok = model.decode_step(tok, caches, backend, start + i)
        out[:, i] = tok
    return out


class GraphDecoder:
    """One decode step captured in a CUDA graph: reads the token buffer and the device position,
    writes the next token into the buffer and into column ``step`` of the output, bumps the
    position and the step."""

    def __init__(self, model: Llama, caches, backend, first: torch.Tensor, start: int,
                 steps: int):
        dev = first.device
        self.model, self.caches, self.backend = model, caches, backend
        self.first, self.start, self.steps = first, start, steps
        self.position = GraphPosition(first.shape[0], start, dev)
        self.token = first.clone()
        self.step = torch.zeros(1, dtype=torch.int64, device=dev)
        self.out = torch.zeros(first.shape[0], steps, dtype=torch.int64, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (allocator, kernels' first calls) off-graph
            for _ in range(min(2, steps)):  # within the steps: slots and output columns
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.reset()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()
        self.reset()

    def _step(self):
        nxt = self.model.decode_step(self.token, self.caches, self.backend, self.position)
        self.out.index_copy_(1, self.step, nxt.unsqueeze(1))
        self.token.copy_(nxt)
        self.position.advance()
        self.step += 1

    def reset(self):
        self.token.copy_(self.first)
        self.position.reset(self.start)
        self.step.zero_()

    def run(self, steps: Optional[int] = None) -> torch.Tensor:
        """Replays steps (default all, at most all) from the start; the tokens (b, steps) (the
        buffer)."""
        steps = self.steps if steps is None else steps
        if not 0 <= steps <= self.steps:
            raise ValueError(f"{steps} steps, the graph decodes at most {self.steps}")
        self.reset()
        for _ in range(steps):
            self.graph.replay()
        return self.out


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> Optional[int]:
    """The first step (column) at which any row of a and b differ; None if none does."""
    diff = (a != b).any(0).nonzero()
    return int(diff[0]) if diff.numel() else None


def _timed_ms(fn: Callable[[], object], device) -> float:
    """Milliseconds of fn's work: CUDA events around it on a GPU, the wall clock on the CPU."""
    if torch.device(device).type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time_variant(model, caches, backend, mode: str, first, cell: Cell, rounds: int,
                  warmup_steps: Optional[int]):
    """The loop times (ms, one per round) of one backend in one mode, and its tokens."""
    warmup_steps = cell.new_tokens if warmup_steps is None else min(warmup_steps,
                                                                       cell.new_tokens)
    if mode == "eager":
        greedy_eager(model, caches, backend, first, cell.prompt, warmup_steps)

        def loop():
            return greedy_eager(model, caches, backend, first, cell.prompt, cell.new_tokens)
    else:
        decoder = GraphDecoder(model, caches, backend, first, cell.prompt, cell.new_tokens)
        decoder.run(warmup_steps)
        loop = decoder.run
    times, out = [], []
    for _ in range(rounds):
        times.append(_timed_ms(lambda: out.append(loop()), first.device))
    return times, out[-1].clone()


def run_cell(model: Llama, cell: Cell, backends: Dict[str, object], rounds: int,
             warmup_steps: Optional[int] = None, graphs: bool = True, seed: int = 0) -> dict:
    """Prefill once, then each backend x mode decodes the cell's new tokens: median loop ms,
    tokens/s, ms per step, and the first step whose tokens differ from eager SDPA's."""
    dev = model.device
    g = torch.Generator(device=dev).manual_seed(seed + cell.batch * 7919 + cell.context)
    prompts = torch.randint(0, model.cfg.vocab, (cell.batch, cell.prompt), generator=g,
                            device=dev)
    caches = model.new_caches(cell.batch, cell.context)
    rows_per_chunk = max(1, PREFILL_CHUNK_TOKENS // cell.prompt)
    firsts = []
    with torch.inference_mode():
        for r0 in range(0, cell.batch, rows_per_chunk):
            rows = slice(r0, min(cell.batch, r0 + rows_per_chunk))
            firsts.append(model.prefill(prompts[rows], caches, rows))
    first = torch.cat(firsts)
    del prompts
    results, tokens = {}, {}
    modes = MODES if graphs else ("eager",)
    for mode in modes:
        for name, backend in backends.items():
            key = f"{name}_{mode}"
            with torch.inference_mode():
                times, tokens[key] = _time_variant(model, caches, backend, mode, first, cell,
                                                   rounds, warmup_steps)
            ms = statistics.median(times)
            results[key] = dict(loop_ms=ms, ms_per_step=ms / cell.new_tokens,
                                tokens_per_s=cell.batch * cell.new_tokens / (ms * 1e-3),
                                rounds_ms=times)
    ref = tokens["sdpa_eager"]
    for key in results:
        results[key]["first_divergence_vs_sdpa_eager"] = first_divergence(tokens[key], ref)
    row = dict(batch=cell.batch, context=cell.context, prompt=cell.prompt,
               new_tokens=cell.new_tokens, results=results)
    for mode in modes:
        row[f"x_sdpa_{mode}"] = (results[f"flash_ext_{mode}"]["tokens_per_s"] /
                                 results[f"sdpa_{mode}"]["tokens_per_s"])
    del caches
    return row


def _fmt_div(d: Optional[int]) -> str:
    return "same" if d is None else f"@{d}"


def format_row(row: dict, modes: Sequence[str]) -> str:
    res = row["results"]
    cells = []
    for mode in modes:
        f, s = res[f"flash_ext_{mode}"], res[f"sdpa_{mode}"]
        cells.append(f"{f['tokens_per_s']:10.0f} {s['tokens_per_s']:10.0f} "
                     f"{f['ms_per_step']:7.3f} {s['ms_per_step']:7.3f} "
                     f"{row[f'x_sdpa_{mode}']:6.2f}")
    div = "/".join(_fmt_div(res[f"{b}_{m}"]["first_divergence_vs_sdpa_eager"])
                   for m in modes for b in BACKENDS if not (b == "sdpa" and m == "eager"))
    return (f"{row['batch']:>5} {row['context']:>7} {row['new_tokens']:>5} " + "  ".join(cells)
            + f"  {div}")


def table_header(modes: Sequence[str]) -> str:
    cells = [f"{m + ' ext':>10} {m + ' sdpa':>10} {'ms ext':>7} {'ms sdpa':>7} {'x sdpa':>6}"
             for m in modes]
    div = "/".join(f"{b}_{m}" for m in modes for b in BACKENDS
                   if not (b == "sdpa" and m == "eager"))
    return (f"{'batch':>5} {'context':>7} {'new':>5} " + "  ".join(cells)
            + f"  tokens vs sdpa_eager ({div})")


def run_decode_loop(quick: bool = False, out_dir: Optional[str] = None,
                    cfg: LlamaConfig = LlamaConfig(), cells: Optional[Sequence[Cell]] = None,
                    rounds: Optional[int] = None, warmup_steps: Optional[int] = None,
                    graphs: bool = True,
                    sdpa_gqa: str = "pack", seed: int = 0, device="cuda",
                    backends: Optional[Dict[str, object]] = None) -> List[dict]:
    """Runs the cells (default: make_cells(quick)) and prints the table; writes
    bench_decode_loop.json into out_dir. ``device`` and ``backends`` (default: the flash_ext
    and SDPA backends) are for tests on the CPU (graphs=False there)."""
    from flash_ext.bench import progress_line
    cells = list(cells) if cells is not None else make_cells(quick)
    rounds = rounds if rounds is not None else (1 if quick else 3)
    modes = MODES if graphs else ("eager",)
    dt = torch.bfloat16
    t0 = time.monotonic()
    cuda = torch.device(device).type == "cuda"
    device_name = torch.cuda.get_device_name(device) if cuda else str(device)
    model = Llama(cfg, max(c.context for c in cells), device=device, dtype=dt, seed=seed)
    if backends is None:
        backends = {"flash_ext": FlashExtBackend(), "sdpa": SdpaBackend(sdpa_gqa)}
    if set(backends) != set(BACKENDS):
        raise ValueError(f"backends must be named {BACKENDS}, got {tuple(backends)}")
    c0 = cells[0]
    sdpa_kernels = {"eager": sdpa_choice(model, c0.batch, c0.context, False, sdpa_gqa),
                    "graph": sdpa_choice(model, c0.batch, c0.context, True, sdpa_gqa)}
    print(f"decode loop: Llama-architecture model (random init, bf16, seed {seed}): "
          f"{cfg.layers} layers, {cfg.heads_q} q / {cfg.heads_kv} kv heads, d={cfg.head_dim}, "
          f"hidden {cfg.hidden}, SwiGLU {cfg.intermediate}, vocab {cfg.vocab}; "
          f"{device_name}, torch {torch.__version__}")
    print(f"greedy decode of new tokens after a prompt of context - new tokens (SDPA prefill); "
          f"{'CUDA events' if cuda else 'wall clock'} around the loop, median of {rounds} "
          f"round(s) after {'a whole' if warmup_steps is None else f'{warmup_steps} steps of a'} "
          f"warm-up loop; SDPA GQA as {sdpa_gqa!r}, kernel {sdpa_kernels['eager']} (eager), "
          f"{sdpa_kernels['graph']} (graph, masked)", flush=True)
    rows = []
    for i, cell in enumerate(cells, 1):
        row = run_cell(model, cell, backends, rounds, warmup_steps, graphs, seed)
        rows.append(row)
        res = row["results"]
        text = f"{cell.name} ({cell.new_tokens} new): " + ", ".join(
            f"{k} {v['tokens_per_s']:.0f} tok/s" for k, v in res.items())
        print(progress_line(i, len(cells), time.monotonic() - t0, text), file=sys.stderr,
              flush=True)
        if cuda:
            torch.cuda.empty_cache()
    print()
    print(table_header(modes))
    for row in rows:
        print(format_row(row, modes))
    print("tok/s = batch x new tokens / s; x sdpa = flash_ext tok/s / SDPA tok/s; last column: "
          "'same' or @step of the first differing greedy token")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "bench_decode_loop.json")
        with open(path, "w") as f:
            json.dump(dict(device=device_name, torch=torch.__version__,
                           model=asdict(cfg), dtype="bf16", seed=seed, rounds=rounds,
                           warmup_steps=warmup_steps, sdpa_gqa=sdpa_gqa,
                           sdpa_kernel=sdpa_kernels, rows=rows), f, indent=1)
        print(f"wrote {path}")
    return rows
