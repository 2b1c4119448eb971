"""Input checks (CPU only): every bad input raises a clear error before any launch.

The device check comes first, so the other checks are reached with require_cuda=False on CPU
tensors (or, for the public functions, through the individual check functions)."""

import math

import pytest
import torch

import flash_ext
from flash_ext import _validation as V
from flash_ext._validation import DeviceError

from conftest import requires_cuda


def t(*shape, dtype=torch.float16, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


def qkv(b=2, sq=16, sk=24, hq=4, hkv=2, d=64, dtype=torch.float16):
    return t(b, sq, hq, d, dtype=dtype), t(b, sk, hkv, d, dtype=dtype), t(b, sk, hkv, d, dtype=dtype)


def cu(lens):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32)


def check(q, k, v, **kw):
    return V.check_fwd_inputs(q, k, v, require_cuda=False, **kw)


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------


def test_attn_fwd_cpu_tensors_raise_device_error(seed):
    q, k, v = qkv()
    with pytest.raises(DeviceError, match="flash_ext needs CUDA tensors; got q on cpu"):
        flash_ext.attn_fwd(q, k, v)
    # DeviceError is both a ValueError and a RuntimeError.
    with pytest.raises(ValueError):
        flash_ext.attn_fwd(q, k, v)
    with pytest.raises(RuntimeError):
        flash_ext.attn_fwd(q, k, v)


def test_device_check_comes_before_other_checks(seed):
    # float32 and wrong ndim would fail later checks; the device error must win.
    q = torch.randn(3, 5)
    with pytest.raises(DeviceError, match="got q on cpu"):
        flash_ext.attn_fwd(q, q, q)


def test_flash_attn_func_cpu_raises_device_error(seed):
    q, k, v = qkv()
    with pytest.raises(DeviceError, match="CUDA tensors"):
        flash_ext.flash_attn_func(q, k, v)


def test_names_the_first_non_cuda_tensor(seed):
    q, k, v = qkv()
    with pytest.raises(DeviceError, match="got k on cpu"):
        V.check_devices({"q": None, "k": k, "v": v})


def test_mixed_devices(seed):
    q, k, v = qkv()
    k_meta = torch.empty(k.shape, dtype=k.dtype, device="meta")
    with pytest.raises(DeviceError, match="same device.*q on cpu and k on meta"):
        V.check_devices({"q": q, "k": k_meta, "v": v}, require_cuda=False)


def test_non_tensor_argument():
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        V.check_devices({"q": [1.0, 2.0]}, require_cuda=False)


def test_out_on_other_device(seed):
    q, k, v = qkv()
    out = torch.empty(q.shape, dtype=q.dtype, device="meta")
    with pytest.raises(DeviceError, match="same device"):
        check(q, k, v, out=out)


def test_cu_seqlens_on_other_device(seed):
    q, k, v = t(10, 4, 64), t(12, 4, 64), t(12, 4, 64)
    cq = cu([4, 6]).to("meta")
    with pytest.raises(DeviceError):
        check(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=cu([5, 7]), max_seqlen_q=6, max_seqlen_k=7)


# ---------------------------------------------------------------------------------------------
# Dtypes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.float8_e4m3fn])
def test_unsupported_dtype(seed, dtype):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="float16 and bfloat16 only; got q of dtype"):
        check(q.to(dtype), k, v)


def test_mixed_dtypes(seed):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="same dtype; got q float16, k bfloat16, v float16"):
        check(q, k.to(torch.bfloat16), v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_good_inputs_pass(seed, dtype):
    q, k, v = qkv(dtype=dtype)
    assert check(q, k, v) is False


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


def test_wrong_ndim_batched(seed):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="q must be 4-D .*3-D inputs are varlen"):
        check(q[0], k, v)
    with pytest.raises(ValueError, match="k must be 4-D"):
        check(q, k.unsqueeze(0), v)


def test_wrong_ndim_varlen(seed):
    q, k, v = t(2, 10, 4, 64), t(22, 4, 64), t(22, 4, 64)
    with pytest.raises(ValueError, match="q must be 3-D .*for varlen"):
        check(q, k, v, cu_seqlens_q=cu([4, 6]), cu_seqlens_k=cu([10, 12]), max_seqlen_q=6,
              max_seqlen_k=12)


def test_batch_mismatch(seed):
    q, _, _ = qkv(b=2)
    _, k, v = qkv(b=3)
    with pytest.raises(ValueError, match="same batch size"):
        check(q, k, v)


