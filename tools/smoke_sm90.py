"""Quick check of the forward on each path against the fp32 reference (a hang here means a
pipeline deadlock: run it under `timeout`)."""
import os
import sys

import torch

import flash_ext
from flash_ext.reference import attention_ref

torch.manual_seed(0)
ok = True
for path in ("sm80", "sm90"):
    os.environ["FLASH_EXT_FWD_PATH"] = path
    for d, sq, sk, causal in [(128, 256, 256, False), (64, 1000, 1000, True), (256, 130, 300, False),
                              (96, 77, 77, True), (192, 200, 100, False)]:
        q = torch.randn(2, sq, 4, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16)
        out, lse = flash_ext.attn_fwd(q, k, v, causal=causal)
        torch.cuda.synchronize()
        ref, ref_lse = attention_ref(q, k, v, causal=causal)
        err = (out.float() - ref.float()).abs().max().item()
        lerr = (lse - ref_lse).abs().nan_to_num(0).max().item()
        good = err < 2e-2 and lerr < 1e-2
        ok &= good
        print(f"{path} d={d} sq={sq} sk={sk} causal={causal}: max|out-ref|={err:.2e} max|lse-ref|={lerr:.2e} {'ok' if good else 'BAD'}", flush=True)
sys.exit(0 if ok else 1)
