"""Build configuration for flash_ext: parses the FLASH_EXT_* knobs and locates CUTLASS.

Pure Python with no third-party imports (no torch), so setup.py, build_support/gen_instantiations.py
and CPU unit tests can all use it. Every parser raises ``BuildConfigError`` (a ``ValueError``)
with a message that names the offending knob and value.

Knobs (environment variables):

  FLASH_EXT_ARCHS          GPU targets, ';' or ',' separated: 80, 86, 87, 88, 89, 90, 90a, 100,
                           100a, 103, 103a, 110, 110a, 120, 120a, 121, 121a. "NN+PTX" also embeds
                           compute_NN PTX so newer GPUs can JIT it (not allowed on "a" targets,
                           whose PTX runs on that exact GPU only). Default "80+PTX;90a".
  FLASH_EXT_HEADDIMS       kernel head dims to build, subset of 32,64,96,128,192,256 (default all).
  FLASH_EXT_DTYPES         fp16 and/or bf16 (default both).
  FLASH_EXT_PTXAS_VERBOSE  1: pass -Xptxas -v (register / smem / spill report per kernel).
  FLASH_EXT_NVCC_THREADS   N: pass --threads N to nvcc (compiles the gencode targets of one file
                           in parallel).
  FLASH_EXT_CXX_STD        override the host C++ standard of flash_api.cpp (e.g. c++17, c++20).
  FLASH_EXT_SM90_TRACE     1: a diagnostic build whose Hopper forward writes a timeline
                           (csrc/sm90/fwd_trace.h, tools/trace_fwd.py); -DFLASH_EXT_SM90_TRACE goes
                           to every file (it changes FwdParams). Not for production use.
  CUTLASS_PATH             a CUTLASS checkout (its include/ is used).
  MAX_JOBS                 read by torch's ninja build, not here: number of parallel compiles.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

__all__ = [
    "BuildConfigError",
    "Arch",
    "Family",
    "Split",
    "FAMILIES",
    "ALL_HEADDIMS",
    "ALL_DTYPES",
    "DEFAULT_ARCHS",
    "BuildConfig",
    "parse_archs",
    "gencode_flags",
    "family_gencode_flags",
    "source_gencode_flags",
    "parse_headdims",
    "parse_dtypes",
    "parse_bool",
    "parse_positive_int",
    "instantiation_name",
    "family_files",
    "instantiation_files",
    "macro_defines",
    "common_defines",
    "build_info",
    "cxx_std_for_torch",
    "find_cutlass",
    "find_nvidia_wheel_include",
    "CUTLASS_PIP_VERSION",
]


class BuildConfigError(ValueError):
    """A build knob has a bad value, or a build dependency (CUTLASS) is missing."""


# ----------------------------------------------------------------------------------------------
# Kernel families: the table gen_instantiations.py writes files from and setup.py selects sources
# from. To add a family (e.g. "bwd_sm80" or "fwd_sm90"), add one row.
# ----------------------------------------------------------------------------------------------

ALL_HEADDIMS: tuple[int, ...] = (32, 64, 96, 128, 192, 256)
ALL_DTYPES: tuple[str, ...] = ("fp16", "bf16")


@dataclass(frozen=True)
class Split:
    """Kernels of a family in a file of their own, beside the family's main file, so that the kernels
    of one (head dim, dtype) can compile in parallel: ``<family>_hdim<d>_<dtype>_<suffix>.cu``.

    suffix:     file name suffix, e.g. "big_v1"
    header:     header (relative to csrc/) that defines the instantiated templates
    functions:  explicit instantiations, formatted like Family.function
    hdims:      only these head dims (None: every head dim of the family)
    """

    suffix: str
    header: str
    functions: tuple[str, ...]
    hdims: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class Family:
    """One kernel family: one generated .cu per (head dim, dtype), plus one per split.

    name:      file stem prefix, e.g. "fwd_sm80" -> fwd_sm80_hdim128_bf16.cu
    header:    header (relative to csrc/) that defines the launcher template
    function:  explicit instantiation, formatted with {hdim} and {is_bf16} ("true"/"false")
    hdims:     head dims this family has kernels for
    dtypes:    dtypes this family has kernels for
    needs_arch: if set, the family is only compiled when this target is in FLASH_EXT_ARCHS
               (e.g. "90a" for a WGMMA/TMA path), and only for that target; None = built for
               every target
    one_ptx:   compile the device code once, for the lowest target's virtual architecture, and
               assemble every target's SASS from that PTX (see family_gencode_flags)
    sm90_pass: with one_ptx, targets of sm90 and up get their SASS from a second, compute_90
               pass: code that needs sm90 PTX (the decode kernel's programmatic-dependent-launch
               wait, common/pdl.h) is then in their SASS
    splits:    kernels the launcher calls but does not compile itself (Split)
    """

    name: str
    header: str
    function: str
    hdims: tuple[int, ...] = ALL_HEADDIMS
    dtypes: tuple[str, ...] = ALL_DTYPES
    needs_arch: Optional[str] = None
    one_ptx: bool = False
    sm90_pass: bool = False
    splits: tuple[Split, ...] = ()


def _bwd_sm80_splits() -> tuple[Split, ...]:
    """The sm80 backward's main-kernel variants (csrc/sm80/bwd_main_launch.h), by tile
    and feed (big tile with bwd_kernel "v1" or bwd_kernel_v2 "v2", small tile "small_v1"), each
    with the window x dropout variants and the windowed ALiBi one. The small tile differs from the big one above d = 64 only
    (bwd_has_small_tile there, checked against the tile table when run_bwd_sm80 compiles)."""
    fn = ("flash_ext::sm80::launch_bwd_main<{{hdim}}, {{is_bf16}}, {big}, {prefetch}, {window}, "
          "{dropout}{alibi}>(flash_ext::BwdParams&, cudaStream_t)")
    feeds = (("big_v1", "true", "false", None),
             ("big_v2", "true", "true", None),
             ("small_v1", "false", "false", tuple(d for d in ALL_HEADDIMS if d > 64)))
    return tuple(
        Split(suffix=suffix, header="sm80/bwd_main_launch.cuh",
              functions=tuple(fn.format(big=big, prefetch=prefetch, window=w, dropout=dr, alibi="")
                              for dr in ("false", "true") for w in ("false", "true"))
              # ALiBi: the windowed, dropout-free variant with the bias (sm80/bwd_kernel.cuh)
              + (fn.format(big=big, prefetch=prefetch, window="true", dropout="false",
                           alibi=", true"),),
              hdims=hdims)
        for suffix, big, prefetch, hdims in feeds)


FAMILIES: tuple[Family, ...] = (
    Family(
        name="fwd_sm80",
        header="sm80/fwd_launch.cuh",
        function="flash_ext::run_fwd_sm80<{hdim}, {is_bf16}>(flash_ext::FwdParams&, cudaStream_t)",
        one_ptx=True,
    ),
    Family(
        name="bwd_sm80",
        header="sm80/bwd_launch.cuh",
        function="flash_ext::run_bwd_sm80<{hdim}, {is_bf16}>(flash_ext::BwdParams&, cudaStream_t)",
        # not one_ptx: on sm_90 the dq accumulation uses 64-bit vector atomics (sm80/bwd_gmem.h),
        # which compute_80 PTX cannot express; without them the varlen and dropout backward ran
        # 13-40% slower on an H100 (docs/perf-notes.md, session 19).
        splits=_bwd_sm80_splits(),
    ),
    Family(
        name="decode",
        header="decode/decode_launch.cuh",
        function="flash_ext::run_decode<{hdim}, {is_bf16}>(const flash_ext::DecodeParams&, cudaStream_t)",
        hdims=(64, 128, 256),  # other head dims run in the next larger kernel (predicated loads)
        one_ptx=True,
        sm90_pass=True,
    ),
    Family(
        name="fwd_sm90",
        header="sm90/fwd_launch.cuh",
        function=("flash_ext::run_fwd_sm90<{hdim}, {is_bf16}>(const flash_ext::FwdParams&, "
                  "const flash_ext::Sm90FwdConfig&, cudaStream_t)"),
        hdims=(64, 96, 128, 192, 256),
        needs_arch="90a",
    ),
    Family(
        name="bwd_sm90",
        header="sm90/bwd_launch.cuh",
        function="flash_ext::run_bwd_sm90<{hdim}, {is_bf16}>(flash_ext::BwdParams&, cudaStream_t)",
        hdims=(64, 128, 256),
        needs_arch="90a",
    ),
)


def instantiation_name(family: Family, hdim: int, dtype: str, split: Optional[Split] = None) -> str:
    """File name of one generated instantiation, e.g. ``fwd_sm80_hdim64_bf16.cu`` or, for a
    split, ``bwd_sm80_hdim64_bf16_big_v1.cu``."""
    return f"{family.name}_hdim{hdim}_{dtype}" + (f"_{split.suffix}" if split else "") + ".cu"


def family_files(family: Family, hdim: int, dtype: str) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(file name, headers, explicit instantiations) of the one file of a (head dim, dtype) of a
    family: the launcher and every split's kernels in one translation unit. Each file pays its
    own front end (parsing CuTe, ~100 s of nvcc per file for two targets on the GPU machine), so
    the split kernels share the launcher's file instead of paying it again in files of their own:
    in files of their own the sm80 backward's 44 files took 5216 s of jobs against 2580 s for 12
    (docs/perf-notes.md, session 18)."""
    headers, functions = [family.header], [family.function]
    for sp in family.splits:
        if sp.hdims is None or hdim in sp.hdims:
            if sp.header not in headers:
                headers.append(sp.header)
            functions.extend(sp.functions)
    return [(instantiation_name(family, hdim, dtype), tuple(headers), tuple(functions))]