def test_k_v_shapes_differ(seed):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        check(q, k, v[:, :-1])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        check(q, k, t(*v.shape[:-1], 32))


def test_head_dim_mismatch(seed):
    q, k, v = qkv(d=64)
    _, k2, v2 = qkv(d=128)
    with pytest.raises(ValueError, match="same head dim"):
        check(q, k2, v2)


def test_heads_not_divisible(seed):
    q, k, v = qkv(hq=6, hkv=4)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple .* \(4\)"):
        check(q, k, v)


def test_zero_kv_heads(seed):
    q, k, v = qkv(hq=4, hkv=0)
    with pytest.raises(ValueError, match="number of heads must be >= 1"):
        check(q, k, v)


@pytest.mark.parametrize("d", [257, 512])
def test_head_dim_too_large(seed, d):
    q, k, v = qkv(d=d)
    with pytest.raises(ValueError, match=f"head dim must be between 1 and 256; got {d}"):
        check(q, k, v)


def test_head_dim_zero(seed):
    q, k, v = qkv(d=0)
    with pytest.raises(ValueError, match="head dim must be between 1 and 256; got 0"):
        check(q, k, v)


@pytest.mark.parametrize("d", [1, 8, 59, 256])
def test_head_dims_accepted(seed, d):
    q, k, v = qkv(d=d)
    check(q, k, v)


def test_last_dim_not_contiguous(seed):
    q, k, v = qkv()
    qt = t(2, 16, 64, 4).transpose(-1, -2)  # (2, 16, 4, 64) with stride(-1) = 4
    assert qt.shape == q.shape
    with pytest.raises(ValueError, match="last dimension of q must be contiguous"):
        check(qt, k, v)


def test_other_strides_are_accepted(seed):
    # Non-contiguous but last-dim-contiguous inputs (packed qkv slices, transposed views).
    qkv_packed = t(2, 16, 3, 4, 64)
    q, k, v = qkv_packed.unbind(2)
    check(q, k, v)
    kt = t(2, 4, 16, 64).transpose(1, 2)
    check(q, kt, kt)


# ---------------------------------------------------------------------------------------------
# cu_seqlens / max_seqlen
# ---------------------------------------------------------------------------------------------


def varlen_inputs(lens_q=(3, 0, 7), lens_k=(5, 2, 0), hq=4, hkv=2, d=64):
    q = t(sum(lens_q), hq, d)
    k, v = t(sum(lens_k), hkv, d), t(sum(lens_k), hkv, d)
    kw = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q),
              max_seqlen_k=max(lens_k))
    return q, k, v, kw


def test_varlen_good(seed):
    q, k, v, kw = varlen_inputs()
    assert check(q, k, v, **kw) is True


def test_cu_seqlens_only_one_given(seed):
    q, k, v, kw = varlen_inputs()
    kw["cu_seqlens_k"] = None
    with pytest.raises(ValueError, match="must be given together .* only cu_seqlens_q"):
        check(q, k, v, **kw)


def test_cu_seqlens_dtype(seed):
    q, k, v, kw = varlen_inputs()
    kw["cu_seqlens_q"] = kw["cu_seqlens_q"].long()
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32; got int64"):
        check(q, k, v, **kw)


def test_cu_seqlens_not_tensor(seed):
    q, k, v, kw = varlen_inputs()
    kw["cu_seqlens_k"] = [0, 5, 7, 7]
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor"):
        check(q, k, v, **kw)


def test_cu_seqlens_not_1d(seed):
    q, k, v, kw = varlen_inputs()
    kw["cu_seqlens_q"] = kw["cu_seqlens_q"].view(2, 2)
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D"):
        check(q, k, v, **kw)


def test_cu_seqlens_too_short(seed):
    q, k, v, kw = varlen_inputs()
    kw["cu_seqlens_q"] = torch.zeros(1, dtype=torch.int32)
    kw["cu_seqlens_k"] = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="batch \\+ 1 >= 2 entries"):
        check(q, k, v, **kw)


def test_cu_seqlens_lengths_differ(seed):
    q, k, v, kw = varlen_inputs()
    kw["cu_seqlens_k"] = cu([5, 2])
    with pytest.raises(ValueError, match="same length \\(batch \\+ 1\\); got 4 and 3"):
        check(q, k, v, **kw)


