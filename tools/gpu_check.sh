#!/usr/bin/env bash
# One GPU run, everything in it: install the carried CUTLASS wheel, build in place, run the tests,
# run the quick benchmark, print a short summary last.
#
#   bash tools/gpu_check.sh OUTDIR          (or: make gpu-check OUT=OUTDIR)
#
# Environment (all optional):
#   FLASH_EXT_ARCHS   default 90a here (H100/H200); FLASH_EXT_HEADDIMS / FLASH_EXT_DTYPES narrow
#   MAX_JOBS          default 16
#   FLASH_EXT_PTXAS_VERBOSE  default 1 (register/spill report -> OUTDIR/build.log, summary.txt)
#   PYTEST_ARGS       replaces the test selection "tests", e.g. "tests/test_fwd.py -k causal"
#   BENCH_ARGS        replaces "--quick" for python -m flash_ext.bench ("none": no bench)
#   TRACE_ARGS        if set: python tools/trace_fwd.py $TRACE_ARGS --out OUTDIR/trace after the
#                     tests (needs FLASH_EXT_SM90_TRACE=1, a trace build; docs/kernels-sm90.md)
#   PYTHON            default python3
#   SKIP_BUILD=1      reuse the flash_ext/_C*.so already built in place
#   BUILD_ONLY=1      stop after the build (e.g. a first call that only builds; the next call's
#                     build is then an incremental no-op, as long as build/ is still there)
#
# OUTDIR gets at most: env.txt build.log tests.log trace.log trace/ bench.log summary.txt + the
# bench's own files.
# Exit status: 0 all good; 1 build failed (nothing run); 2 tests failed; 3 the bench failed;
# 4 only the trace failed.

set -uo pipefail

if [ $# -lt 1 ] || [ -z "$1" ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 64
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)

PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16}
export FLASH_EXT_ARCHS=${FLASH_EXT_ARCHS:-90a}
export FLASH_EXT_PTXAS_VERBOSE=${FLASH_EXT_PTXAS_VERBOSE:-1}
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

T0=$(date +%s)
now() { date +%s; }
hr() { printf '\n==== %s ====\n' "$*"; }

# ---------------------------------------------------------------- environment
hr "environment"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l | tr -d ' ') changed files"
  # The device machine gets a copy of the working tree whose git metadata can be stale (its HEAD
  # printed an older commit there): this hash of the sources identifies what was built and run.
  # Compare with `bash tools/source_hash.sh` in a checkout.
  echo "sources: $(bash tools/source_hash.sh)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: (no nvidia-smi)"
  fi
  echo "nvcc: $("${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>&1 | grep -o 'release [0-9.]*' || echo '?')"
  "$PY" -c "import sys, torch; print('python:', sys.version.split()[0]); print('torch:', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
  echo "knobs: FLASH_EXT_ARCHS=$FLASH_EXT_ARCHS FLASH_EXT_HEADDIMS=${FLASH_EXT_HEADDIMS:-all} FLASH_EXT_DTYPES=${FLASH_EXT_DTYPES:-all} MAX_JOBS=$MAX_JOBS"
} 2>&1 | tee "$OUT/env.txt"