# ----------------------------------------------------------------------------------------------
# Architectures
# ----------------------------------------------------------------------------------------------

# Targets CUDA 13 nvcc accepts that can run the sm80 (mma.sync/ldmatrix/cp.async) path.
SUPPORTED_ARCHS: tuple[str, ...] = (
    "80", "86", "87", "88", "89", "90", "90a",
    "100", "100a", "103", "103a", "110", "110a", "120", "120a", "121", "121a",
)
DEFAULT_ARCHS = "80+PTX;90a"
_SPLIT = re.compile(r"[;,\s]+")


@dataclass(frozen=True)
class Arch:
    """One compilation target: ``name`` like "80" or "90a"; ``ptx`` also embeds compute_NN PTX."""

    name: str
    ptx: bool = False

    @property
    def number(self) -> int:
        """Numeric compute capability, e.g. 90 for "90a"."""
        return int(self.name.rstrip("af"))

    def __str__(self) -> str:
        return self.name + ("+PTX" if self.ptx else "")


def _split(value: str) -> list[str]:
    return [tok for tok in _SPLIT.split(value.strip()) if tok]


def parse_archs(value: Optional[str]) -> list[Arch]:
    """Parse FLASH_EXT_ARCHS, e.g. ``"80;90a"``, ``"80+PTX,86"``, ``"sm_90a"``, ``"8.0"``.

    Separators: ';', ',' or whitespace. None or an empty string gives the default
    ``"80+PTX;90a"``. Accepted spellings of one target: ``80``, ``8.0``, ``sm_80``,
    ``compute_80``, each optionally followed by ``+PTX`` (case-insensitive).
    Returns the targets de-duplicated (a ``+PTX`` on any duplicate wins), sorted by number.
    Raises BuildConfigError for unknown targets, targets below 80 (the kernels use sm80
    instructions), and ``+PTX`` on an arch-specific target such as ``90a``.
    """
    if value is None or not value.strip():
        value = DEFAULT_ARCHS
    found: dict[str, bool] = {}
    for raw in _split(value):
        tok = raw.strip().lower()
        ptx = False
        if tok.endswith("+ptx"):
            ptx, tok = True, tok[: -len("+ptx")]
        for prefix in ("sm_", "compute_"):
            if tok.startswith(prefix):
                tok = tok[len(prefix):]
        m = re.fullmatch(r"(\d+)\.(\d)([af]?)", tok)  # "8.0", "9.0a"
        if m:
            tok = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        if not re.fullmatch(r"\d+[af]?", tok):
            raise BuildConfigError(
                f"FLASH_EXT_ARCHS: cannot parse {raw!r}; expected targets like 80, 86, 89, 90a, "
                f"'80+PTX', separated by ';' or ','")
        if int(tok.rstrip("af")) < 80:
            raise BuildConfigError(
                f"FLASH_EXT_ARCHS: {raw!r} is not supported; flash_ext needs compute capability "
                f"8.0 or newer (supported: {', '.join(SUPPORTED_ARCHS)})")
        if tok not in SUPPORTED_ARCHS:
            raise BuildConfigError(
                f"FLASH_EXT_ARCHS: unknown target {raw!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        if ptx and tok.endswith("a"):
            raise BuildConfigError(
                f"FLASH_EXT_ARCHS: {raw!r}: PTX of an arch-specific target ({tok}) runs only on "
                f"that exact GPU, so it gives no forward compatibility; add e.g. '80+PTX' instead")
        found[tok] = found.get(tok, False) or ptx
    return sorted((Arch(n, p) for n, p in found.items()), key=lambda a: (a.number, a.name))


def gencode_flags(archs: Sequence[Arch]) -> list[str]:
    """nvcc flags for ``archs``: ``-gencode=arch=compute_80,code=sm_80`` per target, plus
    ``-gencode=arch=compute_80,code=compute_80`` for a target marked ``+PTX``."""
    flags = []
    for a in archs:
        flags.append(f"-gencode=arch=compute_{a.name},code=sm_{a.name}")
        if a.ptx:
            flags.append(f"-gencode=arch=compute_{a.name},code=compute_{a.name}")
    return flags


def _sass_codes(archs: Sequence[Arch]) -> list[str]:
    """sm_NN of each target, once each, in order ("90a" gives plain sm_90: a family's own pass)."""
    codes = []
    for a in archs:
        if f"sm_{a.number}" not in codes:
            codes.append(f"sm_{a.number}")
    return codes


def family_gencode_flags(family: Family, archs: Sequence[Arch]) -> list[str]:
    """The -gencode flags of ``family``'s files, where they differ from the build's.

    - A family that needs one target (``needs_arch``, e.g. "90a") compiles for that target only:
      no device pass for the others (its files are empty there).
    - A ``one_ptx`` family with ``sm90_pass`` does so for its targets below sm90, and runs a
      second, compute_90 pass for the rest: "80+PTX;90a" gives
      ``-gencode=arch=compute_80,code=[sm_80,compute_80]`` and ``-gencode=arch=compute_90,code=[sm_90]``.
    - A ``one_ptx`` family (the sm80 kernels: mma.sync, ldmatrix, cp.async, nothing newer) runs
      nvcc's front end and optimizer (cicc, most of a file's compile time) once, for the lowest
      target, and ptxas assembles each target's SASS from that PTX: "80+PTX;90a" gives
      ``-gencode=arch=compute_80,code=[sm_80,sm_90,compute_80]``. An arch-specific target ("90a")
      gets its plain SASS (sm_90), which the GPU runs alike. When the lowest target is itself
      arch-specific, its PTX runs on that GPU only, so the build's flags stay.
    Other families: the build's flags (``gencode_flags``)."""
    if family.needs_arch is not None:
        return gencode_flags([a for a in archs if a.name == family.needs_arch])
    if not family.one_ptx or not archs or not archs[0].name.isdigit():
        return gencode_flags(archs)
    if family.sm90_pass and archs[0].number < 90 and any(a.number >= 90 for a in archs):
        below = [a for a in archs if a.number < 90]
        high = [a for a in archs if a.number >= 90]
        flags = family_gencode_flags(dataclasses.replace(family, sm90_pass=False), below)
        flags.append(f"-gencode=arch=compute_90,code=[{','.join(_sass_codes(high))}]")
        flags += [f"-gencode=arch=compute_{a.name},code=compute_{a.name}" for a in high if a.ptx]
        return flags
    low = archs[0].name
    codes = _sass_codes(archs) + ([f"compute_{low}"] if archs[0].ptx else [])
    flags = [f"-gencode=arch=compute_{low},code=[{','.join(codes)}]"]
    flags += [f"-gencode=arch=compute_{a.name},code=compute_{a.name}" for a in archs[1:] if a.ptx]
    return flags


def source_gencode_flags(cfg: "BuildConfig", families: Sequence["Family"] = None) -> dict[str, list[str]]:
    """File name (in csrc/instantiations/) -> its -gencode flags, for the files whose flags differ
    from the build's (``gencode_flags(cfg.archs)``); setup.py gives them to those files alone."""
    families = FAMILIES if families is None else families
    build = gencode_flags(cfg.archs)
    out = {}
    for fam in families:
        flags = family_gencode_flags(fam, cfg.archs)
        if flags == build:
            continue
        for name in instantiation_files(cfg, [fam]):
            out[name] = flags
    return out


# ----------------------------------------------------------------------------------------------
# Head dims, dtypes, simple values
# ----------------------------------------------------------------------------------------------

_DTYPE_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
}


