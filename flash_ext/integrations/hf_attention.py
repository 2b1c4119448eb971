"""flash_ext as a transformers attention function, and the mask function that goes with it.

Nothing here imports transformers: these are plain functions with the signatures transformers
calls (its ``AttentionInterface`` and ``AttentionMaskInterface``); flash_ext.integrations.
transformers registers them.

The attention function receives query (batch, heads_q, seqlen_q, head_dim) and key / value
(batch, heads_kv, seqlen_k, head_dim) and returns (output (batch, seqlen_q, heads_q, head_dim),
None). Which flash_ext call runs:

- a 2-D padding mask (from :func:`padding_mask`): the valid tokens are gathered (flash_ext.
  unpad_input's layout), flash_ext.flash_attn_varlen_func runs, flash_ext.pad_input scatters the
  rows back (padded rows are 0);
- ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments (DataCollatorWithFlattening with
  return_flash_attn_kwargs=True): varlen over the flattened batch;
- ``position_ids`` that restart inside a row (packed, padding-free batches) while seqlen_q ==
  seqlen_k: varlen, one sequence per run of positions that grow by one;
- otherwise flash_ext.flash_attn_func on the batch as it is.

GQA/MQA runs natively (no repeat of key/value heads). Causal attention with seqlen_q < seqlen_k
(generation with a KV cache) is aligned to the bottom-right corner, flash_ext's convention.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

import flash_ext
from flash_ext.integrations import sequence_layout as layout

__all__ = ["attention_forward", "padding_mask"]

_HALF = (torch.float16, torch.bfloat16)
_UNSET = object()


def flash_dtype(query: torch.Tensor, module: torch.nn.Module) -> Optional[torch.dtype]:
    """The half dtype to run a float32 query in, or None when it is half already.

    flash_ext takes float16 / bfloat16 only. Under autocast a float32 query (from a float32 norm,
    say) runs in autocast's dtype; otherwise in the dtype of the module's linear weights (as
    transformers' own FlashAttention path does). A module in float32 without autocast raises."""
    if query.dtype in _HALF:
        return None
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if dtype in _HALF:
            return dtype
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear):
            if sub.weight.dtype in _HALF:
                return sub.weight.dtype
            break
    raise TypeError(
        f"flash_ext attention needs float16 or bfloat16 inputs, got {query.dtype}: load the model "
        "with dtype=torch.bfloat16 (or float16), or run it under torch.autocast")


def _window(sliding_window, causal: bool, longest_key: int):
    """transformers' sliding_window w as flash_ext's (left, right) window: a causal query sees
    itself and the w - 1 keys before it (transformers' sliding mask: key > query - w); a
    bidirectional one sees keys at distance <= w (transformers' bidirectional sliding mask).
    (-1, -1) when no query can see more keys than the window holds."""
    if sliding_window is None or sliding_window <= 0 or longest_key <= sliding_window:
        return (-1, -1)
    w = int(sliding_window)
    return (w - 1, 0) if causal else (w, w)


def _check_mask(attention_mask, key_len: int):
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        kind = (f"a {attention_mask.dim()}-D tensor" if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__)
        raise ValueError(
            f"flash_ext attention takes a 2-D (batch, seqlen_k) padding mask or None, got {kind}. "
            "Masks beyond padding (4-D masks, BlockMask) are not supported: pass the 2-D "
            "attention_mask to the model, or use attn_implementation='sdpa' for custom masks")
    if attention_mask.shape[1] > key_len:
        raise ValueError(
            f"flash_ext attention: the padding mask covers {attention_mask.shape[1]} keys but "
            f"only {key_len} keys were given")


def _padded_attention(q, k, v, attention_mask, opts, sliding_window):
    """Attention over a padded batch: gather the valid tokens, varlen, scatter back."""
    b, sq = q.shape[0], q.shape[1]
    _check_mask(attention_mask, k.shape[1])
    if attention_mask.device != q.device:
        attention_mask = attention_mask.to(q.device)
    # A static cache holds its tokens first and unwritten slots after them; the mask covers the
    # written ones.
    if attention_mask.shape[1] < k.shape[1]:
        k, v = k[:, :attention_mask.shape[1]], v[:, :attention_mask.shape[1]]
    keys = layout.padding_layout(attention_mask, flash_ext.unpad_input)
    if keys.all_valid:
        return _dense_attention(q, k, v, opts, sliding_window)
    k_unp, v_unp = layout.gather_tokens(k, keys.indices), layout.gather_tokens(v, keys.indices)
    if sq == k.shape[1]:
        queries = keys
    elif sq == 1:  # one new token per row (decoding): every row has its query
        queries = layout.PaddingLayout(None, torch.arange(b + 1, dtype=torch.int32,
                                                          device=q.device), 1, True)
    else:  # a few new tokens per row after a cache: the last sq columns of a left-padded mask
        queries = layout.padding_layout(attention_mask[:, -sq:], flash_ext.unpad_input)
    q_unp = q.reshape(b, *q.shape[2:]) if sq == 1 else layout.gather_tokens(q, queries.indices)
    out = flash_ext.flash_attn_varlen_func(
        q_unp, k_unp, v_unp, queries.cu_seqlens, keys.cu_seqlens, queries.max_seqlen,
        keys.max_seqlen, window_size=_window(sliding_window, opts["causal"], keys.max_seqlen),
        **opts)
    if sq == 1:
        return out.reshape(b, 1, *out.shape[1:])
    return flash_ext.pad_input(out, queries.indices, b, sq)


