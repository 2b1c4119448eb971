"""Error types (flash_ext/errors.py): every error flash_ext raises for bad input is a
FlashExtError, hence a RuntimeError (FlashAttention's convention: its callers catch
RuntimeError), and also a ValueError / TypeError / NotImplementedError as fits. The C++ side
raises c10::Error, a RuntimeError too, and must not use the TORCH_CHECK variants that map to
other Python classes."""

import ast
import pathlib
import re

import pytest
import torch

import flash_ext
from flash_ext import errors

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The modules that check user input and raise for it.
USER_FACING = ("__init__.py", "_validation.py", "interface.py", "sdpa.py", "padding.py",
               "bert_padding.py")


def test_hierarchy():
    assert issubclass(errors.FlashExtError, RuntimeError)
    for cls, builtin in ((errors.FlashExtValueError, ValueError),
                         (errors.FlashExtTypeError, TypeError),
                         (errors.FlashExtNotImplementedError, NotImplementedError),
                         (errors.DeviceError, ValueError)):
        assert issubclass(cls, errors.FlashExtError) and issubclass(cls, RuntimeError)
        assert issubclass(cls, builtin)
    assert not issubclass(errors.FlashExtTypeError, ValueError)
    assert not issubclass(errors.FlashExtValueError, TypeError)


def test_exported_from_flash_ext():
    for name in errors.__all__:
        assert getattr(flash_ext, name) is getattr(errors, name)
        assert name in flash_ext.__all__
    assert flash_ext._validation.DeviceError is errors.DeviceError


def test_public_names_in_all():
    for name in ("scaled_dot_product_attention", "unpad_input", "pad_input"):
        assert name in flash_ext.__all__ and callable(getattr(flash_ext, name))


def test_errors_pickle():
    import pickle
    e = pickle.loads(pickle.dumps(errors.FlashExtValueError("flash_ext: bad")))
    assert type(e) is errors.FlashExtValueError and str(e) == "flash_ext: bad"


@pytest.mark.parametrize("module", USER_FACING)
def test_every_raise_is_a_flash_ext_error(module):
    """Static: each ``raise X(...)`` in the modules that check user input names a class of
    flash_ext.errors (so every input error is a RuntimeError)."""
    allowed = set(errors.__all__)
    tree = ast.parse((ROOT / "flash_ext" / module).read_text())
    bad, checked = [], 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue  # a bare re-raise
        checked += 1
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        name = exc.attr if isinstance(exc, ast.Attribute) else getattr(exc, "id", None)
        if name not in allowed:
            bad.append((node.lineno, name))
    assert bad == [], f"flash_ext/{module} raises non-FlashExtError classes: {bad}"
    if module == "_validation.py":
        assert checked > 40  # the scan sees the checks


def test_csrc_raises_runtime_errors_only():
    """TORCH_CHECK (c10::Error) reaches Python as RuntimeError; the _VALUE / _TYPE / _INDEX
    variants would raise ValueError / TypeError / IndexError, which FlashAttention-style callers
    catching RuntimeError miss. Nor may C++ throw standard exceptions of its own."""
    pattern = re.compile(r"TORCH_CHECK_(VALUE|TYPE|INDEX|LINALG)\b|c10::(ValueError|TypeError|"
                         r"IndexError)\b|throw\s+std::(invalid_argument|out_of_range|domain_error)")
    hits = []
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in (".cpp", ".h", ".cu", ".cuh", ".hpp"):
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line.split("//", 1)[0]):  # code, not comments
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert hits == [], "\n".join(hits)


# ---------------------------------------------------------------------------------------------
# Dynamic: bad calls through each public entry point
# ---------------------------------------------------------------------------------------------


def t(*shape, dtype=torch.float16, **kw):
    return torch.randn(*shape).to(dtype).requires_grad_(kw.get("requires_grad", False))


def cu(*vals):
    return torch.tensor(vals, dtype=torch.int32)


q4, k4 = t(2, 16, 4, 64), t(2, 16, 2, 64)
lse = torch.zeros(2, 4, 16)

