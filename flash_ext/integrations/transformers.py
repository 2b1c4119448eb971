"""flash_ext in Hugging Face transformers, in one call::

    import flash_ext.integrations.transformers as fe_hf
    name = fe_hf.register()          # "fext"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name,
                                                 dtype=torch.bfloat16)

register() adds flash_ext's attention function to transformers' ``AttentionInterface`` and its
mask function to ``AttentionMaskInterface`` under one name, and returns that name for
``attn_implementation=`` (or ``model.set_attn_implementation``). What the attention function
handles (padding, packed batches, sliding window, softcap, GQA, dropout, generation) is in
flash_ext/integrations/hf_attention.py and docs/integrations.md.

Names: transformers gives some implementation names a meaning of their own, so register()
refuses them (ValueError):
- any name containing "flash": transformers 5.x treats it as a FlashAttention package or Hub
  kernel to import and fails at model construction (``is_flash_attention_requested`` is a
  substring test); 4.5x does the same for names starting with "flash_attention";
- names containing "sdpa" or "flex_attention": they trigger SDPA's / flex attention's own
  dispatch checks;
- names with "/", ":", "@" or "|": Hub kernel references ("org/repo@rev:fn") and the "paged|"
  prefix;
- transformers' built-in names ("eager", ...) and names already registered to another function.

Needs transformers with both interfaces (>= 4.53; 5.x). Importing this module does not import
transformers; register() does.
"""

from __future__ import annotations

import re

from flash_ext.integrations.hf_attention import attention_forward, padding_mask

__all__ = ["DEFAULT_NAME", "register", "attention_forward", "padding_mask"]

DEFAULT_NAME = "fext"

_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*")
_SPECIAL_SUBSTRINGS = ("flash", "sdpa", "flex_attention")
_BUILTIN_NAMES = ("eager", "paged|eager", "sdpa", "flex_attention")


def _interfaces():
    """transformers' AttentionInterface and AttentionMaskInterface classes, or ImportError."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("flash_ext.integrations.transformers needs transformers "
                          "(pip install transformers)") from e
    version = getattr(transformers, "__version__", "unknown")
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        AttentionInterface = None
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        AttentionMaskInterface = None
    if AttentionInterface is None or AttentionMaskInterface is None:
        missing = " and ".join(n for n, c in (("AttentionInterface", AttentionInterface),
                                               ("AttentionMaskInterface", AttentionMaskInterface))
                               if c is None)
        raise ImportError(
            f"transformers {version} has no {missing}: registering flash_ext needs both "
            "(transformers >= 4.53). Upgrade with pip install -U transformers, or call "
            "flash_ext.flash_attn_func / flash_attn_varlen_func directly")
    return AttentionInterface, AttentionMaskInterface


def check_name(name) -> str:
    """``name`` if transformers would use it as a plain registered implementation name; a
    ValueError (TypeError for a non-string) that says why not otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"register(name=...): name must be a str, got {type(name).__name__}")
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"register(name={name!r}): use letters, digits, '_', '.', '-', starting with a "
            "letter (transformers reads '/', ':', '@' as a Hub kernel reference and '|' as a "
            "prefix)")
    lowered = name.lower()
    for special in _SPECIAL_SUBSTRINGS:
        if special in lowered:
            raise ValueError(
                f"register(name={name!r}): transformers treats implementation names containing "
                f"{special!r} specially ('flash': as a FlashAttention package to import, failing "
                f"at model construction). Use another name, e.g. the default {DEFAULT_NAME!r}")
    if name in _BUILTIN_NAMES:
        raise ValueError(f"register(name={name!r}): that is one of transformers' own "
                         "implementations")
    return name


def register(name: str = DEFAULT_NAME) -> str:
    """Register flash_ext's attention and mask functions with transformers under ``name``.

    Returns the name to pass as ``attn_implementation=``. Calling it again with the same name
    is harmless. Raises ValueError for a name transformers would not treat as a plain registered
    implementation (see the module docstring) or one already registered to another function,
    and ImportError when transformers (>= 4.53) is missing."""
    check_name(name)
    attention_interface, mask_interface = _interfaces()
    for iface, fn in ((attention_interface, attention_forward), (mask_interface, padding_mask)):
        current = getattr(iface, "_global_mapping", {}).get(name)
        if current is not None and current is not fn:
            raise ValueError(
                f"register(name={name!r}): transformers' {iface.__name__} already has another "
                f"function under that name ({getattr(current, '__module__', '?')}."
                f"{getattr(current, '__qualname__', current)}); pick another name")
    attention_interface.register(name, attention_forward)
    mask_interface.register(name, padding_mask)
    return name
