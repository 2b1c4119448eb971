"""The fast path of attn_fwd / attn_bwd / flash_attn_*func (flash_ext._fast_args,
flash_ext._attn_bwd_fast) against the full path, on the CPU.

Property: for every call, valid or not, the fast path and the full path make the identical op
calls (the same ops, with the same arguments: the same tensor objects or equal new ones, the
same Python scalars of the same types, -0.0 told from 0.0; in the same grad mode) and return
the same result, or raise the same exception type with the same message after the same op calls
(none, for bad input). Many random argument combinations are drawn (dtypes, shapes, strides and
offsets, head dims that need padding, GQA ratios, window forms, softcap signs and NaN, scales,
dropout, out=, dq/dk/dv, devices), each call is run twice, once with the fast path switched off
(``_fast_args`` returning None), and the two records are compared.

The ops are replaced by recorders (``ops._fwd`` etc.), and CPU tensors stand in for CUDA ones:
the full path's device check is relaxed as ``conftest.meta_ok`` does and the fast path's by its
private switch ``flash_ext._FAST_PATH_ON_CPU``; the unchanged device check is tested on its own.
(Tensors on two CUDA devices, which the fast path leaves to the full path by get_device(),
cannot be made here; CPU and meta tensors stand for a device mismatch.)
"""

import hashlib
import math
import random

import numpy as np
import pytest
import torch

import flash_ext
from flash_ext import _validation, interface, ops
from flash_ext.errors import DeviceError

DTYPES = [torch.bfloat16, torch.float16]
OTHER_DTYPES = [torch.float32, torch.int32, torch.float64]
HEAD_DIMS = [8, 16, 32, 64, 64, 128, 128, 256]
ODD_HEAD_DIMS = [1, 3, 12, 20, 100, 250]
BAD_HEAD_DIMS = [264, 512, 0]


# ---------------------------------------------------------------------------------------------
# Recording the op calls
# ---------------------------------------------------------------------------------------------


class Recorder:
    """Stands in for the ops; records each call as a comparable key (see :meth:`key`)."""

    def __init__(self, known):
        self.known = known  # id -> name of the caller's tensors (identity matters for them)
        self.calls = []
        self.n_outputs = 0

    def _output(self, t):
        self.known[id(t)] = f"op-output-{self.n_outputs}"
        self.n_outputs += 1
        return t

    def key(self, x):
        """Python scalars by type and repr (0.0 and -0.0 differ, NaN equals NaN), tensors by
        identity when they are the caller's or an op's output, else by metadata and bytes."""
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, (int, float)):
            return (type(x).__name__, repr(x))
        if isinstance(x, torch.Tensor):
            name = self.known.get(id(x))
            if name is not None:
                return ("tensor", name)
            meta = (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, str(x.device),
                    x.requires_grad)
            if x.device.type == "meta":
                return ("new tensor",) + meta
            data = x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return ("new tensor",) + meta + (hashlib.sha1(data).hexdigest(),)
        if isinstance(x, (tuple, list)):
            return (type(x).__name__,) + tuple(self.key(y) for y in x)
        return ("other", type(x).__name__, repr(x))

    def _record(self, name, args):
        self.calls.append((name, torch.is_grad_enabled(), self.key(args)))

    def fwd(self, *args):
        self._record("fwd", args)
        q, cu_seqlens_q = args[0], args[3]
        lse_shape = ops._lse_shape(q, cu_seqlens_q)
        return (self._output(torch.zeros(q.shape, dtype=q.dtype, device=q.device)),
                self._output(torch.zeros(lse_shape, dtype=torch.float32, device=q.device)))

    def fwd_out(self, *args):
        self._record("fwd_out", args)
        q, cu_seqlens_q = args[0], args[4]
        args[3].zero_()
        lse_shape = ops._lse_shape(q, cu_seqlens_q)
        return self._output(torch.zeros(lse_shape, dtype=torch.float32, device=q.device))

    def bwd(self, *args):
        self._record("bwd", args)
        q, k, v = args[1:4]
        return tuple(self._output(torch.zeros(t.shape, dtype=q.dtype, device=q.device))
                     for t in (q, k, v))

    def dropout_rng_state(self, q):
        self._record("dropout_rng_state", (q,))
        return self._output(torch.tensor([123, 456], dtype=torch.int64))

    def dropout_mask(self, q, rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p):
        self._record("dropout_mask", (q, rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p))
        return torch.ones(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)


