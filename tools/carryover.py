"""How much a backend's burst time depends on the backend timed right before it.

Usage: python tools/carryover.py BENCH.json [BENCH2.json ...] [--min-n 2]

Reads the `samples` that flash_ext.bench keeps for every timed turn (round, backend, the
backend timed just before it, median ms) and prints, for each backend and each neighbour, the
median over configs of (its time after that neighbour) / (its median time in that config), and
how many turns that is. A value below 1 means faster after that neighbour. With the balanced
order every backend follows every other about equally often, so the table separates the
neighbour's effect from the backend's own speed; with the rotated order (`--order rotated`) most
cells are empty (each backend mostly follows one neighbour). The first turn of a config
("after" = none) follows the previous config's last turn.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict


def carryover_table(rows: list[dict]) -> dict[tuple[str, str], list[float]]:
    """(backend, after) -> per-config ratios of the turn's ms to the backend's median ms in
    that config (one value per turn)."""
    table: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in rows:
        by_backend: dict[str, list[dict]] = defaultdict(list)
        for s in row.get("samples", []):
            if s.get("ms"):
                by_backend[s["backend"]].append(s)
        for backend, samples in by_backend.items():
            if len(samples) < 2:
                continue
            med = statistics.median(s["ms"] for s in samples)
            for s in samples:
                table[(backend, s["after"] or "none")].append(s["ms"] / med)
    return dict(table)


def format_carryover(table: dict[tuple[str, str], list[float]], min_n: int = 1) -> str:
    backends = sorted({b for b, _ in table})
    afters = sorted({a for _, a in table}, key=lambda a: (a == "none", a))
    head = ["backend \\ after"] + afters
    lines = []
    for b in backends:
        cells = [b]
        for a in afters:
            vals = table.get((b, a), [])
            cells.append(f"{statistics.median(vals):.3f} ({len(vals)})" if len(vals) >= min_n else "-")
        lines.append(cells)
    widths = [max(len(str(r[i])) for r in [head] + lines) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths)] + [fmt(c) for c in lines])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--min-n", type=int, default=1, help="hide cells with fewer turns")
    args = ap.parse_args(argv)
    rows = []
    for path in args.files:
        with open(path) as f:
            rows += json.load(f).get("rows", [])
    table = carryover_table(rows)
    if not table:
        print("no per-turn samples in these files (flash_ext.bench keeps them in each row's `samples`)",
              file=sys.stderr)
        return 1
    print("time after a neighbour / the backend's median in the config (median over turns; turns)")
    print(format_carryover(table, args.min_n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
