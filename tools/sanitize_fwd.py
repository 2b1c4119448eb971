"""A few forward calls for compute-sanitizer (memcheck, racecheck, synccheck):

    compute-sanitizer --tool memcheck python tools/sanitize_fwd.py [sm80|sm90]
"""
import os
import sys

import torch

import flash_ext

os.environ["FLASH_EXT_FWD_PATH"] = sys.argv[1] if len(sys.argv) > 1 else "sm90"
torch.manual_seed(0)
dt = torch.bfloat16
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
print("sanitize_fwd done", os.environ["FLASH_EXT_FWD_PATH"])
