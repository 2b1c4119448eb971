"""Sequence layouts of context parallelism: which tokens of the full sequence each rank holds.

Two layouts, both cutting the sequence (length S) into equal chunks:

- ``"contiguous"``: ``world`` chunks of S / world tokens; rank r holds chunk r. Simple, but
  under a causal mask rank r's queries see r + 1 of the world key shards, so the last rank
  does ``world`` times the work of the first.
- ``"zigzag"`` (load-balanced causal): ``2 * world`` chunks of c = S / (2 * world) tokens;
  rank r holds chunk r followed by chunk ``2 * world - 1 - r``. Every rank then holds one
  early and one late chunk, and under a causal mask every step of the ring costs every rank
  the same (see flash_ext/distributed/ring_steps.py).

A rank's tokens are described by *segments*: ``(global_start, length)`` pairs in the order
the tokens sit in the local shard. The ring's per-step masks are computed from them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from flash_ext.errors import FlashExtValueError

__all__ = ["LAYOUTS", "zigzag_shard", "zigzag_gather", "contiguous_shard",
           "contiguous_gather", "shard", "gather", "shard_segments", "shard_varlen",
           "gather_varlen"]

LAYOUTS = ("zigzag", "contiguous")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise FlashExtValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_world_rank(world: int, rank: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise FlashExtValueError(f"world must be an int >= 1, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise FlashExtValueError(f"rank must be an int in [0, {world}), got {rank!r}")


def _chunks(x: torch.Tensor, n: int, dim: int, what: str) -> tuple:
    length = x.shape[dim]
    if length % n:
        raise FlashExtValueError(
            f"{what}: the sequence length along dim {dim} ({length}) must be a multiple of "
            f"{n}")
    if length == 0:
        return tuple(x.narrow(dim, 0, 0) for _ in range(n))
    return torch.split(x, length // n, dim=dim)


def zigzag_shard(x: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of the full sequence ``x`` (sequence along ``dim``):
    chunks ``rank`` and ``2 * world - 1 - rank`` of ``2 * world`` equal chunks, concatenated.
    The length along ``dim`` must be a multiple of ``2 * world``. Returns a new tensor."""
    _check_world_rank(world, rank)
    chunks = _chunks(x, 2 * world, dim, "zigzag_shard")
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_gather(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's zigzag shard (``shards[r]`` from rank r); the
    inverse of :func:`zigzag_shard`."""
    world = len(shards)
    if world < 1:
        raise FlashExtValueError("zigzag_gather needs at least one shard")
    ordered = [None] * (2 * world)
    for rank, s in enumerate(shards):
        first, second = _chunks(s, 2, dim, "zigzag_gather")
        ordered[rank] = first
        ordered[2 * world - 1 - rank] = second
    return torch.cat(ordered, dim=dim)


def contiguous_shard(x: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s contiguous shard: chunk ``rank`` of ``world`` equal chunks (a view)."""
    _check_world_rank(world, rank)
    return _chunks(x, world, dim, "contiguous_shard")[rank]


def contiguous_gather(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's contiguous shard."""
    if len(shards) < 1:
        raise FlashExtValueError("contiguous_gather needs at least one shard")
    return torch.cat(list(shards), dim=dim)


def shard(x: torch.Tensor, world: int, rank: int, layout: str = "zigzag",
          dim: int = 1) -> torch.Tensor:
    """:func:`zigzag_shard` or :func:`contiguous_shard` by name."""
    _check_layout(layout)
    fn = zigzag_shard if layout == "zigzag" else contiguous_shard
    return fn(x, world, rank, dim)


def gather(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """:func:`zigzag_gather` or :func:`contiguous_gather` by name."""
    _check_layout(layout)
    fn = zigzag_gather if layout == "zigzag" else contiguous_gather
    return fn(shards, dim)


def shard_segments(layout: str, local_len: int, world: int, rank: int) -> tuple:
    """The global positions of rank ``rank``'s ``local_len`` tokens: ``(global_start,
    length)`` segments in local order."""
    _check_layout(layout)
    _check_world_rank(world, rank)
    if layout == "contiguous":
        return ((rank * local_len, local_len),)
    if local_len % 2:
        raise FlashExtValueError(
            f"zigzag layout: the local sequence length ({local_len}) must be even (two chunks)")
    c = local_len // 2
    return ((rank * c, c), ((2 * world - 1 - rank) * c, c))


def _doc_bounds(cu_seqlens) -> list:
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    cu = [int(x) for x in cu]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise FlashExtValueError(f"cu_seqlens must start at 0 and not decrease, got {cu}")
    return cu


def shard_varlen(x: torch.Tensor, cu_seqlens, world: int, rank: int, layout: str = "zigzag",
                 dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s shard of packed documents: every document [cu_seqlens[i],
    cu_seqlens[i+1]) along ``dim`` is sharded on its own (:func:`shard`), the shards packed in
    document order. Each document's length must be a multiple of ``2 * world`` (zigzag) or
    ``world``. The local cu_seqlens are ``cu_seqlens // world``."""
    cu = _doc_bounds(cu_seqlens)
    if cu[-1] != x.shape[dim]:
        raise FlashExtValueError(f"shard_varlen: cu_seqlens ends at {cu[-1]}, the tensor has "
                                 f"{x.shape[dim]} tokens along dim {dim}")
    parts = [shard(x.narrow(dim, a, b - a), world, rank, layout, dim)
             for a, b in zip(cu, cu[1:])]
    return torch.cat(parts, dim=dim) if parts else x.narrow(dim, 0, 0)


def gather_varlen(shards: Sequence[torch.Tensor], cu_seqlens, layout: str = "zigzag",
                  dim: int = 0) -> torch.Tensor:
    """The packed documents from every rank's :func:`shard_varlen` shard; ``cu_seqlens`` are
    the full (global) cumulative lengths."""
    cu = _doc_bounds(cu_seqlens)
    world = len(shards)
    docs = []
    for a, b in zip(cu, cu[1:]):
        m = (b - a) // world
        docs.append(gather([s.narrow(dim, a // world, m) for s in shards], layout, dim))
    return torch.cat(docs, dim=dim) if docs else shards[0].narrow(dim, 0, 0)
