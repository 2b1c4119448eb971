"""unpad_input / pad_input (flash_ext.padding, also flash_ext.bert_padding) on CPU tensors:
FlashAttention-2's return values, exact round trips, gradients, left and right padding, rows
with no token, unused_mask, errors."""

import pytest
import torch

import flash_ext
from flash_ext import FlashExtError, pad_input, unpad_input
from flash_ext.errors import DeviceError


def mask_of(lengths, seqlen, left=False):
    """bool (batch, seqlen): each row's first (or, with left=True, last) lengths[i] positions."""
    pos = torch.arange(seqlen).unsqueeze(0)
    lens = torch.tensor(lengths).unsqueeze(1)
    return pos >= seqlen - lens if left else pos < lens


def expected_unpad(x, kept):
    """What unpad_input must return, computed row by row (the test's independent version)."""
    rows, idx, cu, = [], [], [0]
    b, s = kept.shape
    for i in range(b):
        for j in range(s):
            if kept[i, j]:
                rows.append(x[i, j])
                idx.append(i * s + j)
        cu.append(len(idx))
    tokens = torch.stack(rows) if rows else x.new_zeros((0,) + x.shape[2:])
    return tokens, torch.tensor(idx, dtype=torch.int64), torch.tensor(cu, dtype=torch.int32)


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
@pytest.mark.parametrize("lengths", [[5, 2, 7, 0], [7, 7, 7, 7], [0, 0, 0, 0], [1, 0, 3, 6]])
def test_unpad_matches_row_by_row(seed, lengths, left):
    b, s = len(lengths), 7
    x = torch.randn(b, s, 3, 8)
    mask = mask_of(lengths, s, left)
    tokens, indices, cu, max_seqlen, seqused = unpad_input(x, mask)
    want_tokens, want_idx, want_cu = expected_unpad(x, mask)
    assert torch.equal(tokens, want_tokens)
    assert indices.dtype == torch.int64 and torch.equal(indices, want_idx)
    assert cu.dtype == torch.int32 and torch.equal(cu, want_cu)
    assert type(max_seqlen) is int and max_seqlen == max(lengths)
    assert seqused.dtype == torch.int32 and seqused.tolist() == lengths
    # Round trip: every kept token back in place, zeros elsewhere.
    padded = pad_input(tokens, indices, b, s)
    assert padded.shape == x.shape and padded.dtype == x.dtype
    assert torch.equal(padded, x * mask[:, :, None, None])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_mask_dtypes(seed, dtype):
    x = torch.randn(3, 6, 4)
    mask = mask_of([6, 2, 4], 6)
    got = unpad_input(x, mask.to(dtype))
    want = unpad_input(x, mask)
    for g, w in zip(got, want):
        assert (g == w) if isinstance(g, int) else torch.equal(g, w)


def test_integer_mask_nonzero_means_token(seed):
    x = torch.randn(1, 4, 2)
    tokens, indices, *_ = unpad_input(x, torch.tensor([[0, 2, 0, -1]]))
    assert indices.tolist() == [1, 3] and torch.equal(tokens, x[0, [1, 3]])


def test_holes_keep_order(seed):
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 0, 0, 1]], dtype=torch.bool)
    tokens, indices, cu, max_seqlen, seqused = unpad_input(x, mask)
    assert indices.tolist() == [0, 2, 3, 6, 9]
    assert cu.tolist() == [0, 3, 5] and max_seqlen == 3 and seqused.tolist() == [3, 2]
    assert torch.equal(pad_input(tokens, indices, 2, 5), x * mask[..., None])


def test_unused_mask(seed):
    """unused tokens are packed and counted in cu_seqlens / max_seqlen, not in seqused."""
    x = torch.randn(3, 6, 2, 8)
    used = mask_of([3, 1, 0], 6)
    unused = torch.zeros(3, 6, dtype=torch.bool)
    unused[0, 3:5] = True   # two allocated-but-unused slots after row 0's tokens
    unused[2, :2] = True    # a row with unused slots only
    tokens, indices, cu, max_seqlen, seqused = unpad_input(x, used, unused)
    want_tokens, want_idx, want_cu = expected_unpad(x, used | unused)
    assert torch.equal(tokens, want_tokens) and torch.equal(indices, want_idx)
    assert torch.equal(cu, want_cu) and cu.tolist() == [0, 5, 6, 8]
    assert max_seqlen == 5
    assert seqused.dtype == torch.int32 and seqused.tolist() == [3, 1, 0]
    # An unused slot that is also marked valid counts once.
    _, _, cu2, _, seqused2 = unpad_input(x, used.long(), (used | unused).long())
    assert torch.equal(cu2, cu) and seqused2.tolist() == [3, 1, 0]