@pytest.fixture
def cpu_stand_in(monkeypatch):
    """CPU tensors accepted by both paths' device checks."""
    check_devices = _validation.check_devices
    monkeypatch.setattr(_validation, "check_devices",
                        lambda tensors, require_cuda=True, **kw: check_devices(
                            tensors, require_cuda=False, **kw))
    monkeypatch.setattr(flash_ext, "_FAST_PATH_ON_CPU", True)


class Paths:
    """Runs one call with the fast path on or off, with recorders in place of the ops."""

    def __init__(self, monkeypatch):
        self.mp = monkeypatch
        self.fast_args = flash_ext._fast_args
        self.bwd_fast = flash_ext._attn_bwd_fast
        self.hits = 0

    def _count(self, fn):
        def counted(*args):
            result = fn(*args)
            self.hits += result is not None
            return result
        return counted

    def run(self, fn, args, kwargs, known_tensors, fast: bool, grad: bool):
        known = {id(t): name for name, t in known_tensors.items()
                 if isinstance(t, torch.Tensor)}
        rec = Recorder(known)
        with self.mp.context() as m:
            for name in ("fwd", "fwd_out", "bwd"):
                m.setattr(ops, "_" + name, getattr(rec, name))
            m.setattr(ops, "_dropout_rng_state", rec.dropout_rng_state)
            m.setattr(ops, "_dropout_mask", rec.dropout_mask)
            if fast:
                # _fast_args counts for attn_fwd and flash_attn_*func; _attn_bwd_fast for attn_bwd.
                counted = self._count(self.fast_args)
                inner = self.fast_args if fn is flash_ext.attn_bwd else counted
                m.setattr(flash_ext, "_fast_args", inner)
                m.setattr(interface, "_fast_args", inner)
                if fn is flash_ext.attn_bwd:
                    m.setattr(flash_ext, "_attn_bwd_fast", self._count(self.bwd_fast))
            else:
                m.setattr(flash_ext, "_fast_args", lambda *args: None)
                m.setattr(interface, "_fast_args", lambda *args: None)
            try:
                with torch.set_grad_enabled(grad):
                    result = ("returned", rec.key(fn(*args, **kwargs)))
            except Exception as e:  # noqa: BLE001 - the point is to compare any exception
                result = ("raised", type(e), str(e))
        return rec.calls, result

    def check(self, fn, args, kwargs, known_tensors, grad):
        full = self.run(fn, args, kwargs, known_tensors, fast=False, grad=grad)
        fast = self.run(fn, args, kwargs, known_tensors, fast=True, grad=grad)
        assert fast == full, (fn.__name__, args, kwargs)
        return full


# ---------------------------------------------------------------------------------------------
# Random arguments
# ---------------------------------------------------------------------------------------------


LAYOUTS = ["wide", "offset", "strided_last", "expanded", "size1_strides"]
ASPECTS = ("scale", "causal", "window", "softcap", "deterministic", "dropout", "batch",
           "seqlen", "heads", "headdim", "shape", "dtype", "layout", "device", "not_tensor",
           "varlen", "rng_state", "out", "like", "lse", "grads", "alibi", "probs")


