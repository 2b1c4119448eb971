"""seqused_k on the varlen forward and block_table on flash_attn_varlen_func, checked on the CPU.

A fixture gives flash_ext::fwd and fwd_out CPU kernels that implement seqused_k's meaning with
flash_ext.reference (each sequence's keys cut to their first seqused_k[b]) and record their
calls; the Python layer then runs end to end on CPU tensors: the gather of a paged cache, the
arguments the op receives, the results against a reference built with plain loops, the
validation errors (raised before any op call), inputs that require grad (the forward runs, the
backward raises), and torch.compile.
tests/test_paged_prefill_gpu.py runs the same against the kernels.
"""

import pytest
import torch

import flash_ext
from flash_ext import FlashExtNotImplementedError, FlashExtTypeError, FlashExtValueError
from flash_ext import paged_kv
from flash_ext.errors import DeviceError
from flash_ext.reference import attention_ref_varlen

FN = "flash_attn_varlen_func"


# ---------------------------------------------------------------------------------------------
# CPU kernels that honour seqused_k
# ---------------------------------------------------------------------------------------------


def _trim(k, cu_seqlens_k, seqused_k):
    """k cut to each sequence's first seqused_k[b] keys, and the matching cu_seqlens."""
    ck = cu_seqlens_k.tolist()
    used = seqused_k.tolist()
    parts = [k[ck[b]:ck[b] + used[b]] for b in range(len(used))]
    cu = torch.tensor([0] + used, dtype=torch.int64).cumsum(0).to(torch.int32)
    return torch.cat(parts) if parts else k[:0], cu


class SequsedKernels:
    """CPU kernels for flash_ext::fwd and fwd_out; ``calls`` lists each call's seqused_k (a
    copy, or None) and the k it was given."""

    def __init__(self):
        self.calls = []
        self.lib = torch.library.Library("flash_ext", "IMPL")
        self.lib.impl("fwd", self.fwd, "CPU")
        self.lib.impl("fwd_out", self.fwd_out, "CPU")

    def _forward(self, q, k, v, cu_q, cu_k, scale, causal, wl, wr, softcap, seqused_k):
        self.calls.append({"seqused_k": None if seqused_k is None else seqused_k.clone(),
                           "k": k, "cu_seqlens_k": cu_k})
        assert cu_q is not None, "these kernels serve varlen calls only"
        if seqused_k is not None:
            k, cu_k2 = _trim(k, cu_k, seqused_k)
            v, _ = _trim(v, cu_k, seqused_k)
            cu_k = cu_k2
        out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, softmax_scale=scale, causal=causal,
                                        window_size=(wl, wr), softcap=softcap)
        return out.to(q.dtype).contiguous(), lse.contiguous()

    def fwd(self, q, k, v, cu_q, cu_k, mq, mk, scale, causal, wl, wr, softcap, dropout_p=0.0,
            rng_state=None, deterministic=False, startend_row_indices=None, seqused_k=None,
            alibi_slopes=None):
        assert dropout_p == 0.0
        return self._forward(q, k, v, cu_q, cu_k, scale, causal, wl, wr, softcap, seqused_k)

    def fwd_out(self, q, k, v, out, cu_q, cu_k, mq, mk, scale, causal, wl, wr, softcap,
                dropout_p=0.0, rng_state=None, startend_row_indices=None, seqused_k=None,
                alibi_slopes=None):
        o, lse = self._forward(q, k, v, cu_q, cu_k, scale, causal, wl, wr, softcap, seqused_k)
        out.copy_(o)
        return lse


@pytest.fixture
def kernels(meta_ok):
    k = SequsedKernels()
    yield k
    k.lib._destroy()


def _cu(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)