def test_gradients(seed):
    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    mask = mask_of([5, 2, 0], 5, left=True)
    tokens, indices, *_ = unpad_input(x, mask)
    w = torch.randn(tokens.shape, dtype=torch.float64)
    (tokens * w).sum().backward()
    want = torch.zeros_like(x)
    want[mask] = w
    assert torch.equal(x.grad, want)  # gathered tokens get w, padding gets 0

    t = torch.randn(tokens.shape, dtype=torch.float64, requires_grad=True)
    padded = pad_input(t, indices, 3, 5)
    g = torch.randn(padded.shape, dtype=torch.float64)
    (padded * g).sum().backward()
    assert torch.equal(t.grad, g[mask])

    torch.autograd.gradcheck(lambda x: unpad_input(x, mask)[0], (x.detach().requires_grad_(),))
    torch.autograd.gradcheck(lambda t: pad_input(t, indices, 3, 5), (t.detach().requires_grad_(),))


def test_pad_input_takes_int32_indices(seed):
    x = torch.randn(2, 4, 3)
    tokens, indices, *_ = unpad_input(x, mask_of([3, 4], 4))
    assert torch.equal(pad_input(tokens, indices.int(), 2, 4), pad_input(tokens, indices, 2, 4))


def test_empty_batch(seed):
    tokens, indices, cu, max_seqlen, seqused = unpad_input(torch.randn(0, 4, 8),
                                                           torch.zeros(0, 4, dtype=torch.bool))
    assert tokens.shape == (0, 8) and indices.shape == (0,) and cu.tolist() == [0]
    assert max_seqlen == 0 and seqused.shape == (0,)
    assert pad_input(tokens, indices, 0, 4).shape == (0, 4, 8)


def test_bert_padding_module():
    import flash_ext.bert_padding as bp
    from flash_ext.bert_padding import pad_input as p, unpad_input as u
    assert u is unpad_input and p is pad_input and bp.unpad_input is flash_ext.unpad_input
    assert flash_ext.bert_padding is bp


# ---------------------------------------------------------------------------------------------
# Errors: FlashExtError subclasses (RuntimeError), before any work
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,exc,match", [
    ((torch.randn(2, 4, 8), torch.ones(2, 5, dtype=torch.bool)), ValueError,
     r"attention_mask must be \(batch, seqlen\) = \(2, 4\)"),
    ((torch.randn(2, 4, 8), torch.ones(2, 4)), TypeError, "bool or integer"),
    ((torch.randn(2, 4, 8), [[1, 1, 1, 1]] * 2), TypeError, "attention_mask must be a torch.Tensor"),
    ((torch.randn(4), torch.ones(1, 4, dtype=torch.bool)), ValueError, r"\(batch, seqlen, ...\)"),
    ((torch.randn(2, 4, 8), torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool)),
     ValueError, "unused_mask must be"),
    (("x", torch.ones(2, 4, dtype=torch.bool)), TypeError, "hidden_states must be a torch.Tensor"),
])
def test_unpad_errors(args, exc, match):
    with pytest.raises(exc, match=match) as info:
        unpad_input(*args)
    assert isinstance(info.value, FlashExtError)


def test_unpad_mask_on_other_device():
    with pytest.raises(DeviceError, match="attention_mask must be on hidden_states' device"):
        unpad_input(torch.randn(2, 4, 8), torch.ones(2, 4, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("args,exc,match", [
    ((torch.randn(3, 8), torch.tensor([0, 1, 2]), 1, 2), ValueError,
     r"indices must lie in \[0, batch \* seqlen\) = \[0, 2\); got values from 0 to 2"),
    ((torch.randn(3, 8), torch.tensor([0, -1, 2]), 2, 2), ValueError, "indices must lie in"),
    ((torch.randn(3, 8), torch.tensor([0, 1]), 2, 2), ValueError, "one entry per row"),
    ((torch.randn(3, 8), torch.tensor([0., 1., 2.]), 2, 2), TypeError, "int64 or int32"),
    ((torch.randn(3, 8), [0, 1, 2], 2, 2), TypeError, "indices must be a torch.Tensor"),
    ((torch.randn(3, 8), torch.tensor([0, 1, 2]), 2.0, 2), TypeError, "batch must be an int"),
    ((torch.randn(3, 8), torch.tensor([0, 1, 2]), 2, -2), ValueError, "seqlen must be >= 0"),
])
def test_pad_errors(args, exc, match):
    with pytest.raises(exc, match=match) as info:
        pad_input(*args)
    assert isinstance(info.value, FlashExtError)