def test_cu_seqlens_decreasing(seed):
    q, k, v, kw = varlen_inputs(lens_q=(3, 0, 7))
    kw["cu_seqlens_q"] = torch.tensor([0, 8, 3, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        check(q, k, v, **kw)


def test_cu_seqlens_not_starting_at_zero(seed):
    q, k, v, kw = varlen_inputs()
    kw["cu_seqlens_k"] = torch.tensor([1, 5, 7, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        check(q, k, v, **kw)


def test_cu_seqlens_last_not_total(seed):
    q, k, v, kw = varlen_inputs(lens_q=(3, 0, 7))
    kw["cu_seqlens_q"] = cu([3, 0, 6])
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must equal the number of tokens \(10\); got 9"):
        check(q, k, v, **kw)


def test_max_seqlen_too_small(seed):
    q, k, v, kw = varlen_inputs(lens_k=(5, 2, 0))
    kw["max_seqlen_k"] = 4
    with pytest.raises(ValueError, match=r"max_seqlen_k \(4\) is smaller than the longest .*\(5\)"):
        check(q, k, v, **kw)


def test_max_seqlen_larger_is_fine(seed):
    q, k, v, kw = varlen_inputs()
    kw["max_seqlen_q"] = 1000
    check(q, k, v, **kw)


def test_value_checks_skipped_when_disabled(seed, monkeypatch):
    # CPU cu_seqlens are always checked; the global switch only concerns CUDA tensors.
    monkeypatch.setattr(V, "CHECK_CU_SEQLENS_VALUES", False)
    assert V.should_check_values(torch.zeros(2, dtype=torch.int32)) is True
    meta = torch.zeros(2, dtype=torch.int32, device="meta")
    assert V.should_check_values(meta) is False


def test_value_checks_skipped_for_fake_tensors(fake_mode):
    with fake_mode:
        c = torch.zeros(3, dtype=torch.int32, device="cuda")
    assert V.should_check_values(c) is False


@pytest.mark.parametrize("missing", ["max_seqlen_q", "max_seqlen_k"])
def test_max_seqlen_required(seed, missing):
    q, k, v, kw = varlen_inputs()
    kw[missing] = None
    with pytest.raises(ValueError, match=f"varlen inputs need {missing}"):
        check(q, k, v, **kw)


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (3.5, TypeError), (True, TypeError),
                                     ("7", TypeError)])
def test_max_seqlen_bad_values(seed, bad, exc):
    q, k, v, kw = varlen_inputs()
    kw["max_seqlen_q"] = bad
    with pytest.raises(exc, match="max_seqlen_q"):
        check(q, k, v, **kw)


def test_max_seqlen_without_varlen(seed):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="max_seqlen_q is only used with varlen"):
        check(q, k, v, max_seqlen_q=16)


# ---------------------------------------------------------------------------------------------
# Scalars and out=
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [-0.5, -30.0, 0, 0.0])
def test_softcap_at_most_zero_is_off(seed, softcap):
    """FlashAttention's convention: softcap <= 0 disables it (the op receives 0.0)."""
    q, k, v = qkv()
    check(q, k, v, softcap=softcap)
    assert flash_ext._scalar_args(64, None, False, (-1, -1), softcap)[4] == 0.0
    assert flash_ext._scalar_args(64, None, False, (-1, -1), 30)[4] == 30.0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_nonfinite_softcap(seed, bad):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softcap must be finite"):
        check(q, k, v, softcap=bad)


def test_softcap_type(seed):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="softcap must be a float"):
        check(q, k, v, softcap=None)


@pytest.mark.parametrize("ws", [(-2, -1), (-1, -5), (3, -2)])
def test_window_below_minus_one(seed, ws):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="must be >= -1"):
        check(q, k, v, window_size=ws)


@pytest.mark.parametrize("ws", [(1, 2, 3), 5, None])
def test_window_not_a_pair(seed, ws):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window_size must be a pair"):
        check(q, k, v, window_size=ws)


def test_window_not_int(seed):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="window_size left must be an int"):
        check(q, k, v, window_size=(1.5, 0))


@pytest.mark.parametrize("ws", [(-1, -1), (0, 0), (128, 0), (-1, 7), [3, 3]])
def test_windows_accepted(seed, ws):
    q, k, v = qkv()
    check(q, k, v, window_size=ws)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_softmax_scale_not_finite(seed, bad):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        check(q, k, v, softmax_scale=bad)