def parse_headdims(value: Optional[str]) -> list[int]:
    """Parse FLASH_EXT_HEADDIMS, e.g. ``"64,128"``; None, "" or "all" gives all kernel head dims
    (32, 64, 96, 128, 192, 256). Returns a sorted, de-duplicated list.
    Raises BuildConfigError for a value that is not one of the kernel head dims."""
    if value is None or not value.strip() or value.strip().lower() == "all":
        return list(ALL_HEADDIMS)
    dims = set()
    for tok in _split(value):
        if not tok.isdigit() or int(tok) not in ALL_HEADDIMS:
            raise BuildConfigError(
                f"FLASH_EXT_HEADDIMS: {tok!r} is not a kernel head dim; choose from "
                f"{', '.join(map(str, ALL_HEADDIMS))} (other head dims run in the next larger kernel)")
        dims.add(int(tok))
    return sorted(dims)


def parse_dtypes(value: Optional[str]) -> list[str]:
    """Parse FLASH_EXT_DTYPES, e.g. ``"bf16"``; None, "" or "all" gives ["fp16", "bf16"].
    Aliases float16/half and bfloat16 are accepted. Returns canonical names in the order
    fp16, bf16. Raises BuildConfigError for anything else."""
    if value is None or not value.strip() or value.strip().lower() == "all":
        return list(ALL_DTYPES)
    chosen = set()
    for tok in _split(value):
        canon = _DTYPE_ALIASES.get(tok.lower())
        if canon is None:
            raise BuildConfigError(f"FLASH_EXT_DTYPES: {tok!r} is not supported; choose from fp16, bf16")
        chosen.add(canon)
    return [d for d in ALL_DTYPES if d in chosen]


