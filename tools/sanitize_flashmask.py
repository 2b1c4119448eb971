"""A few FlashMask forward + backward calls for compute-sanitizer (memcheck / racecheck /
synccheck), with no other library's kernels in between (the GPU tests' references run cuBLAS,
whose kernels the sanitizer reports or trips on): the mask forms (causal C = 1 / 2, non-causal
C = 2 / 4), documents on and off block edges, a band, fully masked rows, GQA, softcap, on the
backward path the environment picks (FLASH_EXT_BWD_PATH=sm90 / sm80 to force one).

    compute-sanitizer --tool racecheck python tools/sanitize_flashmask.py [head dim]
"""
import sys

import torch

import flash_ext
from flash_ext import flashmask_masks as masks


def bounds_cases(s, dev):
    doc, causal = masks.causal_document([128, 256, 6, 250, s - 640], device=dev)
    yield doc, causal
    yield masks.sliding_window(200, s, device=dev)
    yield masks.prefix_lm(300, [600, s - 600], device=dev)
    yield masks.global_sliding_window(64, 100, s, device=dev)
    dead = torch.full((1, 1, s, 1), 250, dtype=torch.int32, device=dev)  # rows 250.. see nothing
    dead[:, :, 128:256] = 0                                               # keys 128..255 unseen
    yield dead, True


def main():
    torch.manual_seed(0)
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    dt, dev, s = torch.bfloat16, "cuda", 1000
    for (bounds, causal), hkv, softcap in zip(bounds_cases(s, dev), (2, 4, 1, 2, 4), (0.0, 0.0, 30.0, 0.0, 0.0)):
        q = torch.randn(2, s, 4, d, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(2, s, hkv, d, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(2, s, hkv, d, device=dev, dtype=dt, requires_grad=True)
        out = flash_ext.flashmask_attention(q, k, v, bounds.expand(2, -1, -1, -1).contiguous(), causal=causal,
                                            softcap=softcap)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
    print("ok")


if __name__ == "__main__":
    main()
