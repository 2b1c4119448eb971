"""flash_attn_with_kvcache on the CPU: its checks, the reference it is measured against, the
arguments it hands the two ops, and torch.compile tracing. No kernel is needed: the ops are
replaced by recorders, or given a CPU implementation built from the reference's helpers
(registered for the CPU dispatch key in this file only)."""

import math

import pytest
import torch

import flash_ext
from flash_ext import _validation as V
from flash_ext import ops
from flash_ext import reference as R

from kvcache_cases import brute_force, make_case

F16 = torch.float16


# ---------------------------------------------------------------------------------------------
# The schemas and the exports
# ---------------------------------------------------------------------------------------------

APPEND_SCHEMA = (
    "flash_ext::kvcache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, "
    "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, int cache_seqlen, "
    "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, "
    "bool rotary_interleaved) -> ()")
FWD_SCHEMA = (
    "flash_ext::fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? rotary_cos, "
    "Tensor? rotary_sin, Tensor? cache_seqlens, int cache_seqlen, int seqlen_new, "
    "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, Tensor? alibi_slopes, "
    "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
    "bool rotary_interleaved, int num_splits) -> (Tensor out, Tensor lse)")


def test_schemas_are_the_designed_ones():
    """The registered schemas (stand-ins or the build's) are exactly design 3.2's."""
    from torch._C import parse_schema
    assert torch.ops.flash_ext.kvcache_append.default._schema == parse_schema(APPEND_SCHEMA)
    assert torch.ops.flash_ext.fwd_kvcache.default._schema == parse_schema(FWD_SCHEMA)
    assert ops._kvcache_append is torch.ops.flash_ext.kvcache_append.default
    assert ops._fwd_kvcache is torch.ops.flash_ext.fwd_kvcache.default


def test_the_wrapper_leaves_the_checks_to_validation():
    """flash_ext/kvcache.py raises nothing itself: every check is in flash_ext/_validation.py."""
    import ast
    import inspect
    from flash_ext import kvcache
    raises = [n.lineno for n in ast.walk(ast.parse(inspect.getsource(kvcache)))
              if isinstance(n, ast.Raise)]
    assert raises == []


def test_exported_like_the_other_flash_attn_functions():
    from flash_ext import interface
    assert "flash_attn_with_kvcache" in flash_ext.__all__
    assert "flash_attn_with_kvcache" in interface.__all__
    assert flash_ext.flash_attn_with_kvcache is interface.flash_attn_with_kvcache
    from flash_ext.kvcache import flash_attn_with_kvcache
    assert flash_ext.flash_attn_with_kvcache is flash_attn_with_kvcache


# ---------------------------------------------------------------------------------------------
# The reference against a brute-force loop
# ---------------------------------------------------------------------------------------------

REF_CASES = {
    "decode": dict(),
    "no_new_kv": dict(s_new=0),
    "full_caches": dict(seqlens=None),
    "int_seqlens": dict(seqlens="int"),
    "speculative_causal": dict(sq=4, s_new=4, causal=True),
    "fewer_new_than_q": dict(sq=5, s_new=2, causal=True),
    "local": dict(sq=3, s_new=3, window_size=(5, 1)),
    "local_left_only": dict(sq=3, s_new=1, window_size=(7, -1)),
    "softcap": dict(sq=2, s_new=2, softcap=0.8, causal=True),
    "mqa": dict(hq=6, hkv=1, sq=2, s_new=2, causal=True),
    "mha": dict(hq=2, hkv=2),
    "gqa_rows_of_many": dict(hq=8, hkv=2, sq=3, s_new=3),
    "rotary_interleaved": dict(sq=3, s_new=3, rotary="interleaved", causal=True),
    "rotary_half": dict(sq=3, s_new=3, rotary="half", causal=True),
    "rotary_half_partial": dict(sq=2, s_new=2, rotary="half", rotary_frac=0.5),
    "rotary_interleaved_partial_noncausal": dict(sq=3, s_new=1, rotary="interleaved",
                                                 rotary_frac=0.5),
    "rotary_local": dict(sq=2, s_new=2, rotary="half", window_size=(4, 0)),
    "leftpad": dict(sq=2, s_new=2, leftpad=True, causal=True),
    "leftpad_rotary": dict(sq=2, s_new=2, leftpad=True, rotary="interleaved", causal=True),
    "batch_idx": dict(batch_idx=True, s_new=2, sq=2, causal=True),
    "batch_idx_leftpad": dict(batch_idx=True, leftpad=True, b=3),
    "alibi_h": dict(alibi="h", sq=3, s_new=3),
    "alibi_bh_causal": dict(alibi="bh", sq=3, s_new=3, causal=True),
    "alibi_softcap_local": dict(alibi="h", sq=2, s_new=2, softcap=1.5, window_size=(6, 2)),
    "paged_16": dict(page_size=16, sq=2, s_new=2, causal=True),
    "paged_32_rotary_alibi": dict(page_size=32, sq=2, s_new=2, rotary="half", alibi="bh",
                                  causal=True),
    "paged_leftpad": dict(page_size=16, leftpad=True, s_new=3, sq=3),
    "paged_full": dict(page_size=16, full=True, s_new=2, sq=2),
    "bf16_everything": dict(dtype=torch.bfloat16, sq=3, s_new=3, rotary="interleaved",
                            leftpad=True, batch_idx=True, alibi="bh", causal=True, softcap=2.0),
    "d128": dict(d=128, hq=4, hkv=1, sq=2, s_new=1, rotary="half", rotary_frac=0.5),
}


