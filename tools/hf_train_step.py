"""Training-step time of a transformers Llama with flash_ext attention beside SDPA's.

    python tools/hf_train_step.py                      # the issue's model: 4 layers, hidden 1024,
                                                       # 8 query / 2 KV heads (MLP 2816),
                                                       # batch 4 x 2048, bf16
    python tools/hf_train_step.py --layers 8 --seqlen 4096 --batch 2 --json out.json

Builds the model from a config (random init, nothing downloaded), once per implementation with
the same weights, and times forward + backward + AdamW step with CUDA events after warmup:
--repeats rounds in which the implementations take turns, one block of --steps steps each
(order reversed every round); the median block per implementation. --profile adds each one's
top kernels and its attention ops' device time per step. Prints one line per implementation and
the ratio. --packed times a padding-free batch instead: one row of --batch sequences of --seqlen
tokens each, position_ids restarting per sequence (DataCollatorWithFlattening's layout).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=2816,
                   help="MLP width (default 2816, README's example model)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--packed", action="store_true",
                   help="one row of batch x seqlen tokens with restarting position_ids")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", default="sdpa,flash_ext",
                   help="comma-separated: sdpa, eager, flash_attention_2, flash_ext")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--profile", action="store_true",
                   help="also print each implementation's top GPU kernels over 3 steps (torch.profiler)")
    return p.parse_args(argv)


def build_inputs(args, torch):
    g = torch.Generator().manual_seed(0)
    if args.packed:
        ids = torch.randint(3, args.vocab, (1, args.batch * args.seqlen), generator=g)
        pos = torch.arange(args.seqlen).repeat(args.batch).unsqueeze(0)
        return dict(input_ids=ids.cuda(), labels=ids.cuda(), position_ids=pos.cuda())
    ids = torch.randint(3, args.vocab, (args.batch, args.seqlen), generator=g)
    return dict(input_ids=ids.cuda(), labels=ids.cuda())


def make_step(model, inputs, torch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step():
        model(**inputs, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_block(step, args, torch):
    """ms per step over one block of --steps steps (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / args.steps


def time_interleaved(steps, args, torch):
    """impl -> median ms per step. The implementations take turns block by block (the order
    reversed every round), so clock and thermal drift over the run weighs on all of them alike."""
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times = {impl: [] for impl in steps}
    order = list(steps)
    for r in range(args.repeats):
        for impl in (order if r % 2 == 0 else order[::-1]):
            times[impl].append(time_block(steps[impl], args, torch))
    return {impl: statistics.median(t) for impl, t in times.items()}


# Ops whose device time is attention's: flash_ext's ops (with the GQA gradient sums they launch)
# and SDPA's backends.
ATTENTION_OPS = ("flash_ext::fwd", "flash_ext::bwd", "aten::_scaled_dot_product_flash_attention",
                 "aten::_scaled_dot_product_flash_attention_backward",
                 "aten::_scaled_dot_product_cudnn_attention",
                 "aten::_scaled_dot_product_cudnn_attention_backward",
                 "aten::_scaled_dot_product_efficient_attention",
                 "aten::_scaled_dot_product_efficient_attention_backward")


def profile_steps(model, inputs, impl, torch):
    from torch.profiler import ProfilerActivity, profile
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            model(**inputs, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    print(f"--- {impl}: top GPU kernels over 3 steps")
    events = prof.key_averages()
    print(events.table(sort_by="device_time_total", row_limit=18, max_name_column_width=70))
    # The outermost attention op of each call: an op may run inside another of the list (the
    # autograd layer of flash_ext::fwd calls its CUDA kernel through the same op name).
    attn = {}
    for e in prof.events():
        if e.name not in ATTENTION_OPS:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name not in ATTENTION_OPS:
            parent = parent.cpu_parent
        if parent is None:
            attn[e.name] = attn.get(e.name, 0.0) + e.device_time_total / 3
    print(f"--- {impl}: attention device time per step: {sum(attn.values()) / 1000:.3f} ms; "
          + ", ".join(f"{k} {v / 1000:.3f} ms" for k, v in sorted(attn.items())))


def main(argv=None):
    args = parse_args(argv)
    import torch
    import transformers
    if not torch.cuda.is_available():
        sys.exit("hf_train_step.py needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=max(4096, args.seqlen), use_cache=False)
    names = {}
    for impl in args.impls.split(","):
        if impl == "flash_ext":
            import flash_ext.integrations.transformers as fe_hf
            names[impl] = fe_hf.register()
        else:
            names[impl] = impl
    inputs = build_inputs(args, torch)
    torch.manual_seed(0)
    state = None
    models = {}
    for impl, name in names.items():
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=name).to("cuda", dtype)
        if state is None:
            state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(state)
        models[impl] = model
    results = time_interleaved({impl: make_step(m, inputs, torch) for impl, m in models.items()}, args, torch)
    if args.profile:
        for impl, model in models.items():
            profile_steps(model, inputs, impl, torch)
    shape = (f"1 x {args.batch * args.seqlen} packed ({args.batch} sequences)" if args.packed
             else f"{args.batch} x {args.seqlen}")
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.heads} q / {args.kv_heads} "
          f"kv heads, batch {shape}, {args.dtype}, {torch.cuda.get_device_name()}, "
          f"transformers {transformers.__version__}")
    base = results.get("sdpa")
    for impl, ms in results.items():
        ratio = f"  ({base / ms:.2f}x sdpa's speed)" if base and impl != "sdpa" else ""
        print(f"  {impl:>18}: {ms:8.2f} ms per training step{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), ms_per_step=results,
                           device=torch.cuda.get_device_name(),
                           transformers=transformers.__version__), f, indent=1)
    return results


if __name__ == "__main__":
    main()