def _rand(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


# ---------------------------------------------------------------------------------------------
# The gather's index math
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 3, 16, 48])
def test_gather_index_matches_loop(page_size):
    torch.manual_seed(0)
    batch, max_pages, num_pages = 4, 5, 11
    table = torch.randint(0, num_pages, (batch, max_pages), dtype=torch.int32)
    table[1, 3:] = -7          # garbage past a sequence's end: clamped, never out of bounds
    table[2, 4] = 10 ** 6
    mk = max_pages * page_size - (page_size // 2)
    page, row = paged_kv.paged_gather_index(table, page_size, num_pages, mk)
    assert page.shape == row.shape == (batch, mk) and page.dtype == torch.int64
    for b in range(batch):
        for j in range(mk):
            want = min(max(int(table[b, j // page_size]), 0), num_pages - 1)
            assert int(page[b, j]) == want and int(row[b, j]) == j % page_size


def test_gather_index_clamps_columns_past_the_table():
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    page, row = paged_kv.paged_gather_index(table, 4, 3, 12)  # 12 slots, table covers 8
    assert page.tolist() == [[2] * 4 + [0] * 4 + [0] * 4]
    assert row.tolist() == [[0, 1, 2, 3] * 3]


def test_gather_paged_kv_reads_strided_caches_in_place():
    torch.manual_seed(1)
    num_pages, page_size, hkv, d, batch, mk = 6, 5, 2, 8, 3, 9
    big = _rand(num_pages, page_size, 2 * hkv, d)
    k_cache, v_cache = big[:, :, :hkv], big[:, :, hkv:]  # strided views
    table = torch.randint(0, num_pages, (batch, 2), dtype=torch.int32)
    k, v = paged_kv.gather_paged_kv(k_cache, v_cache, table, mk)
    assert k.shape == v.shape == (batch * mk, hkv, d) and k.is_contiguous()
    for b in range(batch):
        for j in range(mk):
            p, r = int(table[b, j // page_size]), j % page_size
            assert torch.equal(k[b * mk + j], k_cache[p, r])
            assert torch.equal(v[b * mk + j], v_cache[p, r])


def test_used_key_counts_and_padded_cu_seqlens():
    cu = _cu([3, 0, 5])
    assert paged_kv.used_key_counts(cu, None).tolist() == [3, 0, 5]
    used = torch.tensor([1, 0, 2], dtype=torch.int32)
    assert paged_kv.used_key_counts(cu, used).tolist() == [1, 0, 2]
    pc = paged_kv.padded_cu_seqlens(3, 7, "cpu")
    assert pc.dtype == torch.int32 and pc.tolist() == [0, 7, 14, 21]


# ---------------------------------------------------------------------------------------------
# seqused_k on the varlen forward
# ---------------------------------------------------------------------------------------------


def _trimmed_ref(q, k, v, cu_q, cu_k, used, **kw):
    kt, cut = _trim(k, cu_k, used)
    vt, _ = _trim(v, cu_k, used)
    return attention_ref_varlen(q, kt, vt, cu_q, cut, **kw)


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_reaches_the_op_and_trims(kernels, causal):
    torch.manual_seed(2)
    lq, lk, used = [3, 5, 2], [6, 4, 9], [6, 2, 0]
    q = _rand(sum(lq), 4, 16)
    k, v = _rand(sum(lk), 2, 16), _rand(sum(lk), 2, 16)
    cu_q, cu_k = _cu(lq), _cu(lk)
    su = torch.tensor(used, dtype=torch.int32)
    out, lse, _ = flash_ext.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, seqused_k=su,
        return_attn_probs=True)
    assert len(kernels.calls) == 1 and kernels.calls[0]["seqused_k"].tolist() == used
    ro, rl = _trimmed_ref(q, k, v, cu_q, cu_k, su, causal=causal)
    torch.testing.assert_close(out.float(), ro, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, rl)
    assert torch.all(out[8:] == 0) and torch.all(torch.isneginf(lse[:, 8:]))  # seqused_k = 0
    # attn_fwd takes it as a keyword, and out= passes it on too
    o2, _ = flash_ext.attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                               max_seqlen_k=9, causal=causal, seqused_k=su)
    buf = torch.empty_like(q)
    flash_ext.attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                       max_seqlen_k=9, causal=causal, seqused_k=su, out=buf)
    assert torch.equal(o2, out) and torch.equal(buf, out)
    assert [c["seqused_k"].tolist() for c in kernels.calls[1:]] == [used, used]


def test_calls_without_seqused_k_pass_none(kernels):
    lq = [2, 3]
    q, k, v = _rand(5, 2, 16), _rand(5, 2, 16), _rand(5, 2, 16)
    flash_ext.flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lq), 3, 3)
    assert kernels.calls[0]["seqused_k"] is None


def _seqused_call(**over):
    lq = [2, 3]
    args = dict(q=_rand(5, 2, 16), k=_rand(5, 2, 16), v=_rand(5, 2, 16), cu_seqlens_q=_cu(lq),
                cu_seqlens_k=_cu(lq), max_seqlen_q=3, max_seqlen_k=3,
                seqused_k=torch.tensor([1, 3], dtype=torch.int32))
    args.update(over)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return flash_ext.attn_fwd(q, k, v, **args)


@pytest.mark.parametrize("over, cls, msg", [
    (dict(seqused_k=torch.tensor([1, 3], dtype=torch.int64)), FlashExtTypeError,
     "seqused_k must be int32"),
    (dict(seqused_k=torch.tensor([1, 3, 0], dtype=torch.int32)), FlashExtValueError,
     "seqused_k must have shape (batch,) = (2,)"),
    (dict(seqused_k=torch.tensor([[1, 3]], dtype=torch.int32)), FlashExtValueError,
     "seqused_k must have shape (batch,)"),
    (dict(seqused_k=torch.tensor([1, 4], dtype=torch.int32)), FlashExtValueError,
     "seqused_k[1] = 4"),
    (dict(seqused_k=torch.tensor([-1, 3], dtype=torch.int32)), FlashExtValueError,
     "seqused_k must be >= 0"),
    (dict(seqused_k=torch.tensor([1, 3], dtype=torch.int32, device="meta")), DeviceError,
     "seqused_k on meta"),
    (dict(seqused_k=[1, 3]), FlashExtTypeError, "seqused_k must be a torch.Tensor"),
])
def test_seqused_k_validation(kernels, over, cls, msg):
    with pytest.raises(cls, match=None) as e:
        _seqused_call(**over)
    assert msg in str(e.value)
    assert kernels.calls == []


def test_seqused_k_needs_varlen(kernels):
    q = _rand(1, 4, 2, 16)
    with pytest.raises(FlashExtValueError, match="seqused_k needs varlen inputs"):
        flash_ext.attn_fwd(q, q, q, seqused_k=torch.tensor([1], dtype=torch.int32))
    assert kernels.calls == []


def _check_backward_raises(out, inputs):
    """out's backward raises flash_ext's NotImplementedError (a RuntimeError, as FlashAttention's
    errors are) and leaves no gradient behind."""
    assert out.requires_grad and out.grad_fn is not None
    with pytest.raises(FlashExtNotImplementedError):
        torch.autograd.grad(out, inputs, torch.ones_like(out), retain_graph=True)
    with pytest.raises(FlashExtNotImplementedError,
                       match="seqused_k / block_table have no backward") as info:
        out.float().sum().backward()
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, NotImplementedError)
    assert "torch.no_grad()" in str(info.value) and "gather_paged_kv" in str(info.value)
    assert all(t.grad is None for t in inputs)


@pytest.mark.parametrize("grad_args", [("q",), ("k",), ("v",), ("q", "k", "v")])
def test_seqused_k_with_grad_runs_the_forward_only(kernels, grad_args):
    """Inputs that require grad: the forward runs and gives the result of the call without
    grad; the output's backward raises."""
    torch.manual_seed(5)
    plain = dict(q=_rand(5, 2, 16), k=_rand(5, 2, 16), v=_rand(5, 2, 16))
    want, want_lse = _seqused_call(**plain)
    args = {n: (t.clone().requires_grad_(True) if n in grad_args else t)
            for n, t in plain.items()}
    out, lse = _seqused_call(**args)
    assert len(kernels.calls) == 2
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert not lse.requires_grad
    _check_backward_raises(out, [args[n] for n in grad_args])


def test_seqused_k_with_grad_under_no_grad(kernels):
    """Under torch.no_grad() nothing changes: a plain output, no node."""
    q, k, v = _rand(5, 2, 16).requires_grad_(True), _rand(5, 2, 16), _rand(5, 2, 16)
    with torch.no_grad():
        out, _ = _seqused_call(q=q, k=k, v=v)
    assert not out.requires_grad and out.grad_fn is None
    out2, _ = _seqused_call(q=q.detach(), k=k, v=v)
    assert not out2.requires_grad and torch.equal(out, out2)
    assert len(kernels.calls) == 2


def test_seqused_k_forward_only_output_is_an_ordinary_tensor(kernels):
    """No copy of the kernel's output; in-place operations on it are allowed (and their own
    backward still reaches the raising node); k and v may be one tensor."""
    q, kv = _rand(5, 2, 16).requires_grad_(True), _rand(5, 2, 16).requires_grad_(True)
    out, _ = _seqused_call(q=q, k=kv, v=kv)
    out.mul_(2)
    _check_backward_raises(out, [q, kv])


def test_op_refuses_seqused_k_when_recording(kernels):
    """The autograd formula of flash_ext::fwd itself (C++ in the build, tests/stand_in_ops.py
    here) refuses seqused_k when it would record a graph, for direct op calls."""
    q = _rand(5, 2, 16).requires_grad_(True)
    k = _rand(5, 2, 16)
    cu = _cu([2, 3])
    with pytest.raises(RuntimeError, match="seqused_k / block_table: forward only"):
        torch.ops.flash_ext.fwd(q, k, k, cu, cu, 3, 3, 0.25, False, -1, -1, 0.0,
                                seqused_k=torch.tensor([1, 3], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# block_table on flash_attn_varlen_func
# ---------------------------------------------------------------------------------------------


def _paged_case(lq, lk, page_size, hq=4, hkv=2, d=16, extra_pages=3, seed=3, dtype=torch.float16):
    """A paged cache holding sequences of lk keys (pages in random order, garbage entries past
    each sequence's pages) and the same keys as a plain varlen k, v."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lk)
    pages_per = [max(1, -(-n // page_size)) for n in lk]
    max_pages = max(pages_per) + 2
    num_pages = sum(pages_per) + extra_pages
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g)
    table = torch.full((batch, max_pages), -1, dtype=torch.int32)
    table[:, -1] = 10 ** 6  # garbage past every sequence's pages
    ks, vs, used = [], [], 0
    for b in range(batch):
        pages = perm[used:used + pages_per[b]]
        used += pages_per[b]
        table[b, :pages_per[b]] = pages.to(torch.int32)
        ks.append(k_cache[pages].flatten(0, 1)[:lk[b]])
        vs.append(v_cache[pages].flatten(0, 1)[:lk[b]])
    q = torch.randn(sum(lq), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, table, torch.cat(ks), torch.cat(vs)


@pytest.mark.parametrize("page_size", [1, 5, 16, 48])
@pytest.mark.parametrize("causal", [False, True])
def test_block_table_matches_plain_varlen(kernels, page_size, causal):
    lq, lk = [3, 1, 6], [7, 0, 20]
    q, kc, vc, table, k, v = _paged_case(lq, lk, page_size)
    cu_q, cu_k = _cu(lq), _cu(lk)
    mk = max(lk) + 2  # larger than needed: padding slots are never attended
    out, lse, _ = flash_ext.flash_attn_varlen_func(
        q, kc, vc, cu_q, cu_k, max(lq), mk, causal=causal, block_table=table,
        return_attn_probs=True)
    ro, rl = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=causal)
    torch.testing.assert_close(out.float(), ro, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, rl)
    call = kernels.calls[-1]
    assert call["seqused_k"].tolist() == lk
    assert call["cu_seqlens_k"].tolist() == [0, mk, 2 * mk, 3 * mk]
    assert call["k"].shape == (3 * mk, 2, 16)


def test_block_table_chunked_prefill_with_seqused_k(kernels):
    """New queries attend to the cached tokens plus themselves (already in the cache): causal
    aligns bottom-right to each sequence's count, which seqused_k sets (cu_seqlens_k ignored)."""
    cached, new = [10, 0, 33], [4, 5, 1]
    total = [c + n for c, n in zip(cached, new)]
    q, kc, vc, table, k, v = _paged_case(new, total, 16, seed=4)
    cu_k_ignored = _cu([1, 1, 1])
    su = torch.tensor(total, dtype=torch.int32)
    out = flash_ext.flash_attn_varlen_func(q, kc, vc, _cu(new), cu_k_ignored, max(new),
                                           max(total), causal=True, block_table=table,
                                           seqused_k=su)
    ro, _ = attention_ref_varlen(q, k, v, _cu(new), _cu(total), causal=True)
    torch.testing.assert_close(out.float(), ro, atol=2e-3, rtol=2e-3)


def test_block_table_head_dim_padding_and_gqa(kernels):
    lq, lk = [2, 3], [9, 4]
    q, kc, vc, table, k, v = _paged_case(lq, lk, 4, hq=6, hkv=3, d=12)
    out = flash_ext.flash_attn_varlen_func(q, kc, vc, _cu(lq), _cu(lk), 3, 9, block_table=table,
                                           softmax_scale=0.3, window_size=(3, 1))
    ro, _ = attention_ref_varlen(q, k, v, _cu(lq), _cu(lk), softmax_scale=0.3,
                                 window_size=(3, 1))
    assert out.shape == q.shape
    torch.testing.assert_close(out.float(), ro, atol=2e-3, rtol=2e-3)
    assert kernels.calls[-1]["k"].shape[-1] == 16  # padded to a multiple of 8 for the op


def test_block_table_max_seqlen_k_zero(kernels):
    lq = [2, 1]
    q, kc, vc, table, _, _ = _paged_case(lq, [0, 0], 16)
    out, lse, _ = flash_ext.flash_attn_varlen_func(q, kc, vc, _cu(lq), _cu([0, 0]), 2, 0,
                                                   block_table=table, return_attn_probs=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse)) and kernels.calls == []


def _paged_call(**over):
    lq, lk = [2, 3], [5, 7]
    q, kc, vc, table, _, _ = _paged_case(lq, lk, 4)
    args = dict(q=q, k=kc, v=vc, cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), max_seqlen_q=3,
                max_seqlen_k=7, block_table=table)
    args.update(over)
    return flash_ext.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("over, cls, msg", [
    (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), FlashExtTypeError,
     "block_table must be int32"),
    (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), FlashExtValueError,
     "block_table must have shape (batch, max_pages_per_seq) with batch = 2"),
    (dict(block_table=torch.zeros(2, dtype=torch.int32)), FlashExtValueError,
     "block_table must have shape (batch, max_pages_per_seq)"),
    (dict(k=_rand(20, 2, 16), v=_rand(20, 2, 16)), FlashExtValueError,
     "with block_table, k must be a paged cache, 4-D"),
    (dict(k=_rand(8, 4, 2, 16), v=_rand(8, 4, 1, 16)), FlashExtValueError,
     "k and v must have the same shape"),
    (dict(k=_rand(8, 0, 2, 16), v=_rand(8, 0, 2, 16)), FlashExtValueError,
     "page size must be >= 1, got 0"),
    (dict(k=_rand(8, 4, 2, 8), v=_rand(8, 4, 2, 8)), FlashExtValueError,
     "same head dim"),
    (dict(k=_rand(8, 4, 3, 16), v=_rand(8, 4, 3, 16)), FlashExtValueError,
     "must be a multiple of the number of key/value heads"),
    (dict(k=_rand(8, 4, 2, 16, dtype=torch.bfloat16), v=_rand(8, 4, 2, 16, dtype=torch.bfloat16)),
     FlashExtTypeError, "must have the same dtype"),
    (dict(max_seqlen_k=100), FlashExtValueError,
     "max_seqlen_k (100) must be at most what block_table can address"),
    (dict(max_seqlen_k=6), FlashExtValueError,
     "max_seqlen_k (6) is smaller than the key count of a sequence (7)"),
    (dict(seqused_k=torch.tensor([5, 8], dtype=torch.int32)), FlashExtValueError,
     "max_seqlen_k (7) is smaller than seqused_k (8)"),
    (dict(seqused_k=torch.tensor([5, -1], dtype=torch.int32)), FlashExtValueError,
     "seqused_k must be >= 0"),
    (dict(seqused_k=torch.tensor([5], dtype=torch.int32)), FlashExtValueError,
     "seqused_k must have shape (batch,) = (2,)"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 4], dtype=torch.int32)), FlashExtValueError,
     "cu_seqlens_k must be non-decreasing"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32)), FlashExtValueError,
     "cu_seqlens_q[-1] must equal the number of tokens (5)"),
    (dict(block_table=torch.tensor([[0, 1, -1], [2, 9, 0]], dtype=torch.int32)),
     FlashExtValueError, "block_table[1, 1] = 9"),
    (dict(block_table=torch.tensor([[0, 1, 0], [2, 3, 0]], dtype=torch.int32, device="meta")),
     DeviceError, "block_table on meta"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), FlashExtTypeError, "alibi_slopes must be float32"),
    (dict(softcap="x"), FlashExtTypeError, "softcap must be a float"),
])
def test_block_table_validation(kernels, over, cls, msg):
    with pytest.raises(cls) as e:
        _paged_call(**over)
    assert msg in str(e.value)
    assert kernels.calls == []


