"""A few flash_attn_with_kvcache calls for compute-sanitizer (memcheck / racecheck / synccheck):
appends with rotary into contiguous and paged caches, splits forced and automatic, GQA, causal,
local, ALiBi, left padding, ragged lengths. The ring depth comes from FLASH_EXT_DECODE_RING.

    FLASH_EXT_DECODE_RING=6 compute-sanitizer --tool memcheck python tools/sanitize_decode.py
"""
import torch

import flash_ext


def main():
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    b, hq, hkv, d, cap = 3, 8, 2, 128, 640
    for page in (None, 16, 64):  # pages of 16: four per 64-key block
        paged = page is not None
        for splits in (1, 0, 5, 64):  # 64: the merge in several passes
            q = torch.randn(b, 2, hq, d, device=dev, dtype=dt)
            k = torch.randn(b, 2, hkv, d, device=dev, dtype=dt)
            v = torch.randn(b, 2, hkv, d, device=dev, dtype=dt)
            if paged:
                kc = torch.randn(b * cap // page, page, hkv, d, device=dev, dtype=dt)
                vc = torch.randn_like(kc)
                table = torch.randperm(b * cap // page, device=dev, dtype=torch.int32).view(b, cap // page)
            else:
                kc = torch.randn(b, cap, hkv, d, device=dev, dtype=dt)
                vc = torch.randn_like(kc)
                table = None
            seqlens = torch.tensor([5, 300, 600], device=dev, dtype=torch.int32)
            cos = torch.randn(cap, 32, device=dev, dtype=dt)
            sin = torch.randn(cap, 32, device=dev, dtype=dt)
            slopes = torch.rand(hq, device=dev, dtype=torch.float32)
            leftpad = None if paged else torch.tensor([0, 7, 100], device=dev, dtype=torch.int32)
            out = flash_ext.flash_attn_with_kvcache(
                q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, block_table=table,
                cache_leftpad=leftpad, causal=True, alibi_slopes=slopes, num_splits=splits)
            out = flash_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                    window_size=(50, 0), num_splits=splits)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
    print("ok")


if __name__ == "__main__":
    main()