@pytest.mark.parametrize("name", sorted(REF_CASES))
def test_reference_matches_brute_force(name):
    kw = make_case(seed=hash(name) % 1000, **REF_CASES[name])
    out, lse, kc, vc = R.kvcache_attention(**kw)
    want_out, want_lse, want_kc, want_vc = brute_force(**kw)
    # The caches: the same rounding (rotation in fp32, rounded to the dtype) element by element.
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse.float()))
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-4)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=2e-5, rtol=1e-5)


def test_reference_sees_every_cache_element_it_should():
    """Control for the comparison above: a change of one visible key changes the output; a
    change of one key before the left padding, or past L_b, does not."""
    kw = make_case(b=1, leftpad=True, s_new=1, seed=3, capacity=64)
    lens, pad = int(kw["cache_seqlens"][0]), int(kw["cache_leftpad"][0])
    if pad == 0 or lens == pad:
        kw["cache_seqlens"][0], kw["cache_leftpad"][0] = lens, pad = 20, 5
    base, _, _, _ = R.kvcache_attention(**kw)
    for slot, changes in ((pad, True), (pad - 1, False), (lens + 1, False)):
        kc = kw["k_cache"].clone()
        kc[0, slot] += 1.0
        out, _, _, _ = R.kvcache_attention(**dict(kw, k_cache=kc))
        assert (not torch.equal(out, base)) == changes, slot


def _pages_of(cache, block_table, capacity):
    """A contiguous (b, capacity, ...) view of a paged cache's sequences (a copy)."""
    b = block_table.shape[0]
    return torch.stack([R.kvcache_gather(cache, i, capacity, block_table=block_table)
                        for i in range(b)])


@pytest.mark.parametrize("page_size", [16, 32, 64])
@pytest.mark.parametrize("rotary", [None, "interleaved"])
def test_reference_paged_equals_contiguous(page_size, rotary):
    kw = make_case(page_size=page_size, capacity=64, sq=2, s_new=2, rotary=rotary,
                   causal=True, alibi="h", seed=page_size)
    capacity = 64
    contig = dict(kw)
    del contig["block_table"]
    contig["k_cache"] = _pages_of(kw["k_cache"], kw["block_table"], capacity)
    contig["v_cache"] = _pages_of(kw["v_cache"], kw["block_table"], capacity)
    out_p, lse_p, kc_p, vc_p = R.kvcache_attention(**kw)
    out_c, lse_c, kc_c, vc_c = R.kvcache_attention(**contig)
    torch.testing.assert_close(out_p, out_c, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse_p, lse_c, atol=1e-6, rtol=1e-6)
    assert torch.equal(_pages_of(kc_p, kw["block_table"], capacity), kc_c)
    assert torch.equal(_pages_of(vc_p, kw["block_table"], capacity), vc_c)


def test_reference_rows_with_no_key():
    """cache_seqlens 0 without new tokens: out 0, lse -inf, no NaN; causal rows before the
    first key likewise."""
    kw = make_case(b=2, sq=3, s_new=0, seed=1)
    kw["cache_seqlens"] = torch.tensor([0, 2], dtype=torch.int32)
    kw["causal"] = True
    out, lse, _, _ = R.kvcache_attention(**kw)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isneginf(lse[0]).all()
    # Sequence 1: 2 keys, 3 causal query rows: row 0 sees none, rows 1 and 2 see 1 and 2 keys.
    assert torch.isneginf(lse[1, :, 0]).all() and torch.isfinite(lse[1, :, 1:]).all()
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))
    assert not out.isnan().any()


def test_reference_alibi_is_exact_under_causal():
    """ALiBi's bias is -slope |t + L - sq - j| under causal masks too (not FlashAttention-2's
    row-shifted form): lse moves when only the rows' offsets would."""
    kw = make_case(b=1, sq=2, s_new=2, alibi="h", causal=True, seed=5)
    _, lse, _, _ = R.kvcache_attention(**kw)
    _, lse0, _, _ = R.kvcache_attention(**dict(kw, alibi_slopes=None))
    assert (lse < lse0 + 1e-6).all()  # every bias is <= 0, the diagonal's is 0


# ---------------------------------------------------------------------------------------------
# The wrapper: what it hands the ops (recorders)
# ---------------------------------------------------------------------------------------------


class OpRecorder:
    """Stands in for ops._kvcache_append and ops._fwd_kvcache: records the calls, in order, and
    returns outputs of the real ops' shapes."""

    def __init__(self):
        self.calls = []

    def append(self, *args):
        self.calls.append(("append", args))

    def fwd(self, *args):
        self.calls.append(("fwd", args))
        q = args[0]
        b, sq, hq, _ = q.shape
        return torch.zeros_like(q), torch.zeros(b, hq, sq)

    def names(self):
        return [c[0] for c in self.calls]

    def args(self, name):
        return [a for n, a in self.calls if n == name][-1]


@pytest.fixture
def recorder(monkeypatch, meta_ok):
    rec = OpRecorder()
    monkeypatch.setattr(ops, "_kvcache_append", rec.append)
    monkeypatch.setattr(ops, "_fwd_kvcache", rec.fwd)
    return rec


