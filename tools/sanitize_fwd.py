"""A few forward calls for compute-sanitizer (memcheck, racecheck, synccheck):

    compute-sanitizer --tool memcheck python tools/sanitize_fwd.py [sm80|sm90] [tiles [HEAD_DIM [TILE [PINGPONG]]]]
    compute-sanitizer --tool memcheck python tools/sanitize_fwd.py sm90 streamk

TILE: alt or base; PINGPONG: 1, 0 or auto (the default); without them, all four.

tiles: instead, Hopper calls with more tiles than the GPU has SMs (persistent CTAs run several
tiles: the Q slabs (at d = 256 also O's staging), the O tile, the tile ring and the ping-pong
turns are reused across tiles), on both tiles of d = 64 and d = 256 (FLASH_EXT_SM90_FWD_TILE) and
ping-pong forced on (d = 256 has it off by default without a mask) and off, causal and local (claimed
tiles) and not (static stride), each head dim in its default main-loop order (pv_mid up to
d = 192, overlap at d = 256).

streamk: Hopper calls without a mask with the stream-K tail forced on (FLASH_EXT_SM90_STREAM_K=1):
one partial wave, whole tiles then the tail, both d = 64 tiles, d = 256 (O staged in Q's slab) and
one tile split over every SM (the pieces' workspace, counters and merge).
"""
import sys

import torch

import flash_ext


def tune(name, value):
    """Sets a tuning switch of the ops (they read the environment once per process)."""
    torch.ops.flash_ext.set_tuning(name, value)


path = sys.argv[1] if len(sys.argv) > 1 else "sm90"
tune("FLASH_EXT_FWD_PATH", path)
torch.manual_seed(0)
dt = torch.bfloat16
if len(sys.argv) > 2 and sys.argv[2] == "tiles":
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # argv[4] / argv[5] narrow the run to one tile and one ping-pong mode ("" = the default
    # mode): racecheck at d = 256 does not finish all four combinations within a device call
    # (on an H100, 128 x 64 with per-tile ping-pong alone took over 411 s).
    tiles = [sys.argv[4]] if len(sys.argv) > 4 else ["alt", "base"]
    pingpongs = [sys.argv[5]] if len(sys.argv) > 5 else ["1", "0"]
    for tile in tiles:
        tune("FLASH_EXT_SM90_FWD_TILE", tile)
        for pingpong in pingpongs:  # 1: turns carried across tiles
            tune("FLASH_EXT_SM90_PINGPONG", pingpong)
            for d in [int(sys.argv[3])] if len(sys.argv) > 3 else (64, 128, 256):  # one: racecheck is slow
                s = 700  # 4-6 query blocks per head, the last one partial
                h = (sms + 3) // 4 + 1
                q = torch.randn(1, s, h, d, device="cuda", dtype=dt)
                # a sliding window: warpgroups of a tile skip different blocks at both ends
                for kw in ({}, {"causal": True}, {"window_size": (96, 0)}):
                    out, _ = flash_ext.attn_fwd(q, q, q, **kw)
                    assert torch.isfinite(out).all(), (tile, pingpong, d, kw)
    torch.cuda.synchronize()
    print("sanitize_fwd tiles done")
    sys.exit(0)
if len(sys.argv) > 2 and sys.argv[2] == "streamk":
    tune("FLASH_EXT_SM90_STREAM_K", "1")
    for d, b, sq, sk, h, tile in [(128, 1, 1000, 1000, 3, "alt"), (128, 3, 2048, 2048, 3, "alt"),
                                  (64, 2, 1000, 1000, 4, "alt"), (64, 2, 1000, 1000, 4, "base"),
                                  (256, 1, 1000, 999, 6, "alt"), (128, 1, 50, 20000, 1, "alt")]:
        tune("FLASH_EXT_SM90_FWD_TILE", tile)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
        k = torch.randn(b, sk, h, d, device="cuda", dtype=dt)
        out, lse = flash_ext.attn_fwd(q, k, k)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), (d, b, sq, sk, h, tile)
    torch.cuda.synchronize()
    print("sanitize_fwd streamk done")
    sys.exit(0)
for d, sq, sk, hq, hkv, causal in [(128, 200, 200, 2, 2, False), (64, 131, 257, 4, 1, True),
                                   (256, 64, 100, 2, 1, False)]:
    q = torch.randn(1, sq, hq, d, device="cuda", dtype=dt)
    k = torch.randn(1, sk, hkv, d, device="cuda", dtype=dt)
    v = torch.randn(1, sk, hkv, d, device="cuda", dtype=dt)
    flash_ext.attn_fwd(q, k, v, causal=causal)
lens = torch.tensor([0, 70, 0, 150], dtype=torch.int32)
cu = torch.zeros(5, dtype=torch.int32, device="cuda")
cu[1:] = torch.cumsum(lens, 0).cuda()
q = torch.randn(int(lens.sum()), 4, 128, device="cuda", dtype=dt)
k = torch.randn(int(lens.sum()), 2, 128, device="cuda", dtype=dt)
flash_ext.attn_fwd(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=150, max_seqlen_k=150,
                   causal=True)
torch.cuda.synchronize()
print("sanitize_fwd done", path)
