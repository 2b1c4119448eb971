"""Ring attention over a sequence sharded across the ranks of a process group, and the same
ring emulated in one process.

Each rank holds its shard of q, k, v (batch, local_seqlen, heads, headdim) in one layout
(flash_ext/distributed/layout.py). Forward: ``world`` steps; at step i the rank attends its
queries to the key/value shard of rank ``(rank - i) mod world`` while that shard moves on to
the next rank and the following one arrives (torch.distributed.batch_isend_irecv: send to
rank + 1, receive from rank - 1), and merges the partial results by log-sum-exp. Backward:
the key/value shards go round again; each step's dq adds up locally, and the step's dk/dv
are added to a float32 buffer that travels with the shard one step behind it, arriving at
the shard's owner after the last step. The per-step arithmetic is
flash_ext/distributed/ring_steps.py; :func:`emulated_ring_forward` /
:func:`emulated_ring_backward` run it for N ranks in one process, exchanging shards by list
index, in the same order of additions as the ring (so the two agree to the bit when the
kernels are deterministic).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from flash_ext.distributed import layout as _layout
from flash_ext.distributed.ring_steps import (FlashBackend, backward_step, forward_step,
                                              plan_step)
from flash_ext.distributed.ring_steps_varlen import (backward_step_varlen, forward_step_varlen,
                                                     plan_varlen_step)
from flash_ext.errors import FlashExtValueError

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "emulated_ring_forward",
           "emulated_ring_backward", "step_plans", "varlen_step_plans"]


def step_plans(layout: str, local_len: int, world: int, rank: int, causal: bool,
               window_size: Sequence[int]) -> list:
    """The calls of every step of rank ``rank``: ``plans[i]`` for the key shard of rank
    ``(rank - i) mod world``."""
    mine = _layout.shard_segments(layout, local_len, world, rank)
    return [plan_step(mine, _layout.shard_segments(layout, local_len, world,
                                                   (rank - i) % world), causal, window_size)
            for i in range(world)]


def varlen_step_plans(local_lengths, layout: str, world: int, rank: int, causal: bool,
                      window_size: Sequence[int], device) -> list:
    """:func:`step_plans` for packed documents (``local_lengths``: each document's local
    length): per step, a list of ring_steps_varlen.VarlenCall."""
    return [plan_varlen_step(local_lengths, layout, world, rank, (rank - i) % world, causal,
                             window_size, device) for i in range(world)]


def _local_lengths(cu_seqlens, total: int, layout: str) -> list:
    """Each document's local length from the local cu_seqlens (a host sync if on the GPU)."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    cu = [int(x) for x in cu]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise FlashExtValueError(
            f"ring attention: cu_seqlens must start at 0, not decrease and end at the local "
            f"token count ({total}), got {cu}")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if layout == "zigzag" and any(n % 2 for n in lengths):
        raise FlashExtValueError(
            f"zigzag layout: every document's local length must be even, got {lengths}")
    return lengths


