"""Outputs of computations that have a forward but no backward (varlen attention with
``seqused_k``, and flash_attn_varlen_func's paged ``block_table``), made safe for autograd.

The attention forward runs as usual when q, k or v requires grad (FlashAttention-2's own tests
do that and only skip the backward), without recording it; :func:`attach` then gives the output
an autograd node that links it to those inputs and whose backward raises
:class:`~flash_ext.FlashExtNotImplementedError` with :data:`NO_BACKWARD`. A user who calls
backward gets that clear error, never missing or wrong gradients.

How, and why this way:

- ``_ForwardOnly`` (an autograd.Function) returns the output detached: the same storage, no
  copy, an ordinary tensor that in-place operations may modify (returning the input itself
  would make it a view that autograd forbids modifying in place).
- Its backward does not raise itself: it returns the gradients from the op
  ``flash_ext::forward_only_backward``, whose kernel raises and whose fake kernel gives the
  gradients' shapes. torch.compile then traces the whole call (and its backward) into one graph
  without a break, and the error comes when the backward runs, eager or compiled; a Python
  ``raise`` in the backward would stop the trace instead. The op's outputs are the gradients
  the backward returns, so no compiler removes it as unused.
- Each input tensor is passed once (Dynamo cannot trace an autograd.Function given one tensor
  twice, e.g. k and v the same tensor).
"""

from __future__ import annotations

from typing import List

import torch

from flash_ext.errors import FlashExtNotImplementedError

__all__ = ["NO_BACKWARD", "attach", "needs_node"]

NO_BACKWARD = (
    "flash_ext: seqused_k / block_table have no backward. The forward of this output ran with "
    "inputs that require grad (flash_attn_varlen_func or attn_fwd with seqused_k or "
    "block_table), but no gradient can be computed through it. If no gradient is needed, run "
    "the call under torch.no_grad() or torch.inference_mode() (or detach the inputs). To train "
    "through it, call flash_attn_varlen_func without block_table and seqused_k: gather a paged "
    "cache into contiguous k and v first (flash_ext.paged_kv.gather_paged_kv), and give each "
    "sequence's used keys through cu_seqlens_k instead of seqused_k.")


@torch.library.custom_op("flash_ext::forward_only_backward", mutates_args=())
def _forward_only_backward(grad_out: torch.Tensor,
                           inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    """The gradients of ``inputs`` for a forward-only output: there are none; raises."""
    raise FlashExtNotImplementedError(NO_BACKWARD)


@_forward_only_backward.register_fake
def _forward_only_backward_fake(grad_out, inputs):
    return [torch.empty_like(t) for t in inputs]


class _ForwardOnly(torch.autograd.Function):
    """out (computed without recording) linked to ``inputs``; its backward raises."""

    @staticmethod
    def forward(ctx, out, *inputs):
        ctx.save_for_backward(*inputs)
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out):
        return (None, *_forward_only_backward(grad_out, list(ctx.saved_tensors)))


def needs_node(*tensors) -> bool:
    """Whether autograd would record a call on these tensors (grad mode on and one of them
    requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def attach(out: torch.Tensor, *tensors) -> torch.Tensor:
    """``out`` (computed under torch.no_grad()) as the output of a node on those of ``tensors``
    that require grad, whose backward raises FlashExtNotImplementedError (NO_BACKWARD)."""
    inputs = []
    for t in tensors:
        if t is not None and t.requires_grad and not any(t is u for u in inputs):
            inputs.append(t)
    return _ForwardOnly.apply(out, *inputs)