class Draw(random.Random):
    """random.Random that focuses each case on one or two aspects of the call (ASPECTS), or
    none: rare (mostly invalid) values of a focused aspect are drawn often, the others' seldom,
    so that most cases are valid but for the focus (a check of the fast path is tested against
    the full path's for each value), and many are valid altogether (the fast path serves them)."""

    def __init__(self, seed):
        super().__init__(seed)
        self.focus = set()
        if self.random() < 0.6:
            self.focus.add(self.choice(ASPECTS))
            if self.random() < 0.2:
                self.focus.add(self.choice(ASPECTS))
        # One layout for the case's tensors (mostly: see _tensor).
        self.layout = self.choice(["contiguous", "bhsd"])
        if self.rare(0.3, "layout"):
            self.layout = self.choice(LAYOUTS)

    def rare(self, p, aspect):
        return self.random() < (0.6 if aspect in self.focus else p * 0.2)

    def roll(self, aspect):
        """A uniform number for a choice among rare branches (r < 0.03: the first one, ...),
        below 0.15 when the case focuses on `aspect`."""
        return self.random() * (0.15 if aspect in self.focus else 3.0)


def _pick(rng, aspect, common, rare, p_rare=0.15):
    """A value of `common` mostly, of `rare` (callables are called) with probability p_rare,
    or often if the case focuses on `aspect`."""
    v = rng.choice(rare if rng.rare(p_rare, aspect) else common)
    return v() if callable(v) else v


def _tensor(rng, shape, dtype, requires_grad=False):
    """A tensor of the given shape in one of the layouts a caller may pass: contiguous, a
    transposed (b, h, s, d) view, a slice of wider rows, at an odd storage offset, with a
    strided last dim, expanded over the batch, odd strides of size-1 dims; now and then on
    the meta device."""
    layout = rng.layout if rng.random() < 0.8 else rng.choice(["contiguous", "bhsd"] + LAYOUTS)
    if len(shape) != 4:
        layout = rng.choice(["contiguous", "offset"])
    make = (lambda *s: torch.randn(*s).to(dtype)) if dtype.is_floating_point else \
        (lambda *s: torch.randint(-3, 3, s, dtype=dtype))
    if layout == "bhsd":
        b, s, h, d = shape
        t = make(b, h, s, d).transpose(1, 2)
    elif layout == "wide":
        pad = rng.choice([1, 3, 8, 16, -shape[-1] % 8 or 8])  # the last: rows of 8k elements
        t = make(*shape[:-1], shape[-1] + pad)[..., :shape[-1]]
    elif layout == "offset":
        n = math.prod(shape)
        off = rng.choice([1, 2, 4, 8, 16])
        t = make(n + off)[off:].view(shape)
    elif layout == "strided_last":
        t = make(*shape[:-1], 2 * shape[-1])[..., ::2]
    elif layout == "expanded":
        t = make(1, *shape[1:]).expand(shape)
    elif layout == "size1_strides":
        strides = list(torch.empty(shape).stride())
        for i in range(3):
            if shape[i] == 1:
                strides[i] = rng.choice([1, 3, 7, 8, 12])
        t = make(math.prod(shape) + 64).as_strided(shape, strides)
    else:
        t = make(*shape)
    if rng.rare(0.03, "device"):
        t = t.to("meta")
    if requires_grad and dtype.is_floating_point:
        t = t.detach().requires_grad_(True)
    return t


