"""A few varlen (cu_seqlens) forward + backward calls for compute-sanitizer (memcheck / racecheck /
synccheck), with no other library's kernels in between: sequences ending on and inside blocks, a
length-1 sequence, one without keys, one without queries, seqlen_q != seqlen_k per sequence,
causal, a window, softcap, GQA and MQA, rows of q and k after the last sequence (in none), on
the backward path the environment picks
(FLASH_EXT_BWD_PATH=sm90 / sm80 to force one).

    FLASH_EXT_BWD_PATH=sm90 compute-sanitizer --tool racecheck python tools/sanitize_bwd_varlen.py [head dim]
"""
import sys

import torch


def main():
    ops = torch.ops.flash_ext
    torch.manual_seed(0)
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    dt, dev = torch.bfloat16, "cuda"
    cases = [  # (lens_q, lens_k, heads_q, heads_kv, causal, window_left, window_right, softcap, extra rows)
        ([128, 64, 256, 1], [128, 64, 256, 1], 4, 4, True, -1, 0, 0.0, 0),
        ([100, 1, 257, 0, 30], [300, 129, 0, 5, 1], 4, 2, True, -1, 0, 0.0, 0),
        ([300, 65, 129], [300, 65, 129], 4, 1, False, 32, 8, 0.0, 0),
        ([200, 17], [150, 400], 4, 2, False, -1, -1, 30.0, 3),
    ]
    for lens_q, lens_k, hq, hkv, causal, wl, wr, softcap, extra in cases:
        cq = torch.tensor([0] + [sum(lens_q[:i + 1]) for i in range(len(lens_q))], dtype=torch.int32, device=dev)
        ck = torch.tensor([0] + [sum(lens_k[:i + 1]) for i in range(len(lens_k))], dtype=torch.int32, device=dev)
        q = torch.randn(sum(lens_q) + extra, hq, d, device=dev, dtype=dt)
        k = torch.randn(sum(lens_k) + extra, hkv, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        scale = d ** -0.5
        out, lse = ops.fwd(q, k, v, cq, ck, max(lens_q), max(lens_k), scale, causal, wl, wr, softcap)
        dq, dk, dv = ops.bwd(torch.randn_like(out), q, k, v, out, lse, cq, ck, max(lens_q), max(lens_k), scale,
                             causal, wl, wr, softcap, False)
        torch.cuda.synchronize()
        # out's rows of no sequence are the forward's to leave unwritten; dq, dk, dv are all zeros there.
        assert all(torch.isfinite(t).all() for t in (out[:sum(lens_q)], dq, dk, dv))
    print("ok")


if __name__ == "__main__":
    import flash_ext  # noqa: F401  (registers the ops)
    main()
