"""``flash_ext.bert_padding``: the module name FlashAttention-2 users import the padding helpers
from (``from flash_attn.bert_padding import unpad_input, pad_input``); the functions are
flash_ext.padding's."""

from flash_ext.padding import pad_input, unpad_input

__all__ = ["unpad_input", "pad_input"]