def parse_bool(name: str, value: Optional[str]) -> bool:
    """Parse a 0/1 style knob: unset, "", 0, false, no, off -> False; 1, true, yes, on -> True."""
    if value is None:
        return False
    v = value.strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise BuildConfigError(f"{name}: expected 0 or 1, got {value!r}")


def parse_positive_int(name: str, value: Optional[str]) -> Optional[int]:
    """Parse an optional positive integer knob; unset or "" gives None."""
    if value is None or not value.strip():
        return None
    v = value.strip()
    if not v.isdigit() or int(v) < 1:
        raise BuildConfigError(f"{name}: expected a positive integer, got {value!r}")
    return int(v)


# ----------------------------------------------------------------------------------------------
# The whole configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class BuildConfig:
    """The parsed knobs. Build one with ``BuildConfig.from_env(os.environ)``."""

    archs: list[Arch] = field(default_factory=lambda: parse_archs(None))
    headdims: list[int] = field(default_factory=lambda: list(ALL_HEADDIMS))
    dtypes: list[str] = field(default_factory=lambda: list(ALL_DTYPES))
    ptxas_verbose: bool = False
    nvcc_threads: Optional[int] = None
    cxx_std: Optional[str] = None  # None: decided from the torch version by setup.py
    sm90_trace: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "BuildConfig":
        """Read every FLASH_EXT_* knob from ``env`` (a dict or os.environ)."""
        std = env.get("FLASH_EXT_CXX_STD", "").strip() or None
        if std is not None and not re.fullmatch(r"c\+\+\d\d", std):
            raise BuildConfigError(f"FLASH_EXT_CXX_STD: expected e.g. c++17 or c++20, got {std!r}")
        return cls(
            archs=parse_archs(env.get("FLASH_EXT_ARCHS")),
            headdims=parse_headdims(env.get("FLASH_EXT_HEADDIMS")),
            dtypes=parse_dtypes(env.get("FLASH_EXT_DTYPES")),
            ptxas_verbose=parse_bool("FLASH_EXT_PTXAS_VERBOSE", env.get("FLASH_EXT_PTXAS_VERBOSE")),
            nvcc_threads=parse_positive_int("FLASH_EXT_NVCC_THREADS", env.get("FLASH_EXT_NVCC_THREADS")),
            cxx_std=std,
            sm90_trace=parse_bool("FLASH_EXT_SM90_TRACE", env.get("FLASH_EXT_SM90_TRACE")),
        )

    def has_arch(self, name: str) -> bool:
        """True if target ``name`` (e.g. "90a") is being built."""
        return any(a.name == name for a in self.archs)


