"""Shared fixtures and helpers. CPU tests run everywhere; GPU tests are marked ``requires_cuda``
and skip with a reason on machines without a CUDA GPU."""

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA GPU (none found)")


@pytest.fixture
def seed():
    """Seed torch's RNG per test (every test draws fresh random inputs)."""
    torch.manual_seed(0)
    return 0


@pytest.fixture
def fake_mode():
    """A FakeTensorMode: tensors with device='cuda' but no data, usable without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode()


@pytest.fixture
def meta_ok(monkeypatch):
    """Let the Python layer accept meta tensors (it requires CUDA tensors otherwise)."""
    from flash_ext import _validation as V
    orig = V.check_devices
    monkeypatch.setattr(V, "check_devices",
                        lambda tensors, require_cuda=True: orig(tensors, require_cuda=False))


def meta(*shape, dtype=torch.bfloat16, requires_grad=False):
    """An empty tensor on the meta device (shapes and dtypes only)."""
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=requires_grad)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    torch._dynamo.reset()
