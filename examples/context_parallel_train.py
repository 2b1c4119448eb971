"""A few training steps of a small causal transformer whose sequence is sharded over the ranks
(context parallelism with flash_ext.distributed's zigzag ring), next to the same model trained
on the whole sequence in one process: the losses agree step by step.

    torchrun --nproc-per-node 2 examples/context_parallel_train.py        # GPUs, NCCL, bf16
    torchrun --nproc-per-node 3 examples/context_parallel_train.py --cpu  # CPU, gloo, fp32,
                                                                          # reference attention

Each rank holds the zigzag shard of the tokens (and of their positions: the position embedding
is looked up at the global positions). The parameters are replicated: after the backward the
gradients are summed over the ranks (as data parallelism would), and the loss is the mean over
all tokens of the sequence. Every rank also trains an identical copy on the whole sequence
(one-process attention) and checks the loss against it.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from flash_ext import distributed as cp


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, attend):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1)
        a = attend(q.view(b, s, self.heads, self.hd), k.view(b, s, self.kv_heads, self.hd),
                   v.view(b, s, self.kv_heads, self.hd))
        x = x + self.proj(a.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=256, dim=128, layers=2, heads=4, kv_heads=2, max_len=4096):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, positions, attend):
        x = self.emb(tokens) + self.pos(positions)
        for blk in self.blocks:
            x = blk(x, attend)
        return self.head(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="gloo and the float32 reference attention")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        device, dtype, backend = torch.device("cpu"), torch.float32, cp.ReferenceBackend()
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dtype, backend = torch.bfloat16, None  # None: flash_ext's kernels

    def ring_attend(q, k, v):
        return cp.ring_flash_attn_func(q, k, v, causal=True, backend=backend)

    def full_attend(q, k, v):
        if args.cpu:
            from flash_ext.reference import attention_ref
            return attention_ref(q, k, v, causal=True)[0]
        import flash_ext
        return flash_ext.attn_fwd(q, k, v, causal=True)[0]

    torch.manual_seed(0)
    model = TinyLM(max_len=args.seqlen).to(device, dtype)
    full_model = TinyLM(max_len=args.seqlen).to(device, dtype)
    full_model.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    full_opt = torch.optim.SGD(full_model.parameters(), lr=0.1)

    tokens = torch.randint(0, 256, (2, args.seqlen + 1), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(args.seqlen, device=device).expand(2, -1)
    my = [cp.zigzag_shard(t, world, rank, dim=1) for t in (inputs, targets, positions)]
    n_tokens = targets.numel()

    for step in range(args.steps):
        logits = model(my[0], my[2], ring_attend)
        loss = F.cross_entropy(logits.float().flatten(0, 1), my[1].flatten(), reduction="sum")
        (loss / n_tokens).backward()
        for prm in model.parameters():  # replicated parameters: sum the shards' gradients
            dist.all_reduce(prm.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        opt.step()
        opt.zero_grad()

        full_logits = full_model(inputs, positions, full_attend)
        full_loss = F.cross_entropy(full_logits.float().flatten(0, 1), targets.flatten())
        full_loss.backward()
        full_opt.step()
        full_opt.zero_grad()

        ring_loss = total.item() / n_tokens
        tol = 1e-4 if args.cpu else 2e-2
        if rank == 0:
            print(f"step {step}: ring ({world} ranks) loss {ring_loss:.6f}   one process "
                  f"{full_loss.item():.6f}")
        assert abs(ring_loss - full_loss.item()) <= tol * max(1.0, abs(full_loss.item())), \
            f"step {step}: losses differ ({ring_loss} vs {full_loss.item()})"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
