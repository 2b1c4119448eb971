"""The Hopper forward's timeline: where a tile's cycles go, and how the last wave ends.

Needs a trace build (FLASH_EXT_SM90_TRACE=1 at build time; csrc/sm90/fwd_trace.h), e.g.

    FLASH_EXT_SM90_TRACE=1 FLASH_EXT_HEADDIMS=256 FLASH_EXT_DTYPES=bf16 python setup.py build_ext --inplace
    PYTHONPATH=. python tools/trace_fwd.py --hdims 256 --seqlens 2048,16384 --out trace_out

For each config (bf16, batch = 16384 / seqlen, heads = 2048 / head dim, as the bench) it times a
few calls without the trace, then one call with it, and reports per consumer warpgroup and tile
(medians over the call's tiles, in cycles of the SM clock measured from the CTAs' own clock64 and
%globaltimer):
  Q wait     tile decoded -> this warpgroup's Q landed
  first S    Q landed -> S of the first key block done (no P V to hide under)
  loop       first S done -> the key-block loop done, and per key block
  last P V   loop done -> the last P V done
  epilogue   last P V done -> O and lse written
  to next    O written -> the next tile decoded (the scheduler, the dynamic claim)
  boundary   a tile's span minus its key blocks at the steady per-block pace: what the tile costs
             beyond its main loop
and how far warpgroup 1 runs behind warpgroup 0 (their first S of the same tile),
and per CTA the span from its first to its last cycle against the kernel's: the idle SM time of
the last wave. The trace marks cost a few stores per tile (the main loop has none); compare the
traced call's time with the untraced ones it prints beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass

HEADER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "sm90",
                      "fwd_trace.h")


@dataclass(frozen=True)
class Layout:
    """The buffer layout of csrc/sm90/fwd_trace.h (read from the header, so the two agree)."""
    ctas: int
    roles: int
    tiles: int
    events: int
    names: dict  # event name -> index

    @property
    def cta_words(self) -> int:
        return 4 + self.roles * self.tiles * self.events

    @property
    def words(self) -> int:
        return self.ctas * self.cta_words

    def slot(self, cta: int, role: int, k: int) -> int:
        """Index of the first word of role's k-th tile slot of CTA cta (fwd_trace.h's slot())."""
        return cta * self.cta_words + 4 + (role * self.tiles + k) * self.events

    @classmethod
    def from_header(cls, path: str = HEADER) -> "Layout":
        text = open(path).read()
        consts = {k: int(v) for k, v in re.findall(r"\b(k\w+) = (\d+)\b", text)}
        names = {k: consts[k] for k in ("kTileTop", "kQReady", "kFirstS", "kLoopDone", "kLastPV",
                                        "kStored", "kProdTop", "kProdFirstK", "kProdQ",
                                        "kProdLastV", "kBlocks", "kTile")}
        return cls(consts["kTraceCtas"], consts["kTraceRoles"], consts["kTraceTiles"],
                   consts["kTraceEvents"], names)


def _median(xs):
    return statistics.median(xs) if xs else None


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def analyze(buf, lay: Layout) -> dict:
    """Phases of every consumer tile and the CTAs' spans from a trace buffer (a flat sequence of
    ints, the layout of ``lay``). Pure Python: the CPU tests feed it a synthetic buffer."""
    ev = lay.names
    ctas, tiles, per_block, wg_offsets = [], [], [], []
    for c in range(lay.ctas):
        base = c * lay.cta_words
        clk0, ns0, clk1, ns1 = (int(buf[base + i]) for i in range(4))
        if ns0 == 0 or ns1 <= ns0 or clk1 <= clk0:
            continue
        ghz = (clk1 - clk0) / (ns1 - ns0)
        ctas.append({"cta": c, "start_ns": ns0, "end_ns": ns1, "ghz": ghz})
        # how far warpgroup 1 runs behind warpgroup 0 on the same tile (lockstep: ~0)
        for k in range(lay.tiles):
            w0, w1 = lay.slot(c, 1, k), lay.slot(c, 2, k)
            f0, f1 = int(buf[w0 + ev["kFirstS"]]), int(buf[w1 + ev["kFirstS"]])
            if not (f0 and f1) or int(buf[w0 + ev["kTile"]]) != int(buf[w1 + ev["kTile"]]):
                break
            wg_offsets.append(f1 - f0)
        for role in range(1, lay.roles):
            rows = []
            for k in range(lay.tiles):
                w = lay.slot(c, role, k)
                e = [int(buf[w + i]) for i in range(lay.events)]
                if e[ev["kTileTop"]] == 0:
                    break
                rows.append(e)
            for k, e in enumerate(rows):
                if e[ev["kQReady"]] == 0:  # no visible key block (a window): only the epilogue ran
                    continue
                prod = lay.slot(c, 0, k)  # the producer's slot k: the same tile if it
                # had key blocks (checked by the tile index below)
                t = {"cta": c, "wg": role - 1, "slot": k, "blocks": e[ev["kBlocks"]], "tile": e[ev["kTile"]]}
                t["q_wait"] = e[ev["kQReady"]] - e[ev["kTileTop"]]
                t["first_s"] = e[ev["kFirstS"]] - e[ev["kQReady"]]
                t["loop"] = e[ev["kLoopDone"]] - e[ev["kFirstS"]]
                t["last_pv"] = e[ev["kLastPV"]] - e[ev["kLoopDone"]]
                t["epilogue"] = e[ev["kStored"]] - e[ev["kLastPV"]]
                nxt = rows[k + 1][ev["kTileTop"]] if k + 1 < len(rows) else None
                t["to_next"] = nxt - e[ev["kStored"]] if nxt is not None else None
                t["span"] = (nxt if nxt is not None else e[ev["kStored"]]) - e[ev["kTileTop"]]
                if int(buf[prod + ev["kTile"]]) == t["tile"] and int(buf[prod + ev["kProdQ"]]):
                    t["q_after_issue"] = e[ev["kQReady"]] - int(buf[prod + ev["kProdQ"]])
                if t["blocks"] > 1 and e[ev["kStored"]]:
                    per_block.append(t["loop"] / (t["blocks"] - 1))
                if e[ev["kStored"]]:  # a stream-K piece that parked its state has no epilogue
                    tiles.append(t)
    steady = _median(per_block)
    for t in tiles:
        if steady and t["to_next"] is not None:
            t["boundary"] = t["span"] - t["blocks"] * steady
    span_ns = (max(c["end_ns"] for c in ctas) - min(c["start_ns"] for c in ctas)) if ctas else 0
    busy_ns = sum(c["end_ns"] - c["start_ns"] for c in ctas)
    return {
        "ctas": ctas, "tiles": tiles, "steady_cycles_per_block": steady, "wg1_behind": wg_offsets,
        "ghz": _median([c["ghz"] for c in ctas]),
        "kernel_ns": span_ns,
        "idle_fraction": 1 - busy_ns / (span_ns * len(ctas)) if ctas and span_ns else None,
        "cta_end_ns": sorted(c["end_ns"] - min(x["start_ns"] for x in ctas) for c in ctas),
    }


PHASES = ("q_wait", "first_s", "loop", "last_pv", "epilogue", "to_next", "span", "boundary",
          "q_after_issue")


def format_report(name: str, res: dict, untraced_ms: list[float], traced_ms: float) -> str:
    ghz = res["ghz"] or 0.0
    lines = [f"== {name}: untraced {', '.join(f'{m:.3f}' for m in untraced_ms)} ms, traced "
             f"{traced_ms:.3f} ms; {len(res['ctas'])} CTAs at {ghz:.2f} GHz, {len(res['tiles'])} "
             f"consumer tiles (per warpgroup)"]
    steady = res["steady_cycles_per_block"]
    if steady:
        lines.append(f"   steady pace: {steady:.0f} cycles per key block (median over tiles)")
    lines.append(f"   {'phase':14s} {'median':>9s} {'p10':>9s} {'p90':>9s}   cycles (median us)")
    for ph in PHASES:
        xs = [t[ph] for t in res["tiles"] if t.get(ph) is not None]
        if not xs:
            continue
        med = _median(xs)
        us = f"{med / ghz / 1e3:.2f}" if ghz else "-"
        lines.append(f"   {ph:14s} {med:9.0f} {_pct(xs, 0.1):9.0f} {_pct(xs, 0.9):9.0f}   ({us} us)")
    off = res["wg1_behind"]
    if off:
        lines.append(f"   warpgroup 1's first S after warpgroup 0's, same tile: median {_median(off):.0f}, "
                     f"p10 {_pct(off, 0.1):.0f}, p90 {_pct(off, 0.9):.0f} cycles")
    ends = res["cta_end_ns"]
    if ends:
        lines.append(f"   CTA ends (us from the first start): first {ends[0] / 1e3:.1f}, median "
                     f"{_median(ends) / 1e3:.1f}, last {ends[-1] / 1e3:.1f}; SM time idle in the "
                     f"kernel's span: {100 * (res['idle_fraction'] or 0):.1f}%")
    by_slot = {}
    for t in res["tiles"]:
        by_slot.setdefault(t["slot"], []).append(t["span"])
    if by_slot:
        lines.append("   tile span by slot (median cycles): " +
                     ", ".join(f"{k}: {_median(v):.0f}" for k, v in sorted(by_slot.items())))
    return "\n".join(lines)


MASKS = ("full", "causal", "fm_nomask", "causal_doc", "varlen_doc")


def make_call(flash_ext, q, k, v, mask: str):
    """One forward call of a trace cell. full / causal: the plain kernels; fm_nomask: FlashMask with
    nothing masked beyond causal (the policy's own cost); causal_doc: FlashMask on the mask bench's
    documents; varlen_doc: the same documents as a varlen call (no policy, the same tiles)."""
    import torch
    from flash_ext import bench_mask
    b, s = q.shape[0], q.shape[1]
    if mask in ("full", "causal"):
        return lambda: flash_ext.attn_fwd(q, k, v, causal=mask == "causal")
    if mask == "fm_nomask":
        sri = torch.full((b, 1, s, 1), s, dtype=torch.int32, device=q.device)
        return lambda: flash_ext.flashmask_attention(q, k, v, sri, causal=True)
    if mask == "causal_doc":
        sri, causal, _ = bench_mask.build_mask("causal_doc", s, device=q.device)
        sri = sri.expand(b, -1, -1, -1).contiguous()
        return lambda: flash_ext.flashmask_attention(q, k, v, sri, causal=causal)
    if mask == "varlen_doc":
        lens = bench_mask.doc_lengths(s) * b
        cu = torch.tensor([0] + lens, dtype=torch.int32, device=q.device).cumsum(0, dtype=torch.int32)
        qv, kv, vv = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))
        mx = max(lens)
        return lambda: flash_ext.flash_attn_varlen_func(qv, kv, vv, cu, cu, mx, mx, causal=True)
    raise ValueError(f"unknown trace mask {mask!r} (one of {', '.join(MASKS)})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", default="256")
    ap.add_argument("--seqlens", default="2048")
    ap.add_argument("--masks", default="full,causal", help="comma-separated: " + ", ".join(MASKS))
    ap.add_argument("--calls", type=int, default=5, help="untraced calls timed beside the traced one")
    ap.add_argument("--out", default=None, help="directory for report.txt and the raw JSON")
    args = ap.parse_args(argv)

    import torch
    import flash_ext
    from flash_ext.bench import time_ms  # CUDA events around each call
    if not torch.cuda.is_available():
        print("trace_fwd needs a CUDA GPU", file=sys.stderr)
        return 2
    if not hasattr(torch.ops.flash_ext, "sm90_trace_buffer"):
        print("this build has no trace: rebuild with FLASH_EXT_SM90_TRACE=1 "
              f"(build_info: {flash_ext.build_info()})", file=sys.stderr)
        return 2
    lay = Layout.from_header()
    buf = torch.zeros(lay.words, dtype=torch.int64, device="cuda")
    reports, raw = [], {}
    for d in (int(x) for x in args.hdims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for mask in args.masks.split(","):
                b, h = max(1, 16384 // s), 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                call = make_call(flash_ext, q, k, v, mask)
                untraced = [time_ms(call, reps=1, warmup=5 if i == 0 else 0) for i in range(args.calls)]
                buf.zero_()
                torch.ops.flash_ext.sm90_trace_buffer(buf)
                try:
                    traced = time_ms(call, reps=1, warmup=0)
                finally:
                    torch.ops.flash_ext.sm90_trace_buffer(None)
                res = analyze(buf.cpu().tolist(), lay)
                name = f"d={d} s={s} b={b} h={h} {mask}"
                reports.append(format_report(name, res, untraced, traced))
                print(reports[-1], flush=True)
                raw[name] = {"tiles": res["tiles"], "ctas": res["ctas"], "untraced_ms": untraced}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.txt"), "w") as f:
            f.write("\n\n".join(reports) + "\n")
        with open(os.path.join(args.out, "trace.json"), "w") as f:
            json.dump(raw, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