def _varlen_over_batch(q, k, v, cu_q, cu_k, max_q, max_k, opts, sliding_window):
    """Varlen attention over the flattened (batch * seqlen) tokens of q, k, v."""
    b, sq = q.shape[0], q.shape[1]
    flat = [t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v)]
    if cu_q.dtype != torch.int32:
        cu_q = cu_q.to(torch.int32)
    if cu_k.dtype != torch.int32:
        cu_k = cu_k.to(torch.int32)
    out = flash_ext.flash_attn_varlen_func(
        *flat, cu_q, cu_k, int(max_q), int(max_k),
        window_size=_window(sliding_window, opts["causal"], int(max_k)), **opts)
    return out.reshape(b, sq, *out.shape[1:])


def _dense_attention(q, k, v, opts, sliding_window):
    return flash_ext.flash_attn_func(
        q, k, v, window_size=_window(sliding_window, opts["causal"], k.shape[1]), **opts)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window=_UNSET, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention-function contract, computed by flash_ext.

    Args (as transformers passes them):
        module: the attention layer (its ``is_causal``, ``sliding_window`` and linear weights'
            dtype are read when the call does not say).
        query: (batch, heads_q, seqlen_q, head_dim); key, value: (batch, heads_kv, seqlen_k,
            head_dim), heads_q a multiple of heads_kv.
        attention_mask: None or a 2-D (batch, seqlen_k) padding mask (nonzero = token); see
            :func:`padding_mask`.
        dropout: attention dropout probability (transformers passes 0 in eval mode).
        scaling: softmax scale, default 1/sqrt(head_dim).
        sliding_window: window size w (a causal query sees itself and w - 1 earlier keys);
            default: ``module.sliding_window`` if it has one.
        softcap: logit soft-capping (Gemma 2's attn_logit_softcapping); None or <= 0 = off.
        is_causal: default ``module.is_causal`` (True if it has none).
        kwargs: ``position_ids``, ``cu_seq_lens_q/k`` with ``max_length_q/k``, ``deterministic``;
            the rest are ignored.

    Returns:
        (output (batch, seqlen_q, heads_q, head_dim) in the half dtype it ran in, None).
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("flash_ext attention does not support attention sinks (s_aux)")
    if sliding_window is _UNSET:
        sliding_window = getattr(module, "sliding_window", None)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()

    b, _, sq, head_dim = query.shape
    # transformers' (batch, heads, seqlen, dim) -> flash_ext's (batch, seqlen, heads, dim): views.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    dtype = flash_dtype(query, module)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    v_dim = v.shape[-1]
    if v_dim < head_dim:  # value heads narrower than query/key heads: zero columns, cut below
        v = F.pad(v, (0, head_dim - v_dim))

    opts = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=bool(is_causal),
                softcap=float(softcap) if softcap else 0.0, deterministic=bool(deterministic))

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None:
        out = _padded_attention(q, k, v, attention_mask, opts, sliding_window)
    elif all(x is not None for x in (cu_q, cu_k, max_q, max_k)):
        out = _varlen_over_batch(q, k, v, cu_q, cu_k, max_q, max_k, opts, sliding_window)
    elif position_ids is not None and sq > 1 and sq == k.shape[1] and (
            packed := layout.packed_layout(position_ids, b, sq)) is not None:
        out = _varlen_over_batch(q, k, v, packed.cu_seqlens, packed.cu_seqlens,
                                 packed.max_seqlen, packed.max_seqlen, opts, sliding_window)
    else:
        out = _dense_attention(q, k, v, opts, sliding_window)
    if v_dim < head_dim:
        out = out[..., :v_dim]
    return out, None


def padding_mask(batch_size: int, kv_length: int, kv_offset: int = 0,
                 attention_mask: Optional[torch.Tensor] = None, q_length: Optional[int] = None,
                 q_offset=0, cache_position: Optional[torch.Tensor] = None, **kwargs):
    """transformers' mask-function contract for flash_ext: None, or a 2-D bool (batch, n) mask
    of the keys the attention function gets (n <= kv_length).

    flash_ext computes causal / sliding-window masking itself and takes padding as varlen, so
    the only mask it needs is which keys hold tokens: the model's 2-D attention_mask cut to the
    last kv_length columns (None when nothing is padded). Without an attention_mask, a static
    cache (kv_length = its capacity) still needs one: the keys after the queries are unwritten.

    Takes transformers 5.x's arguments (q_length, q_offset) and 4.5x's (cache_position)."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:].to(torch.bool)
        if attention_mask.shape[1] == kv_length and not torch.compiler.is_compiling() \
                and bool(attention_mask.all()):
            return None
        return attention_mask
    if q_length is None:
        if cache_position is None:
            return None
        q_length = cache_position.shape[0]
        if kv_length <= q_length:  # no cache before these queries
            return None
        q_offset = cache_position[-1:] + 1 - q_length  # a tensor: no sync here
    end = q_offset + q_length - kv_offset  # keys [0, end) are written
    if isinstance(end, torch.Tensor):
        cols = torch.arange(kv_length, device=end.device)
        return (cols < end.reshape(-1)[:1]).expand(batch_size, kv_length)
    if end >= kv_length:
        return None
    return torch.ones((batch_size, max(int(end), 0)), dtype=torch.bool,
                      device=kwargs.get("device", "cpu"))
