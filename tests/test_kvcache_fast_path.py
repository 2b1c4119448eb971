"""The fast path of flash_attn_with_kvcache (flash_ext.kvcache._fast_call) against the full
path, on the CPU.

Property: for every call, valid or not, the fast path and the full path make the identical op
calls (ops._kvcache_append and ops._fwd_kvcache, with the same arguments: the caller's tensor
objects or equal new ones, the same Python scalars of the same types, -0.0 told from 0.0; in the
same grad mode) and return the same result, or raise the same exception type with the same
message before any op call. Many random calls are drawn (dtypes, shapes, strides and offsets,
devices, int or tensor cache_seqlens and their values, k/v present or not, window forms,
scales, softcap signs, num_splits, return_softmax_lse, paged caches and their block_table forms,
and the options that take the full path: rotary, ALiBi, cache_batch_idx, cache_leftpad, inputs
that require grad), each
call is run twice, once with the fast path switched off (``_fast_call`` returning None), and
the two records are compared. Each run starts with an empty value-check cache, so both paths
check the index values themselves; now and then the value-check policy says "skip" (as during
CUDA graph capture).

The ops are replaced by recorders and CPU tensors stand in for CUDA ones (the ``meta_ok``
fixture: the full path's device check relaxed, the fast path widened by
``flash_ext._FAST_PATH_ON_CPU``); the unchanged device check is tested on its own.
"""

import hashlib
import math
import random

import numpy as np
import pytest
import torch

import flash_ext
from flash_ext import _validation, kvcache, ops

DTYPES = [torch.float16, torch.bfloat16]
OTHER_DTYPES = [torch.float32, torch.int32]
HEAD_DIMS = [8, 16, 64, 64, 128, 256]
BAD_HEAD_DIMS = [4, 12, 59, 0, 264]  # rare: padded copies (not the fast path), or errors


# ---------------------------------------------------------------------------------------------
# Recording the op calls
# ---------------------------------------------------------------------------------------------


class Recorder:
    """Stands in for the two ops; records each call as a comparable key (see :meth:`key`)."""

    def __init__(self, known):
        self.known = known  # id -> name of the caller's tensors (identity matters for them)
        self.calls = []
        self.n_outputs = 0

    def _output(self, t):
        self.known[id(t)] = f"op-output-{self.n_outputs}"
        self.n_outputs += 1
        return t

    def key(self, x):
        """Python scalars by type and repr (0.0 and -0.0 differ), tensors by identity when they
        are the caller's or an op's output, else by metadata and bytes."""
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

    def append(self, *args):
        self._record("append", args)

    def fwd(self, *args):
        self._record("fwd", args)
        q = args[0]
        b, sq, hq, _ = q.shape
        return (self._output(torch.zeros(q.shape, dtype=q.dtype, device=q.device)),
                self._output(torch.zeros((b, hq, sq), dtype=torch.float32, device=q.device)))


class Paths:
    """Runs one call with the fast path on or off, with recorders in place of the ops and an
    empty value-check cache."""

    def __init__(self, monkeypatch):
        self.mp = monkeypatch
        self.fast_call = kvcache._fast_call
        self.hits = 0
        self.hit_kinds = set()

    def _counted(self, *args):
        result = self.fast_call(*args)
        if result is not None:
            self.hits += 1
            k, seqlens = args[3], args[5]
            paged = len(args) > 13 and args[13] is not None
            self.hit_kinds.add((k is not None, type(seqlens).__name__, paged))
        return result

    def run(self, kwargs, fast, grad, skip_values):
        known = {id(t): name for name, t in kwargs.items() if isinstance(t, torch.Tensor)}
        rec = Recorder(known)
        with self.mp.context() as m:
            m.setattr(ops, "_kvcache_append", rec.append)
            m.setattr(ops, "_fwd_kvcache", rec.fwd)
            m.setattr(_validation, "_CHECKED", {})
            if skip_values:  # the policy's "not now" (CUDA graph capture, the env switch)
                m.setattr(_validation, "should_check_values", lambda t, enabled=None: False)
            m.setattr(kvcache, "_fast_call", self._counted if fast else lambda *args: None)
            try:
                with torch.set_grad_enabled(grad):
                    result = ("returned", rec.key(flash_ext.flash_attn_with_kvcache(**kwargs)))
            except Exception as e:  # noqa: BLE001 - the point is to compare any exception
                result = ("raised", type(e), str(e))
        if result[0] == "raised":
            assert rec.calls == [], result  # bad input: nothing called, nothing written
        return rec.calls, result

    def check(self, kwargs, grad=False, skip_values=False):
        full = self.run(kwargs, fast=False, grad=grad, skip_values=skip_values)
        fast = self.run(kwargs, fast=True, grad=grad, skip_values=skip_values)
        assert fast == full, kwargs
        return full