def _scalars(rng):
    return dict(
        softmax_scale=_pick(rng, "scale", [None, None, 0.125, 0.5, 1.0, 2.0], [
            0, 1, -1.0, 0.0, -0.0, float("nan"), float("inf"), 1e-30, 2 ** 1100, True,
            np.float64(0.5), np.float32(0.25), lambda: torch.tensor(0.5), "0.5"]),
        causal=_pick(rng, "causal", [False, True], [0, 1, None, np.bool_(True), "yes"], 0.1),
        window_size=_pick(rng, "window", [(-1, -1), (-1, -1), (3, 0), (2, 2), (0, -1), [-1, 4],
                                          [1, 1]], [
            (-2, 0), (0, -5), (-1, -2), (-3, -1), (1,), (1, 2, 3), (), (True, 0), (1.0, 2),
            (np.int64(2), 0),
            lambda: np.array([3, 1]), lambda: torch.tensor([2, 1]),
            lambda: torch.tensor([2.0, 1.0]), lambda: torch.tensor([1, 2, 3]),
            lambda: torch.tensor(2), "ab", None, range(2), 5, (2 ** 40, -1),
            lambda: (torch.tensor(2), 0)]),
        softcap=_pick(rng, "softcap", [0.0, 0.0, 30.0, 5.5, -1.0, -0.0], [
            0, 5, -3, float("nan"), float("inf"), float("-inf"), None, 10 ** 400, True,
            np.float64(2.0), lambda: torch.tensor(1.0), "1"]),
        deterministic=_pick(rng, "deterministic", [False, True], [0, 1, None, "no"], 0.1),
        dropout_p=_pick(rng, "dropout", [0.0, 0.0, 0.0, -0.0, 0], [
            0.1, 1.0, 0.5, -0.1, 1.5, float("nan"), None, True, False, np.float64(0.0),
            lambda: torch.tensor(0.0), "0"], 0.2),
    )


def _shapes(rng):
    """(q shape, k shape, v shape): mostly consistent 4-D shapes (GQA ratios, head dims that
    need padding, empty dims), now and then inconsistent ones."""
    b = _pick(rng, "batch", [1, 1, 2], [0, 3])
    sq, sk = _pick(rng, "seqlen", [1, 3, 5], [0], 0.1), _pick(rng, "seqlen", [1, 4, 5], [0], 0.1)
    hkv = _pick(rng, "heads", [1, 2, 1], [3, 0], 0.1)
    hq = hkv * _pick(rng, "heads", [1, 1, 2, 4], [3, 0], 0.1)
    if rng.rare(0.05, "heads"):
        hq += 1
    d = _pick(rng, "headdim", HEAD_DIMS,
              ODD_HEAD_DIMS if rng.random() < 0.7 else BAD_HEAD_DIMS, 0.3)
    qs, ks, vs = [b, sq, hq, d], [b, sk, hkv, d], [b, sk, hkv, d]
    r = rng.roll("shape")
    if r < 0.03:
        ks[0] += 1
        vs[0] += 1
    elif r < 0.06:
        vs[1] += 1
    elif r < 0.09:
        ks[3] += 8
        vs[3] += 8
    elif r < 0.11:
        qs = qs[1:]
    elif r < 0.13:
        ks = ks + [1]
    elif r < 0.15:
        vs = vs[1:]
    return qs, ks, vs


def _dtypes(rng):
    dtype = rng.choice(OTHER_DTYPES) if rng.rare(0.05, "dtype") else rng.choice(DTYPES)
    dts = [dtype] * 3
    if rng.rare(0.07, "dtype"):
        dts[rng.randrange(3)] = rng.choice(DTYPES + OTHER_DTYPES)
    return dts


def _qkv(rng, requires_grad):
    qs, ks, vs = _shapes(rng)
    dts = _dtypes(rng)
    return [_tensor(rng, s, dt, requires_grad) for s, dt in zip((qs, ks, vs), dts)]


def _not_a_tensor(rng):
    return rng.choice([None, [1.0, 2.0], 3.0, lambda: np.zeros((1, 2, 1, 8))])


def _maybe_not_tensor(rng, tensors, p=0.05):
    """tensors, one of them now and then replaced by something else."""
    tensors = list(tensors)
    if rng.rare(p, "not_tensor"):
        v = _not_a_tensor(rng)
        tensors[rng.randrange(len(tensors))] = v() if callable(v) else v
    return tensors


def _like(rng, ref, p_bad=0.05):
    """A tensor like ref (its shape and dtype, any layout), or now and then not quite."""
    if not isinstance(ref, torch.Tensor):
        return torch.randn(2, 3)
    shape, dtype = list(ref.shape), ref.dtype
    r = rng.roll("like")
    if r < p_bad and shape:
        shape[rng.randrange(len(shape))] += 1
    elif r < 2 * p_bad and dtype.is_floating_point:
        dtype = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    if not dtype.is_floating_point:
        dtype = torch.bfloat16
    t = _tensor(rng, shape, dtype)
    return t.to(ref.device) if ref.device.type == "meta" and t.device.type != "meta" else t


