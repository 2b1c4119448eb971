"""seqused_k and block_table on flash_attn_varlen_func against the reference, on the GPU
(skipped without a CUDA GPU and the compiled extension).

seqused_k: the result must equal flash_ext.reference.attention_ref_varlen on the sequences cut
to their used keys (the keys past them are poisoned with NaN: they must never reach the
result). block_table: the result must equal the reference on the same keys laid out plainly,
for page sizes 16, 48, 64, 256 (pages in random order, garbage table entries past each
sequence's pages), and for chunked prefill (new queries against cached tokens plus themselves,
causal bottom-right). With inputs that require grad, both give the same result and the output's
backward raises. Pass criterion and lse tolerance: tests/test_fwd_gpu.py's. Each case runs
under FLASH_EXT_FWD_PATH=sm80 and auto (seqused_k calls route to the sm80 kernel on every GPU:
csrc/dispatch/paths.cpp, tma_compatible).
"""

import pytest
import torch

import flash_ext
from flash_ext.reference import attention_ref_varlen

from conftest import requires_cuda
from test_fwd_gpu import assert_close_to_ref

pytestmark = requires_cuda

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True, params=["sm80", "auto"])
def fwd_path(request, tuning):
    tuning.set("FLASH_EXT_FWD_PATH", request.param)
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def dname(dtype):
    return str(dtype).replace("torch.", "")


def cu_of(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(
        device="cuda", dtype=torch.int32)


def _trim(t, lens_k, used):
    starts = [sum(lens_k[:b]) for b in range(len(lens_k))]
    return torch.cat([t[s:s + u] for s, u in zip(starts, used)])


def _check(out, lse, q, k, v, cu_q, cu_k, label, **kw):
    ref, ref_lse = attention_ref_varlen(q, k, v, cu_q, cu_k, **kw)
    pt, _ = attention_ref_varlen(q, k, v, cu_q, cu_k, upcast=False, **kw)
    assert_close_to_ref(out, lse, ref, ref_lse, pt, None, label)


# ---------------------------------------------------------------------------------------------
# seqused_k
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens_q,lens_k,used", [
    ([17, 300, 1, 64], [40, 300, 9, 200], [40, 129, 0, 77]),  # one sequence uses no key
    ([128, 3], [64, 1000], [1, 999]),                          # sq > used, sq < used
])
def test_seqused_k(dtype, causal, lens_q, lens_k, used):
    hq, hkv, d = 8, 2, 128
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype)
    # Poison every unused key: NaN there must not reach the result.
    k_used, v_used = _trim(k, lens_k, used).clone(), _trim(v, lens_k, used).clone()
    keep = torch.zeros(sum(lens_k), dtype=torch.bool, device="cuda")
    for s, u in zip([sum(lens_k[:b]) for b in range(len(lens_k))], used):
        keep[s:s + u] = True
    k[~keep] = float("nan")
    v[~keep] = float("nan")
    su = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse, _ = flash_ext.flash_attn_varlen_func(
        q, k, v, cu_of(lens_q), cu_of(lens_k), max(lens_q), max(lens_k), causal=causal,
        seqused_k=su, return_attn_probs=True)
    _check(out, lse, q, k_used, v_used, cu_of(lens_q), cu_of(used), f"seqused_k {used}",
           causal=causal)
    if 0 in used:
        b = used.index(0)
        rows = slice(sum(lens_q[:b]), sum(lens_q[:b + 1]))
        assert torch.all(out[rows] == 0) and torch.all(torch.isneginf(lse[:, rows]))


def test_seqused_k_forced_sm90_is_refused(fwd_path, tuning):
    if not (torch.cuda.get_device_capability()[0] == 9 and "90a" in flash_ext.build_info()):
        pytest.skip("needs an sm90 GPU and a build with 90a")
    tuning.set("FLASH_EXT_FWD_PATH", "sm90")
    q = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = cu_of([4, 6])
    su = torch.tensor([2, 6], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="FLASH_EXT_FWD_PATH=sm90 cannot run seqused_k"):
        flash_ext.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, seqused_k=su)


# ---------------------------------------------------------------------------------------------
# block_table
# ---------------------------------------------------------------------------------------------


