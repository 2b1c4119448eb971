"""The Hopper backward's deterministic dQ order (csrc/sm90/bwd_dq_order.h), checked on the CPU: a
key-block CTA waits until dq_order_predecessors(m, n) CTAs have added to query block m's tile, so
that count must be exactly the number of key blocks above n that see m (one too many and the CTA
spins forever; one too few and two CTAs add at once). Python transcriptions of
BlockMask::query_block_range (csrc/common/mask.h) and dq_order_predecessors, checked against the
sets of key blocks that see each query block, over causal, local and full masks and unequal
lengths. Keep the transcriptions in step with the C++."""

import random

import pytest


def query_block_range(n, seqlen_q, seqlen_k, wl, wr, bm, bn, has_window):
    """BlockMask::query_block_range: query blocks [m_min, m_max) that see key block n."""
    m_min, m_max = 0, (seqlen_q + bm - 1) // bm
    if has_window:
        shift = seqlen_k - seqlen_q
        first_col, last_col = n * bn, min((n + 1) * bn, seqlen_k) - 1
        if wr >= 0:
            first_row = first_col - shift - wr
            m_min = 0 if first_row <= 0 else first_row // bm
        if wl >= 0:
            last_row = last_col - shift + wl
            m_max = min(m_max, 0 if last_row < 0 else last_row // bm + 1)
    return m_min, m_max


def _cdiv_trunc(a, b):
    """C++ integer division (truncates towards zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def dq_order_predecessors(m, n, n_blocks, seqlen_q, seqlen_k, wr, bm, bn, has_window):
    n_max = n_blocks - 1
    if has_window and wr >= 0:
        end = (m + 1) * bm + (seqlen_k - seqlen_q) + wr
        n_max = min(n_max, _cdiv_trunc(end - 1, bn))
    return n_max - n


def _cases():
    rng = random.Random(0)
    windows = [(-1, 0), (-1, -1), (16, 0), (100, 30), (-1, 8), (0, 0), (300, 0), (-1, 200), (5, 700)]
    cases = []
    for _ in range(400):
        sq, sk = rng.randint(1, 1500), rng.randint(1, 1500)
        wl, wr = rng.choice(windows)
        bm, bn = rng.choice([(64, 128), (128, 128), (64, 64)])
        cases.append((sq, sk, wl, wr, bm, bn))
    return cases


@pytest.mark.parametrize("sq,sk,wl,wr,bm,bn", _cases())
def test_predecessors_count_the_key_blocks_above(sq, sk, wl, wr, bm, bn):
    has_window = not (wl < 0 and wr < 0)
    n_blocks = (sk + bn - 1) // bn
    m_blocks = (sq + bm - 1) // bm
    sees = {m: [] for m in range(m_blocks)}
    for n in range(n_blocks):
        lo, hi = query_block_range(n, sq, sk, wl, wr, bm, bn, has_window)
        for m in range(lo, hi):
            sees[m].append(n)
    for m, ns in sees.items():
        # the key blocks that see a query block are one interval (the descending order needs no gaps)
        assert ns == list(range(ns[0], ns[-1] + 1)) if ns else True, (m, ns)
        for n in ns:
            want = sum(1 for x in ns if x > n)
            got = dq_order_predecessors(m, n, n_blocks, sq, sk, wr, bm, bn, has_window)
            assert got == want, f"m={m} n={n}: counts {got}, key blocks above that see m: {want}"


def test_descending_launch_never_deadlocks():
    """A model of the launch: CTAs of one head in descending key-block order, at most `resident`
    at once, each walking its query blocks and adding to m only after the key blocks above that
    see m have; every CTA finishes."""
    sq = sk = 1000
    bm, bn, resident = 64, 128, 3
    for wl, wr in [(-1, 0), (-1, -1), (100, 0)]:
        has_window = not (wl < 0 and wr < 0)
        n_blocks = (sk + bn - 1) // bn
        order = list(range(n_blocks - 1, -1, -1))
        added = {}
        progress = {n: query_block_range(n, sq, sk, wl, wr, bm, bn, has_window) for n in order}
        pos = {n: progress[n][0] for n in order}
        running, queue = [], list(order)
        for _ in range(100000):
            while queue and len(running) < resident:
                running.append(queue.pop(0))
            if not running:
                break
            moved = False
            for n in list(running):
                m, end = pos[n], progress[n][1]
                if m >= end:
                    running.remove(n)
                    moved = True
                    continue
                need = dq_order_predecessors(m, n, n_blocks, sq, sk, wr, bm, bn, has_window)
                if added.get(m, 0) == need:
                    added[m] = need + 1
                    pos[n] = m + 1
                    moved = True
            assert moved, f"window {(wl, wr)}: no CTA can move (deadlock) with {running} resident"
        assert not running and not queue
