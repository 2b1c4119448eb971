"""Compare the SASS of the kernels between two versions of the sources (refactors must leave it
byte-identical, or say where and why not).

  python tools/sass_diff.py dump OUTDIR [--rev REV] [--arch 90a|80:90] FILE...
      compile csrc/instantiations/FILE.cu (e.g. fwd_sm90_hdim128_bf16) with setup.py's kernel
      flags (no torch needed) and write OUTDIR/<function>.sass per kernel; --rev REV compiles
      that git revision's tree (a temporary worktree) instead of the working tree
  python tools/sass_diff.py so OUTDIR LIB.so|SASS.txt[.gz]
      the same split from a built extension (cuobjdump --dump-sass) or a saved dump of one
  python tools/sass_diff.py compare DIR_A DIR_B [--key-a REGEX] [--key-b REGEX]
      per kernel: identical bytes (the dump's column padding ignored), identical up to kernel-parameter offsets (c[0x0][...]: the
      params struct's layout moved), or different (the first differing lines are shown).
      Kernels are paired by name; where a refactor renamed them, --key-a / --key-b pair them by
      the groups a regex captures from each side's demangled name (named groups in name order,
      else positional), e.g. for the Hopper forward before and after it became a shell of parts:
        --key-a 'FwdTraits<(?P<t>[^>]*)>, (?P<w>true|false), (?P<l>\d)>'
        --key-b 'FwdTraits<(?P<t>[^>]*)>, (?P<l>\d)>, .*Mask<\d+, \d+, (?P<w>true|false)>'

Needs nvcc (CUDA_HOME) and cuobjdump/nvdisasm (the toolkit's, or `pip install
nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`), and CUTLASS headers as setup.py finds them.
Exit status of compare: 0 all identical (bytes or up to parameter offsets), 1 otherwise.
"""

import argparse
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

NVCC_FLAGS = [
    "-O3", "-std=c++17", "-DNDEBUG", "--use_fast_math", "--expt-relaxed-constexpr",
    "--expt-extended-lambda", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]


def _tool(name):
    exe = shutil.which(name)
    if exe:
        return exe
    cands = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name)]
    cands += [os.path.join(p, "nvidia", "cu13", "bin", name) for p in sys.path]
    for c in cands:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit(f"sass_diff: {name} not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


def _cutlass_include():
    for var in ("CUTLASS_PATH",):
        if os.environ.get(var):
            return [os.path.join(os.environ[var], "include")]
    tp = ROOT / "third_party" / "cutlass" / "include"
    if tp.is_dir():
        return [str(tp)]
    import importlib.util
    spec = importlib.util.find_spec("cutlass_library")
    if spec and spec.submodule_search_locations:
        inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
        if inc.is_dir():
            return [str(inc)]
    sys.exit("sass_diff: CUTLASS headers not found (CUTLASS_PATH, third_party/cutlass, nvidia-cutlass)")


def _split(sass_text):
    """{function name: SASS lines} from cuobjdump --dump-sass output."""
    funcs, name, lines, arch = {}, None, [], ""
    for line in sass_text.splitlines():
        a = re.match(r"\s*arch = (sm_\w+)", line)
        if a:
            arch = a.group(1)
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                funcs[name] = lines
            name, lines = m.group(1) + "." + arch, []
        elif name and line.strip() and not line.strip().startswith(("....", "-----", "Fatbin", "code for", "arch =", "host =", "compile_size", "identifier")):
            lines.append(line.rstrip())
    if name:
        funcs[name] = lines
    return funcs


def _cuobjdump(path):
    exe = _tool("cuobjdump")
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(_tool("nvdisasm")) + os.pathsep + env.get("PATH", "")
    return subprocess.run([exe, "--dump-sass", str(path)], capture_output=True, text=True, env=env,
                          check=True).stdout


def _write(outdir, funcs, arch_tag=""):
    """OUTDIR/<name>.sass per kernel (long names cut, with a hash of the whole), and OUTDIR/index.tsv:
    file name, full (mangled) name."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    index = out / "index.tsv"
    rows = dict(line.split("\t", 1) for line in index.read_text().splitlines()) if index.is_file() else {}
    for name, lines in funcs.items():
        fname = name + arch_tag
        if len(fname) > 180:
            fname = name[:160] + "." + hashlib.sha1(name.encode()).hexdigest()[:12] + arch_tag
        (out / f"{fname}.sass").write_text("\n".join(lines) + "\n")
        rows[f"{fname}.sass"] = name
    index.write_text("".join(f"{k}\t{v}\n" for k, v in sorted(rows.items())))
    return len(funcs)


def _names(d):
    """{file name: demangled kernel name} for the .sass files of a dump (index.tsv where there is
    one; else the file name, as older dumps wrote it)."""
    index = d / "index.tsv"
    rows = dict(line.split("\t", 1) for line in index.read_text().splitlines()) if index.is_file() else {}
    files = sorted(p.name for p in d.glob("*.sass"))
    mangled = [re.sub(r"(\.sm_\w+)?\.sass$", "", rows.get(f, f)) for f in files]
    filt = shutil.which("c++filt") or shutil.which("cu++filt")
    if filt:
        r = subprocess.run([filt], input="\n".join(mangled), capture_output=True, text=True)
        if r.returncode == 0 and len(r.stdout.splitlines()) == len(mangled):
            mangled = r.stdout.splitlines()
    return dict(zip(files, mangled))


def _keys(d, regex):
    """{pairing key: file name}: the regex's groups of the demangled name, else the file name."""
    keys = {}
    for f, name in _names(d).items():
        m = re.search(regex, name) if regex else None
        if m:
            gd = m.groupdict()
            key = "|".join(gd[k] for k in sorted(gd)) if gd else "|".join(m.groups())
            key = "key:" + key + "|" + re.sub(r".*?(\.sm_\w+)?\.sass$", r"\1", f)
        else:
            key = f
        if key in keys:
            sys.exit(f"sass_diff: two kernels of {d} have the key {key}: {keys[key]}, {f}")
        keys[key] = f
    return keys


def cmd_dump(args):
    src_root = ROOT
    tmp = None
    if args.rev:
        tmp = tempfile.mkdtemp(prefix="sass_rev_")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", tmp, args.rev], check=True,
                       capture_output=True)
        src_root = Path(tmp)
    try:
        nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
        # "90a": compute_90a -> sm_90a; "80:90": SASS for sm_90 from compute_80 PTX (how the build
        # compiles the sm80 kernels for a Hopper target).
        virt, _, real = args.arch.partition(":")
        gencode = [f"-gencode=arch=compute_{virt},code=sm_{real or virt}"]
        for f in args.files:
            name = f if f.endswith(".cu") else f + ".cu"
            src = src_root / "csrc" / "instantiations" / name
            if not src.is_file():
                src = src_root / name
            with tempfile.TemporaryDirectory() as td:
                obj = os.path.join(td, "k.o")
                cmd = [nvcc, *NVCC_FLAGS, *gencode, "-I", str(src_root / "csrc"),
                       *sum((["-I", i] for i in _cutlass_include()), []), "-c", str(src), "-o", obj]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    sys.exit(f"sass_diff: compiling {src} failed:\n{r.stderr[-4000:]}")
                n = _write(args.outdir, _split(_cuobjdump(obj)))
                print(f"{name}: {n} kernels", flush=True)
    finally:
        if tmp:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tmp], capture_output=True)