def paged_case(lens_k, page_size, hkv, d, dtype, extra_pages=5):
    """Sequences of lens_k keys in a paged cache (pages in random order, NaN in every slot no
    sequence uses, garbage table entries past each sequence's pages); also the same keys laid
    out as plain varlen k, v."""
    pages_per = [max(1, -(-n // page_size)) for n in lens_k]
    num_pages = sum(pages_per) + extra_pages
    k_cache = torch.full((num_pages, page_size, hkv, d), float("nan"), device="cuda", dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_pages, device="cuda")
    table = torch.full((len(lens_k), max(pages_per) + 1), -3, dtype=torch.int32, device="cuda")
    table[:, -1] = 1 << 30
    ks, vs, at = [], [], 0
    for b, n in enumerate(lens_k):
        pages = perm[at:at + pages_per[b]]
        at += pages_per[b]
        table[b, :pages_per[b]] = pages.to(torch.int32)
        kb = torch.randn(n, hkv, d, device="cuda", dtype=dtype)
        vb = torch.randn(n, hkv, d, device="cuda", dtype=dtype)
        slots_k = k_cache[pages].flatten(0, 1)
        slots_v = v_cache[pages].flatten(0, 1)
        slots_k[:n], slots_v[:n] = kb, vb
        k_cache[pages] = slots_k.unflatten(0, (len(pages), page_size))
        v_cache[pages] = slots_v.unflatten(0, (len(pages), page_size))
        ks.append(kb)
        vs.append(vb)
    return k_cache, v_cache, table, torch.cat(ks), torch.cat(vs)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_block_table(dtype, page_size, causal):
    lens_q, lens_k = [33, 1, 200], [300, 0, 517]
    hq, hkv, d = 8, 2, 128
    kc, vc, table, k, v = paged_case(lens_k, page_size, hkv, d, dtype)
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype)
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    out, lse, _ = flash_ext.flash_attn_varlen_func(
        q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, block_table=table,
        return_attn_probs=True)
    _check(out, lse, q, k, v, cu_q, cu_k, f"paged {page_size}", causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("page_size", [16, 256])
def test_chunked_prefill(dtype, page_size):
    """A chunk of new tokens per sequence, whose k and v are already in the cache after the
    previously cached ones; queries see the cache and themselves, causal bottom-right. The key
    counts come from seqused_k (cache + chunk); cu_seqlens_k is the plain layout's."""
    cached, new = [500, 0, 64, 1000], [64, 37, 1, 128]
    total = [c + n for c, n in zip(cached, new)]
    hq, hkv, d = 16, 4, 64
    kc, vc, table, k, v = paged_case(total, page_size, hkv, d, dtype)
    q = torch.randn(sum(new), hq, d, device="cuda", dtype=dtype)
    su = torch.tensor(total, dtype=torch.int32, device="cuda")
    out, lse, _ = flash_ext.flash_attn_varlen_func(
        q, kc, vc, cu_of(new), cu_of(total), max(new), max(total), causal=True,
        block_table=table, seqused_k=su, return_attn_probs=True)
    _check(out, lse, q, k, v, cu_of(new), cu_of(total), "chunked prefill", causal=True)


def test_block_table_cuda_graph_capture():
    """No host sync on the paged path: it captures in a CUDA graph and replays with new values."""
    lens_q, lens_k = [16, 40], [100, 300]
    kc, vc, table, _, _ = paged_case(lens_k, 16, 2, 64, torch.bfloat16)
    q = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=torch.bfloat16)
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)

    def call():
        return flash_ext.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 40, 300, causal=True,
                                                block_table=table)

    call()  # value checks run (and are remembered) outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, call(), atol=0, rtol=0)


def _forward_only_case(paged, dtype, d=128):
    """(q, k or k_cache, v or v_cache, cu_q, cu_k, max_q, max_k, extra keywords) and the used
    keys as plain varlen k, v, for a call with seqused_k or block_table."""
    lens_q, lens_k, used = [17, 64, 5], [40, 300, 90], [40, 129, 0]
    hq, hkv = 6, 2
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=dtype)
    if paged:
        kc, vc, table, k, v = paged_case(used, 16, hkv, d, dtype)
        return ((q, kc, vc, cu_of(lens_q), cu_of(used), max(lens_q), max(used)),
                dict(block_table=table), k, v, used)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=dtype)
    su = torch.tensor(used, dtype=torch.int32, device="cuda")
    return ((q, k, v, cu_of(lens_q), cu_of(lens_k), max(lens_q), max(lens_k)),
            dict(seqused_k=su), _trim(k, lens_k, used), _trim(v, lens_k, used), used)


