"""Host time per call of flash_ext's Python layer alone, on any machine (no GPU, no build needed):
the entry points' own cost, without the dispatcher, autograd or a launch (developer tool for
docs/perf-notes.md, "host time per call"; tools/host_overhead.py measures the whole call on a GPU).

    PYTHONPATH=. python tools/host_python_overhead.py [--n 20000 --repeats 7] [--kvcache]

The ops flash_ext.ops._fwd / _bwd are replaced by Python no-ops that return preallocated tensors,
and CPU tensors stand in for CUDA ones (the device check is relaxed to accept them: the same
switch the CPU tests use). Prints microseconds per call, the best of --repeats runs of --n calls,
for each entry point and for the no-op itself (the floor). Without flash_ext._C the op schemas
come from tests/stand_in_ops.py. Runs against any checkout (PYTHONPATH picks the flash_ext
package), so before / after comparisons use one script.

--kvcache: flash_attn_with_kvcache instead (a decode step: batch 1, one query token, 8k cache
slots), ops._kvcache_append / _fwd_kvcache replaced by no-ops, each case timed on the fast path
and on the full path (the fast path switched off: flash_ext.kvcache._fast_call returning None).
cache_seqlens is one tensor for every call, so its value check is done once and then found in
the cache (as for the layers of one decode step). The "paged" cases use the same 8k slots as 32
pages of 256 tokens with one block_table tensor (checked once, like cache_seqlens)."""
import argparse
import importlib.util
import os
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_flash_ext():
    spec = importlib.util.find_spec("flash_ext")
    built = spec is not None and any(
        name.startswith("_C") for loc in spec.submodule_search_locations or ()
        for name in os.listdir(loc))
    if not built:
        sys.path.insert(0, os.path.join(_ROOT, "tests"))
        import stand_in_ops
        stand_in_ops.install()
    import flash_ext
    return flash_ext


def us_per_call(fn, n, repeats):
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per run")
    ap.add_argument("--repeats", type=int, default=7, help="runs per case (the best is kept)")
    ap.add_argument("--kvcache", action="store_true",
                    help="time flash_attn_with_kvcache, fast path against full path")
    a = ap.parse_args()

    flash_ext = _import_flash_ext()
    from flash_ext import _validation, ops

    # CPU tensors in place of CUDA ones: the full path's device check and (where it exists) the
    # fast path's, relaxed as the CPU tests relax them.
    check_devices = _validation.check_devices
    _validation.check_devices = lambda tensors, require_cuda=True, **kw: check_devices(
        tensors, require_cuda=False, **kw)
    if hasattr(flash_ext, "_FAST_PATH_ON_CPU"):
        flash_ext._FAST_PATH_ON_CPU = True
    if a.kvcache:
        return kvcache_main(flash_ext, a)

    b, s, hq, hkv, d, dt = 1, 128, 8, 2, 128, torch.bfloat16
    q = torch.randn(b, s, hq, d, dtype=dt)
    k, v = (torch.randn(b, s, hkv, d, dtype=dt) for _ in range(2))
    kv = torch.stack([k, v], dim=2)
    qkv = torch.randn(b, s, 3, hq, d, dtype=dt)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(b, hq, s, dtype=torch.float32)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    fwd_result, bwd_result = (out, lse), grads
    ops._fwd = lambda *args: fwd_result
    ops._bwd = lambda *args: bwd_result

    cases = {
        "no-op op (the floor)": lambda: ops._fwd(q, k, v, None, None, 0, 0, 0.1, True, -1, 0,
                                                 0.0, 0.0, None, False),
        "attn_fwd(q, k, v, causal=True)": lambda: flash_ext.attn_fwd(q, k, v, causal=True),
        "attn_fwd(..., softmax_scale, window_size, softcap)": lambda: flash_ext.attn_fwd(
            q, k, v, softmax_scale=0.1, window_size=(64, 0), softcap=30.0),
        "attn_bwd(dout, q, k, v, out, lse, causal=True)": lambda: flash_ext.attn_bwd(
            dout, q, k, v, out, lse, causal=True),
        "flash_attn_func(q, k, v, causal=True)": lambda: flash_ext.flash_attn_func(
            q, k, v, causal=True),
        "flash_attn_kvpacked_func(q, kv, causal=True)": lambda: flash_ext.flash_attn_kvpacked_func(
            q, kv, causal=True),
        "flash_attn_qkvpacked_func(qkv, causal=True)": lambda: flash_ext.flash_attn_qkvpacked_func(
            qkv, causal=True),
    }
    print(f"flash_ext from {os.path.dirname(flash_ext.__file__)}; b={b} s={s} hq={hq} hkv={hkv} "
          f"d={d} bf16 CPU stand-ins, ops no-ops; torch {torch.__version__}; best of "
          f"{a.repeats} x {a.n}")
    for name, fn in cases.items():
        print(f"{us_per_call(fn, a.n, a.repeats):8.2f} us per call  {name}", flush=True)