@pytest.mark.parametrize("bad", [0.0, -0.125])
def test_softmax_scale_not_positive(seed, bad):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softmax_scale must be > 0"):
        check(q, k, v, softmax_scale=bad)


def test_softmax_scale_type(seed):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="softmax_scale must be a float or None"):
        check(q, k, v, softmax_scale="0.1")


def test_out_wrong_shape(seed):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="out must have q's shape"):
        check(q, k, v, out=torch.empty(2, 16, 4, 32, dtype=q.dtype))


def test_out_wrong_dtype(seed):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="out must have q's dtype \\(float16\\); got bfloat16"):
        check(q, k, v, out=torch.empty(q.shape, dtype=torch.bfloat16))


def test_out_good(seed):
    q, k, v = qkv()
    big = torch.empty(2, 20, 4, 64, dtype=q.dtype)
    check(q, k, v, out=big[:, 2:18])  # any strides are accepted


# ---------------------------------------------------------------------------------------------
# FlashAttention-compatible functions: unsupported features (checked before the device)
# ---------------------------------------------------------------------------------------------


def test_dropout_accepted_then_device_checked(seed):
    """dropout_p in [0, 1] is supported now: these CPU tensors fail the device check instead."""
    q, k, v = qkv()
    with pytest.raises(DeviceError):
        flash_ext.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(DeviceError):
        flash_ext.attn_fwd(q, k, v, dropout_p=0.1)


def test_dropout_out_of_range(seed):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout_p must be a number in \\[0, 1\\]"):
        flash_ext.flash_attn_func(q, k, v, dropout_p=1.5)


def test_block_table_needs_paged_caches(seed, meta_ok):
    # block_table is supported (tests/test_paged_prefill.py); plain varlen k, v do not go with it.
    q, k, v, kw = varlen_inputs()
    with pytest.raises(ValueError, match="with block_table, k must be a paged cache"):
        flash_ext.flash_attn_varlen_func(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"],
                                         kw["max_seqlen_q"], kw["max_seqlen_k"],
                                         block_table=torch.zeros(3, 1, dtype=torch.int32))


def test_packed_shapes(seed):
    with pytest.raises(ValueError, match="qkv must have shape \\(batch, seqlen, 3, nheads, headdim\\)"):
        flash_ext.flash_attn_qkvpacked_func(t(2, 16, 2, 4, 64))
    with pytest.raises(ValueError, match="kv must have shape \\(batch, seqlen_k, 2, nheads_kv, headdim\\)"):
        flash_ext.flash_attn_kvpacked_func(t(2, 16, 4, 64), t(2, 16, 4, 64))
    with pytest.raises(ValueError, match="qkv must have shape \\(total, 3, nheads, headdim\\)"):
        flash_ext.flash_attn_varlen_qkvpacked_func(t(16, 4, 64), cu([16]), 16)
    with pytest.raises(ValueError, match="kv must have shape \\(total_k, 2, nheads_kv, headdim\\)"):
        flash_ext.flash_attn_varlen_kvpacked_func(t(16, 4, 64), t(16, 3, 4, 64), cu([16]), cu([16]),
                                                  16, 16)


def test_packed_cpu_raises_device_error(seed):
    with pytest.raises(DeviceError, match="got q on cpu"):
        flash_ext.flash_attn_qkvpacked_func(t(2, 16, 3, 4, 64))
    with pytest.raises(DeviceError, match="got q on cpu"):
        flash_ext.flash_attn_varlen_qkvpacked_func(t(16, 3, 4, 64), cu([16]), 16)


# ---------------------------------------------------------------------------------------------
# One place for each check
# ---------------------------------------------------------------------------------------------


def test_entry_points_leave_the_checks_to_validation():
    """attn_fwd, attn_bwd, the FlashAttention-compatible functions, scaled_dot_product_attention
    and the padding helpers raise nothing themselves: every check on user input is in
    flash_ext/_validation.py."""
    import ast
    import inspect
    from flash_ext import bert_padding, interface, padding, sdpa
    for module in (flash_ext, interface, sdpa, padding, bert_padding):
        raises = [n.lineno for n in ast.walk(ast.parse(inspect.getsource(module)))
                  if isinstance(n, ast.Raise)]
        assert raises == [], f"{module.__name__} raises at lines {raises}"


@pytest.mark.parametrize("missing", ["q", "k", "v"])
def test_missing_tensor(seed, meta_ok, missing):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v)
    args[missing] = None
    with pytest.raises(TypeError, match=f"{missing} must be a torch.Tensor, got None"):
        check(**args)
    with pytest.raises(TypeError, match=f"{missing} must be a torch.Tensor, got None"):
        flash_ext.attn_fwd(**args)


