"""The Hopper kernels must run on the tensor cores' Hopper instructions: their SASS shows HGMMA.

Needs the built extension with 90a in FLASH_EXT_ARCHS and cuobjdump (from the CUDA toolkit, or
`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`). Runs on CPU-only machines (CI).
"""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

import flash_ext


def _find_cuobjdump():
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    for base in [os.environ.get("CUDA_HOME", "/usr/local/cuda")] + sys.path:
        for cand in (os.path.join(base, "bin", "cuobjdump"),
                     os.path.join(base, "nvidia", "cu13", "bin", "cuobjdump")):
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
    return None


def _extension_path():
    hits = glob.glob(os.path.join(os.path.dirname(flash_ext.__file__), "_C*.so"))
    return hits[0] if hits else None


def _sass_by_function(so_path, exe):
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(exe) + os.pathsep + env.get("PATH", "")  # cuobjdump runs nvdisasm
    out = subprocess.run([exe, "--dump-sass", so_path], capture_output=True, text=True, env=env,
                         check=True).stdout
    funcs, name = {}, None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
        elif name:
            funcs[name].append(line)
    return funcs


def _sm90_sass(kernel):
    """SASS by function of the extension's sm90 `kernel` instantiations (skips without cuobjdump)."""
    exe = _find_cuobjdump()
    if exe is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    so = _extension_path()
    assert so, "flash_ext/_C*.so not found next to the package"
    funcs = _sass_by_function(so, exe)
    return {n: body for n, body in funcs.items() if f"sm90{len(kernel)}{kernel}" in n}


@pytest.mark.skipif("90a" not in flash_ext.build_info(), reason="this build has no sm_90a kernels")
@pytest.mark.parametrize("kernel", ["fwd_kernel", "bwd_kernel"])
def test_sm90_kernels_use_hgmma(kernel):
    sm90 = _sm90_sass(kernel)
    assert sm90, f"no sm90 {kernel} in the extension's SASS"
    for name, body in sm90.items():
        text = "\n".join(body)
        if "EXIT" in text and "HGMMA" not in text and len(body) < 50:
            continue  # an empty sm_80 stub of the sm90 kernel (its body needs sm_90a)
        assert "HGMMA" in text, f"{name} has no HGMMA instruction"
    assert any("HGMMA" in "\n".join(b) for b in sm90.values())


def _serialized_hgmma_share(body):
    """Full wgmma waits per HGMMA instruction of a kernel. ptxas serializes a kernel's wgmmas when
    it cannot keep their asynchronous operands in registers (warning C7512, which does not fail a
    build): every HGMMA then closes its own group and is waited for at once (1.0); a pipelined
    kernel waits for everything only a few times per loop (the Hopper kernels: 0.03-0.12)."""
    hgmma = sum(1 for line in body if "HGMMA" in line)
    waits = sum(1 for line in body if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line)
    return waits / max(1, hgmma)


@pytest.mark.skipif("90a" not in flash_ext.build_info(), reason="this build has no sm_90a kernels")
@pytest.mark.parametrize("kernel", ["fwd_kernel", "bwd_kernel"])
def test_sm90_kernels_keep_wgmma_async(kernel):
    """No Hopper kernel runs its wgmmas one at a time (a register-pressure fallback of ptxas that
    cost a d = 64 backward draft its pipelining without a spill or an error)."""
    sm90 = _sm90_sass(kernel)
    checked = 0
    for name, body in sm90.items():
        if not any("HGMMA" in line for line in body):
            continue  # an empty sm_80 stub
        share = _serialized_hgmma_share(body)
        assert share < 0.5, f"{name}: {share:.2f} full wgmma waits per HGMMA (serialized wgmma, ptxas C7512)"
        checked += 1
    assert checked, f"no sm90 {kernel} with HGMMA in the extension's SASS"