def kvcache_main(flash_ext, a):
    from flash_ext import kvcache, ops

    b, capacity, hq, hkv, d, dt = 1, 8192, 32, 8, 128, torch.bfloat16
    q = torch.randn(b, 1, hq, d, dtype=dt)
    k_cache, v_cache = (torch.randn(b, capacity, hkv, d, dtype=dt) for _ in range(2))
    k, v = (torch.randn(b, 1, hkv, d, dtype=dt) for _ in range(2))
    lens = torch.full((b,), 4000, dtype=torch.int32)
    # The same 8k slots as a paged cache: 32 pages of 256 tokens, sequence b on pages 32b...
    page_size = 256
    pages = capacity // page_size
    k_paged, v_paged = (torch.randn(b * pages, page_size, hkv, d, dtype=dt) for _ in range(2))
    table = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
    fwd_result = (torch.empty_like(q), torch.empty(b, hq, 1, dtype=torch.float32))
    ops._kvcache_append = lambda *args: None
    ops._fwd_kvcache = lambda *args: fwd_result
    f = flash_ext.flash_attn_with_kvcache

    cases = {
        "no append, tensor cache_seqlens": lambda: f(q, k_cache, v_cache, cache_seqlens=lens),
        "append k, v, tensor cache_seqlens, causal": lambda: f(
            q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True),
        "append k, v, int cache_seqlens, causal": lambda: f(
            q, k_cache, v_cache, k, v, cache_seqlens=4000, causal=True),
        "no append, int cache_seqlens": lambda: f(q, k_cache, v_cache, cache_seqlens=4000),
        "append, tensor, scale/window/softcap/lse": lambda: f(
            q, k_cache, v_cache, k, v, cache_seqlens=lens, softmax_scale=0.1,
            window_size=(1024, 0), softcap=30.0, return_softmax_lse=True),
        "paged: no append, tensor cache_seqlens": lambda: f(
            q, k_paged, v_paged, cache_seqlens=lens, block_table=table),
        "paged: append k, v, tensor cache_seqlens, causal": lambda: f(
            q, k_paged, v_paged, k, v, cache_seqlens=lens, block_table=table, causal=True),
        "paged: append k, v, int cache_seqlens, causal": lambda: f(
            q, k_paged, v_paged, k, v, cache_seqlens=4000, block_table=table, causal=True),
    }
    fast_call = getattr(kvcache, "_fast_call", None)
    print(f"flash_ext from {os.path.dirname(flash_ext.__file__)}; flash_attn_with_kvcache, "
          f"b={b} sq=1 capacity={capacity} hq={hq} hkv={hkv} d={d} bf16 CPU stand-ins, ops "
          f"no-ops; torch {torch.__version__}; best of {a.repeats} x {a.n}")
    floor = us_per_call(lambda: ops._fwd_kvcache(q, k_cache, v_cache, None, None, lens, -1, 1,
                                                 None, None, None, None, 0.1, True, -1, 0,
                                                 0.0, True, 0), a.n, a.repeats)
    print(f"{floor:8.2f} us per call  no-op op (the floor)")
    print("    full     fast   ratio  (us per call)")
    for name, fn in cases.items():
        if fast_call is not None:
            kvcache._fast_call = lambda *args: None
        full = us_per_call(fn, a.n, a.repeats)
        if fast_call is None:
            print(f"{full:8.2f}        -       -  {name}", flush=True)
            continue
        kvcache._fast_call = fast_call
        fast = us_per_call(fn, a.n, a.repeats)
        print(f"{full:8.2f} {fast:8.2f} {full / fast:6.2f}x  {name}", flush=True)


if __name__ == "__main__":
    main()
