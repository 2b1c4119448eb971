"""Training-step time of a transformers Llama with flash_ext attention beside SDPA's.

    python tools/hf_train_step.py                      # the issue's model: 4 layers, hidden 1024,
                                                       # 8 query / 2 KV heads (MLP 2816),
                                                       # batch 4 x 2048, bf16
    python tools/hf_train_step.py --layers 8 --seqlen 4096 --batch 2 --json out.json

Builds the model from a config (random init, nothing downloaded), once per implementation with
the same weights, and times forward + backward + AdamW step with CUDA events after warmup
(median of --repeats timed blocks of --steps steps each). Prints one line per implementation and
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


def time_steps(model, inputs, args, torch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step():
        model(**inputs, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / args.steps)
    return statistics.median(times)


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
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=18, max_name_column_width=70))


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
    results = {}
    for impl, name in names.items():
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=name).to("cuda", dtype)
        if state is None:
            state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(state)
        results[impl] = time_steps(model, inputs, args, torch)
        if args.profile:
            profile_steps(model, inputs, impl, torch)
        del model
        torch.cuda.empty_cache()
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