def _lse(rng, q):
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return torch.zeros(2, 3)
    shape = [q.shape[0], q.shape[2], q.shape[1]]
    dtype = torch.float32
    r = rng.roll("lse")
    if r < 0.04:
        shape = shape[::-1]
    elif r < 0.08:
        dtype = torch.bfloat16
    elif r < 0.1:
        return torch.zeros(shape, dtype=dtype).t() if len(shape) == 2 else \
            torch.zeros(shape + [2], dtype=dtype)[..., 0]
    lse = torch.zeros(shape, dtype=dtype)
    return lse.to("meta") if q.device.type == "meta" or rng.rare(0.03, "device") else lse


def _rare_kwargs(rng):
    """Arguments the fast path leaves to the full path: cu_seqlens and max_seqlen (whole or in
    part: always an error with 4-D inputs), rng_state."""
    kw = {}
    if rng.rare(0.05, "varlen"):
        cu = torch.tensor([0, 2], dtype=torch.int32)
        varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2, max_seqlen_k=2)
        names = list(varlen)
        kw = {n: varlen[n] for n in rng.sample(names, rng.randint(1, len(names)))}
    if rng.rare(0.05, "rng_state"):
        kw["rng_state"] = rng.choice([torch.tensor([1, 2], dtype=torch.int64),
                                      torch.tensor([1, 2], dtype=torch.int32), 7])
    return kw


# ---------------------------------------------------------------------------------------------
# The properties
# ---------------------------------------------------------------------------------------------

N_CHUNKS, PER_CHUNK = 8, 400


@pytest.mark.parametrize("chunk", range(N_CHUNKS))
def test_attn_fwd_fast_path_equals_full_path(cpu_stand_in, monkeypatch, chunk):
    paths = Paths(monkeypatch)
    returned = 0
    for i in range(PER_CHUNK):
        rng = Draw(f"fwd-{chunk}-{i}")
        grad = rng.random() < 0.5
        q, k, v = _qkv(rng, requires_grad=grad and rng.random() < 0.5)
        q, k, v = _maybe_not_tensor(rng, (q, k, v))
        kwargs = _scalars(rng)
        kwargs.update(_rare_kwargs(rng))
        if rng.rare(0.05, "out"):
            kwargs["out"] = _like(rng, q)
        known = dict(q=q, k=k, v=v, **{n: t for n, t in kwargs.items()
                                       if isinstance(t, torch.Tensor)})
        _, result = paths.check(flash_ext.attn_fwd, (q, k, v), kwargs, known, grad)
        returned += result[0] == "returned"
    # Not vacuous: a good share of the calls are valid, and most of those take the fast path.
    assert returned > PER_CHUNK * 0.25, returned
    assert paths.hits > returned * 0.4, (paths.hits, returned)


@pytest.mark.parametrize("chunk", range(N_CHUNKS))
def test_attn_bwd_fast_path_equals_full_path(cpu_stand_in, monkeypatch, chunk):
    paths = Paths(monkeypatch)
    returned = 0
    for i in range(PER_CHUNK):
        rng = Draw(f"bwd-{chunk}-{i}")
        grad = rng.random() < 0.5
        q, k, v = _qkv(rng, requires_grad=grad and rng.random() < 0.5)
        dout, out, lse = _like(rng, q), _like(rng, q), _lse(rng, q)
        q, k, v, dout, out, lse = _maybe_not_tensor(rng, (q, k, v, dout, out, lse))
        kwargs = _scalars(rng)
        kwargs.update(_rare_kwargs(rng))
        for name, ref in (("dq", q), ("dk", k), ("dv", v)):
            if rng.rare(0.04, "grads"):
                kwargs[name] = _like(rng, ref)
        if rng.rare(0.1, "rng_state") and "rng_state" not in kwargs:  # dropout's backward
            kwargs["rng_state"] = torch.tensor([1, 2], dtype=torch.int64)
        known = dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse,
                     **{n: t for n, t in kwargs.items() if isinstance(t, torch.Tensor)})
        _, result = paths.check(flash_ext.attn_bwd, (dout, q, k, v, out, lse), kwargs, known,
                                grad)
        returned += result[0] == "returned"
    assert returned > PER_CHUNK * 0.15, returned
    assert paths.hits > returned * 0.3, (paths.hits, returned)