def test_out_with_grad_is_rejected(seed):
    q, k, v = qkv()
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        check(q, k, v, out=torch.empty_like(q))
    with torch.no_grad():
        check(q, k, v, out=torch.empty_like(q))
    check(q, k, v)


def test_dropout_checked_before_the_device(seed):
    """A bad dropout_p is reported whatever the tensors, by attn_fwd and by the
    FlashAttention-compatible functions alike."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout_p must be a number in \\[0, 1\\]"):
        flash_ext.attn_fwd(q, k, v, dropout_p=1.5)
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        flash_ext.flash_attn_func(q, k, v, dropout_p="0.1")
    with pytest.raises(ValueError, match="rng_state"):
        flash_ext.attn_fwd(q, k, v, dropout_p=0.1, rng_state=torch.zeros(3, dtype=torch.int64))


def test_bwd_dropout_needs_rng_state(seed):
    q, k, v = qkv()
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    with pytest.raises(ValueError, match="needs the forward's rng_state"):
        V.check_bwd_inputs(q, q, k, v, q, lse, dropout_p=0.1, require_cuda=False)
    assert V.check_bwd_inputs(q, q, k, v, q, lse, dropout_p=0.1,
                              rng_state=torch.tensor([1, 2]), require_cuda=False) is False


# ---------------------------------------------------------------------------------------------
# window_size and softcap as FlashAttention's callers pass them, through every entry point
# ---------------------------------------------------------------------------------------------


class ScalarRecorder:
    """CPU kernels for flash_ext::fwd and bwd that record (window_left, window_right, softcap)
    and return zeros."""

    def __init__(self):
        self.seen = []
        self.lib = torch.library.Library("flash_ext", "IMPL")
        self.lib.impl("fwd", self.fwd, "CPU")
        self.lib.impl("bwd", self.bwd, "CPU")

    def fwd(self, q, k, v, cq, ck, mq, mk, scale, causal, wl, wr, softcap, dropout_p=0.0,
            rng_state=None, deterministic=False):
        self.seen.append((wl, wr, softcap))
        lse_shape = (q.shape[1], q.shape[0]) if cq is not None else (q.shape[0], q.shape[2],
                                                                       q.shape[1])
        return torch.zeros(q.shape, dtype=q.dtype), torch.zeros(lse_shape)

    def bwd(self, dout, q, k, v, out, lse, cq, ck, mq, mk, scale, causal, wl, wr, softcap,
            deterministic, dropout_p=0.0, rng_state=None):
        self.seen.append((wl, wr, softcap))
        return tuple(torch.zeros(x.shape, dtype=q.dtype) for x in (q, k, v))


@pytest.fixture
def recorder(meta_ok):
    r = ScalarRecorder()
    yield r
    r.lib._destroy()


def _entry_points():
    """name -> call(window_size, softcap) for every public entry point taking window_size."""
    b, s, h, d = 2, 8, 2, 64
    q, k = t(b, s, h, d), t(b, s, h, d)
    kv, qkv = t(b, s, 2, h, d), t(b, s, 3, h, d)
    qv, kvv, qkvv = t(b * s, h, d), t(b * s, 2, h, d), t(b * s, 3, h, d)
    c = cu([s] * b)
    lse = torch.zeros(b, h, s)
    return {
        "attn_fwd": lambda ws, sc: flash_ext.attn_fwd(q, k, k, window_size=ws, softcap=sc),
        "attn_bwd": lambda ws, sc: flash_ext.attn_bwd(q, q, k, k, q, lse, window_size=ws,
                                                      softcap=sc),
        "flash_attn_func": lambda ws, sc: flash_ext.flash_attn_func(q, k, k, window_size=ws,
                                                                    softcap=sc),
        "kvpacked": lambda ws, sc: flash_ext.flash_attn_kvpacked_func(q, kv, window_size=ws,
                                                                      softcap=sc),
        "qkvpacked": lambda ws, sc: flash_ext.flash_attn_qkvpacked_func(qkv, window_size=ws,
                                                                        softcap=sc),
        "varlen": lambda ws, sc: flash_ext.flash_attn_varlen_func(
            qv, qv, qv, c, c, s, s, window_size=ws, softcap=sc),
        "varlen_kvpacked": lambda ws, sc: flash_ext.flash_attn_varlen_kvpacked_func(
            qv, kvv, c, c, s, s, window_size=ws, softcap=sc),
        "varlen_qkvpacked": lambda ws, sc: flash_ext.flash_attn_varlen_qkvpacked_func(
            qkvv, c, s, window_size=ws, softcap=sc),
    }


def _window_forms(left, right):
    import numpy as np
    return {
        "tuple": (left, right),
        "list": [left, right],
        "numpy-scalars": (np.int64(left), np.int32(right)),
        "numpy-array": np.array([left, right]),
        "tensor-int64": torch.tensor([left, right]),
        "tensor-int32": torch.tensor([left, right], dtype=torch.int32),
        "0d-tensors": (torch.tensor(left), torch.tensor(right)),
    }


@pytest.mark.parametrize("entry", list(_entry_points()))
def test_window_forms_and_softcap_reach_the_op(recorder, entry):
    call = _entry_points()[entry]
    for form, ws in _window_forms(5, -1).items():
        recorder.seen.clear()
        call(ws, 0.0)
        assert recorder.seen == [(5, -1, 0.0)], (entry, form)
    for softcap, want in ((-2.5, 0.0), (0, 0.0), (7, 7.0)):
        recorder.seen.clear()
        call(torch.tensor([-1, 3]), softcap)
        assert recorder.seen == [(-1, 3, want)], (entry, softcap)


@pytest.mark.parametrize("entry", list(_entry_points()))
@pytest.mark.parametrize("ws,exc,match", [
    (torch.tensor([-2, 0]), ValueError, "window_size left must be >= -1"),
    (torch.tensor([0.5, 1.0]), TypeError, "window_size must hold integers"),
    (torch.tensor([True, False]), TypeError, "window_size must hold integers"),
    (torch.tensor([[1, 2]]), ValueError, "window_size must be a pair"),
    ("ab", ValueError, "window_size must be a pair"),
    ((1, None), TypeError, "window_size right must be an int; got NoneType"),
])
def test_bad_window_forms_every_entry_point(recorder, entry, ws, exc, match):
    with pytest.raises(exc, match=match) as info:
        _entry_points()[entry](ws, 0.0)
    assert isinstance(info.value, flash_ext.FlashExtError)
    assert recorder.seen == []  # nothing launched


def test_window_tensor_values_on_the_device_read_once():
    """check_window_size leaves a device tensor's values to window_pair (one read, not two)."""
    on_meta = torch.empty(2, dtype=torch.int64, device="meta")
    V.check_window_size(on_meta)  # metadata only: would fail if it read the values
    with pytest.raises(TypeError, match="must hold integers"):
        V.check_window_size(torch.empty(2, device="meta"))
    with pytest.raises((NotImplementedError, RuntimeError)):
        V.window_pair(on_meta)  # reads the values (a meta tensor has none)


