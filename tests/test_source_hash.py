"""tools/source_hash.sh: the id of the sources a GPU run built (CPU only; needs bash and sha1sum)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["csrc", "flash_ext", "tests", "setup.py", "build_support", "tools/source_hash.sh"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha1sum") is None,
                                reason="needs bash and sha1sum")


def source_hash(root, cwd=None):
    out = subprocess.run(["bash", str(root / "tools" / "source_hash.sh")], cwd=cwd or "/",
                         capture_output=True, text=True, check=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{12}", out), out
    return out


def copy_sources(dst):
    for part in PARTS:
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, dst / part, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            (dst / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / part)


def test_same_without_git_and_from_any_directory(tmp_path):
    copy_sources(tmp_path)  # no .git, no build outputs: what the GPU machine may see
    assert source_hash(tmp_path) == source_hash(ROOT) == source_hash(ROOT, cwd=ROOT / "docs")


def test_changes_with_a_kernel_source(tmp_path):
    copy_sources(tmp_path)
    before = source_hash(tmp_path)
    with open(tmp_path / "csrc" / "params.h", "a") as f:
        f.write("\n// edited\n")
    assert source_hash(tmp_path) != before