@pytest.mark.parametrize("chunk", range(N_CHUNKS // 2))
def test_flash_attn_funcs_fast_path_equals_full_path(cpu_stand_in, monkeypatch, chunk):
    paths = Paths(monkeypatch)
    returned = 0
    for i in range(PER_CHUNK):
        rng = Draw(f"func-{chunk}-{i}")
        grad = rng.random() < 0.5
        q, k, v = _qkv(rng, requires_grad=grad and rng.random() < 0.5)
        s = _scalars(rng)
        kwargs = dict(dropout_p=s["dropout_p"], softmax_scale=s["softmax_scale"],
                      causal=s["causal"], window_size=s["window_size"], softcap=s["softcap"],
                      deterministic=s["deterministic"])
        if rng.rare(0.05, "alibi"):
            kwargs["alibi_slopes"] = torch.zeros(2)
        if rng.rare(0.15, "probs"):
            kwargs["return_attn_probs"] = rng.choice([True, 1, None, False])
        which = rng.choice(["func", "kvpacked", "qkvpacked"])
        if which == "func":
            fn, args = flash_ext.flash_attn_func, (q, k, v)
        elif which == "kvpacked":
            same = k.shape == v.shape and k.device == v.device and k.dtype == v.dtype
            kv = torch.stack([k, v], dim=2) if same and rng.random() < 0.9 else k
            fn, args = flash_ext.flash_attn_kvpacked_func, (q, kv)
        else:
            if q.dim() == 4 and rng.random() < 0.9:
                qkv = _tensor(rng, [q.shape[0], q.shape[1], 3, q.shape[2], q.shape[3]], q.dtype)
            else:
                qkv = q
            fn, args = flash_ext.flash_attn_qkvpacked_func, (qkv,)
        if rng.random() < 0.5:  # FlashAttention's positional order
            args = args + tuple(kwargs.pop(n) for n in ("dropout_p", "softmax_scale", "causal",
                                                        "window_size", "softcap"))
        known = {f"arg{j}": t for j, t in enumerate(args)}
        known.update((n, t) for n, t in kwargs.items() if isinstance(t, torch.Tensor))
        _, result = paths.check(fn, args, kwargs, known, grad)
        returned += result[0] == "returned"
    assert returned > PER_CHUNK * 0.25, returned
    assert paths.hits > returned * 0.3, (paths.hits, returned)


# ---------------------------------------------------------------------------------------------
# The parts the property tests relax or take for granted
# ---------------------------------------------------------------------------------------------


def test_common_call_takes_the_fast_path(cpu_stand_in, monkeypatch):
    """The calls of tools/host_overhead.py and of the transformers integration (transposed
    (b, h, s, d) views) are served by the fast path, with the arguments the full path
    passes."""
    paths = Paths(monkeypatch)
    q, k, v = (torch.randn(2, h, 5, 64).to(torch.bfloat16).transpose(1, 2) for h in (4, 2, 2))
    dout, out = torch.randn_like(q), torch.randn_like(q)
    lse = torch.zeros(2, 4, 5)
    known = dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse)
    for kwargs in ({}, {"causal": True}, {"softmax_scale": 0.3, "window_size": (2, 0),
                                          "softcap": 20.0, "deterministic": True}):
        calls, result = paths.check(flash_ext.attn_fwd, (q, k, v), kwargs, known, grad=True)
        assert result[0] == "returned" and [c[0] for c in calls] == ["fwd"]
        calls, result = paths.check(flash_ext.attn_bwd, (dout, q, k, v, out, lse), kwargs,
                                    known, grad=True)
        assert result[0] == "returned" and [c[0] for c in calls] == ["bwd"]
        assert calls[0][1] is False  # the backward op runs without grad mode, as before
        paths.check(flash_ext.flash_attn_func, (q, k, v), kwargs, known, grad=False)
    assert paths.hits == 9


@pytest.mark.parametrize("d", [1, 4, 12, 20, 100, 250])
def test_head_dim_to_pad_with_aligned_rows(cpu_stand_in, monkeypatch, d):
    """A head dim that is not a multiple of 8 in rows whose strides are multiples of 8 (a slice
    of wider rows): the full path pads it; the fast path must leave it to the full path."""
    paths = Paths(monkeypatch)
    wide = -d % 8 or 8
    q, k, v = (torch.randn(2, 3, h, d + wide).to(torch.float16)[..., :d] for h in (4, 2, 2))
    assert all(flash_ext._rows_aligned(t) for t in (q, k, v))
    known = dict(q=q, k=k, v=v)
    calls, result = paths.check(flash_ext.attn_fwd, (q, k, v), {"causal": True}, known, False)
    assert result[0] == "returned" and [c[0] for c in calls] == ["fwd"]
    q_passed = calls[0][2][1]  # calls: (op, grad mode, ("tuple", q, k, v, ...))
    assert q_passed[:2] == ("new tensor", (2, 3, 4, (d + 7) // 8 * 8))  # padded
    assert paths.hits == 0


def test_cuda_is_still_required(monkeypatch):
    """Without the CPU switch, CPU tensors fall to the full path and its device error, before
    any op call."""
    rec = Recorder({})
    monkeypatch.setattr(ops, "_fwd", rec.fwd)
    monkeypatch.setattr(ops, "_bwd", rec.bwd)
    assert flash_ext._FAST_PATH_ON_CPU is False
    q = torch.randn(1, 4, 2, 64).to(torch.bfloat16)
    assert flash_ext._fast_args(q, q, q, None, False, (-1, -1), 0.0, False, 0.0) is None
    with pytest.raises(DeviceError, match="flash_ext needs CUDA tensors; got q on cpu"):
        flash_ext.attn_fwd(q, q, q)
    with pytest.raises(DeviceError, match="flash_ext needs CUDA tensors; got q on cpu"):
        flash_ext.flash_attn_func(q, q, q)
    with pytest.raises(DeviceError, match="flash_ext needs CUDA tensors; got dout on cpu"):
        flash_ext.attn_bwd(q, q, q, q, q, torch.zeros(1, 2, 4))
    assert rec.calls == []


def test_fast_path_is_off_while_compiling(cpu_stand_in, monkeypatch):
    """torch.compile traces the full path (tests/test_op_wiring.py compiles attn_fwd)."""
    q = torch.randn(1, 4, 2, 64).to(torch.bfloat16)
    assert flash_ext._fast_args(q, q, q, None, False, (-1, -1), 0.0, False, 0.0) is not None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert flash_ext._fast_args(q, q, q, None, False, (-1, -1), 0.0, False, 0.0) is None


def test_rows_aligned_is_ops_is_aligned():
    rng = random.Random(0)
    for _ in range(2000):
        shape = [rng.choice([1, 2, 3]), rng.choice([1, 2, 5]), rng.choice([1, 2, 3]),
                 rng.choice([1, 8, 16, 24])]
        strides = [rng.choice([0, 1, 2, 7, 8, 16, 24, 40, 48]) for _ in range(3)] + \
            [rng.choice([1, 1, 1, 2])]
        t = torch.empty(4096, dtype=torch.bfloat16)[rng.choice([0, 1, 8, 9, 16]):].as_strided(
            shape, strides)
        assert flash_ext._rows_aligned(t) == ops._is_aligned(t), (shape, strides,
                                                                  t.storage_offset())
