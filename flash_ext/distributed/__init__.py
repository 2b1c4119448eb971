"""Context parallelism: exact attention over a sequence sharded across the ranks of a
torch.distributed process group (a ring of key/value shards with log-sum-exp merging,
load-balanced causal "zigzag" layout). See docs/context-parallel.md.

    from flash_ext.distributed import ring_flash_attn_func, zigzag_shard, zigzag_gather
"""

from flash_ext.distributed.layout import (LAYOUTS, contiguous_gather, contiguous_shard, gather,
                                          gather_varlen, shard, shard_segments, shard_varlen,
                                          zigzag_gather, zigzag_shard)
from flash_ext.distributed.ring import (emulated_ring_backward, emulated_ring_forward,
                                        ring_flash_attn_func, ring_flash_attn_varlen_func,
                                        step_plans, varlen_step_plans)
from flash_ext.distributed.ring_steps import (BlockCall, FlashBackend, ReferenceBackend,
                                              merge_partials, plan_block, plan_step)

__all__ = ["LAYOUTS", "zigzag_shard", "zigzag_gather", "contiguous_shard", "contiguous_gather",
           "shard", "gather", "shard_segments", "shard_varlen", "gather_varlen",
           "ring_flash_attn_func", "ring_flash_attn_varlen_func", "emulated_ring_forward",
           "emulated_ring_backward", "step_plans", "varlen_step_plans", "BlockCall", "FlashBackend",
           "ReferenceBackend", "merge_partials", "plan_block", "plan_step"]