APPEND_ARGS = ("k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
               "cache_seqlen", "cache_batch_idx", "cache_leftpad", "block_table",
               "rotary_interleaved")
FWD_ARGS = ("q", "k_cache", "v_cache", "rotary_cos", "rotary_sin", "cache_seqlens",
            "cache_seqlen", "seqlen_new", "cache_batch_idx", "cache_leftpad", "block_table",
            "alibi_slopes", "softmax_scale", "causal", "window_left", "window_right", "softcap",
            "rotary_interleaved", "num_splits")


def _named(names, args):
    assert len(names) == len(args)
    return dict(zip(names, args))


def test_append_then_attention_with_a_tensor_of_lengths(recorder):
    kw = make_case(page_size=16, sq=2, s_new=2, rotary="half", leftpad=True, alibi="bh",
                   causal=True, softcap=3.0)
    out, lse = flash_ext.flash_attn_with_kvcache(**kw, num_splits=7, return_softmax_lse=True)
    assert recorder.names() == ["append", "fwd"]
    a = _named(APPEND_ARGS, recorder.args("append"))
    f = _named(FWD_ARGS, recorder.args("fwd"))
    for name in ("k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                 "cache_leftpad", "block_table"):
        assert a[name] is kw[name], name  # the tensors themselves: no copies
    assert a["cache_seqlen"] == -1 and a["cache_batch_idx"] is None
    assert a["rotary_interleaved"] is False
    for name in ("q", "k_cache", "v_cache", "rotary_cos", "rotary_sin", "cache_seqlens",
                 "cache_leftpad", "block_table", "alibi_slopes"):
        assert f[name] is kw[name], name
    assert f["cache_seqlen"] == -1 and f["seqlen_new"] == 2 and f["cache_batch_idx"] is None
    assert f["softmax_scale"] == pytest.approx(1 / math.sqrt(64))
    assert (f["causal"], f["window_left"], f["window_right"]) == (True, -1, 0)
    assert f["softcap"] == 3.0 and f["rotary_interleaved"] is False and f["num_splits"] == 7
    assert out.shape == kw["q"].shape and lse.shape == (2, 4, 2)


def test_int_lengths_are_passed_as_an_int(recorder):
    kw = make_case(seqlens="int", s_new=1, batch_idx=True, window_size=(8, 3))
    n = kw["cache_seqlens"]
    out = flash_ext.flash_attn_with_kvcache(**kw, softmax_scale=0.5)
    assert isinstance(out, torch.Tensor)
    a = _named(APPEND_ARGS, recorder.args("append"))
    f = _named(FWD_ARGS, recorder.args("fwd"))
    assert a["cache_seqlens"] is None and a["cache_seqlen"] == n and type(a["cache_seqlen"]) is int
    assert a["cache_batch_idx"] is kw["cache_batch_idx"] and a["block_table"] is None
    assert f["cache_seqlens"] is None and f["cache_seqlen"] == n and f["seqlen_new"] == 1
    assert (f["softmax_scale"], f["causal"], f["window_left"], f["window_right"]) == \
        (0.5, False, 8, 3)
    assert f["rotary_cos"] is None and f["alibi_slopes"] is None and f["num_splits"] == 0


def test_without_new_tokens_there_is_no_append(recorder):
    kw = make_case(s_new=0, seqlens="tensor", softcap=-1.0)
    flash_ext.flash_attn_with_kvcache(**kw)
    assert recorder.names() == ["fwd"]
    f = _named(FWD_ARGS, recorder.args("fwd"))
    assert f["cache_seqlens"] is kw["cache_seqlens"] and f["seqlen_new"] == 0
    assert f["softcap"] == 0.0


def test_full_caches_when_no_lengths(recorder):
    kw = make_case(seqlens=None)
    flash_ext.flash_attn_with_kvcache(**kw)
    f = _named(FWD_ARGS, recorder.args("fwd"))
    assert recorder.names() == ["fwd"]
    assert f["cache_seqlens"] is None and f["cache_seqlen"] == -1 and f["seqlen_new"] == 0


def test_empty_new_tokens_append_nothing(recorder):
    kw = make_case(s_new=1)
    kw["k"], kw["v"] = kw["k"][:, :0], kw["v"][:, :0]
    flash_ext.flash_attn_with_kvcache(**kw)
    assert recorder.names() == ["fwd"]
    assert _named(FWD_ARGS, recorder.args("fwd"))["seqlen_new"] == 0


def test_small_tensors_made_readable_caches_never_copied(recorder):
    """q, k, v and the index tensors with odd strides are copied (they are small); the caches
    are passed as they are."""
    kw = make_case(sq=2, s_new=2, leftpad=True)
    kw["q"] = torch.randn(2, 2, 4, 72, dtype=F16)[..., 3:67]  # unaligned rows
    lens = torch.zeros(2, 2, dtype=torch.int32)
    lens[:, 0] = kw["cache_seqlens"]
    kw["cache_seqlens"] = lens[:, 0]  # stride 2
    flash_ext.flash_attn_with_kvcache(**kw)
    f = _named(FWD_ARGS, recorder.args("fwd"))
    assert f["q"] is not kw["q"] and torch.equal(f["q"], kw["q"]) and ops._is_aligned(f["q"])
    assert f["cache_seqlens"].stride() == (1,) and torch.equal(f["cache_seqlens"], lens[:, 0])
    assert f["k_cache"] is kw["k_cache"] and f["v_cache"] is kw["v_cache"]


def test_outputs_carry_no_gradient(recorder, monkeypatch):
    """No gradients (FlashAttention-2's behaviour): the ops run without autograd recording."""
    kw = make_case()
    kw["q"].requires_grad_(True)
    grad_modes = []

    def fwd(*args):
        grad_modes.append(torch.is_grad_enabled())
        return recorder.fwd(*args)

    monkeypatch.setattr(ops, "_fwd_kvcache", fwd)
    out = flash_ext.flash_attn_with_kvcache(**kw)
    assert grad_modes == [False] and not out.requires_grad


# ---------------------------------------------------------------------------------------------
# Bad input: the right error, a clear message, nothing called, both caches unchanged
# ---------------------------------------------------------------------------------------------


def _i32(*vals):
    return torch.tensor(vals, dtype=torch.int32)


BAD = {
    # dtypes
    "q_fp32": (dict(), lambda kw: kw.update(q=kw["q"].float()), TypeError,
               "supports float16 and bfloat16 only; got q of dtype float32"),
    "k_cache_dtype": (dict(), lambda kw: kw.update(k_cache=kw["k_cache"].bfloat16()), TypeError,
                      "k_cache must have q's dtype \\(float16\\); got bfloat16"),
    "v_dtype": (dict(), lambda kw: kw.update(v=kw["v"].bfloat16()), TypeError,
                "v must have q's dtype"),
    "rotary_dtype": (dict(rotary="half"), lambda kw: kw.update(
        rotary_cos=kw["rotary_cos"].float()), TypeError, "rotary_cos must have q's dtype"),
    "alibi_dtype": (dict(alibi="h"), lambda kw: kw.update(
        alibi_slopes=kw["alibi_slopes"].half()), TypeError,
        "alibi_slopes must be float32; got float16"),
    "block_table_int64": (dict(page_size=16), lambda kw: kw.update(
        block_table=kw["block_table"].long()), TypeError, "block_table must be int32; got int64"),
    "seqlens_int64": (dict(), lambda kw: kw.update(cache_seqlens=kw["cache_seqlens"].long()),
                      TypeError, "cache_seqlens must be int32; got int64"),
    "seqlens_float": (dict(), lambda kw: kw.update(cache_seqlens=3.0), TypeError,
                      "cache_seqlens must be an int, an int32 tensor"),
    "batch_idx_int64": (dict(batch_idx=True), lambda kw: kw.update(
        cache_batch_idx=kw["cache_batch_idx"].long()), TypeError, "cache_batch_idx must be int32"),
    "leftpad_int64": (dict(leftpad=True), lambda kw: kw.update(
        cache_leftpad=kw["cache_leftpad"].long()), TypeError, "cache_leftpad must be int32"),
    # shapes and layouts
    "q_3d": (dict(), lambda kw: kw.update(q=kw["q"][0]), ValueError, "q must be 4-D"),
    "caches_differ": (dict(), lambda kw: kw.update(v_cache=kw["v_cache"][:, :32]), ValueError,
                      "k_cache and v_cache must have the same shape"),
    "head_dim_mismatch": (dict(), lambda kw: kw.update(q=kw["q"][..., :32]), ValueError,
                          "q and k_cache must have the same head dim"),
    "heads_not_divisible": (dict(hq=3, hkv=2), None, ValueError,
                            "number of query heads \\(3\\) must be a positive multiple"),
    "head_dim_past_256": (dict(d=264), None, ValueError,
                          "head dim must be between 1 and 256; got 264"),
    "head_dim_past_256_not_padded": (dict(d=259), None, ValueError,
                                     "head dim must be between 1 and 256; got 259"),
    "page_size_40": (dict(page_size=40, capacity=80), None, ValueError,
                     "page size must be a multiple of 16, got 40"),
    "block_table_and_batch_idx": (dict(page_size=16), lambda kw: kw.update(
        cache_batch_idx=_i32(0, 1)), ValueError, "cache_batch_idx cannot be used with block_table"),
    "block_table_shape": (dict(page_size=16), lambda kw: kw.update(
        block_table=kw["block_table"][:1]), ValueError,
        "block_table must have shape \\(batch, max_pages_per_seq\\) with batch = 2; "
        "got \\(1, 4\\)"),
    "too_few_cache_rows": (dict(), lambda kw: kw.update(k_cache=kw["k_cache"][:1],
                                                        v_cache=kw["v_cache"][:1]),
                           ValueError, "k_cache has 1 rows \\(batch_cache\\) for a batch of 2"),
    "k_without_v": (dict(), lambda kw: kw.update(v=None), ValueError,
                    "k and v .* must be given together; only k was given"),
    "k_shape": (dict(), lambda kw: kw.update(k=kw["k"][:, :, :1], v=kw["v"][:, :, :1]),
                ValueError, "k must have shape \\(batch, seqlen_new, nheads_k, headdim\\)"),
    "k_v_lengths_differ": (dict(s_new=2), lambda kw: kw.update(v=kw["v"][:, :1]), ValueError,
                           "k and v must have the same shape"),
    "append_without_lengths": (dict(), lambda kw: kw.update(cache_seqlens=None), ValueError,
                               "appending k and v needs cache_seqlens"),
    "q_longer_than_cache": (dict(capacity=16, sq=17), None, ValueError,
                            "seqlen_q \\(17\\) and seqlen_new \\(1\\) must be at most the cache"),
    "int_lengths_past_capacity": (dict(s_new=2), lambda kw: kw.update(cache_seqlens=63),
                                  ValueError, "cache_seqlens \\+ seqlen_new must lie in "
                                  "\\[0, capacity = 64\\]; got cache_seqlens = 63 and "
                                  "seqlen_new = 2"),
    "int_lengths_negative": (dict(), lambda kw: kw.update(cache_seqlens=-1), ValueError,
                             "must lie in \\[0, capacity"),
    "seqlens_shape": (dict(), lambda kw: kw.update(cache_seqlens=_i32(1, 2, 3)), ValueError,
                      "cache_seqlens must have shape \\(batch,\\) = \\(2,\\); got \\(3\\)"),
    "batch_idx_shape": (dict(batch_idx=True), lambda kw: kw.update(cache_batch_idx=_i32(0)),
                        ValueError, "cache_batch_idx must have shape"),
    "leftpad_shape": (dict(leftpad=True), lambda kw: kw.update(
        cache_leftpad=kw["cache_leftpad"].view(2, 1)), ValueError, "cache_leftpad must have shape"),
    "cos_without_sin": (dict(rotary="half"), lambda kw: kw.update(rotary_sin=None), ValueError,
                        "rotary_cos and rotary_sin must be given together; only rotary_cos"),
    "rotary_without_k": (dict(rotary="half", s_new=0), None, ValueError,
                         "rotary_cos/rotary_sin need the new k and v"),
    "rotary_shapes_differ": (dict(rotary="half"), lambda kw: kw.update(
        rotary_sin=kw["rotary_sin"][:-1]), ValueError, "must have the same shape"),
    "rotary_dim_not_16": (dict(rotary="half"), lambda kw: kw.update(
        rotary_cos=kw["rotary_cos"][:, :12], rotary_sin=kw["rotary_sin"][:, :12]), ValueError,
        "rotary dim .* must be a multiple of 16 and at most the head dim \\(64\\); got 24"),
    "rotary_dim_past_head_dim": (dict(rotary="half"), lambda kw: kw.update(
        rotary_cos=torch.cat([kw["rotary_cos"]] * 2, 1),
        rotary_sin=torch.cat([kw["rotary_sin"]] * 2, 1)), ValueError, "got 128"),
    "rotary_table_short": (dict(rotary="half"), lambda kw: kw.update(
        rotary_cos=kw["rotary_cos"][:60], rotary_sin=kw["rotary_sin"][:60]), ValueError,
        "seqlen_ro >= capacity = 64\\); got seqlen_ro = 60"),
    "rotary_table_2d": (dict(rotary="half"), lambda kw: kw.update(
        rotary_cos=kw["rotary_cos"][None], rotary_sin=kw["rotary_sin"][None]), ValueError,
        "rotary_cos must be 2-D"),
    "alibi_shape": (dict(alibi="h"), lambda kw: kw.update(alibi_slopes=torch.rand(3)), ValueError,
                    "alibi_slopes must have shape \\(nheads,\\) = \\(4,\\) or \\(batch, nheads\\) "
                    "= \\(2, 4\\); got \\(3\\)"),
    "alibi_shape_bh": (dict(alibi="h"), lambda kw: kw.update(alibi_slopes=torch.rand(4, 2)),
                       ValueError, "alibi_slopes must have shape"),
    "num_splits_negative": (dict(), lambda kw: kw.update(num_splits=-1), ValueError,
                            "num_splits must be >= 0"),
    "num_splits_float": (dict(), lambda kw: kw.update(num_splits=2.0), TypeError,
                         "num_splits must be an int"),
    "softmax_scale_zero": (dict(), lambda kw: kw.update(softmax_scale=0.0), ValueError,
                           "softmax_scale must be > 0"),
    "softcap_inf": (dict(), lambda kw: kw.update(softcap=math.inf), ValueError,
                    "softcap must be finite"),
    "window_below_minus_one": (dict(), lambda kw: kw.update(window_size=(-2, 0)), ValueError,
                               "window_size left must be >= -1"),
    "cache_last_dim_strided": (dict(), lambda kw: kw.update(
        k_cache=kw["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
        "last dimension of k_cache must be contiguous"),
    "cache_rows_unaligned": (dict(), lambda kw: kw.update(
        v_cache=torch.empty(kw["v_cache"].numel() + 4, dtype=F16)[4:].view(
            kw["v_cache"].shape).copy_(kw["v_cache"])), ValueError,
        "v_cache must have 16-byte aligned rows .*storage offset 4"),
    "k_missing_q": (dict(), lambda kw: kw.update(q=None), TypeError,
                    "q must be a torch.Tensor, got None"),
}

BAD_VALUES = {
    "lengths_past_capacity": (dict(s_new=2), lambda kw: kw.update(cache_seqlens=_i32(3, 63)),
                              "cache_seqlens \\+ seqlen_new must be at most the cache capacity "
                              "\\(64\\); with seqlen_new = 2, got cache_seqlens\\[1\\] = 63"),
    "lengths_negative": (dict(), lambda kw: kw.update(cache_seqlens=_i32(-1, 3)),
                         "cache_seqlens must be >= 0; got cache_seqlens\\[0\\] = -1"),
    "lengths_past_capacity_no_append": (dict(s_new=0), lambda kw: kw.update(
        cache_seqlens=_i32(3, 65)), "at most the cache capacity \\(64\\)"),
    "leftpad_past_lengths": (dict(leftpad=True), lambda kw: kw.update(
        cache_seqlens=_i32(4, 8), cache_leftpad=_i32(2, 9)),
        "cache_leftpad must be at most cache_seqlens .*cache_leftpad\\[1\\] = 9"),
    "leftpad_negative": (dict(leftpad=True), lambda kw: kw.update(cache_leftpad=_i32(0, -2)),
                         "cache_leftpad must be >= 0; got cache_leftpad\\[1\\] = -2"),
    "batch_idx_out_of_range": (dict(batch_idx=True), lambda kw: kw.update(
        cache_batch_idx=_i32(0, 5)), "cache_batch_idx must lie in \\[0, batch_cache = 5\\); got "
        "cache_batch_idx\\[1\\] = 5"),
    "batch_idx_negative": (dict(batch_idx=True), lambda kw: kw.update(
        cache_batch_idx=_i32(-1, 0)), "cache_batch_idx\\[0\\] = -1"),
    "page_out_of_range": (dict(page_size=16), lambda kw: (
        kw.update(cache_seqlens=_i32(40, 5)), kw["block_table"].__setitem__((0, 2), 11)),
        "block_table entries of the pages in use must lie in \\[0, num_pages = 11\\); got "
        "block_table\\[0, 2\\] = 11"),
    "page_negative": (dict(page_size=16), lambda kw: (
        kw.update(cache_seqlens=_i32(0, 5)), kw["block_table"].__setitem__((1, 0), -1)),
        "block_table\\[1, 0\\] = -1"),
    "page_written_by_the_append": (dict(page_size=16, s_new=2), lambda kw: (
        kw.update(cache_seqlens=_i32(10, 47)), kw["block_table"].__setitem__((1, 3), 99)),
        "block_table\\[1, 3\\] = 99"),
    "rotary_positions_past_table": (dict(rotary="half", sq=4, s_new=1, causal=True), lambda kw: (
        kw.update(cache_seqlens=_i32(3, 62), rotary_cos=kw["rotary_cos"][:64],
                  rotary_sin=kw["rotary_sin"][:64])),
        "cache_seqlens \\+ seqlen_q \\(4\\) must be at most rotary_cos.shape\\[0\\] \\(64\\)"),
    "rotary_positions_int_lengths": (dict(rotary="half", sq=4, s_new=1, causal=True), lambda kw: (
        kw.update(cache_seqlens=62, rotary_cos=kw["rotary_cos"][:64],
                  rotary_sin=kw["rotary_sin"][:64])),
        "must be at most rotary_cos.shape\\[0\\] \\(64\\); got 62 \\+ 4"),
}


def _snapshot(kw):
    return kw["k_cache"].clone(), kw["v_cache"].clone()


def _unchanged(kw, snap):
    return torch.equal(kw["k_cache"], snap[0]) and torch.equal(kw["v_cache"], snap[1])


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_before_any_op(recorder, name):
    over, edit, exc, match = BAD[name]
    kw = make_case(**over)
    if edit is not None:
        edit(kw)
    snap = _snapshot(kw)
    with pytest.raises(exc, match=match) as info:
        flash_ext.flash_attn_with_kvcache(**kw)
    assert isinstance(info.value, flash_ext.FlashExtError)
    assert recorder.calls == []
    assert _unchanged(kw, snap)


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_bad_values_raise_before_any_op(recorder, name):
    over, edit, match = BAD_VALUES[name]
    kw = make_case(**over)
    edit(kw)
    snap = _snapshot(kw)
    with pytest.raises(flash_ext.FlashExtValueError, match=match):
        flash_ext.flash_attn_with_kvcache(**kw)
    assert recorder.calls == []
    assert _unchanged(kw, snap)


def test_bad_values_control_good_values_pass(recorder):
    """Control for the value checks: pages past a sequence's length may hold anything (vLLM
    pads block tables with -1), leftpad == cache_seqlens is allowed, and a full cache is."""
    kw = make_case(page_size=16, s_new=2, leftpad=True)
    kw["cache_seqlens"] = _i32(14, 62)
    kw["cache_leftpad"] = _i32(14, 20)
    kw["block_table"][0, 1:] = -1  # sequence 0 uses page 0 only (16 slots)
    flash_ext.flash_attn_with_kvcache(**kw)
    assert recorder.names() == ["append", "fwd"]


def test_cpu_tensors_raise_device_error():
    kw = make_case()
    with pytest.raises(flash_ext.DeviceError, match="needs CUDA tensors; got q on cpu"):
        flash_ext.flash_attn_with_kvcache(**kw)


def test_value_check_policy(monkeypatch):
    """CPU values are always checked; meta (and fake) tensors never; CUDA ones follow
    FLASH_EXT_CHECK_KVCACHE (CHECK_KVCACHE_VALUES)."""
    cpu = _i32(1, 2)
    assert V.should_check_values(cpu, False) and V.should_check_values(cpu, True)
    assert not V.should_check_values(torch.empty(2, dtype=torch.int32, device="meta"), True)
    monkeypatch.setattr(V, "CHECK_KVCACHE_VALUES", False)
    kw = make_case(s_new=2)
    kw["cache_seqlens"] = _i32(0, 63)
    with pytest.raises(flash_ext.FlashExtValueError):  # still checked: CPU values
        V.check_kvcache_values(kw["q"], kw["k_cache"], kw["cache_seqlens"], None, None, None,
                               64, 2)


def test_values_checked_once_per_tensor_version(monkeypatch):
    """One value check per set of index tensors (and their in-place versions), not per call:
    a decode step hands the same cache_seqlens to every layer."""
    kw = make_case(s_new=1, leftpad=True)
    seen = []
    real_stack = torch.stack

    def counting_stack(*a, **k):
        seen.append(1)
        return real_stack(*a, **k)

    def check():
        V.check_kvcache_values(kw["q"], kw["k_cache"], kw["cache_seqlens"], None,
                               kw["cache_leftpad"], None, 64, 1)

    monkeypatch.setattr(torch, "stack", counting_stack)
    check()
    check()
    assert len(seen) == 1
    kw["cache_seqlens"] += 1  # a decode loop's step: checked again
    check()
    assert len(seen) == 2
    check()
    assert len(seen) == 2
    kw["cache_leftpad"] = kw["cache_leftpad"].clone()  # another tensor: checked again
    check()
    assert len(seen) == 3


# ---------------------------------------------------------------------------------------------
# The wrapper end to end, with CPU implementations of the two ops built from the reference
# ---------------------------------------------------------------------------------------------


def _lens_before(cache_seqlens, cache_seqlen, b, capacity):
    if cache_seqlens is not None:
        assert cache_seqlen == -1
        return cache_seqlens
    if cache_seqlen >= 0:
        return cache_seqlen
    return None


def _capacity(k_cache, block_table):
    return k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)


def _append_cpu(k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
                cache_batch_idx, cache_leftpad, block_table, rotary_interleaved):
    before = _lens_before(cache_seqlens, cache_seqlen, k.shape[0], None)
    assert before is not None  # an append needs the lengths
    R.kvcache_append(k_cache, v_cache, k, v, before, rotary_cos=rotary_cos,
                     rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                     cache_batch_idx=cache_batch_idx, block_table=block_table)


def _fwd_cpu(q, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
             seqlen_new, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
             softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
             num_splits):
    b, sq = q.shape[:2]
    capacity = _capacity(k_cache, block_table)
    before = _lens_before(cache_seqlens, cache_seqlen, b, capacity)
    if before is None:
        assert seqlen_new == 0
        before = capacity
    before = torch.as_tensor(before).expand(b).long()
    if rotary_cos is not None:  # q at its positions before the append (ops.py's contract)
        per_token = causal or window_left >= 0 or window_right >= 0
        pos = before.unsqueeze(1) + (torch.arange(sq) if per_token else torch.zeros(sq).long())
        q = R.apply_rotary(q, rotary_cos, rotary_sin, pos, rotary_interleaved)
    out, lse, _, _ = R.kvcache_attention(
        q, k_cache, v_cache, cache_seqlens=(before + seqlen_new).int(),
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes)
    return out.to(q.dtype), lse


@pytest.fixture
def cpu_ops(meta_ok):
    lib = torch.library.Library("flash_ext", "IMPL")
    lib.impl("kvcache_append", _append_cpu, "CPU")
    lib.impl("fwd_kvcache", _fwd_cpu, "CPU")
    yield
    lib._destroy()


@pytest.mark.parametrize("name", sorted(REF_CASES))
def test_wrapper_equals_reference(cpu_ops, name):
    kw = make_case(seed=hash(name) % 997, **REF_CASES[name])
    want_out, want_lse, want_kc, want_vc = R.kvcache_attention(**kw)
    kc_ptr, vc_ptr = kw["k_cache"].data_ptr(), kw["v_cache"].data_ptr()
    out, lse = flash_ext.flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    assert out.dtype == kw["q"].dtype and out.shape == kw["q"].shape
    assert torch.equal(out, want_out.to(out.dtype))
    assert torch.equal(lse, want_lse)
    # Appended in place: the very tensors, element by element as the reference's.
    assert kw["k_cache"].data_ptr() == kc_ptr and kw["v_cache"].data_ptr() == vc_ptr
    assert torch.equal(kw["k_cache"], want_kc) and torch.equal(kw["v_cache"], want_vc)


def test_wrapper_decode_loop(cpu_ops):
    """Eight decode steps with a cache_seqlens tensor bumped in place, against the reference
    step by step (the pattern a CUDA graph replays)."""
    kw = make_case(b=2, sq=1, s_new=1, page_size=16, rotary="interleaved", causal=True, seed=9)
    kw["cache_seqlens"] = _i32(5, 30)
    k_ref, v_ref = kw["k_cache"].clone(), kw["v_cache"].clone()
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        for name in ("q", "k", "v"):
            kw[name] = torch.randn(kw[name].shape, generator=g).to(F16)
        want, _, k_ref, v_ref = R.kvcache_attention(**dict(kw, k_cache=k_ref, v_cache=v_ref))
        out = flash_ext.flash_attn_with_kvcache(**kw)
        assert torch.equal(out, want.to(F16))
        assert torch.equal(kw["k_cache"], k_ref) and torch.equal(kw["v_cache"], v_ref)
        kw["cache_seqlens"] += 1


@pytest.mark.parametrize("d", [64, 59])  # 59: the zero-padded head dim path
def test_wrapper_under_aot_eager_mutates_the_caches(cpu_ops, d):
    """torch.compile (aot_eager: functionalized, then the mutation written back) gives the
    eager result and updates the caches the caller holds."""
    kw = make_case(b=2, d=d, sq=2, s_new=2, page_size=16, rotary="half", alibi="h", causal=True)
    eager = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    want = flash_ext.flash_attn_with_kvcache(**eager)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k_cache, v_cache, k, v, cos, sin, lens, table, slopes):
        return flash_ext.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cos, sin, lens, block_table=table, causal=True,
            rotary_interleaved=False, alibi_slopes=slopes)

    out = step(kw["q"], kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw["rotary_cos"],
               kw["rotary_sin"], kw["cache_seqlens"], kw["block_table"], kw["alibi_slopes"])
    assert torch.equal(out, want)
    assert torch.equal(kw["k_cache"], eager["k_cache"])
    assert torch.equal(kw["v_cache"], eager["v_cache"])


