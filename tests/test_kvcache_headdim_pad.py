"""flash_attn_with_kvcache with a head dim that is not a multiple of 8 (FlashAttention-2's own
test uses d = 59), on the CPU: the call runs on zero-padded copies of q, k, v and the caches
(flash_ext.kvcache._run_padded) and copies the caches back after an append.

Checked here: the result against the reference computed at the original head dim; the caches
after the append element by element (the written slots hold the reference's values, every other
element is unchanged, the caller's tensors are updated in place); the default softmax_scale
from the original head dim; what the ops receive; head-dim mismatches that padding would hide
(59 and 60 both pad to 64) still raise; bad input, and an op that fails after the append,
leave the caller's caches untouched; the fast path declines these calls; torch.compile.
The ops are CPU implementations built from the reference (tests/test_kvcache_api.py) or
recorders. tests/test_kvcache_gpu.py runs d = 59 against the kernels.
"""

import math

import pytest
import torch

import flash_ext
from flash_ext import kvcache, ops
from flash_ext import reference as R

from kvcache_cases import brute_force, make_case
from test_kvcache_api import OpRecorder, Recorder, _append_cpu, _fwd_cpu

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture
def cpu_ops(meta_ok):
    lib = torch.library.Library("flash_ext", "IMPL")
    lib.impl("kvcache_append", _append_cpu, "CPU")
    lib.impl("fwd_kvcache", _fwd_cpu, "CPU")
    yield
    lib._destroy()


@pytest.fixture
def recorder(monkeypatch, meta_ok):
    rec = OpRecorder()
    monkeypatch.setattr(ops, "_kvcache_append", rec.append)
    monkeypatch.setattr(ops, "_fwd_kvcache", rec.fwd)
    return rec


def _lengths(kw):
    lens = kw.get("cache_seqlens")
    b = kw["q"].shape[0]
    if isinstance(lens, torch.Tensor):
        return [int(x) for x in lens.tolist()]
    return [int(lens)] * b


