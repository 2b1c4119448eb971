"""Shared fixtures and helpers. CPU tests run everywhere; GPU tests are marked ``requires_cuda``
and skip with a reason on machines without a CUDA GPU."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build_support"))

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


# A build narrowed by FLASH_EXT_HEADDIMS / FLASH_EXT_DTYPES (README "Build knobs") has no kernel
# for the other head dims and dtypes, and the op says so before launching anything. Tests of
# those cases then skip with that message instead of failing; on a full build they still fail.
_NOT_IN_BUILD = ("this build has no", "rebuild with FLASH_EXT_HEADDIMS", "FLASH_EXT_FWD_PATH=sm90 needs",
                 "FLASH_EXT_BWD_PATH=sm90 needs")


def narrowed_build_info(info):
    """Whether a build_info() string describes a build narrowed by FLASH_EXT_HEADDIMS or
    FLASH_EXT_DTYPES (missing some head dim or dtype of the full build, build_support/build_config.py)."""
    import build_config as bc  # build_support/ is on sys.path (top of this file)
    fields = dict(kv.split("=", 1) for kv in info.split() if "=" in kv)
    return (set(fields.get("hdims", "").split(",")) != {str(d) for d in bc.ALL_HEADDIMS}
            or set(fields.get("dtypes", "").split(",")) != set(bc.ALL_DTYPES))


def _build_is_narrowed():
    try:
        import flash_ext
        info = flash_ext.build_info()
    except Exception:  # no extension: nothing to skip for
        return False
    return narrowed_build_info(info)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when != "call" or not rep.failed or call.excinfo is None:
        return
    if not call.excinfo.errisinstance(RuntimeError):
        return
    msg = str(call.excinfo.value)
    if any(m in msg for m in _NOT_IN_BUILD) and _build_is_narrowed():
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0,
                        "Skipped: not in this narrowed build: " + msg.splitlines()[0][:200])