# ---------------------------------------------------------------------------------------------
# Fake kernels and torch.compile tracing (fake CUDA tensors, no GPU)
# ---------------------------------------------------------------------------------------------


def _fake_case(mode, **over):
    kw = make_case(**over)
    with mode:
        return {n: (mode.from_tensor(t).to("cuda") if isinstance(t, torch.Tensor) else t)
                for n, t in kw.items()}


def test_fake_kernels(fake_mode):
    kw = _fake_case(fake_mode, sq=3, hq=8, hkv=2)
    with fake_mode:
        q = kw["q"]
        res = torch.ops.flash_ext.kvcache_append(kw["k_cache"], kw["v_cache"], kw["k"], kw["v"],
                                                 None, None, kw["cache_seqlens"], -1, None,
                                                 None, None, True)
        assert res is None
        qs = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided q: outputs contiguous
        out, lse = torch.ops.flash_ext.fwd_kvcache(
            qs, kw["k_cache"], kw["v_cache"], None, None, kw["cache_seqlens"], -1, 1, None,
            None, None, None, 0.125, False, -1, -1, 0.0, True, 0)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert out.device.type == "cuda"
    assert lse.shape == (2, 8, 3) and lse.dtype == torch.float32 and lse.is_contiguous()


class Recorder:
    """A Dynamo backend that keeps the FX graphs it receives and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def count(self, op):
        return sum(1 for g in self.graphs for n in g.graph.nodes
                   if n.op == "call_function" and n.target in (op, op.default))


def _decode_step(q, k_cache, v_cache, k, v, cos, sin, lens, table, slopes):
    return flash_ext.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
        block_table=table, causal=True, alibi_slopes=slopes, return_softmax_lse=True)


def _step_args(kw):
    return (kw["q"], kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw.get("rotary_cos"),
            kw.get("rotary_sin"), kw["cache_seqlens"], kw.get("block_table"),
            kw.get("alibi_slopes"))


def test_compile_fullgraph_one_graph_two_ops(fake_mode):
    kw = _fake_case(fake_mode, page_size=16, sq=2, s_new=2, rotary="interleaved", alibi="bh")
    rec = Recorder()
    step = torch.compile(_decode_step, fullgraph=True, backend=rec)
    with fake_mode:
        out, lse = step(*_step_args(kw))
    assert out.shape == kw["q"].shape and lse.shape == (2, 4, 2)
    assert len(rec.graphs) == 1
    assert rec.count(torch.ops.flash_ext.kvcache_append) == 1
    assert rec.count(torch.ops.flash_ext.fwd_kvcache) == 1


def test_compile_int_lengths_and_no_append(fake_mode):
    kw = _fake_case(fake_mode, seqlens="int", s_new=0, batch_idx=True, leftpad=True)
    rec = Recorder()

    @torch.compile(fullgraph=True, backend=rec)
    def step(q, k_cache, v_cache, idx, pad, n):
        return flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=n,
                                                 cache_batch_idx=idx, cache_leftpad=pad,
                                                 window_size=(16, 0))

    with fake_mode:
        out = step(kw["q"], kw["k_cache"], kw["v_cache"], kw["cache_batch_idx"],
                   kw["cache_leftpad"], kw["cache_seqlens"])
    assert out.shape == kw["q"].shape
    assert rec.count(torch.ops.flash_ext.kvcache_append) == 0
    assert rec.count(torch.ops.flash_ext.fwd_kvcache) == 1


def test_explain_no_graph_breaks(fake_mode):
    kw = _fake_case(fake_mode, page_size=16, sq=1, s_new=1, rotary="half", alibi="h")
    with fake_mode:
        explanation = torch._dynamo.explain(_decode_step)(*_step_args(kw))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compile_aot_eager_functionalizes_the_append(fake_mode):
    """aot_eager functionalizes the mutating append (auto_functionalized) without errors."""
    kw = _fake_case(fake_mode, page_size=16, s_new=1, rotary="half")
    step = torch.compile(_decode_step, fullgraph=True, backend="aot_eager")
    with fake_mode:
        out, lse = step(*_step_args(kw))
    assert out.shape == kw["q"].shape


def test_compile_detects_graph_breaks(fake_mode):
    """Control: the fullgraph checks above can fail."""
    kw = _fake_case(fake_mode)

    def broken(*args):
        out = _decode_step(*args)
        torch._dynamo.graph_break()
        return out

    with pytest.raises(Exception, match="(?i)graph.break"):
        with fake_mode:
            torch.compile(broken, fullgraph=True, backend="eager")(*_step_args(kw))