# ---------------------------------------------------------------- CUTLASS wheel
shopt -s nullglob
wheels=(.whl/nvidia_cutlass-*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -gt 0 ]; then
  whl=${wheels[${#wheels[@]}-1]}
  echo "installing $whl"
  "$PY" -m pip install -q --no-index --no-deps "$whl" 2>&1 | tail -3 \
    || echo "WARNING: installing $whl failed (the build reports if CUTLASS is missing)"
fi

# ---------------------------------------------------------------- build
build_rc=0
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  echo "SKIP_BUILD=1: using the existing in-place build" | tee "$OUT/build.log"
  build_s=0
else
  hr "build (MAX_JOBS=$MAX_JOBS, FLASH_EXT_ARCHS=$FLASH_EXT_ARCHS)"
  t=$(now)
  # Show progress lines only; the full log (compiler commands, ptxas report) goes to build.log.
  "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 &
  bpid=$!
  # tail stops once the build process is gone.
  tail -n +1 -f --pid="$bpid" "$OUT/build.log" 2>/dev/null \
    | grep --line-buffered -E '^flash_ext build:|^\[[0-9]+/[0-9]+\]' \
    | sed -u -E -e 's/^(\[[0-9]+\/[0-9]+\]).* -c (-c )?([^ ]+) .*/\1 \3/' -e "s|$REPO/||"
  wait "$bpid"; build_rc=$?
  build_s=$(( $(now) - t ))
  echo "build: rc=$build_rc in ${build_s}s"
  if [ $build_rc -ne 0 ]; then
    echo "---- build errors (full log: $OUT/build.log) ----"
    grep -E -m 40 'error|FAILED|Error' "$OUT/build.log"
    echo "---- build.log tail ----"
    tail -n 25 "$OUT/build.log"
  fi
fi

# ptxas report: one line per (kernel, target) with registers, smem, spills.
ptxas_table() {
  "$PY" - "$OUT/build.log" <<'EOF'
import re, subprocess, sys
rows, cur = [], None
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Compiling entry function '([^']+)' for '(\w+)'", line)
    if m:
        cur = {"fn": m.group(1), "arch": m.group(2), "regs": "?", "smem": "0", "spill": "0/0"}
        rows.append(cur)
        continue
    if cur is None:
        continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
        cur["spill"] = f"{m.group(1)}/{m.group(2)}"
    m = re.search(r"Used (\d+) registers", line)
    if m:
        cur["regs"] = m.group(1)
        s = re.search(r"(\d+) bytes smem", line)
        cur["smem"] = s.group(1) if s else "0"
if not rows:
    print("(no ptxas report in build.log: nothing was recompiled, or FLASH_EXT_PTXAS_VERBOSE=0)")
    sys.exit(0)
try:
    names = subprocess.run(["c++filt"], input="\n".join(r["fn"] for r in rows), capture_output=True,
                           text=True, check=True).stdout.splitlines()
except Exception:
    names = [r["fn"] for r in rows]
print(f"{'target':8} {'regs':>4} {'smem':>6} {'spill st/ld':>11}  kernel")
for r, n in zip(rows, names):
    n = re.sub(r"\(flash_ext::\w+Params\)$", "", n.replace("void ", "", 1))
    print(f"{r['arch']:8} {r['regs']:>4} {r['smem']:>6} {r['spill']:>11}  {n[:110]}")
spills = [r for r in rows if r["spill"] != "0/0"]
print(f"{len(rows)} kernels, max {max(int(r['regs']) for r in rows if r['regs'].isdigit())} registers, "
      f"{len(spills)} with spills")
EOF
}

tests_rc=-1
bench_rc=-1
trace_rc=-1
tests_s=0
bench_s=0
trace_s=0
if [ $build_rc -eq 0 ] && [ "${BUILD_ONLY:-0}" != 1 ]; then
  hr "build info"
  "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import torch, flash_ext
try:
    import flash_ext._C  # noqa: F401  (flash_ext may load it lazily)
except ImportError as e:
    print("import flash_ext._C:", e)
print(torch.ops.flash_ext.build_info())
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
EOF

  # -------------------------------------------------------------- tests
  hr "tests: pytest -q -x ${PYTEST_ARGS:-tests}"
  t=$(now)
  # shellcheck disable=SC2086  # PYTEST_ARGS is a word list on purpose
  FLASH_EXT_TESTS_REQUIRE_EXT=1 "$PY" -m pytest -q -x ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/tests.log"
  tests_rc=${PIPESTATUS[0]}
  tests_s=$(( $(now) - t ))
  [ "$tests_rc" -eq 5 ] && echo "pytest: no tests were collected (rc 5): counted as a failure"

  # -------------------------------------------------------------- timeline (trace build)
  if [ -n "${TRACE_ARGS:-}" ]; then
    hr "trace: python tools/trace_fwd.py $TRACE_ARGS --out $OUT/trace"
    t=$(now)
    # shellcheck disable=SC2086
    "$PY" tools/trace_fwd.py $TRACE_ARGS --out "$OUT/trace" 2>&1 | tee "$OUT/trace.log"
    trace_rc=${PIPESTATUS[0]}
    trace_s=$(( $(now) - t ))
  fi

  # -------------------------------------------------------------- bench
  if [ "${BENCH_ARGS:-}" = none ]; then
    echo "BENCH_ARGS=none: no bench" > "$OUT/bench.log"
    bench_rc=0
  else
    hr "bench: python -m flash_ext.bench ${BENCH_ARGS:---quick} --out $OUT"
    t=$(now)
    # shellcheck disable=SC2086
    "$PY" -m flash_ext.bench ${BENCH_ARGS:---quick} --out "$OUT" 2>&1 | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}
    bench_s=$(( $(now) - t ))
  fi
fi

# ---------------------------------------------------------------- summary (printed last)
{
  echo
  echo "==================== gpu_check summary ===================="
  grep -m1 '^gpu:' "$OUT/env.txt" || true
  grep -m1 '^archs=' "$OUT/env.txt" 2>/dev/null || true
  echo "build: rc=$build_rc ${build_s}s"
  if [ "${SKIP_BUILD:-0}" != 1 ]; then
    echo "---- ptxas (registers, smem bytes, spill bytes) ----"
    ptxas_table
  fi
  if [ $build_rc -eq 0 ] && [ "${BUILD_ONLY:-0}" != 1 ]; then
    summary_line=$(grep -E '[0-9]+ (passed|failed|error|skipped)|no tests ran|errors? during collection' "$OUT/tests.log" | tail -n 1)
    echo "tests: rc=$tests_rc ${tests_s}s: ${summary_line:-?}"
    grep -E '^(FAILED|ERROR) ' "$OUT/tests.log" | head -n 10
    [ -n "${TRACE_ARGS:-}" ] && echo "trace: rc=$trace_rc ${trace_s}s (report: trace/report.txt)"
    echo "bench: rc=$bench_rc ${bench_s}s"
    echo "---- bench (tail of bench.log) ----"
    tail -n "${BENCH_TAIL:-30}" "$OUT/bench.log"
  fi
  echo "total: $(( $(now) - T0 ))s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
} > "$OUT/summary.txt" 2>&1
# The ptxas table can be long: print at most 25 rows of it here; summary.txt has all of it.
awk '/^---- ptxas/ {p = 1; n = 0; print; next}
     /^(tests|total): / {p = 0}
     p && !/^[0-9]+ kernels, max/ { if (++n <= 25) print; else if (n == 26) print "... (full table in summary.txt)"; next }
     {print}' "$OUT/summary.txt"

if [ $build_rc -ne 0 ]; then exit 1; fi
if [ "${BUILD_ONLY:-0}" = 1 ]; then exit 0; fi
if [ "$tests_rc" -ne 0 ]; then exit 2; fi
if [ "$bench_rc" -ne 0 ]; then exit 3; fi
if [ -n "${TRACE_ARGS:-}" ] && [ "$trace_rc" -ne 0 ]; then exit 4; fi
exit 0