def instantiation_files(cfg: BuildConfig, families: Sequence[Family] = FAMILIES) -> list[str]:
    """File names (relative to csrc/instantiations/) selected by ``cfg``: every family whose
    ``needs_arch`` is built, crossed with the selected head dims and dtypes it has kernels for."""
    names = []
    for fam in families:
        if fam.needs_arch is not None and not cfg.has_arch(fam.needs_arch):
            continue
        for d in cfg.headdims:
            if d not in fam.hdims:
                continue
            for t in cfg.dtypes:
                if t in fam.dtypes:
                    names += [name for name, _, _ in family_files(fam, d, t)]
    return names


def build_info(cfg: BuildConfig) -> str:
    """The string flash_ext::build_info() returns, e.g.
    ``"archs=80+PTX;90a hdims=32,64,96,128,192,256 dtypes=fp16,bf16"``."""
    return (f"archs={';'.join(str(a) for a in cfg.archs)} "
            f"hdims={','.join(str(d) for d in cfg.headdims)} "
            f"dtypes={','.join(cfg.dtypes)}" + (" sm90_trace=1" if cfg.sm90_trace else ""))


def macro_defines(cfg: BuildConfig) -> list[str]:
    """Preprocessor flags for flash_api.cpp (and the kernels), unquoted (one argv entry each):
    ``-DFLASH_EXT_HDIM_<d>`` per built head dim, ``-DFLASH_EXT_FP16`` / ``-DFLASH_EXT_BF16``,
    ``-DFLASH_EXT_SM90A`` when 90a is built, and ``-DFLASH_EXT_BUILD_INFO="<build_info>"``
    (a C string literal). setup.py shell-quotes these for ninja."""
    defs = [f"-DFLASH_EXT_HDIM_{d}" for d in cfg.headdims]
    defs += [f"-DFLASH_EXT_{t.upper()}" for t in cfg.dtypes]
    if cfg.has_arch("90a"):
        defs.append("-DFLASH_EXT_SM90A")
    defs.append(f'-DFLASH_EXT_BUILD_INFO="{build_info(cfg)}"')
    return defs


