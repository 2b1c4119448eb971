"""Build knob parsing in build_support/build_config.py (pure Python, CPU only)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build_support"))

import build_config as bc  # noqa: E402


def names(archs):
    return [str(a) for a in archs]


def test_archs_basic_gencode():
    archs = bc.parse_archs("80;90a")
    assert [a.name for a in archs] == ["80", "90a"]
    assert bc.gencode_flags(archs) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90a,code=sm_90a",
    ]


def test_archs_ptx_adds_compute_code():
    flags = bc.gencode_flags(bc.parse_archs("80+PTX"))
    assert flags == ["-gencode=arch=compute_80,code=sm_80",
                     "-gencode=arch=compute_80,code=compute_80"]


@pytest.mark.parametrize("spelling", ["sm_86", "8.6", "compute_86", " 86 "])
def test_archs_spellings(spelling):
    assert names(bc.parse_archs(spelling)) == ["86"]


def test_archs_separators_dedup_and_sort():
    assert names(bc.parse_archs("90a, 80 ;86;80+PTX")) == ["80+PTX", "86", "90a"]


def test_archs_default():
    assert names(bc.parse_archs(None)) == names(bc.parse_archs("")) == ["80+PTX", "90a"]


@pytest.mark.parametrize("bad", ["75", "70;80", "91", "sm_xx", "90a+PTX", "abc"])
def test_bad_arch_raises(bad):
    with pytest.raises(bc.BuildConfigError, match="FLASH_EXT_ARCHS"):
        bc.parse_archs(bad)
    assert issubclass(bc.BuildConfigError, ValueError)


def test_headdims_narrowing():
    assert bc.parse_headdims("128,64") == [64, 128]
    assert bc.parse_headdims("64;64") == [64]
    assert bc.parse_headdims(None) == bc.parse_headdims("all") == [32, 64, 96, 128, 192, 256]


@pytest.mark.parametrize("bad", ["80", "0", "x", "64,300"])
def test_headdims_bad(bad):
    with pytest.raises(bc.BuildConfigError, match="FLASH_EXT_HEADDIMS"):
        bc.parse_headdims(bad)


def test_dtypes():
    assert bc.parse_dtypes("bf16") == ["bf16"]
    assert bc.parse_dtypes("bfloat16,half") == ["fp16", "bf16"]
    assert bc.parse_dtypes(None) == ["fp16", "bf16"]
    with pytest.raises(bc.BuildConfigError, match="FLASH_EXT_DTYPES"):
        bc.parse_dtypes("fp32")


def test_from_env_and_instantiations():
    cfg = bc.BuildConfig.from_env({"FLASH_EXT_ARCHS": "90a", "FLASH_EXT_HEADDIMS": "64,128",
                                   "FLASH_EXT_DTYPES": "bf16"})
    assert names(cfg.archs) == ["90a"] and cfg.headdims == [64, 128] and cfg.dtypes == ["bf16"]
    files = bc.instantiation_files(cfg)
    # The forward family is always there; other families (bwd, ...) follow the same narrowing.
    assert "fwd_sm80_hdim64_bf16.cu" in files and "fwd_sm80_hdim128_bf16.cu" in files
    assert len(files) == len(set(files))
    for f in files:
        assert "_bf16" in f and ("_hdim64_" in f or "_hdim128_" in f), f
        assert "_fp16" not in f, f
    narrower = bc.BuildConfig.from_env({"FLASH_EXT_ARCHS": "90a", "FLASH_EXT_HEADDIMS": "64",
                                        "FLASH_EXT_DTYPES": "bf16"})
    assert set(bc.instantiation_files(narrower)) == {f for f in files if "_hdim64_" in f}
    info = bc.build_info(cfg)
    assert info == "archs=90a hdims=64,128 dtypes=bf16"
    defs = bc.macro_defines(cfg)
    assert "-DFLASH_EXT_HDIM_64" in defs and "-DFLASH_EXT_BF16" in defs
    assert "-DFLASH_EXT_FP16" not in defs and "-DFLASH_EXT_SM90A" in defs


def test_bool_and_int_knobs():
    assert bc.parse_bool("X", None) is False and bc.parse_bool("X", "1") is True
    with pytest.raises(bc.BuildConfigError):
        bc.parse_bool("X", "maybe")
    assert bc.parse_positive_int("N", "4") == 4 and bc.parse_positive_int("N", "") is None
    with pytest.raises(bc.BuildConfigError):
        bc.parse_positive_int("N", "0")


def test_narrowed_build_info_matches_build_info():
    # tests/conftest.py skips tests of kernels a narrowed build lacks; it reads build_info().
    from conftest import narrowed_build_info
    full = bc.build_info(bc.BuildConfig.from_env({}))
    assert not narrowed_build_info(full)
    assert narrowed_build_info(bc.build_info(bc.BuildConfig.from_env({"FLASH_EXT_HEADDIMS": "64,128"})))
    assert narrowed_build_info(bc.build_info(bc.BuildConfig.from_env({"FLASH_EXT_DTYPES": "bf16"})))
    # the order of the knob's values does not matter
    assert not narrowed_build_info(bc.build_info(bc.BuildConfig.from_env({"FLASH_EXT_DTYPES": "bf16,fp16"})))


def test_sm90_trace_knob():
    plain = bc.BuildConfig.from_env({})
    assert plain.sm90_trace is False and bc.common_defines(plain) == []
    assert "trace" not in bc.build_info(plain)
    cfg = bc.BuildConfig.from_env({"FLASH_EXT_SM90_TRACE": "1", "FLASH_EXT_HEADDIMS": "256"})
    assert cfg.sm90_trace and bc.common_defines(cfg) == ["-DFLASH_EXT_SM90_TRACE"]
    assert bc.build_info(cfg).endswith(" sm90_trace=1")
    with pytest.raises(bc.BuildConfigError):
        bc.BuildConfig.from_env({"FLASH_EXT_SM90_TRACE": "sometimes"})


def test_bwd_sm80_one_file_per_head_dim_and_dtype():
    # The sm80 backward of one (head dim, dtype) compiles in one file: its launcher plus every
    # main-kernel variant (csrc/sm80/bwd_main_launch.h): tile x feed x (window x dropout, and the
    # windowed ALiBi one), the small tile above d = 64 only (bwd_has_small_tile in that header).
    fam = next(f for f in bc.FAMILIES if f.name == "bwd_sm80")
    for d in fam.hdims:
        files = bc.family_files(fam, d, "bf16")
        assert [n for n, _, _ in files] == [f"bwd_sm80_hdim{d}_bf16.cu"]
        _, headers, functions = files[0]
        assert headers == ("sm80/bwd_launch.cuh", "sm80/bwd_main_launch.cuh")
        variants = [f for f in functions if "launch_bwd_main" in f]
        assert len(variants) == (15 if d > 64 else 10) and len(set(variants)) == len(variants)
    # A narrowed build selects just its files.
    cfg = bc.BuildConfig.from_env({"FLASH_EXT_HEADDIMS": "128", "FLASH_EXT_DTYPES": "fp16"})
    files = bc.instantiation_files(cfg)
    assert {f for f in files if f.startswith("bwd_sm80")} == {"bwd_sm80_hdim128_fp16.cu"}


def test_generated_files_up_to_date():
    # What CI checks with `python build_support/gen_instantiations.py --check`.
    import gen_instantiations
    assert gen_instantiations.main(["--check"]) == 0



# ----------------------------------------------------------------------------------------------
# Per-file target lists (build_config.family_gencode_flags, build_support/per_source_flags.py)
# ----------------------------------------------------------------------------------------------

def _family(name):
    return next(f for f in bc.FAMILIES if f.name == name)


def test_default_build_per_file_gencode():
    cfg = bc.BuildConfig.from_env({})
    by_file = bc.source_gencode_flags(cfg)
    # the sm80 forward: one compute_80 pass, SASS for sm_80 and sm_90 (H100) and the PTX
    assert by_file["fwd_sm80_hdim128_bf16.cu"] == ["-gencode=arch=compute_80,code=[sm_80,sm_90,compute_80]"]
    # Hopper-only families: the 90a pass only
    assert by_file["fwd_sm90_hdim64_fp16.cu"] == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert by_file["bwd_sm90_hdim256_bf16.cu"] == ["-gencode=arch=compute_90a,code=sm_90a"]
    # the sm80 backward keeps the build's passes (compute_90a for sm_90's vector atomics)
    assert not any(n.startswith("bwd_sm80_") for n in by_file)
    assert set(by_file) <= set(bc.instantiation_files(cfg))


@pytest.mark.parametrize("archs, want", [
    ("80;86;90a", ["-gencode=arch=compute_80,code=[sm_80,sm_86,sm_90]"]),
    ("80;90+PTX;100a", ["-gencode=arch=compute_80,code=[sm_80,sm_90,sm_100]",
                        "-gencode=arch=compute_90,code=compute_90"]),
    ("86+PTX;120a", ["-gencode=arch=compute_86,code=[sm_86,sm_120,compute_86]"]),
])
def test_one_ptx_family_flags(archs, want):
    assert bc.family_gencode_flags(_family("fwd_sm80"), bc.parse_archs(archs)) == want


@pytest.mark.parametrize("archs, want", [
    # the default build: sm_80 and its PTX from compute_80, sm_90 from compute_90 (the PDL wait)
    ("80+PTX;90a", ["-gencode=arch=compute_80,code=[sm_80,compute_80]",
                    "-gencode=arch=compute_90,code=[sm_90]"]),
    ("80;86;89;90a;100a", ["-gencode=arch=compute_80,code=[sm_80,sm_86,sm_89]",
                           "-gencode=arch=compute_90,code=[sm_90,sm_100]"]),
    ("80;90+PTX", ["-gencode=arch=compute_80,code=[sm_80]",
                   "-gencode=arch=compute_90,code=[sm_90]", "-gencode=arch=compute_90,code=compute_90"]),
    ("80;86", ["-gencode=arch=compute_80,code=[sm_80,sm_86]"]),  # no sm90 target: one pass
])
def test_decode_family_has_an_sm90_pass(archs, want):
    assert bc.family_gencode_flags(_family("decode"), bc.parse_archs(archs)) == want


def test_decode_family_keeps_build_flags_at_sm90_and_up():
    for archs in ("90a", "90;100a"):
        parsed = bc.parse_archs(archs)
        flags = bc.family_gencode_flags(_family("decode"), parsed)
        assert flags == bc.family_gencode_flags(_family("fwd_sm80"), parsed)


def test_one_ptx_keeps_build_flags_when_lowest_target_is_arch_specific():
    archs = bc.parse_archs("90a;100a")  # compute_90a PTX runs on sm_90a only
    assert bc.family_gencode_flags(_family("fwd_sm80"), archs) == bc.gencode_flags(archs)
    assert bc.source_gencode_flags(bc.BuildConfig.from_env({"FLASH_EXT_ARCHS": "90a"})) == {}


def test_rewrite_ninja_overrides_only_named_files():
    from per_source_flags import rewrite_ninja
    text = "\n".join([
        "cuda_post_cflags = -O3 '-DX=\"a b\"' -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a -lineinfo",
        "build /b/fwd_sm80_hdim64_bf16.o: cuda_compile /s/csrc/instantiations/fwd_sm80_hdim64_bf16.cu",
        "build /b/bwd_sm80_hdim64_bf16.o: cuda_compile /s/csrc/instantiations/bwd_sm80_hdim64_bf16.cu",
        "build /b/ops_fwd.o: compile /s/csrc/ops_fwd.cpp", ""])
    new, matched = rewrite_ninja(text, {"fwd_sm80_hdim64_bf16.cu": ["-gencode=arch=compute_80,code=[sm_80,sm_90]"]})
    assert matched == ["fwd_sm80_hdim64_bf16.cu"]
    lines = new.split("\n")
    i = lines.index("build /b/fwd_sm80_hdim64_bf16.o: cuda_compile /s/csrc/instantiations/fwd_sm80_hdim64_bf16.cu")
    assert lines[i + 1] == ("  cuda_post_cflags = -O3 '-DX=\"a b\"' -lineinfo "
                            "'-gencode=arch=compute_80,code=[sm_80,sm_90]'")
    assert lines[i + 2].startswith("build /b/bwd_sm80")  # untouched: no override line
    assert new.replace(lines[i + 1] + "\n", "") == text