def test_block_table_garbage_past_the_end_is_fine(kernels):
    """Entries of pages a sequence does not use are never checked nor read out of bounds."""
    table = torch.tensor([[0, 1, -5], [2, 3, 10 ** 6]], dtype=torch.int32)
    _paged_call(block_table=table)
    assert len(kernels.calls) == 1


@pytest.mark.parametrize("grad_args", [("q",), ("k",), ("q", "k", "v")])
def test_block_table_with_grad_runs_the_forward_only(kernels, grad_args):
    """FlashAttention-2's test_flash_attn_varlen_causal: the paged forward with q requiring
    grad (only its backward is skipped). The forward gives the result of the call without
    grad; the output's backward raises."""
    lq, lk = [2, 3], [5, 7]
    q, kc, vc, table, k, v = _paged_case(lq, lk, 4)
    want = flash_ext.flash_attn_varlen_func(q, kc, vc, _cu(lq), _cu(lk), 3, 7, causal=True,
                                            block_table=table)
    args = dict(q=q.clone(), k=kc.clone(), v=vc.clone())
    for n in grad_args:
        args[n].requires_grad_(True)
    out, lse, _ = flash_ext.flash_attn_varlen_func(args["q"], args["k"], args["v"], _cu(lq),
                                                   _cu(lk), 3, 7, causal=True,
                                                   block_table=table, return_attn_probs=True)
    assert len(kernels.calls) == 2
    assert torch.equal(out, want) and not lse.requires_grad
    ro, _ = attention_ref_varlen(q, k, v, _cu(lq), _cu(lk), causal=True)
    torch.testing.assert_close(out.float(), ro, atol=2e-3, rtol=2e-3)
    _check_backward_raises(out, [args[n] for n in grad_args])


