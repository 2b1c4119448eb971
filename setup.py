"""Build flash_ext and its CUDA extension flash_ext._C.

torch must already be installed (it is not a build requirement that pip should fetch):

    pip install --no-build-isolation .                 # install
    python setup.py build_ext --inplace                # develop: build next to the sources

Knobs (environment variables; parsing and defaults are in build_support/build_config.py):
    FLASH_EXT_ARCHS="80+PTX;90a"  FLASH_EXT_HEADDIMS=32,...,256  FLASH_EXT_DTYPES=fp16,bf16
    FLASH_EXT_PTXAS_VERBOSE=1  FLASH_EXT_NVCC_THREADS=N  FLASH_EXT_CXX_STD=c++20
    MAX_JOBS=N (parallel compiles)  CUTLASS_PATH=/path/to/cutlass  CUDA_HOME=/usr/local/cuda
"""

import os
import re
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "build_support"))
import build_config as bc  # noqa: E402  (pure Python, no torch)
from per_source_flags import per_source_gencode  # noqa: E402

# torch.utils.cpp_extension fixes CUDA_HOME at import time. An `nvcc` wrapper on PATH (e.g. in
# /usr/local/bin) makes it guess /usr/local, and linking then fails on -lcudart.
if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH") and \
        os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension
except ImportError as e:  # pragma: no cover
    sys.exit(f"flash_ext: torch must be installed before building ({e}); then use "
             f"`pip install --no-build-isolation .`")


def read_version() -> str:
    init = ROOT / "flash_ext" / "__init__.py"
    if init.is_file():
        m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', init.read_text(), re.M)
        if m:
            return m.group(1)
    return "0.1.0"


def fail(msg: str) -> None:
    sys.exit(f"\nflash_ext build error:\n{msg}\n")