BAD_CALLS = {
    "fwd-dtype": (lambda: flash_ext.attn_fwd(q4.float(), k4, k4), TypeError),
    "fwd-ndim": (lambda: flash_ext.attn_fwd(q4[0], k4, k4), ValueError),
    "fwd-window-value": (lambda: flash_ext.attn_fwd(q4, k4, k4, window_size=(-2, 0)), ValueError),
    "fwd-window-type": (lambda: flash_ext.attn_fwd(q4, k4, k4, window_size=(0.5, 0)), TypeError),
    "fwd-window-tensor": (lambda: flash_ext.attn_fwd(q4, k4, k4, window_size=torch.zeros(3)),
                          ValueError),
    "fwd-scale": (lambda: flash_ext.attn_fwd(q4, k4, k4, softmax_scale=0.0), ValueError),
    "fwd-softcap": (lambda: flash_ext.attn_fwd(q4, k4, k4, softcap="1"), TypeError),
    "fwd-dropout": (lambda: flash_ext.attn_fwd(q4, k4, k4, dropout_p=1.5), ValueError),
    "fwd-gqa": (lambda: flash_ext.attn_fwd(q4, t(2, 16, 3, 64), t(2, 16, 3, 64)), ValueError),
    "fwd-out-with-grad": (lambda: flash_ext.attn_fwd(t(2, 16, 4, 64, requires_grad=True), k4, k4,
                                                     out=torch.empty(2, 16, 4, 64).half()),
                          RuntimeError),
    "bwd-lse": (lambda: flash_ext.attn_bwd(q4, q4, k4, k4, q4, lse.double()), TypeError),
    "bwd-dropout": (lambda: flash_ext.attn_bwd(q4, q4, k4, k4, q4, lse, dropout_p=0.1),
                    ValueError),
    "func-alibi": (lambda: flash_ext.flash_attn_func(q4, k4, k4, alibi_slopes=torch.ones(4, dtype=torch.float64)),
                   TypeError),
    "qkvpacked-shape": (lambda: flash_ext.flash_attn_qkvpacked_func(t(2, 16, 2, 4, 64)),
                        ValueError),
    "varlen-cu-values": (lambda: flash_ext.flash_attn_varlen_func(
        t(10, 4, 64), t(10, 2, 64), t(10, 2, 64), cu(0, 4, 9), cu(0, 4, 10), 6, 6), ValueError),
    "varlen-max-seqlen": (lambda: flash_ext.flash_attn_varlen_func(
        t(10, 4, 64), t(10, 2, 64), t(10, 2, 64), cu(0, 4, 10), cu(0, 4, 10), 6, 6.0), TypeError),
    "varlen-block-table": (lambda: flash_ext.flash_attn_varlen_func(
        t(10, 4, 64), t(10, 2, 64), t(10, 2, 64), cu(0, 4, 10), cu(0, 4, 10), 6, 6,
        block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError),  # k not a paged cache
    "sdpa-mask": (lambda: flash_ext.scaled_dot_product_attention(
        t(2, 4, 8, 64), t(2, 4, 8, 64), t(2, 4, 8, 64), torch.ones(8, 8, dtype=torch.bool)),
                  NotImplementedError),
    "sdpa-heads": (lambda: flash_ext.scaled_dot_product_attention(
        t(2, 4, 8, 64), t(2, 2, 8, 64), t(2, 2, 8, 64)), ValueError),
    "unpad-float-mask": (lambda: flash_ext.unpad_input(t(2, 4, 8), torch.ones(2, 4)), TypeError),
    "pad-indices": (lambda: flash_ext.pad_input(t(3, 8), torch.tensor([0, 1, 9]), 2, 4),
                    ValueError),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_is_a_runtime_error(meta_ok, name):
    call, builtin = BAD_CALLS[name]
    with pytest.raises(errors.FlashExtError) as info:
        call()
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value, builtin), type(info.value).__mro__
    assert str(info.value).startswith("flash_ext"), str(info.value)


def test_cpu_tensors_are_a_runtime_error():
    with pytest.raises(RuntimeError, match="CUDA") as info:
        flash_ext.flash_attn_func(q4, k4, k4)
    assert isinstance(info.value, errors.DeviceError)


def test_flash_attention_style_except_clause_catches_them(meta_ok):
    """The pattern FlashAttention code uses around its calls."""
    caught = []
    for name, (call, _) in BAD_CALLS.items():
        try:
            call()
        except RuntimeError as e:  # noqa: PERF203
            caught.append(type(e))
    assert len(caught) == len(BAD_CALLS)