def test_block_table_with_grad_under_no_grad(kernels):
    lq, lk = [2, 3], [5, 7]
    q, kc, vc, table, _, _ = _paged_case(lq, lk, 4)
    q.requires_grad_(True)
    with torch.no_grad():
        out = flash_ext.flash_attn_varlen_func(q, kc, vc, _cu(lq), _cu(lk), 3, 7,
                                               block_table=table)
    assert not out.requires_grad and out.grad_fn is None and len(kernels.calls) == 1


def _paged_causal_call(cu_q, cu_k):
    """The paged causal varlen call the compile tests trace (max_seqlen_q 3, max_seqlen_k 7)."""
    def f(q, kc, vc, table):
        return flash_ext.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 3, 7, causal=True,
                                                block_table=table)
    return f


def test_block_table_with_grad_compiles_fullgraph(kernels):
    """torch.compile traces the forward-only call (and its backward) into one graph; the
    compiled output's backward raises the same error at run time."""
    lq, lk = [2, 3], [5, 7]
    q, kc, vc, table, _, _ = _paged_case(lq, lk, 4)
    f = _paged_causal_call(_cu(lq), _cu(lk))

    want = f(q, kc, vc, table)
    qg = q.clone().requires_grad_(True)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(qg, kc, vc, table)
    assert torch.equal(out, want)
    _check_backward_raises(out, [qg])