def make_extension() -> CUDAExtension:
    try:
        cfg = bc.BuildConfig.from_env(os.environ)
        cutlass_dirs, cutlass_from = bc.find_cutlass(ROOT, os.environ)
    except bc.BuildConfigError as e:
        fail(str(e))

    inst_dir = ROOT / "csrc" / "instantiations"
    kernel_sources = [inst_dir / name for name in bc.instantiation_files(cfg)]
    missing = [str(p.relative_to(ROOT)) for p in kernel_sources if not p.is_file()]
    if missing:
        fail("missing generated sources (run `python build_support/gen_instantiations.py`): " + ", ".join(missing))
    # The torch-facing layer and the host code it calls (no kernels): csrc/ops_*.cpp register the
    # ops; api/ checks and fills params; dispatch/ and tuning/ choose what runs and how.
    host_sources = [ROOT / "csrc" / name for name in (
        "ops_library.cpp", "ops_fwd.cpp", "ops_bwd.cpp", "ops_autograd.cpp", "ops_dropout.cpp", "ops_kvcache.cpp",
        "ops_flashmask.cpp",
        "api/checks.cpp", "api/errors.cpp", "api/flashmask.cpp", "api/params_fill.cpp", "api/workspace.cpp",
        "dispatch/paths.cpp", "tuning/heuristics.cpp", "tuning/overrides.cpp", "device_info.cpp",
        "sm90/tensor_map_encode.cu",  # host only: the TMA encode (needs nvcc for CUTLASS's declaration)
        "dropout_mask.cu",  # the flash_ext::dropout_mask kernel
        "decode/kvcache_append.cu",  # the flash_ext::kvcache_append kernel
        "flashmask/flashmask_summary.cu",  # FlashMask's kernel A (one PTX for every target: see below)
        "flashmask/flashmask_fwd_tiles.cu",  # the Hopper FlashMask forward's tile table (likewise)
    )]
    for f in host_sources:
        if not f.is_file():
            fail(f"missing {f.relative_to(ROOT)}")
    # ninja starts jobs in this order: the longest translation units first (the sm80 backward's,
    # then the sm80 forward's), so that no long one starts last and runs on alone.
    first = ("bwd_sm80_", "fwd_sm80_")
    kernel_sources.sort(key=lambda p: next((i for i, f in enumerate(first) if p.name.startswith(f)), len(first)))
    sources = [str(p.relative_to(ROOT)) for p in kernel_sources + host_sources]

    # One argv entry per flag, unquoted: torch's ninja writer shell-quotes every flag itself
    # (so -DFLASH_EXT_BUILD_INFO="archs=80;90a ..." reaches the compiler intact).
    defines = bc.macro_defines(cfg)

    cxx_std = cfg.cxx_std or bc.cxx_std_for_torch(torch.__version__)
    cxx_flags = ["-O3", f"-std={cxx_std}"] + defines + bc.common_defines(cfg)
    # torch >= 2.14's ATen/cuda headers include cusparse.h, which ships in the nvidia-* wheels
    # (site-packages/nvidia/cu13/include) but not in every CUDA toolkit. -idirafter: the
    # toolkit's own headers still win.
    wheel_inc = bc.find_nvidia_wheel_include("cusparse.h")
    if wheel_inc:
        cxx_flags += ["-idirafter", wheel_inc]

    # Kernel units include no torch header: C++17 is enough there. The FLASH_EXT_* knob macros
    # go to the host .cpp files only, so narrowing head dims / dtypes does not recompile other kernels.
    nvcc_flags = [
        "-O3",
        "-std=c++17",
        "-DNDEBUG",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-lineinfo",
    ] + bc.gencode_flags(cfg.archs)  # explicit -gencode: torch then ignores TORCH_CUDA_ARCH_LIST
    # ...and the kernel files that need fewer device passes get their own (FlashExtBuild)
    SOURCE_GENCODE.update(bc.source_gencode_flags(cfg))
    # FlashMask's kernel A is plain CUDA for sm80 and newer: one front end and optimizer pass, the
    # SASS of every target assembled from its PTX, as for the one_ptx kernel families.
    for name in ("flashmask_summary", "flashmask_fwd_tiles"):
        SOURCE_GENCODE[name + ".cu"] = bc.family_gencode_flags(
            bc.Family(name=name, header="", function="", one_ptx=True), cfg.archs)
    nvcc_flags += bc.common_defines(cfg)  # the same on both sides (FwdParams' layout)
    if cfg.ptxas_verbose:
        nvcc_flags += ["-Xptxas", "-v"]
    if cfg.nvcc_threads:
        nvcc_flags += ["--threads", str(cfg.nvcc_threads)]

    print(f"flash_ext build: {bc.build_info(cfg)}; {len(kernel_sources)} kernel files; "
          f"CUTLASS from {cutlass_from}; CUDA_HOME={os.environ.get('CUDA_HOME', '(torch default)')}; "
          f"torch {torch.__version__}; host -std={cxx_std}; MAX_JOBS={os.environ.get('MAX_JOBS', '(auto)')}",
          flush=True)

    return CUDAExtension(
        name="flash_ext._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc")] + cutlass_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


SOURCE_GENCODE: dict[str, list[str]] = {}


class FlashExtBuild(BuildExtension):
    """torch's ninja build, with per-file -gencode flags for the kernel files whose device code
    needs fewer passes than the build's targets (build_support/per_source_flags.py)."""

    def build_extensions(self):
        with per_source_gencode(SOURCE_GENCODE):
            super().build_extensions()


setup(
    name="flash_ext",
    version=read_version(),
    description="Fast exact attention (FlashAttention-2 style CUDA/CuTe kernels) for PyTorch",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").is_file() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["flash_ext", "flash_ext.*"]),
    python_requires=">=3.9",
    install_requires=[],  # torch is required but must be installed beforehand (see README)
    extras_require={
        # README's test command: pytest; numpy (window_size given as numpy scalars); transformers
        # (the Hugging Face integration's tests, which build small models from a config)
        "test": ["pytest", "numpy", "transformers"],
        "bench": ["matplotlib"],  # python -m flash_ext.bench's PNG
    },
    ext_modules=[make_extension()],
    cmdclass={"build_ext": FlashExtBuild.with_options(use_ninja=True)},
    zip_safe=False,
)