def common_defines(cfg: BuildConfig) -> list[str]:
    """Preprocessor flags for every file, host and kernel alike: those that change a struct the
    two share (``-DFLASH_EXT_SM90_TRACE`` adds FwdParams::sm90_trace)."""
    return ["-DFLASH_EXT_SM90_TRACE"] if cfg.sm90_trace else []


def cxx_std_for_torch(torch_version: str) -> str:
    """Host C++ standard for the torch-facing files: "c++20" for torch >= 2.11, else "c++17".

    torch >= 2.14's headers require C++20. torch 2.11 (the GPU machine) builds with either, and
    using C++20 there too means flash_api.cpp is compiled under the same standard on the
    workstation (torch 2.14) and on the GPU machine, so a C++20-only construct cannot pass
    here and fail there. ``torch_version`` like "2.14.1+cu130" or "2.11.0"; unparsable -> c++20.
    """
    m = re.match(r"(\d+)\.(\d+)", torch_version)
    if not m:
        return "c++20"
    return "c++20" if (int(m.group(1)), int(m.group(2))) >= (2, 11) else "c++17"


# ----------------------------------------------------------------------------------------------
# Dependencies: CUTLASS and the CUDA headers shipped in nvidia-* wheels
# ----------------------------------------------------------------------------------------------