def cmd_so(args):
    p = Path(args.input)
    if p.suffix == ".so" or p.suffix == ".o":
        text = _cuobjdump(p)
    elif p.suffix == ".gz":
        text = gzip.open(p, "rt").read()
    else:
        text = p.read_text()
    print(f"{_write(args.outdir, _split(text))} kernels")


_PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
_ENC = re.compile(r"/\* 0x[0-9a-f]+ \*/")


def cmd_compare(args):
    a, b = Path(args.a), Path(args.b)
    ka, kb = _keys(a, args.key_a), _keys(b, args.key_b)
    same = offsets = differ = 0
    for key in sorted(set(ka) | set(kb)):
        name = ka.get(key) or kb.get(key)
        if key not in ka or key not in kb:
            print(f"ONLY IN {'A' if key in ka else 'B'}: {name}")
            differ += 1
            continue
        if ka[key] != kb[key]:
            name = f"{ka[key]} ~ {kb[key]}"
        # Whitespace runs collapsed: cuobjdump pads the columns to the longest line of the whole
        # object, so the same kernel dumped from files holding other kernels differs in padding.
        la = [" ".join(x.split()) for x in (a / ka[key]).read_text().splitlines()]
        lb = [" ".join(x.split()) for x in (b / kb[key]).read_text().splitlines()]
        if la == lb:
            same += 1
            continue
        # Up to the kernel parameters' offsets: drop the encodings (they hold the offsets) and
        # the offsets themselves.
        na = [_PARAM.sub("c[0x0][P]", _ENC.sub("", x)) for x in la]
        nb = [_PARAM.sub("c[0x0][P]", _ENC.sub("", x)) for x in lb]
        if na == nb:
            offsets += 1
            if args.verbose:
                print(f"PARAM OFFSETS ONLY: {name}")
            continue
        differ += 1
        print(f"DIFFERENT: {name} ({len(la)} vs {len(lb)} lines)")
        shown = 0
        for i, (x, y) in enumerate(zip(na, nb)):
            if x != y:
                print(f"   A {x.strip()}\n   B {y.strip()}")
                shown += 1
                if shown >= 3:
                    break
    print(f"{same} identical, {offsets} identical up to kernel-parameter offsets, {differ} different")
    return 0 if differ == 0 else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("outdir")
    d.add_argument("--rev")
    d.add_argument("--arch", default="90a", help='target, e.g. 90a or 80:90 (compute_80 PTX to sm_90 SASS)')
    d.add_argument("files", nargs="+")
    s = sub.add_parser("so")
    s.add_argument("outdir")
    s.add_argument("input")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("-v", "--verbose", action="store_true")
    c.add_argument("--key-a", help="regex pairing DIR_A's kernels by the groups it captures from the demangled name")
    c.add_argument("--key-b", help="the same for DIR_B")
    args = ap.parse_args()
    if args.cmd == "dump":
        cmd_dump(args)
    elif args.cmd == "so":
        cmd_so(args)
    else:
        sys.exit(cmd_compare(args))


if __name__ == "__main__":
    main()