# ---------------------------------------------------------------------------------------------
# Random arguments
# ---------------------------------------------------------------------------------------------


ASPECTS = ("scale", "causal", "window", "softcap", "splits", "interleaved", "lse", "shape",
           "headdim", "dtype", "layout", "device", "not_tensor", "seqlens", "values", "newkv",
           "options", "grad", "policy", "paged")
# block_table forms: the fast path's (a contiguous int32 (batch, max_pages) tensor), and the
# others, valid ones that take the full path (strided) or invalid ones.
TABLE_FORMS = ["int64", "strided", "transposed", "1d", "rows", "meta", "list", "bad_entry",
               "negative_entry", "float"]
LAYOUTS = ["wide", "wide_unaligned", "offset", "strided_last", "expanded"]


class Draw(random.Random):
    """random.Random that focuses each case on one or two aspects (ASPECTS), or none: rare
    (mostly invalid, or full-path) values of a focused aspect are drawn often, the others'
    seldom, so that most cases are valid but for the focus and many are valid altogether."""

    def __init__(self, seed):
        super().__init__(seed)
        self.focus = set()
        if self.random() < 0.6:
            self.focus.add(self.choice(ASPECTS))
            if self.random() < 0.2:
                self.focus.add(self.choice(ASPECTS))

    def rare(self, p, aspect):
        return self.random() < (0.6 if aspect in self.focus else p * 0.2)


def _pick(rng, aspect, common, rare, p_rare=0.15):
    v = rng.choice(rare if rng.rare(p_rare, aspect) else common)
    return v() if callable(v) else v


def _tensor(rng, shape, dtype, aspect="layout"):
    """A tensor of the given shape: contiguous, a transposed (b, h, s, d) view, or now and then
    a slice of wider rows (aligned or not), at an odd storage offset, with a strided last dim,
    expanded over the batch; now and then on the meta device."""
    layout = rng.choice(LAYOUTS) if rng.rare(0.1, aspect) else rng.choice(["contiguous", "bhsd"])
    make = (lambda *s: torch.randn(*s).to(dtype)) if dtype.is_floating_point else \
        (lambda *s: torch.randint(-3, 3, s, dtype=dtype))
    if len(shape) != 4 and layout != "contiguous":
        layout = "offset"
    if layout == "bhsd":
        b, s, h, d = shape
        t = make(b, h, s, d).transpose(1, 2)
    elif layout in ("wide", "wide_unaligned"):
        pad = 8 if layout == "wide" else rng.choice([1, 3])
        t = make(*shape[:-1], shape[-1] + pad)[..., :shape[-1]]
    elif layout == "offset":
        off = rng.choice([1, 8, 16])
        t = make(math.prod(shape) + off)[off:].view(shape)
    elif layout == "strided_last":
        t = make(*shape[:-1], 2 * shape[-1])[..., ::2]
    elif layout == "expanded":
        t = make(1, *shape[1:]).expand(shape)
    else:
        t = make(*shape)
    if rng.rare(0.02, "device"):
        t = t.to("meta")
    return t


def _not_a_tensor(rng):
    v = rng.choice([None, [1.0, 2.0], 3.0, lambda: np.zeros((1, 1, 2, 8))])
    return v() if callable(v) else v


def _scalars(rng):
    return dict(
        softmax_scale=_pick(rng, "scale", [None, None, 0.125, 0.5, 1.0], [
            0, 1, -1.0, 0.0, float("nan"), float("inf"), True, np.float64(0.5),
            lambda: torch.tensor(0.5), "0.5"]),
        causal=_pick(rng, "causal", [False, True], [0, 1, None, np.bool_(True), "yes"], 0.1),
        window_size=_pick(rng, "window", [(-1, -1), (-1, -1), (3, 0), (2, 2), (0, -1), [-1, 4],
                                          [1, 1]], [
            (-2, 0), (0, -5), (1,), (1, 2, 3), (True, 0), (1.0, 2), (np.int64(2), 0),
            lambda: np.array([3, 1]), lambda: torch.tensor([2, 1]), "ab", None, range(2)]),
        softcap=_pick(rng, "softcap", [0.0, 0.0, 30.0, 5.5, -1.0, -0.0], [
            0, 5, -3, float("nan"), float("inf"), None, True, np.float64(2.0),
            lambda: torch.tensor(1.0)]),
        num_splits=_pick(rng, "splits", [0, 0, 1, 4, 200], [
            -1, 1.0, True, None, np.int64(2), "2"]),
        rotary_interleaved=_pick(rng, "interleaved", [True, False], [0, 1, None, "no"], 0.1),
        return_softmax_lse=_pick(rng, "lse", [False, True], [0, 1, None, "yes"], 0.1),
    )