def _check_varlen(q, k, v, cu_seqlens, layout, window_size, softcap, softmax_scale) -> tuple:
    """:func:`_check` for (total, heads, d) tensors; returns (local lengths, window,
    softmax_scale, softcap)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise FlashExtValueError(
                f"varlen ring attention: {name} must be a 3-D (total, heads, headdim) tensor, "
                f"got {getattr(t, 'shape', type(t))}")
    window, scale, softcap = _check(q[None], k[None], v[None], "contiguous", window_size,
                                    softcap, softmax_scale)
    if layout not in _layout.LAYOUTS:
        raise FlashExtValueError(f"layout must be one of {_layout.LAYOUTS}, got {layout!r}")
    return _local_lengths(cu_seqlens, q.shape[0], layout), window, scale, softcap


def _check(q, k, v, layout, window_size, softcap, softmax_scale) -> tuple:
    """Shapes and arguments, before any communication or launch. Returns (window pair,
    softmax_scale, softcap)."""
    from flash_ext import _validation
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise FlashExtValueError(
                f"ring attention: {name} must be a 4-D (batch, local_seqlen, heads, headdim) "
                f"tensor, got {getattr(t, 'shape', type(t))}")
    if k.shape != v.shape:
        raise FlashExtValueError(f"ring attention: k {tuple(k.shape)} and v {tuple(v.shape)} "
                                 "differ")
    b, s, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise FlashExtValueError(
            f"ring attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, "
            "local sequence length and head dim (each rank holds the same tokens of q, k, v)")
    if hq % k.shape[2]:
        raise FlashExtValueError(f"ring attention: q heads ({hq}) must be a multiple of k/v "
                                 f"heads ({k.shape[2]})")
    if layout not in _layout.LAYOUTS:
        raise FlashExtValueError(f"layout must be one of {_layout.LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and s % 2:
        raise FlashExtValueError(f"zigzag layout: the local sequence length ({s}) must be even")
    window = _validation.window_pair(window_size)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not 0.0 < scale < math.inf:
        raise FlashExtValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    softcap = float(softcap)
    return window, scale, softcap if softcap > 0.0 else 0.0


# ----------------------------------------------------------------------------------------------
# Emulated ring: N ranks in one process
# ----------------------------------------------------------------------------------------------

def emulated_ring_forward(q_shards, k_shards, v_shards, *, causal: bool = False,
                          softmax_scale: Optional[float] = None,
                          window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                          layout: str = "zigzag", cu_seqlens=None, backend=None) -> tuple:
    """The ring's forward for ``len(q_shards)`` ranks in one process (``q_shards[r]`` is rank
    r's shard). Returns (outs, lses): per rank, out in q's dtype and lse float32 (b, h, s).
    With ``cu_seqlens`` (the local cumulative document lengths, the same on every rank): packed
    documents, shards (total, h, d) as layout.shard_varlen makes them, lse (h, total)."""
    world = len(q_shards)
    if not (world == len(k_shards) == len(v_shards)) or world < 1:
        raise FlashExtValueError("emulated ring: give one q, k and v shard per rank")
    backend = backend or FlashBackend()
    plans, scale, softcap, step, _ = _emulated_plans(q_shards, k_shards, v_shards, causal,
                                                     softmax_scale, window_size, softcap,
                                                     layout, cu_seqlens)
    accs = [_new_accumulators(q) for q in q_shards]
    for i in range(world):
        for r in range(world):
            src = (r - i) % world
            step(q_shards[r], k_shards[src], v_shards[src], plans[r][i], *accs[r], backend,
                 scale, softcap)
    return ([o.to(q.dtype) for (o, _), q in zip(accs, q_shards)], [l for _, l in accs])


def emulated_ring_backward(douts, q_shards, k_shards, v_shards, outs, lses, *,
                           causal: bool = False, softmax_scale: Optional[float] = None,
                           window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                           layout: str = "zigzag", cu_seqlens=None, backend=None) -> tuple:
    """The ring's backward for the ranks of :func:`emulated_ring_forward`, given each rank's
    dout and its forward's out and lse. Returns (dqs, dks, dvs), per rank, in the inputs'
    dtypes."""
    world = len(q_shards)
    backend = backend or FlashBackend()
    plans, scale, softcap, _, step = _emulated_plans(q_shards, k_shards, v_shards, causal,
                                                     softmax_scale, window_size, softcap,
                                                     layout, cu_seqlens)
    dqs = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) for q in q_shards]
    dks = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for k in k_shards]
    dvs = [torch.zeros(v.shape, dtype=torch.float32, device=v.device) for v in v_shards]
    for i in range(world):
        for r in range(world):
            src = (r - i) % world
            dk_step = torch.zeros_like(dks[src])
            dv_step = torch.zeros_like(dvs[src])
            step(douts[r], q_shards[r], k_shards[src], v_shards[src], outs[r], lses[r],
                 plans[r][i], dqs[r], dk_step, dv_step, backend, scale, softcap)
            # The ring adds this step's share to the buffer that arrived with the shard.
            dks[src] = dk_step + dks[src] if i else dk_step
            dvs[src] = dv_step + dvs[src] if i else dv_step
    return ([g.to(t.dtype) for g, t in zip(dqs, q_shards)],
            [g.to(t.dtype) for g, t in zip(dks, k_shards)],
            [g.to(t.dtype) for g, t in zip(dvs, v_shards)])


def _emulated_plans(q_shards, k_shards, v_shards, causal, softmax_scale, window_size, softcap,
                    layout, cu_seqlens) -> tuple:
    """(plans per rank, scale, softcap, forward step, backward step) of the emulated ring."""
    world = len(q_shards)
    q, k, v = q_shards[0], k_shards[0], v_shards[0]
    if cu_seqlens is None:
        window, scale, softcap = _check(q, k, v, layout, window_size, softcap, softmax_scale)
        plans = [step_plans(layout, q.shape[1], world, r, causal, window) for r in range(world)]
        return plans, scale, softcap, forward_step, backward_step
    lengths, window, scale, softcap = _check_varlen(q, k, v, cu_seqlens, layout, window_size,
                                                    softcap, softmax_scale)
    plans = [varlen_step_plans(lengths, layout, world, r, causal, window, q.device)
             for r in range(world)]
    return plans, scale, softcap, forward_step_varlen, backward_step_varlen


def _new_accumulators(q: torch.Tensor) -> tuple:
    """float32 (out, lse) to merge into: lse (b, h, s), or (h, total) for varlen q."""
    if q.dim() == 3:
        lse_shape = (q.shape[1], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
            torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device))


# ----------------------------------------------------------------------------------------------
# The ring over torch.distributed
# ----------------------------------------------------------------------------------------------

class _Transfer:
    """Tensors in flight from rank - 1 (received) and to rank + 1 (sent)."""

    def __init__(self, received, requests, sent):
        self.received, self.requests, self._sent = received, requests, sent

    def wait(self) -> list:
        for req in self.requests:
            req.wait()
        self._sent = None  # the send buffers may be freed now
        return self.received


class _RingComm:
    """Point-to-point shifts around the ring of a process group."""

    def __init__(self, group):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        to_global = (lambda r: r) if group is None else (
            lambda r: dist.get_global_rank(group, r))
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)

    def shift(self, tensors) -> _Transfer:
        """Starts sending ``tensors`` to rank + 1 and receiving as many of the same shapes
        from rank - 1; returns at once."""
        dist = self.dist
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return _Transfer(received, dist.batch_isend_irecv(ops), sent)


def _ring_forward(comm, q, k, v, plans, backend, scale, softcap, step=forward_step):
    acc_out, acc_lse = _new_accumulators(q)
    kv = [k, v]
    for i in range(comm.world):
        # The next shard's transfer overlaps this step's attention.
        transfer = comm.shift(kv) if i + 1 < comm.world else None
        step(q, kv[0], kv[1], plans[i], acc_out, acc_lse, backend, scale, softcap)
        if transfer is not None:
            kv = transfer.wait()
    return acc_out.to(q.dtype), acc_lse


def _ring_backward(comm, dout, q, k, v, out, lse, plans, backend, scale, softcap,
                   step=backward_step):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k, v]
    dkv_transfer = None
    for i in range(comm.world):
        kv_transfer = comm.shift(kv) if i + 1 < comm.world else None
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        step(dout, q, kv[0], kv[1], out, lse, plans[i], dq, dk, dv, backend, scale, softcap)
        if dkv_transfer is not None:
            # The buffer of this shard's dk/dv, from the ranks it visited before.
            prev_dk, prev_dv = dkv_transfer.wait()
            dk, dv = dk + prev_dk, dv + prev_dv
        dkv_transfer = comm.shift([dk, dv]) if comm.world > 1 else None
        if kv_transfer is not None:
            kv = kv_transfer.wait()
    if dkv_transfer is not None:
        dk, dv = dkv_transfer.wait()  # this rank's own shard, back from its last visit
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingFlashAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, window, softcap, layout, backend,
                local_lengths):
        comm = _RingComm(group)
        if local_lengths is None:
            plans = step_plans(layout, q.shape[1], comm.world, comm.rank, causal, window)
            steps = (forward_step, backward_step)
        else:
            plans = varlen_step_plans(local_lengths, layout, comm.world, comm.rank, causal,
                                      window, q.device)
            steps = (forward_step_varlen, backward_step_varlen)
        out, lse = _ring_forward(comm, q, k, v, plans, backend, scale, softcap, steps[0])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.plans, ctx.backend, ctx.scale, ctx.softcap = (comm, plans, backend, scale,
                                                                     softcap)
        ctx.backward_step = steps[1]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.comm, dout, q, k, v, out, lse, ctx.plans, ctx.backend,
                                    ctx.scale, ctx.softcap, ctx.backward_step)
        return dq, dk, dv, None, None, None, None, None, None, None, None


@torch.compiler.disable
def ring_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                         causal: bool = False, softmax_scale: Optional[float] = None,
                         window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                         layout: str = "zigzag", return_lse: bool = False, backend=None):
    """Exact attention over a sequence sharded across the ranks of ``group`` (default: the
    default process group), differentiable.

    Each rank passes its shard q (batch, local_seqlen, heads_q, headdim), k and v (batch,
    local_seqlen, heads_kv, headdim) (heads_q a multiple of heads_kv: GQA/MQA), in the
    ``layout`` that :func:`flash_ext.distributed.shard` produces ("zigzag": the load-balanced
    causal layout; "contiguous": rank r holds the r-th slice). causal, softmax_scale,
    window_size and softcap mean what they mean for flash_ext.attn_fwd on the full sequence.
    Every rank of the group must call it with the same shapes and arguments.

    Returns out (q's shape and dtype: this rank's shard of the full attention's output), and
    with ``return_lse`` also lse (batch, heads_q, local_seqlen) float32, not differentiable.
    ``backend``: the per-step attention (default: flash_ext's kernels); see ring_steps.py.

    Under torch.compile this function is not traced (a graph break): the communication runs
    eagerly between the compiled graphs before and after it.
    """
    window, scale, softcap = _check(q, k, v, layout, window_size, softcap, softmax_scale)
    if backend is None:
        backend = FlashBackend()
    out, lse = _RingFlashAttn.apply(q, k, v, group, bool(causal), scale, window, softcap,
                                    layout, backend, None)
    return (out, lse) if return_lse else out


@torch.compiler.disable
def ring_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens,
                                group=None, causal: bool = False,
                                softmax_scale: Optional[float] = None,
                                window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                layout: str = "zigzag", return_lse: bool = False,
                                backend=None):
    """:func:`ring_flash_attn_func` for packed documents: q (total, heads_q, headdim), k and v
    (total, heads_kv, headdim), this rank's shard as :func:`flash_ext.distributed.shard_varlen`
    makes it (every document sharded on its own: its full length a multiple of 2 * world for
    zigzag, of world for contiguous). ``cu_seqlens``: the *local* cumulative document lengths
    (the full ones divided by world), the same on every rank; a tensor or a list (read on the
    host once per call: a sync if it is on the GPU). No attention crosses documents. Returns
    out (total, heads_q, headdim), and with ``return_lse`` lse (heads_q, total) float32."""
    lengths, window, scale, softcap = _check_varlen(q, k, v, cu_seqlens, layout, window_size,
                                                    softcap, softmax_scale)
    if backend is None:
        backend = FlashBackend()
    out, lse = _RingFlashAttn.apply(q, k, v, group, bool(causal), scale, window, softcap,
                                    layout, backend, lengths)
    return (out, lse) if return_lse else out