def test_window_pair_fast_path_returns_the_tuple():
    ws = (128, 0)
    assert V.window_pair(ws) is ws


@requires_cuda
def test_window_size_cuda_tensor():
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16)
    want, _ = flash_ext.attn_fwd(q, q, q, window_size=(7, 3))
    got, _ = flash_ext.attn_fwd(q, q, q, window_size=torch.tensor([7, 3], device="cuda"))
    assert torch.equal(got, want)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(flash_ext.FlashExtValueError, match="window_size right must be >= -1"):
        flash_ext.attn_fwd(q, q, q, window_size=torch.tensor([7, -3], device="cuda"), out=out)
    assert out.isnan().all()  # nothing written


def test_cu_seqlens_values_checked_once_per_tensor_version():
    """One host sync per cu_seqlens tensor, not per call: a passed tensor is remembered until it
    is written in place or freed."""
    import gc
    from flash_ext import _validation as v
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert not v._checked_before(cu, 5, 3)
    v._remember_checked(cu, 5, 3)
    assert v._checked_before(cu, 5, 3)
    assert not v._checked_before(cu, 5, 4) and not v._checked_before(cu, 6, 3)
    cu[1] = 9  # in place: the values must be checked again
    assert not v._checked_before(cu, 5, 3)
    v._remember_checked(cu, 5, 3)
    n = len(v._CHECKED)
    del cu
    gc.collect()
    assert len(v._CHECKED) == n - 1
    other = torch.tensor([0, 3, 5], dtype=torch.int32)  # equal values, another tensor
    assert not v._checked_before(other, 5, 3)