def _block_table(rng, b, max_pages, num_pages):
    """A block_table (b, max_pages) of distinct pages in [0, num_pages) where there are enough,
    or now and then another form (TABLE_FORMS)."""
    n = b * max_pages
    if num_pages >= n:
        entries = torch.randperm(num_pages)[:n].to(torch.int32)
    else:
        entries = torch.randint(0, max(num_pages, 1), (n,), dtype=torch.int32)
    table = entries.view(b, max_pages)
    form = rng.choice(TABLE_FORMS) if rng.rare(0.15, "paged") else "plain"
    if form == "int64":
        table = table.long()
    elif form == "float":
        table = table.float()
    elif form == "strided":  # valid, last dim strided: the full path copies it
        table = torch.stack([table, table], dim=-1).view(b, 2 * max_pages)[:, ::2]
    elif form == "transposed":  # valid, rows strided (contiguous when b or max_pages is 1)
        table = table.t().contiguous().t()
    elif form == "1d":
        table = table.reshape(-1)
    elif form == "rows":
        table = torch.cat([table, table[:1]])
    elif form == "meta":
        table = table.to("meta")
    elif form == "list":
        table = table.tolist()
    elif form in ("bad_entry", "negative_entry") and n:
        table = table.clone()
        table.view(-1)[rng.randrange(n)] = num_pages if form == "bad_entry" else -1
    return table