def test_block_table_compiles_fullgraph(kernels):
    lq, lk = [2, 3], [5, 7]
    q, kc, vc, table, k, v = _paged_case(lq, lk, 4)
    f = _paged_causal_call(_cu(lq), _cu(lk))

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, kc, vc, table)
    torch.testing.assert_close(out, f(q, kc, vc, table))


def test_fake_tensors_give_shapes(fake_mode):
    """Traced with fake CUDA tensors (no GPU, no values): the gather and the op's fake kernel
    give out and lse of the right shapes."""
    with fake_mode:
        q = torch.empty(5, 4, 64, dtype=torch.bfloat16, device="cuda")
        kc = torch.empty(10, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
        table = torch.zeros(2, 3, dtype=torch.int32, device="cuda")
        cu_q = torch.zeros(3, dtype=torch.int32, device="cuda")
        su = torch.zeros(2, dtype=torch.int32, device="cuda")
        out, lse, _ = flash_ext.flash_attn_varlen_func(q, kc, kc, cu_q, cu_q, 3, 40,
                                                       block_table=table, seqused_k=su,
                                                       return_attn_probs=True)
        assert out.shape == q.shape and lse.shape == (4, 5) and lse.dtype == torch.float32


def test_fast_path_is_not_taken_with_seqused_k(kernels, monkeypatch):
    """attn_fwd's fast path serves no call with seqused_k: it raises the full path's error."""
    calls = []
    monkeypatch.setattr(flash_ext, "_fast_args", lambda *a: calls.append(a))
    q = _rand(1, 4, 2, 16)
    with pytest.raises(FlashExtValueError, match="seqused_k needs varlen"):
        flash_ext.attn_fwd(q, q, q, seqused_k=torch.tensor([1], dtype=torch.int32))
    assert calls == []
