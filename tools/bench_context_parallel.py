"""Scaling of flash_ext's ring attention over N GPUs (issue 28): efficiency T1 / (N x TN), T1
flash_ext on one GPU over the whole sequence, TN the ring on N GPUs, against PyTorch's
context_parallel with SDPA (flash backend) at the same shapes.

    torchrun --nproc-per-node 2 tools/bench_context_parallel.py --out cp_2gpu.jsonl
    torchrun --nproc-per-node 8 tools/bench_context_parallel.py --seqlens 65536 131072 262144

Shapes: batch 1, --heads query and key/value heads, head dim --headdim (128), bf16; causal
(zigzag layout) and not; forward and forward + backward. Each time is the median over --iters
runs after --warmup, on CUDA events, with a barrier before each run (the ring's time is the
slowest rank's, as all ranks wait for the last transfer). Rank 0 also times T1 (the others
wait). One JSON line per (seqlen, causal, pass) in --out and on stdout.
--cpu runs the same code on CPU processes (gloo, float32 reference attention, tiny shapes):
a check of the script, not a measurement.
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flash_ext import distributed as cp


def _timer(cpu):
    if cpu:
        def run(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return run

    def run(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    return run


def _median_ms(fn, args, group_sync=True):
    timer = _timer(args.cpu)
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.iters):
        if group_sync:
            dist.barrier()
        times.append(timer(fn))
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    if group_sync:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _pass_fn(attn, q, k, v, backward):
    """A closure running attn forward (and backward with a fixed dout)."""
    if not backward:
        def fwd():
            with torch.no_grad():
                attn(q, k, v)
        return fwd
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def fwd_bwd():
        out = attn(qg, kg, vg)
        torch.autograd.backward(out, dout)
        qg.grad = kg.grad = vg.grad = None
    return fwd_bwd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", type=int, nargs="+", default=[65536, 131072, 262144])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-torch-cp", action="store_true", help="skip PyTorch's context_parallel")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    kv_heads = args.kv_heads or args.heads

    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        device, dtype, backend = torch.device("cpu"), torch.float32, cp.ReferenceBackend()
    else:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dtype, backend = torch.bfloat16, None

    def one_gpu(q, k, v, causal):
        if args.cpu:
            from flash_ext.reference import attention_ref
            return attention_ref(q, k, v, causal=causal)[0]
        import flash_ext
        return flash_ext.attn_fwd(q, k, v, causal=causal)[0]

    results = []
    for seqlen in args.seqlens:
        g = torch.Generator(device="cpu").manual_seed(seqlen)
        shape_q, shape_kv = (1, seqlen, args.heads, args.headdim), (1, seqlen, kv_heads,
                                                                    args.headdim)
        full = [torch.randn(s, generator=g).to(device, dtype) for s in (shape_q, shape_kv,
                                                                         shape_kv)]
        for causal in (True, False):
            layout = "zigzag" if causal else "contiguous"
            local = [cp.shard(t, world, rank, layout).contiguous() for t in full]
            for backward in (False, True):
                row = dict(world=world, seqlen=seqlen, heads=args.heads, kv_heads=kv_heads,
                           headdim=args.headdim, causal=causal, layout=layout,
                           **{"pass": "fwd+bwd" if backward else "fwd"})
                t1 = torch.zeros(1, dtype=torch.float64)
                if rank == 0:
                    t1[0] = _median_ms(_pass_fn(lambda q, k, v: one_gpu(q, k, v, causal),
                                                *full, backward), args, group_sync=False)
                dist.broadcast(t1, 0)
                row["t1_ms"] = float(t1)

                def ring(q, k, v):
                    return cp.ring_flash_attn_func(q, k, v, causal=causal, layout=layout,
                                                   backend=backend)
                row["ring_ms"] = _median_ms(_pass_fn(ring, *local, backward), args)
                row["ring_efficiency"] = row["t1_ms"] / (world * row["ring_ms"])
                if not args.no_torch_cp and not args.cpu:
                    row.update(_torch_cp(full, causal, backward, world, args))
                results.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
        del full
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            for row in results:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def _torch_cp(full, causal, backward, world, args):
    """PyTorch's context_parallel (its ring, load-balanced for causal) around SDPA's flash
    backend, on (batch, heads, seqlen, headdim) buffers sharded by the context manager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        mesh = init_device_mesh("cuda", (world,))
        q, k, v = (t.transpose(1, 2).contiguous() for t in full)
        enable_gqa = q.shape[1] != k.shape[1]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), context_parallel(
                mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                no_restore_buffers={q, k, v}):
            def attn(q_, k_, v_):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal,
                                                      enable_gqa=enable_gqa)
            ms = _median_ms(_pass_fn(attn, q, k, v, backward), args)
        return {"torch_cp_ms": ms}
    except Exception as e:  # reported, not fatal: the flash_ext numbers still stand
        return {"torch_cp_error": f"{type(e).__name__}: {e}"[:300]}


if __name__ == "__main__":
    main()