def _case(rng):
    """The keyword arguments of one call."""
    b = _pick(rng, "shape", [1, 1, 2, 3], [0])
    sq = _pick(rng, "shape", [1, 1, 2, 3], [0, 40])
    hkv = _pick(rng, "shape", [1, 2], [0, 3])
    hq = hkv * _pick(rng, "shape", [1, 2, 4], [0, 3]) + (1 if rng.rare(0.05, "shape") else 0)
    d = _pick(rng, "headdim", HEAD_DIMS, BAD_HEAD_DIMS, 0.1)
    capacity = _pick(rng, "shape", [16, 32, 40], [0, 1, 8])
    b_cache = max(b + _pick(rng, "shape", [0, 0, 1], [-1]), 0)
    paged = rng.random() < 0.25 or rng.rare(0.1, "paged")
    if paged:  # k_cache (num_pages, page_size, hkv, d); capacity max_pages * page_size
        page_size = _pick(rng, "paged", [16, 32, 16, 48], [8, 24, 40, 1, 0])
        max_pages = _pick(rng, "paged", [1, 2, 3], [0])
        b_cache = max(max(b, 0) * max_pages + _pick(rng, "paged", [0, 0, 2], [-1]), 0)
        capacity = page_size * max_pages
    s_new = _pick(rng, "newkv", [1, 1, 2, 0], [0, 3, 50])
    dtype = rng.choice(OTHER_DTYPES) if rng.rare(0.05, "dtype") else rng.choice(DTYPES)
    dts = [dtype] * 5  # q, k_cache, v_cache, k, v
    if rng.rare(0.05, "dtype"):
        dts[rng.randrange(5)] = rng.choice(DTYPES + OTHER_DTYPES)

    cache_shape = [b_cache, page_size if paged else capacity, hkv, d]
    v_cache_shape = list(cache_shape)
    if rng.rare(0.05, "shape"):
        v_cache_shape[rng.randrange(4)] += 1
    kw = dict(q=_tensor(rng, [b, sq, hq, d], dts[0]),
              k_cache=_tensor(rng, cache_shape, dts[1]),
              v_cache=_tensor(rng, v_cache_shape, dts[2]))
    if rng.rare(0.05, "shape"):
        kw[rng.choice(["q", "k_cache"])] = _tensor(rng, [b, sq, hq], dtype)
    new_shape = [b, s_new, hkv, d]
    if rng.rare(0.05, "newkv"):
        new_shape[rng.choice([0, 2, 3])] += 1
    with_new = s_new > 0 or rng.random() < 0.3  # s_new = 0: no k, v, or empty ones
    if with_new:
        kw["k"] = _tensor(rng, new_shape, dts[3])
        kw["v"] = _tensor(rng, new_shape if not rng.rare(0.05, "newkv") else
                          [b, s_new + 1, hkv, d], dts[4])
        if rng.rare(0.05, "newkv"):
            del kw[rng.choice(["k", "v"])]
    n_new = s_new if with_new else 0

    # cache_seqlens: mostly an int32 tensor (b,) or an int, with values that fit
    hi = max(capacity - n_new, 0)
    lens = [rng.randint(0, hi) for _ in range(max(b, 0))]
    if rng.rare(0.1, "values") and lens:
        lens[rng.randrange(len(lens))] = rng.choice([-1, hi + 1, capacity + 5])
    form = rng.choice(["tensor", "tensor", "int"])
    if rng.rare(0.1, "seqlens"):
        form = rng.choice(["none", "int64", "long", "strided", "2d", "float", "numpy", "bool",
                           "meta", "list"])
    if form == "tensor":
        seqlens = torch.tensor(lens, dtype=torch.int32)
    elif form == "int":
        seqlens = lens[0] if lens else 0
    elif form == "none":
        seqlens = None
    elif form == "int64":
        seqlens = torch.tensor(lens, dtype=torch.int64)
    elif form == "long":  # one entry too many
        seqlens = torch.tensor(lens + [0], dtype=torch.int32)
    elif form == "strided":
        seqlens = torch.tensor([x for x in lens for _ in (0, 1)], dtype=torch.int32)[::2]
    elif form == "2d":
        seqlens = torch.tensor(lens, dtype=torch.int32).view(-1, 1)
    elif form == "float":
        seqlens = float(lens[0]) if lens else 0.0
    elif form == "numpy":
        seqlens = np.int64(lens[0] if lens else 0)
    elif form == "bool":
        seqlens = True
    elif form == "meta":
        seqlens = torch.tensor(lens, dtype=torch.int32).to("meta")
    else:
        seqlens = lens
    kw["cache_seqlens"] = seqlens

    # The options that take the full path
    if rng.rare(0.1, "options"):
        option = rng.choice(["rotary", "alibi", "batch_idx", "leftpad", "block_table", "sin"])
        if option in ("rotary", "sin"):
            rd = max(16, d // 2 // 16 * 16)
            kw["rotary_cos"] = torch.randn(capacity + sq, rd // 2).to(dtype)
            kw["rotary_sin"] = torch.randn(capacity + sq, rd // 2).to(dtype)
            if option == "sin":
                del kw["rotary_cos"]
        elif option == "alibi":
            kw["alibi_slopes"] = torch.rand(max(hq, 0))
        elif option == "batch_idx":
            kw["cache_batch_idx"] = torch.randperm(max(b_cache, 0))[:max(b, 0)].to(torch.int32)
        elif option == "leftpad":
            kw["cache_leftpad"] = torch.zeros(max(b, 0), dtype=torch.int32)
        else:
            kw["block_table"] = torch.arange(max(b, 0), dtype=torch.int32).view(-1, 1)

    if paged:
        kw["block_table"] = _block_table(rng, max(b, 0), max_pages, b_cache)
        if rng.rare(0.03, "paged"):  # not allowed with block_table
            kw["cache_batch_idx"] = torch.zeros(max(b, 0), dtype=torch.int32)

    # Inputs that require grad (the full path runs the ops without grad mode then)
    if rng.rare(0.05, "grad"):
        name = rng.choice(["q", "k", "v", "k_cache", "v_cache"])
        t = kw.get(name)
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
            kw[name] = t.detach().requires_grad_(True)

    if rng.rare(0.03, "not_tensor"):
        kw[rng.choice(["q", "k_cache", "v_cache", "k", "v"])] = _not_a_tensor(rng)
    kw.update(_scalars(rng))
    return kw


# ---------------------------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------------------------

N_CHUNKS, PER_CHUNK = 8, 500


@pytest.mark.parametrize("chunk", range(N_CHUNKS))
def test_fast_path_equals_full_path(meta_ok, monkeypatch, chunk):
    paths = Paths(monkeypatch)
    returned = 0
    for i in range(PER_CHUNK):
        rng = Draw(f"kvcache-{chunk}-{i}")
        grad = rng.random() < 0.3
        skip_values = rng.rare(0.1, "policy")
        _, result = paths.check(_case(rng), grad=grad, skip_values=skip_values)
        returned += result[0] == "returned"
    # Not vacuous: a good share of the calls are valid, most of those take the fast path, and
    # it serves all eight forms of the common call (append or not, tensor or int lengths,
    # contiguous or paged cache).
    assert returned > PER_CHUNK * 0.25, returned
    assert paths.hits > returned * 0.5, (paths.hits, returned)
    assert paths.hit_kinds == {(k, s, p) for k in (True, False) for s in ("Tensor", "int")
                               for p in (True, False)}, paths.hit_kinds


# ---------------------------------------------------------------------------------------------
# The common calls, the value-check cache, and what the property tests relax
# ---------------------------------------------------------------------------------------------


def _decode(b=2, sq=1, hq=8, hkv=2, d=128, capacity=64, s_new=1, dtype=torch.bfloat16,
            seqlens="tensor"):
    kw = dict(q=torch.randn(b, sq, hq, d).to(dtype),
              k_cache=torch.randn(b, capacity, hkv, d).to(dtype),
              v_cache=torch.randn(b, capacity, hkv, d).to(dtype))
    if s_new:
        kw["k"] = torch.randn(b, s_new, hkv, d).to(dtype)
        kw["v"] = torch.randn(b, s_new, hkv, d).to(dtype)
    lens = torch.arange(b, dtype=torch.int32) + 5
    kw["cache_seqlens"] = lens if seqlens == "tensor" else 5
    return kw


def test_common_calls_take_the_fast_path(meta_ok, monkeypatch):
    """A decode step (append one token, causal), the same without append, int lengths, with
    the other scalars set: served by the fast path, with the arguments the full path passes."""
    paths = Paths(monkeypatch)
    for seqlens in ("tensor", "int"):
        for s_new in (1, 0, 3):
            kw = _decode(s_new=s_new, seqlens=seqlens)
            calls, result = paths.check(dict(kw, causal=True))
            assert result[0] == "returned"
            assert [c[0] for c in calls] == (["append", "fwd"] if s_new else ["fwd"])
            paths.check(dict(kw, softmax_scale=0.3, window_size=[16, 0], softcap=20.0,
                             num_splits=3, rotary_interleaved=False, return_softmax_lse=True))
    assert paths.hits == 12


def test_fast_path_arguments(meta_ok, monkeypatch):
    """The arguments themselves (not only their equality with the full path's)."""
    calls = []
    monkeypatch.setattr(ops, "_kvcache_append", lambda *a: calls.append(("append", a)))
    monkeypatch.setattr(ops, "_fwd_kvcache", lambda *a: calls.append(("fwd", a)) or ("o", "l"))
    kw = _decode()
    assert flash_ext.flash_attn_with_kvcache(**kw, causal=True, return_softmax_lse=True) == \
        ("o", "l")
    (_, append), (_, fwd) = calls
    assert append == (kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], None, None,
                      kw["cache_seqlens"], -1, None, None, None, True)
    assert all(x is y for x, y in zip(append, (kw["k_cache"], kw["v_cache"], kw["k"], kw["v"])))
    assert fwd[:11] == (kw["q"], kw["k_cache"], kw["v_cache"], None, None, kw["cache_seqlens"],
                        -1, 1, None, None, None)
    assert fwd[11:] == (None, 1 / math.sqrt(128), True, -1, 0, 0.0, True, 0)
    assert [type(x) for x in fwd[12:]] == [float, bool, int, int, float, bool, int]


def _count_value_checks(monkeypatch):
    """The ops as no-ops and check_kvcache_values counted: the list grows by one per check."""
    monkeypatch.setattr(ops, "_kvcache_append", lambda *a: None)
    monkeypatch.setattr(ops, "_fwd_kvcache", lambda q, *a: (q, None))
    checks = []
    real = _validation.check_kvcache_values
    monkeypatch.setattr(_validation, "check_kvcache_values",
                        lambda *a: checks.append(1) or real(*a))
    return checks


def test_values_checked_once_per_tensor_version(meta_ok, monkeypatch):
    """The fast path keeps check_kvcache_values' cache: the first call with a cache_seqlens
    checks it, the next ones with the same tensor, version and shapes do not call the check;
    an in-place update of the tensor (a decode loop's step) or another seqlen_new checks
    again."""
    checks = _count_value_checks(monkeypatch)
    kw = _decode()
    seen = []
    for step in range(4):
        flash_ext.flash_attn_with_kvcache(**kw, causal=True)
        flash_ext.flash_attn_with_kvcache(**kw, causal=True)  # the next layer: no check
        seen.append(len(checks))
        kw["cache_seqlens"] += 1
    assert seen == [1, 2, 3, 4]
    flash_ext.flash_attn_with_kvcache(**dict(kw, k=None, v=None))  # another seqlen_new
    assert len(checks) == 5
    # Control: the full path's hit (the same entry) and the fast path's agree.
    monkeypatch.setattr(kvcache, "_fast_call", lambda *a: None)
    flash_ext.flash_attn_with_kvcache(**dict(kw, k=None, v=None))
    assert len(checks) == 6  # the full path calls it, and it finds its entry


def test_cpu_values_checked_with_the_switch_off(meta_ok, monkeypatch):
    """CPU values are checked whatever FLASH_EXT_CHECK_KVCACHE says, on the fast path too; an
    update of the tensor after a passed check is seen."""
    monkeypatch.setattr(ops, "_kvcache_append", lambda *a: pytest.fail("append called"))
    monkeypatch.setattr(ops, "_fwd_kvcache", lambda *a: pytest.fail("fwd called"))
    monkeypatch.setattr(_validation, "CHECK_KVCACHE_VALUES", False)
    kw = _decode(capacity=16)
    kw["cache_seqlens"].fill_(16)  # + 1 new token: past the capacity
    hits = []
    fast = kvcache._fast_call
    monkeypatch.setattr(kvcache, "_fast_call", lambda *a: hits.append(1) or fast(*a))
    with pytest.raises(flash_ext.FlashExtValueError, match="at most the cache capacity"):
        flash_ext.flash_attn_with_kvcache(**kw)
    assert hits == [1]


def test_fast_path_skips_the_check_as_the_policy_says(meta_ok, monkeypatch):
    """When the policy says "not now" (CUDA graph capture, FLASH_EXT_CHECK_KVCACHE=0 for CUDA
    tensors), the fast path does not check either."""
    calls = []
    monkeypatch.setattr(ops, "_kvcache_append", lambda *a: calls.append("append"))
    monkeypatch.setattr(ops, "_fwd_kvcache", lambda q, *a: calls.append("fwd") or (q, None))
    monkeypatch.setattr(_validation, "should_check_values", lambda t, enabled=None: False)
    kw = _decode(capacity=16)
    kw["cache_seqlens"].fill_(16)
    flash_ext.flash_attn_with_kvcache(**kw)
    assert calls == ["append", "fwd"]


def test_cuda_is_still_required(monkeypatch):
    """Without the CPU switch, CPU tensors fall to the full path and its device error, before
    any op call."""
    monkeypatch.setattr(ops, "_kvcache_append", lambda *a: pytest.fail("append called"))
    monkeypatch.setattr(ops, "_fwd_kvcache", lambda *a: pytest.fail("fwd called"))
    assert flash_ext._FAST_PATH_ON_CPU is False
    kw = _decode()
    with pytest.raises(flash_ext.DeviceError, match="needs CUDA tensors; got q on cpu"):
        flash_ext.flash_attn_with_kvcache(**kw)


def _fast_args_of(kw):
    return (kw["q"], kw["k_cache"], kw["v_cache"], kw.get("k"), kw.get("v"),
            kw["cache_seqlens"], None, True, (-1, -1), 0.0, True, 0, False)


def test_fast_path_is_off_while_compiling(meta_ok, monkeypatch):
    """torch.compile traces the full path (tests/test_kvcache_api.py compiles it)."""
    monkeypatch.setattr(ops, "_kvcache_append", lambda *a: None)
    monkeypatch.setattr(ops, "_fwd_kvcache", lambda q, *a: (q, None))
    kw = _decode()
    assert kvcache._fast_call(*_fast_args_of(kw)) is not None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert kvcache._fast_call(*_fast_args_of(kw)) is None


def test_fake_tensors_take_the_full_path(meta_ok, fake_mode):
    kw = _decode()
    with fake_mode:
        fake = {n: (fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t)
                for n, t in kw.items()}
        assert kvcache._fast_call(*_fast_args_of(fake)) is None


# ---------------------------------------------------------------------------------------------
# Paged caches (block_table)
# ---------------------------------------------------------------------------------------------


def _paged_decode(b=2, hq=8, hkv=2, d=64, page_size=16, max_pages=4, s_new=1,
                  dtype=torch.bfloat16, seqlens="tensor"):
    """A decode step against a paged cache: sequence i on pages i, i + b, i + 2b, ... of
    b * max_pages + 1 pages (one spare)."""
    num_pages = b * max_pages + 1
    kw = dict(q=torch.randn(b, 1, hq, d).to(dtype),
              k_cache=torch.randn(num_pages, page_size, hkv, d).to(dtype),
              v_cache=torch.randn(num_pages, page_size, hkv, d).to(dtype),
              block_table=torch.arange(b * max_pages, dtype=torch.int32).view(max_pages, b)
              .t().contiguous())
    if s_new:
        kw["k"] = torch.randn(b, s_new, hkv, d).to(dtype)
        kw["v"] = torch.randn(b, s_new, hkv, d).to(dtype)
    kw["cache_seqlens"] = torch.arange(b, dtype=torch.int32) + 20 if seqlens == "tensor" else 20
    return kw


def _count_fast_path_hits(monkeypatch):
    """A list that gets a 1 for each call the fast path serves (not for those it declines)."""
    hits = []
    fast = kvcache._fast_call

    def counted(*args):
        result = fast(*args)
        if result is not None:
            hits.append(1)
        return result

    monkeypatch.setattr(kvcache, "_fast_call", counted)
    return hits


def test_paged_calls_take_the_fast_path(meta_ok, monkeypatch):
    """Paged decode steps (tensor or int lengths, append or not, page sizes 16 ... 256): served
    by the fast path, with the full path's op calls."""
    paths = Paths(monkeypatch)
    n = 0
    for page_size in (16, 48, 256):
        for seqlens in ("tensor", "int"):
            for s_new in (1, 0, 3):
                kw = _paged_decode(page_size=page_size, s_new=s_new, seqlens=seqlens)
                calls, result = paths.check(dict(kw, causal=True))
                assert result[0] == "returned"
                assert [c[0] for c in calls] == (["append", "fwd"] if s_new else ["fwd"])
                paths.check(dict(kw, softmax_scale=0.3, window_size=(16, 0), softcap=20.0,
                                 num_splits=2, return_softmax_lse=True))
                n += 2
    assert paths.hits == n


def test_paged_fast_path_arguments(meta_ok, monkeypatch):
    """The caller's block_table itself, in the append's and the attention's block_table slot;
    capacity max_pages * page_size (an int length that fills it exactly is accepted)."""
    calls = []
    monkeypatch.setattr(ops, "_kvcache_append", lambda *a: calls.append(("append", a)))
    monkeypatch.setattr(ops, "_fwd_kvcache", lambda *a: calls.append(("fwd", a)) or ("o", "l"))
    hits = _count_fast_path_hits(monkeypatch)
    kw = _paged_decode(page_size=32, max_pages=3, seqlens="int")
    kw["cache_seqlens"] = 3 * 32 - 1
    assert flash_ext.flash_attn_with_kvcache(**kw, causal=True) == "o"
    assert hits == [1]
    (_, append), (_, fwd) = calls
    assert append[:4] == (kw["k_cache"], kw["v_cache"], kw["k"], kw["v"])
    assert append[4:] == (None, None, None, 95, None, None, kw["block_table"], True)
    assert append[10] is kw["block_table"] and fwd[10] is kw["block_table"]
    assert fwd[3:12] == (None, None, None, 95, 1, None, None, kw["block_table"], None)


def test_paged_values_checked_once_per_version(meta_ok, monkeypatch):
    """The value check of a paged call runs once per (cache_seqlens, block_table) and their
    versions, or once per block_table version with int lengths: the next layers' calls find
    the entry; an in-place update of either tensor, or another int length, checks again; the
    full path finds the entry the fast path's check left (the same key)."""
    checks = _count_value_checks(monkeypatch)
    entries = []
    remember = _validation._remember_values_checked
    monkeypatch.setattr(_validation, "_remember_values_checked",
                        lambda *a: entries.append(1) or remember(*a))
    kw = _paged_decode()
    seen = []
    for step in range(3):
        flash_ext.flash_attn_with_kvcache(**kw, causal=True)
        flash_ext.flash_attn_with_kvcache(**kw, causal=True)  # the next layer: no check
        seen.append(len(checks))
        kw["cache_seqlens"] += 1
    assert seen == [1, 2, 3]
    flash_ext.flash_attn_with_kvcache(**kw, causal=True)  # the last += 1: checked again
    flash_ext.flash_attn_with_kvcache(**kw, causal=True)
    assert len(checks) == 4 and len(entries) == 4
    kw["block_table"][0, 3] = 8  # the spare page: a new version of the table only
    flash_ext.flash_attn_with_kvcache(**kw, causal=True)
    flash_ext.flash_attn_with_kvcache(**kw, causal=True)
    assert len(checks) == 5 and len(entries) == 5

    kw = _paged_decode(seqlens="int")
    for length in (20, 20, 21, 21):
        flash_ext.flash_attn_with_kvcache(**dict(kw, cache_seqlens=length), causal=True)
    assert len(checks) == 7 and len(entries) == 7
    kw["block_table"].add_(0)  # an in-place write: checked again
    flash_ext.flash_attn_with_kvcache(**dict(kw, cache_seqlens=21), causal=True)
    assert len(checks) == 8 and len(entries) == 8
    # Control: the full path calls the check, which finds the fast path's entry.
    monkeypatch.setattr(kvcache, "_fast_call", lambda *a: None)
    flash_ext.flash_attn_with_kvcache(**dict(kw, cache_seqlens=21), causal=True)
    assert len(checks) == 9 and len(entries) == 8


def test_paged_bad_entries_raise_before_any_op(meta_ok, monkeypatch):
    """A block_table entry out of range among the pages in use: the fast path's value check
    raises the full path's error, nothing called; with the switch off, CPU tables are checked
    all the same."""
    monkeypatch.setattr(ops, "_kvcache_append", lambda *a: pytest.fail("append called"))
    monkeypatch.setattr(ops, "_fwd_kvcache", lambda *a: pytest.fail("fwd called"))
    monkeypatch.setattr(_validation, "CHECK_KVCACHE_VALUES", False)
    hits = []
    fast = kvcache._fast_call
    monkeypatch.setattr(kvcache, "_fast_call", lambda *a: hits.append(fast(*a)))
    for seqlens in ("tensor", "int"):
        kw = _paged_decode(seqlens=seqlens)
        kw["block_table"][1, 1] = kw["k_cache"].shape[0]  # page 1 holds keys 16..31: in use
        with pytest.raises(flash_ext.FlashExtValueError, match=r"block_table\[1, 1\] = 9"):
            flash_ext.flash_attn_with_kvcache(**kw, causal=True)
    assert len(hits) == 0  # raised inside the fast path, before it returned


def _table_variants():
    """(name, change of the paged decode kwargs, whether the full path accepts it)."""
    def page_size(n):
        def change(kw):
            kw["k_cache"] = torch.randn(9, n, 2, 64).to(torch.bfloat16)
            kw["v_cache"] = torch.randn(9, n, 2, 64).to(torch.bfloat16)
        return change

    def table(fn):
        def change(kw):
            kw["block_table"] = fn(kw["block_table"])
        return change

    def strided(t):
        return torch.stack([t, t], dim=-1).view(t.shape[0], -1)[:, ::2]

    def rows_strided(t):
        wide = torch.zeros(t.shape[0], t.shape[1] + 4, dtype=torch.int32)
        wide[:, :t.shape[1]] = t
        return wide[:, :t.shape[1]]

    return [
        ("page size 8", page_size(8), False),
        ("page size 24", page_size(24), False),
        ("page size 1", page_size(1), False),
        ("page size 0", page_size(0), False),
        ("int64 table", table(lambda t: t.long()), False),
        ("int16 table", table(lambda t: t.short()), False),
        ("float table", table(lambda t: t.float()), False),
        ("strided last dim", table(strided), True),
        ("strided rows", table(rows_strided), True),
        ("transposed", table(lambda t: t.t().contiguous().t()), True),
        ("1-D table", table(lambda t: t.reshape(-1)), False),
        ("3-D table", table(lambda t: t.unsqueeze(0)), False),
        ("a row too many", table(lambda t: torch.cat([t, t[:1]])), False),
        ("a row too few", table(lambda t: t[:1]), False),
        ("meta table", table(lambda t: t.to("meta")), False),
        ("list table", table(lambda t: t.tolist()), False),
        ("numpy table", table(lambda t: t.numpy()), False),
        ("with cache_batch_idx", lambda kw: kw.update(
            cache_batch_idx=torch.zeros(2, dtype=torch.int32)), False),
        ("int length past capacity", lambda kw: kw.update(cache_seqlens=64), False),
        ("seqlen_q past capacity", lambda kw: kw.update(
            q=torch.randn(2, 65, 8, 64).to(torch.bfloat16)), False),
    ]


@pytest.mark.parametrize("name,change,valid", _table_variants(),
                         ids=[v[0] for v in _table_variants()])
def test_paged_variants_the_fast_path_declines(meta_ok, monkeypatch, name, change, valid):
    """Every block_table form but a contiguous int32 (batch, max_pages) tensor on q's device,
    every page size but a positive multiple of 16, and anything the full path rejects: the
    fast path declines (None, nothing called), and the call gives the full path's result or
    its error."""
    kw = _paged_decode()
    change(kw)
    monkeypatch.setattr(ops, "_kvcache_append", lambda *a: pytest.fail("append called"))
    monkeypatch.setattr(ops, "_fwd_kvcache", lambda *a: pytest.fail("fwd called"))
    if "cache_batch_idx" not in kw:  # (that one its caller screens: _fast_call never sees it)
        args = (kw["q"], kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw["cache_seqlens"],
                None, True, (-1, -1), 0.0, True, 0, False, kw["block_table"])
        assert kvcache._fast_call(*args) is None
    paths = Paths(monkeypatch)
    _, result = paths.check(dict(kw, causal=True))
    assert paths.hits == 0
    assert (result[0] == "returned") == valid, result


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("seqlens", ["tensor", "int"])
def test_paged_fast_path_on_the_gpu(page_size, seqlens, monkeypatch):
    """On CUDA with the real kernels: a paged decode step (batch 1, 8k slots) takes the fast
    path, and it gives the full path's output, lse and caches bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not getattr(ops, "_HAS_KVCACHE_OPS", False):
        pytest.skip("this build of flash_ext._C has no KV-cache ops")
    torch.manual_seed(0)
    dev, dt, hq, hkv, d, cap = "cuda", torch.bfloat16, 32, 8, 128, 8192
    pages = cap // page_size
    kw = dict(q=torch.randn(1, 1, hq, d, device=dev, dtype=dt),
              k_cache=torch.randn(pages + 3, page_size, hkv, d, device=dev, dtype=dt),
              v_cache=torch.randn(pages + 3, page_size, hkv, d, device=dev, dtype=dt),
              k=torch.randn(1, 1, hkv, d, device=dev, dtype=dt),
              v=torch.randn(1, 1, hkv, d, device=dev, dtype=dt),
              block_table=torch.randperm(pages + 3, device=dev)[:pages].view(1, pages).int(),
              cache_seqlens=(torch.tensor([4000], dtype=torch.int32, device=dev)
                             if seqlens == "tensor" else 4000))
    hits = _count_fast_path_hits(monkeypatch)

    def run(kw):
        kw = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
        out, lse = flash_ext.flash_attn_with_kvcache(**kw, causal=True, return_softmax_lse=True)
        return out, lse, kw["k_cache"], kw["v_cache"]

    fast_result = run(kw)
    assert len(hits) == 1
    monkeypatch.setattr(kvcache, "_fast_call", lambda *a: None)
    full_result = run(kw)
    for a, b in zip(fast_result, full_result):
        assert torch.equal(a, b)