def _written_slots(kw):
    """Bool (cache.shape[0], cache.shape[1]): the cache rows the call's append writes."""
    kc = kw["k_cache"]
    mask = torch.zeros(kc.shape[:2], dtype=torch.bool)
    if kw.get("k") is None:
        return mask
    s_new = kw["k"].shape[1]
    table, idx = kw.get("block_table"), kw.get("cache_batch_idx")
    for b, n0 in enumerate(_lengths(kw)):
        for n in range(n0, n0 + s_new):
            if table is not None:
                page = kc.shape[1]
                mask[int(table[b, n // page]), n % page] = True
            else:
                mask[int(idx[b]) if idx is not None else b, n] = True
    return mask


CASES = {
    "d59_decode": dict(d=59),
    "d59_no_new_kv": dict(d=59, s_new=0),
    "d59_full_caches": dict(d=59, seqlens=None),
    "d59_int_lengths": dict(d=59, seqlens="int", sq=2, s_new=2, causal=True),
    "d59_rotary_interleaved_causal": dict(d=59, sq=3, s_new=3, rotary="interleaved",
                                          causal=True),
    "d59_rotary_half_partial": dict(d=59, sq=2, s_new=2, rotary="half", rotary_frac=0.5),
    "d59_rotary_local_softcap": dict(d=59, sq=2, s_new=1, rotary="half", window_size=(6, 1),
                                     softcap=1.5),
    "d59_batch_idx_leftpad": dict(d=59, batch_idx=True, leftpad=True, sq=2, s_new=2,
                                  causal=True),
    "d59_alibi_gqa": dict(d=59, hq=8, hkv=2, sq=3, s_new=3, alibi="bh", causal=True),
    "d59_paged": dict(d=59, page_size=16, sq=2, s_new=2, causal=True),
    "d59_paged_rotary_alibi": dict(d=59, page_size=16, sq=2, s_new=2, rotary="interleaved",
                                   alibi="h", causal=True),
    "d59_paged_no_new_kv": dict(d=59, page_size=32, s_new=0),
    "d59_paged_full": dict(d=59, page_size=16, full=True, sq=2, s_new=2),
    "d36_gqa_rotary": dict(d=36, hq=8, hkv=2, sq=2, s_new=2, rotary="interleaved",
                           causal=True),
    "d100_mqa_bf16_rotary": dict(d=100, hq=4, hkv=1, dtype=BF16, sq=3, s_new=3,
                                 rotary="half", causal=True),
    "d100_paged_leftpad": dict(d=100, page_size=16, leftpad=True, sq=2, s_new=2),
    "d4": dict(d=4, sq=2, s_new=2, causal=True),
    "d250_mqa": dict(d=250, hq=2, hkv=1, s_new=2, sq=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_padded_call_equals_reference(cpu_ops, name):
    kw = make_case(seed=sum(map(ord, name)), **CASES[name])
    d = kw["q"].shape[-1]
    assert d % 8 != 0
    want_out, want_lse, want_kc, want_vc = R.kvcache_attention(**kw)
    before_k, before_v = kw["k_cache"].clone(), kw["v_cache"].clone()
    kc_ptr, vc_ptr = kw["k_cache"].data_ptr(), kw["v_cache"].data_ptr()

    out, lse = flash_ext.flash_attn_with_kvcache(**kw, return_softmax_lse=True)

    assert out.shape == kw["q"].shape and out.dtype == kw["q"].dtype
    assert lse.shape == (kw["q"].shape[0], kw["q"].shape[2], kw["q"].shape[1])
    tol = 2e-3 if out.dtype == F16 else 1.6e-2
    torch.testing.assert_close(out.float(), want_out.to(out.dtype).float(), atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-5, rtol=1e-5)

    # The caches: the caller's very tensors, element by element as the reference's; only the
    # written slots differ from before.
    assert kw["k_cache"].data_ptr() == kc_ptr and kw["v_cache"].data_ptr() == vc_ptr
    assert kw["k_cache"].shape[-1] == d
    assert torch.equal(kw["k_cache"], want_kc) and torch.equal(kw["v_cache"], want_vc)
    written = _written_slots(kw)
    for cache, before in ((kw["k_cache"], before_k), (kw["v_cache"], before_v)):
        assert torch.equal(cache[~written], before[~written])
        if written.any():
            assert not torch.equal(cache[written], before[written])


def test_padded_call_equals_brute_force(cpu_ops):
    """The same against the brute-force loop (independent of flash_ext.reference)."""
    kw = make_case(d=59, page_size=16, sq=2, s_new=2, rotary="half", alibi="bh", causal=True,
                   seed=11, capacity=32)
    want_out, want_lse, want_kc, want_vc = brute_force(**kw)
    out, lse = flash_ext.flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    assert torch.equal(kw["k_cache"], want_kc) and torch.equal(kw["v_cache"], want_vc)
    torch.testing.assert_close(out.double(), want_out.to(F16).double(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_default_scale_is_the_original_head_dims(cpu_ops):
    """1 / sqrt(59), not 1 / sqrt(64): the result matches the reference at the given scale
    1 / sqrt(59), and not the one at 1 / sqrt(64) (control)."""
    kw = make_case(d=59, s_new=0, sq=3, seed=4)
    out = flash_ext.flash_attn_with_kvcache(**kw)
    at_59 = flash_ext.flash_attn_with_kvcache(**kw, softmax_scale=1 / math.sqrt(59))
    at_64 = flash_ext.flash_attn_with_kvcache(**kw, softmax_scale=1 / math.sqrt(64))
    assert torch.equal(out, at_59)
    assert not torch.allclose(out.float(), at_64.float(), atol=2e-3, rtol=2e-3)


def test_what_the_ops_receive(recorder):
    """Zero-padded copies (to 64) of q, k, v and the caches; the rotary tables and index
    tensors as given; the scale of d = 59; out cut back to 59 columns."""
    kw = make_case(d=59, sq=2, s_new=2, rotary="half", leftpad=True, alibi="h", causal=True)
    out, lse = flash_ext.flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    assert recorder.names() == ["append", "fwd"]
    kc_a, vc_a, k_a, v_a, cos_a, sin_a, lens_a = recorder.args("append")[:7]
    f = recorder.args("fwd")
    q_f, kc_f, vc_f = f[:3]
    for sent, given in ((kc_a, "k_cache"), (vc_a, "v_cache"), (k_a, "k"), (v_a, "v"),
                        (q_f, "q")):
        t = kw[given]
        assert sent is not t and sent.shape == t.shape[:-1] + (64,), given
        assert ops._is_aligned(sent), given
        assert torch.equal(sent[..., :59], t), given
        assert not sent[..., 59:].any(), given
    assert kc_f is kc_a and vc_f is vc_a  # the attention reads the copies the append wrote
    assert cos_a is kw["rotary_cos"] and sin_a is kw["rotary_sin"]
    assert lens_a is kw["cache_seqlens"]
    assert f[12] == pytest.approx(1 / math.sqrt(59))
    assert out.shape == kw["q"].shape and lse.shape == (2, 4, 2)


@pytest.mark.parametrize("s_new", [0, 2])
def test_caches_written_only_after_an_append(monkeypatch, meta_ok, s_new):
    """Without new tokens nothing is written back to the caller's caches (they are only read)."""
    kw = make_case(d=59, s_new=s_new, sq=2)
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, src, *a, **k):
        if self.data_ptr() in (kw["k_cache"].data_ptr(), kw["v_cache"].data_ptr()):
            copies.append(self.data_ptr())
        return real_copy(self, src, *a, **k)

    rec = OpRecorder()
    monkeypatch.setattr(ops, "_kvcache_append", rec.append)
    monkeypatch.setattr(ops, "_fwd_kvcache", rec.fwd)
    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    flash_ext.flash_attn_with_kvcache(**kw)
    assert len(copies) == (2 if s_new else 0)


def test_caches_of_any_layout(cpu_ops):
    """The caller's caches are views into a wider buffer (rows not 16-byte aligned, which the
    in-place path refuses): the padded path copies them, and writes back only the view."""
    kw = make_case(d=59, sq=2, s_new=2, rotary="interleaved", causal=True, seed=7)
    want_out, _, want_kc, want_vc = R.kvcache_attention(**kw)
    bufs = []
    for name in ("k_cache", "v_cache"):
        buf = torch.randn(kw[name].shape[:-1] + (70,)).to(F16)
        buf[..., 5:64] = kw[name]
        bufs.append((buf, buf.clone()))
        kw[name] = buf[..., 5:64]
    out = flash_ext.flash_attn_with_kvcache(**kw)
    torch.testing.assert_close(out.float(), want_out.to(F16).float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(kw["k_cache"], want_kc) and torch.equal(kw["v_cache"], want_vc)
    for buf, before in bufs:
        assert torch.equal(buf[..., :5], before[..., :5])
        assert torch.equal(buf[..., 64:], before[..., 64:])


def test_inputs_that_require_grad(cpu_ops):
    """As for other head dims: no gradients, plain outputs, the append still visible."""
    kw = make_case(d=59, s_new=1, seed=2)
    _, _, want_kc, _ = R.kvcache_attention(**kw)
    for name in ("q", "k", "v"):
        kw[name].requires_grad_(True)
    out = flash_ext.flash_attn_with_kvcache(**kw)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(kw["k_cache"], want_kc)


# ---------------------------------------------------------------------------------------------
# Bad input: raised before anything runs, the caller's caches untouched
# ---------------------------------------------------------------------------------------------


def _with_head_dim(t, d):
    """t with its last dim cut or zero-extended to d."""
    if t.shape[-1] >= d:
        return t[..., :d].contiguous()
    return torch.nn.functional.pad(t, (0, d - t.shape[-1]))


def _i32(*vals):
    return torch.tensor(vals, dtype=torch.int32)


BAD = {
    # 59 and 60 both pad to 64: the checks read the caller's shapes
    "q_59_caches_60": (dict(d=60), lambda kw: kw.update(q=_with_head_dim(kw["q"], 59)),
                       ValueError, "q and k_cache must have the same head dim"),
    "q_60_caches_59": (dict(d=59), lambda kw: kw.update(q=_with_head_dim(kw["q"], 60)),
                       ValueError, "q and k_cache must have the same head dim"),
    "v_cache_60": (dict(d=59), lambda kw: kw.update(v_cache=_with_head_dim(kw["v_cache"], 60)),
                   ValueError, "k_cache and v_cache must have the same shape"),
    "k_60": (dict(d=59), lambda kw: kw.update(k=_with_head_dim(kw["k"], 60)), ValueError,
             "k must have shape \\(batch, seqlen_new, nheads_k, headdim\\) = \\(2, seqlen_new, "
             "2, 59\\)"),
    "v_58": (dict(d=59), lambda kw: kw.update(v=_with_head_dim(kw["v"], 58)), ValueError,
             "v must have shape"),
    "paged_q_61": (dict(d=59, page_size=16), lambda kw: kw.update(
        q=_with_head_dim(kw["q"], 61)), ValueError, "q and k_cache must have the same head dim"),
    # the rotary dim against the original head dim: 48 > 47, though 47 pads to 48
    "rotary_past_head_dim": (dict(d=47, rotary="half"), lambda kw: kw.update(
        rotary_cos=torch.cat([kw["rotary_cos"]] * 2, 1)[:, :24],
        rotary_sin=torch.cat([kw["rotary_sin"]] * 2, 1)[:, :24]), ValueError,
        "at most the head dim \\(47\\); got 48"),
    "dtype": (dict(d=59), lambda kw: kw.update(v=kw["v"].bfloat16()), TypeError,
              "v must have q's dtype"),
    "page_size_40": (dict(d=59, page_size=40, capacity=80), None, ValueError,
                     "page size must be a multiple of 16, got 40"),
    "k_last_dim_strided": (dict(d=59), lambda kw: kw.update(
        k=kw["k"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
        "last dimension of k must be contiguous"),
}

BAD_VALUES = {
    "lengths_past_capacity": (dict(d=59, s_new=2), lambda kw: kw.update(
        cache_seqlens=_i32(3, 63)), "cache_seqlens \\+ seqlen_new must be at most the cache "
        "capacity \\(64\\).*Nothing was written"),
    "page_out_of_range": (dict(d=59, page_size=16, s_new=2), lambda kw: (
        kw.update(cache_seqlens=_i32(10, 47)), kw["block_table"].__setitem__((1, 3), 99)),
        "block_table\\[1, 3\\] = 99"),
    "batch_idx_out_of_range": (dict(d=59, batch_idx=True, s_new=1), lambda kw: kw.update(
        cache_batch_idx=_i32(0, 5)), "cache_batch_idx must lie in \\[0, batch_cache = 5\\)"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_before_anything(recorder, name):
    over, edit, exc, match = BAD[name]
    kw = make_case(**over)
    if edit is not None:
        edit(kw)
    snap = kw["k_cache"].clone(), kw["v_cache"].clone()
    with pytest.raises(exc, match=match) as info:
        flash_ext.flash_attn_with_kvcache(**kw)
    assert isinstance(info.value, flash_ext.FlashExtError)
    assert recorder.calls == []
    assert torch.equal(kw["k_cache"], snap[0]) and torch.equal(kw["v_cache"], snap[1])


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_bad_values_raise_before_anything(recorder, name):
    over, edit, match = BAD_VALUES[name]
    kw = make_case(**over)
    edit(kw)
    snap = kw["k_cache"].clone(), kw["v_cache"].clone()
    with pytest.raises(flash_ext.FlashExtValueError, match=match):
        flash_ext.flash_attn_with_kvcache(**kw)
    assert recorder.calls == []
    assert torch.equal(kw["k_cache"], snap[0]) and torch.equal(kw["v_cache"], snap[1])


def test_an_op_failing_after_the_append_leaves_the_caches(monkeypatch, meta_ok):
    """The append writes the padded copies; if the attention op then fails, nothing has been
    copied back to the caller's caches."""
    kw = make_case(d=59, page_size=16, s_new=2, sq=2, rotary="half", causal=True)
    snap = kw["k_cache"].clone(), kw["v_cache"].clone()
    appended = []

    def append(k_cache, v_cache, *rest):
        _append_cpu(k_cache, v_cache, *rest)
        appended.append(k_cache)

    def failing_fwd(*args):
        raise RuntimeError("the attention op failed")

    monkeypatch.setattr(ops, "_kvcache_append", append)
    monkeypatch.setattr(ops, "_fwd_kvcache", failing_fwd)
    with pytest.raises(RuntimeError, match="the attention op failed"):
        flash_ext.flash_attn_with_kvcache(**kw)
    assert len(appended) == 1 and appended[0] is not kw["k_cache"]
    assert not torch.equal(appended[0][..., :59], snap[0])  # control: the copy was written
    assert torch.equal(kw["k_cache"], snap[0]) and torch.equal(kw["v_cache"], snap[1])


# ---------------------------------------------------------------------------------------------
# The fast path declines these calls; torch.compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [59, 36, 100, 4])
def test_fast_path_declines(recorder, d):
    kw = make_case(d=d, s_new=1)
    args = (kw["q"], kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw["cache_seqlens"], None,
            False, (-1, -1), 0.0, True, 0, False)
    assert kvcache._fast_call(*args) is None
    assert recorder.calls == []
    # Control: the same call at d = 64 is taken (and runs the ops).
    kw = make_case(d=64, s_new=1)
    args = (kw["q"], kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw["cache_seqlens"], None,
            False, (-1, -1), 0.0, True, 0, False)
    assert kvcache._fast_call(*args) is not None
    assert recorder.names() == ["append", "fwd"]


# torch.compile with aot_eager on this path: test_kvcache_api.py's
# test_wrapper_under_aot_eager_mutates_the_caches[59].


def test_compile_fullgraph_fake_tensors(fake_mode):
    """Traced with fake CUDA tensors: one graph, the two ops, no graph break."""
    kw = make_case(d=59, page_size=16, sq=2, s_new=2, rotary="interleaved")
    with fake_mode:
        kw = {n: (fake_mode.from_tensor(t).to("cuda") if isinstance(t, torch.Tensor) else t)
              for n, t in kw.items()}
    rec = Recorder()

    @torch.compile(fullgraph=True, backend=rec)
    def step(q, k_cache, v_cache, k, v, cos, sin, lens, table):
        return flash_ext.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cos, sin, lens, block_table=table, causal=True,
            return_softmax_lse=True)

    with fake_mode:
        out, lse = step(kw["q"], kw["k_cache"], kw["v_cache"], kw["k"], kw["v"],
                        kw["rotary_cos"], kw["rotary_sin"], kw["cache_seqlens"],
                        kw["block_table"])
    assert out.shape == kw["q"].shape and lse.shape == (2, 4, 2)
    assert len(rec.graphs) == 1
    assert rec.count(torch.ops.flash_ext.kvcache_append) == 1
    assert rec.count(torch.ops.flash_ext.fwd_kvcache) == 1
