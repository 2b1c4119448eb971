"""Shared fixtures and helpers. CPU tests run everywhere; GPU tests are marked ``requires_cuda``
and skip with a reason on machines without a CUDA GPU.

On a checkout where the extension is not built (no flash_ext/_C*.so), the op schemas come from
tests/stand_in_ops.py, so that the CPU tests still run; tests that need the compiled kernels
(``requires_cuda``, ``requires_ext``) skip then."""

import glob
import importlib.machinery
import importlib.util
import os
import sys

import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_TESTS), "tools"))
sys.path.insert(0, os.path.join(os.path.dirname(_TESTS), "build_support"))


def _extension_built() -> bool:
    """Whether a compiled flash_ext._C sits next to the flash_ext package that will be imported
    (looked up without importing it: the import itself needs the ops)."""
    spec = importlib.util.find_spec("flash_ext")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(glob.glob(os.path.join(loc, "_C*" + suffix))
               for loc in spec.submodule_search_locations
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


EXTENSION_BUILT = _extension_built()
if not EXTENSION_BUILT and os.environ.get("FLASH_EXT_TESTS_REQUIRE_EXT", "0") not in ("", "0"):
    # For runs that must test the build (CI, GPU checks): no silent fallback to the stand-in.
    raise RuntimeError("FLASH_EXT_TESTS_REQUIRE_EXT is set but flash_ext._C is not built next to "
                       "the flash_ext package (build it in place: python setup.py build_ext "
                       "--inplace)")
if not EXTENSION_BUILT:
    import stand_in_ops  # tests/ is on sys.path (pytest's rootdir-relative import of conftest)
    stand_in_ops.install()

requires_ext = pytest.mark.skipif(
    not EXTENSION_BUILT, reason="needs the compiled extension flash_ext._C (not built)")
requires_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and EXTENSION_BUILT),
    reason="needs a CUDA GPU and the compiled extension"
    + ("" if torch.cuda.is_available() else " (no GPU found)")
    + ("" if EXTENSION_BUILT else " (flash_ext._C not built)"))


def pytest_report_header(config):
    if not EXTENSION_BUILT:
        return ("flash_ext._C is not built: the op schemas come from tests/stand_in_ops.py; "
                "tests that need the kernels skip")
    return None


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
    """Let the Python layer accept meta and CPU tensors (it requires CUDA tensors otherwise):
    the full path's device check, and the fast path's (flash_ext._fast_args), which then
    serves the common calls on CPU tensors as it does on CUDA ones."""
    import flash_ext
    from flash_ext import _validation as V
    orig = V.check_devices
    monkeypatch.setattr(V, "check_devices",
                        lambda tensors, require_cuda=True, **kw: orig(tensors, require_cuda=False,
                                                                       **kw))
    monkeypatch.setattr(flash_ext, "_FAST_PATH_ON_CPU", True)


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
                 "FLASH_EXT_BWD_PATH=sm90 needs", "no FlashMask mode for this head dim in this build")


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


def built_dtype():
    """A dtype the extension was built for (bf16 unless FLASH_EXT_DTYPES left it out): for tests
    of refusals, whose message must not be "this build has no fp16 kernels" instead."""
    try:
        import flash_ext
        fields = dict(kv.split("=", 1) for kv in flash_ext.build_info().split() if "=" in kv)
    except Exception:  # no extension: the stand-in ops take any dtype
        return torch.bfloat16
    return torch.float16 if "bf16" not in fields.get("dtypes", "bf16").split(",") else torch.bfloat16


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when != "call" or not rep.failed or call.excinfo is None:
        return
    msg = str(call.excinfo.value)
    # pytest.raises(match=...) that met the narrowed build's error instead of the one it expects
    # fails with an AssertionError quoting that error.
    refusal_met_missing_kernel = call.excinfo.errisinstance(AssertionError) and "Regex pattern did not match" in msg
    if not (call.excinfo.errisinstance(RuntimeError) or refusal_met_missing_kernel):
        return
    lines = [line.strip() for line in msg.splitlines() if any(m in line for m in _NOT_IN_BUILD)]
    if lines and _build_is_narrowed():
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0,
                        "Skipped: not in this narrowed build: " + lines[0][:200])


class Tuning:
    """The C++ ops' tuning switches (FLASH_EXT_FWD_PATH, FLASH_EXT_SM90_STREAM_K, ...: README),
    which the extension reads from the environment once per process: tests set them between
    calls through the flash_ext::set_tuning op instead. set(name, value) as the environment
    variable would; every switch set is restored to the environment's value afterwards."""

    def __init__(self):
        self._names = set()

    @staticmethod
    def _ops():
        import flash_ext  # noqa: F401  (loads the extension, which registers the ops)
        return torch.ops.flash_ext

    def set(self, name, value):
        self._ops().set_tuning(name, value)
        self._names.add(name)

    def get(self, name):
        return self._ops().get_tuning(name)

    def restore(self):
        for name in self._names:
            self._ops().set_tuning(name, "")  # "": the environment's value
        self._names.clear()


@pytest.fixture
def tuning():
    t = Tuning()
    yield t
    t.restore()