def _assert_backward_raises(out, inputs):
    with pytest.raises(flash_ext.FlashExtNotImplementedError,
                       match="seqused_k / block_table have no backward") as info:
        torch.autograd.grad(out, inputs, torch.randn_like(out))
    assert isinstance(info.value, RuntimeError)
    assert all(t.grad is None for t in inputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("paged", [False, True], ids=["seqused_k", "block_table"])
@pytest.mark.parametrize("grad_args", ["q", "qkv"])
@pytest.mark.parametrize("d", [128, 59])
def test_inputs_requiring_grad(dtype, paged, grad_args, d):
    """FlashAttention-2's test_flash_attn_varlen_causal runs the paged forward with q requiring
    grad and skips only the backward: the forward gives the reference's result (and bitwise the
    result without grad); the output's backward raises flash_ext's NotImplementedError."""
    args, extra, k_used, v_used, used = _forward_only_case(paged, dtype, d)
    want = flash_ext.flash_attn_varlen_func(*args, causal=True, **extra)
    args = list(args)
    grads = [0] if grad_args == "q" else [0, 1, 2]
    for i in grads:
        args[i] = args[i].clone().requires_grad_(True)
    out, lse, _ = flash_ext.flash_attn_varlen_func(*args, causal=True, return_attn_probs=True,
                                                   **extra)
    assert out.requires_grad and not lse.requires_grad
    assert torch.equal(out, want)
    q, cu_q = args[0].detach(), args[3]
    _check(out.detach(), lse, q, k_used, v_used, cu_q, cu_of(used),
           f"{'paged' if paged else 'seqused_k'} with grad", causal=True)
    _assert_backward_raises(out, [args[i] for i in grads])


@pytest.mark.parametrize("paged", [False, True], ids=["seqused_k", "block_table"])
def test_inputs_requiring_grad_compiled(paged):
    """torch.compile (inductor, fullgraph): eager's result; the backward raises at run time."""
    torch._dynamo.reset()
    args, extra, _, _, _ = _forward_only_case(paged, torch.bfloat16)

    def f(q, k, v):
        return flash_ext.flash_attn_varlen_func(q, k, v, *args[3:], causal=True, **extra)

    want = f(*args[:3])
    q = args[0].clone().requires_grad_(True)
    out = torch.compile(f, fullgraph=True)(q, args[1], args[2])
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    _assert_backward_raises(out, [q])


def test_op_refuses_seqused_k_when_recording():
    """The op itself (its C++ autograd kernel, below flash_ext's functions) still refuses
    seqused_k when autograd would record it: no backward reads it."""
    lens_q, lens_k = [8, 8], [20, 30]
    q = torch.randn(16, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    k = torch.randn(50, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="seqused_k / block_table: forward only"):
        torch.ops.flash_ext.fwd(q, k, k, cu_of(lens_q), cu_of(lens_k), 8, 30, 0.125, False, -1,
                                -1, 0.0, seqused_k=torch.tensor([5, 5], dtype=torch.int32,
                                                                device="cuda"))


@pytest.mark.parametrize("paged", [False, True], ids=["seqused_k", "block_table"])
def test_dropout_with_seqused_k(paged):
    """Dropout works with seqused_k (sm80 kernel): out = S_dmask @ v on each sequence's used keys,
    S_dmask (return_attn_probs) built from the kernel's own mask over the used keys only."""
    lens_q, lens_k, used = [20, 7], [50, 90], [33, 90]
    h, d, dtype = 2, 64, torch.float16
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype)
    if paged:
        kc, vc, table, k, v = paged_case(used, 16, h, d, dtype)
        args = (kc, vc, cu_of(lens_q), cu_of(used), max(lens_q), max(used))
        extra = dict(block_table=table)
    else:
        k = torch.randn(sum(lens_k), h, d, device="cuda", dtype=dtype)
        v = torch.randn(sum(lens_k), h, d, device="cuda", dtype=dtype)
        args = (k, v, cu_of(lens_q), cu_of(lens_k), max(lens_q), max(lens_k))
        extra = dict(seqused_k=torch.tensor(used, dtype=torch.int32, device="cuda"))
        v = _trim(v, lens_k, used)
    out, lse, s_dmask = flash_ext.flash_attn_varlen_func(q, *args, dropout_p=0.3,
                                                         return_attn_probs=True, **extra)
    starts_q = [0, lens_q[0]]
    starts_v = [0, used[0]]
    for b in range(2):
        p = s_dmask[b, :, :lens_q[b], :used[b]]
        assert torch.all(s_dmask[b, :, :, used[b]:] == 0)
        vb = v[starts_v[b]:starts_v[b] + used[b]].float()
        want = torch.einsum("hqk,khd->qhd", p, vb)
        got = out[starts_q[b]:starts_q[b] + lens_q[b]].float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
