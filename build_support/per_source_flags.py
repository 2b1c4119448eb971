"""Per-file nvcc -gencode flags in torch's ninja build.

torch.utils.cpp_extension gives every .cu file of an extension the same nvcc flags. Some kernel
files need fewer device passes than the build's target list (build_config.source_gencode_flags):
a Hopper-only file needs no sm_80 pass, and the sm80 kernels need one front end and optimizer
pass for all targets. This module rewrites the ninja file torch writes so that those files get
their own -gencode flags (a ninja per-build variable), everything else unchanged.

It wraps torch's private ``_write_ninja_file``; if a torch version lacks it, or a build line is
not where it is expected, the build goes on with the common flags (correct, only slower) after a
warning.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import warnings
from typing import Iterator, Mapping, Sequence


def rewrite_ninja(text: str, gencode_by_file: Mapping[str, Sequence[str]]) -> tuple[str, list[str]]:
    """``text`` of a torch ninja file with ``cuda_post_cflags`` overridden, for the
    ``cuda_compile`` build lines whose source file's base name is a key of ``gencode_by_file``:
    the common flags without their -gencode flags, plus the file's. Returns (new text, the names
    that matched)."""
    lines = text.split("\n")
    common = next((ln for ln in lines if ln.startswith("cuda_post_cflags = ")), None)
    if common is None:
        return text, []
    kept = [f for f in shlex.split(common[len("cuda_post_cflags = "):]) if not f.startswith("-gencode")]
    out, matched = [], []
    for ln in lines:
        out.append(ln)
        if not ln.startswith("build ") or ": cuda_compile " not in ln:
            continue
        name = os.path.basename(ln.split(": cuda_compile ", 1)[1].strip())
        flags = gencode_by_file.get(name)
        if flags is None:
            continue
        out.append("  cuda_post_cflags = " + " ".join(shlex.quote(f) for f in kept + list(flags)))
        matched.append(name)
    return "\n".join(out), matched


@contextlib.contextmanager
def per_source_gencode(gencode_by_file: Mapping[str, Sequence[str]]) -> Iterator[None]:
    """Within the block, torch's ninja files give the named files their own -gencode flags."""
    try:
        import torch.utils.cpp_extension as cpp_ext
        original = cpp_ext._write_ninja_file
    except (ImportError, AttributeError):
        warnings.warn("flash_ext build: torch's ninja writer not found; every file gets every "
                      "target (a slower build)")
        yield
        return

    def write_ninja_file(path, *args, **kwargs):
        original(path, *args, **kwargs)
        with open(path) as f:
            text = f.read()
        new, matched = rewrite_ninja(text, gencode_by_file)
        if gencode_by_file and not matched:
            warnings.warn("flash_ext build: no build line matched the per-file target list; every "
                          "file gets every target (a slower build)")
        with open(path, "w") as f:
            f.write(new)

    cpp_ext._write_ninja_file = write_ninja_file
    try:
        yield
    finally:
        cpp_ext._write_ninja_file = original