CUTLASS_PIP_VERSION = "4.2.0.0"


def _cutlass_ok(include_dir: Path) -> bool:
    return (include_dir / "cute" / "tensor.hpp").is_file() and (include_dir / "cutlass" / "cutlass.h").is_file()


def _package_dirs(name: str) -> list[Path]:
    """Directories of a top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p).resolve() for p in (spec.submodule_search_locations or [])]


def find_cutlass(repo_root: os.PathLike | str, env: Mapping[str, str]) -> tuple[list[str], str]:
    """Locate the CUTLASS/CuTe headers. Returns (include dirs, description of where found).

    Order: ``$CUTLASS_PATH/include``; ``<repo>/third_party/cutlass/include``; the
    ``nvidia-cutlass`` pip package (``cutlass_library/source/include``, found with
    importlib.util.find_spec, not imported). The list also holds CUTLASS's
    ``tools/util/include`` when present. A set but wrong CUTLASS_PATH is an error (no silent
    fallback). Nothing found raises BuildConfigError naming the three ways to provide CUTLASS.
    """
    def with_util(root: Path) -> list[str]:
        dirs = [str(root / "include")]
        util = root / "tools" / "util" / "include"
        if util.is_dir():
            dirs.append(str(util))
        return dirs

    cp = env.get("CUTLASS_PATH", "").strip()
    if cp:
        root = Path(cp).expanduser().resolve()
        if not _cutlass_ok(root / "include"):
            raise BuildConfigError(
                f"CUTLASS_PATH={cp} has no include/cute/tensor.hpp and include/cutlass/cutlass.h; "
                f"point it at a CUTLASS checkout (v4.2) or unset it")
        return with_util(root), f"CUTLASS_PATH ({root})"

    tp = Path(repo_root) / "third_party" / "cutlass"
    if _cutlass_ok(tp / "include"):
        return with_util(tp), f"third_party/cutlass ({tp})"

    for pkg in _package_dirs("cutlass_library"):
        src = pkg / "source"
        if _cutlass_ok(src / "include"):
            return with_util(src), f"nvidia-cutlass package ({src})"

    raise BuildConfigError(
        "CUTLASS/CuTe headers not found. Provide them in one of three ways:\n"
        "  1. set CUTLASS_PATH to a CUTLASS v4.2 checkout (its include/ is used);\n"
        "  2. git clone --branch v4.2.0 --depth 1 https://github.com/NVIDIA/cutlass third_party/cutlass\n"
        f"  3. pip install nvidia-cutlass=={CUTLASS_PIP_VERSION}\n"
        "(see third_party/README.md)")


def find_nvidia_wheel_include(header: str = "cusparse.h") -> Optional[str]:
    """The include dir of an installed nvidia-* wheel that holds ``header`` (torch >= 2.14's
    ATen/cuda headers include cusparse.h, which the CUDA toolkit here lacks). Looks in
    ``site-packages/nvidia/cu13/include``, then any ``nvidia/*/include``. None if absent."""
    for base in _package_dirs("nvidia"):
        candidates = [base / "cu13" / "include"] + sorted(base.glob("*/include"))
        for inc in candidates:
            if (inc / header).is_file():
                return str(inc)
    return None
