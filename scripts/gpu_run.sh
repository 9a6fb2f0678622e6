#!/usr/bin/env bash
# The GPU validation run, for a bare H200 machine: Python 3.12 with CuPy, PyTorch, pytest,
# hypothesis, pytest-xdist and NVRTC, but no package registry and no Rust toolchain, about 9
# minutes per command. Everything fits in 8 minutes (TOTAL_S); every stage has its own time limit
# and a failing or timed-out stage does not stop the next; every result is written as it comes.
#
#   scripts/gpu_run.sh [--out DIR] [--jobs N]   # on the GPU machine (DIR defaults to $OUT, else gpu_results)
#   scripts/gpu_run.sh --dry-run [--out DIR]    # on a CPU: every stage's files and arguments, no GPU
#
# Needs the extension built beforehand on a CPU machine and carried along as
# python/pagedkv/_core.abi3.so (docs/decode_kernel.md, section 5); runs with PYTHONPATH=python.
#
# Stages (limit in seconds):
#   env 20        benches/gpu_env.py: versions, the extension, CuPy + device, NVRTC, torch (env.json)
#   precompile 75 every kernel instance into the cubin cache, in parallel (pagedkv.kernels.precompile)
#   probes 45     the mma/ldmatrix/cp.async layout probes (tests/kernels/test_gpu_mma.py) first:
#                 if a fragment layout is wrong, everything after is explained by it
#   gpu-tests 110 the other gpu tests (test_gpu.py, test_gpu_prefill.py), with xdist if present
#   decode 140    benches/gpu_decode.py --kernel-only (JSON after every point)
#   prefill 80    benches/gpu_prefill.py, SDPA flash as the baseline without FlashInfer (JSON per point)
# Output in DIR: summary.tsv (stage, exit status, seconds; a line as each stage ends), one log per
# stage, env.json, probes.xml / gpu-tests.xml (JUnit), h200_decode.json(.txt), h200_prefill.json(.txt).
set -uo pipefail   # no -e: a failing stage must not stop the next
cd "$(dirname "$0")/.."
REPO=$PWD

DRY_RUN=0
OUT_DIR=${OUT:-gpu_results}
JOBS=$(nproc 2>/dev/null || echo 4)
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT_DIR=${2:?--out needs a folder}; shift ;;
        --jobs) JOBS=${2:?--jobs needs a number}; shift ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "gpu_run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$JOBS" in ''|*[!0-9]*|0) echo "gpu_run.sh: --jobs must be a positive integer" >&2; exit 2 ;; esac

PY=${PYTHON:-python3}
TOTAL_S=470   # 8 minutes, less a margin for the interpreter starts between stages
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY=$OUT_DIR/summary.tsv
printf 'stage\texit\tseconds\tlimit_s\n' > "$SUMMARY"

# The carried extension and the checkout's Python sources. A dry run without the .so (CI runs it
# against the installed wheel) uses the installed pagedkv instead.
if ls python/pagedkv/_core*.so >/dev/null 2>&1 || [ "$DRY_RUN" = 0 ]; then
    export PYTHONPATH=$REPO/python${PYTHONPATH:+:$PYTHONPATH}
fi
# One cubin cache for every stage (outside DIR: the cubins need not travel back).
export PAGEDKV_CACHE_DIR=${PAGEDKV_CACHE_DIR:-${TMPDIR:-/tmp}/pagedkv-gpu-run-cache}
# pyproject's addopts name pytest-benchmark, which the bare image lacks.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o "addopts=-ra")

started=$SECONDS
failed=0
planned=0
# stage NAME LIMIT_S CMD...: runs CMD with at most LIMIT_S seconds (less if the total budget is
# nearly spent), its output to the terminal and NAME.log, one summary line when it ends.
stage() {
    local name=$1 limit=$2
    shift 2
    planned=$((planned + limit))
    local left=$((TOTAL_S - (SECONDS - started)))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        echo "== $name: skipped (the ${TOTAL_S} s budget is spent)"
        printf '%s\tskipped\t0\t0\n' "$name" >> "$SUMMARY"
        failed=1
        return
    fi
    echo "== $name (limit ${limit} s; $((SECONDS - started)) s so far)"
    local t0=$SECONDS rc
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    # A dry run collects the gpu tests, which skip without CuPy: "no tests ran" (5) is expected.
    if [ "$DRY_RUN" = 1 ] && [ "$rc" = 5 ] && [ "${name%tests}" != "$name" -o "$name" = probes ]; then rc=0; fi
    [ "$rc" = 124 ] && echo "== $name: timed out after ${limit} s"
    [ "$rc" != 0 ] && failed=1
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >> "$SUMMARY"
}

for f in benches/gpu_env.py benches/gpu_decode.py benches/gpu_prefill.py benches/gpu_timing.py \
    tests/kernels/test_gpu_mma.py tests/kernels/test_gpu.py tests/kernels/test_gpu_prefill.py \
    python/pagedkv/kernels/precompile.py; do
    [ -f "$f" ] || { echo "gpu_run.sh: $f is missing" >&2; exit 2; }
done

if [ "$DRY_RUN" = 1 ]; then
    stage env 20 "$PY" benches/gpu_env.py --dry-run --out "$OUT_DIR/env.json"
    stage precompile 75 "$PY" -m pagedkv.kernels.precompile --dry-run --jobs "$JOBS"
    stage probes 45 "${PYTEST[@]}" --collect-only -m gpu tests/kernels/test_gpu_mma.py
    stage gpu-tests 110 "${PYTEST[@]}" --collect-only -m gpu tests/kernels/test_gpu.py tests/kernels/test_gpu_prefill.py
    stage decode 140 "$PY" benches/gpu_decode.py --dry-run --kernel-only --budget-s 100 --backend numpy
    stage prefill 80 "$PY" benches/gpu_prefill.py --dry-run --budget-s 55 --backend numpy \
        --out "$OUT_DIR/h200_prefill.json"
else
    stage env 20 "$PY" benches/gpu_env.py --out "$OUT_DIR/env.json"
    ARCH=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['arch'])" "$OUT_DIR/env.json" 2>/dev/null || echo sm_90)
    stage precompile 75 "$PY" -m pagedkv.kernels.precompile --arch "$ARCH" --jobs "$JOBS"
    XDIST=()
    "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
    stage probes 45 "${PYTEST[@]}" -m gpu tests/kernels/test_gpu_mma.py --junitxml="$OUT_DIR/probes.xml"
    stage gpu-tests 110 "${PYTEST[@]}" -m gpu "${XDIST[@]}" tests/kernels/test_gpu.py \
        tests/kernels/test_gpu_prefill.py --junitxml="$OUT_DIR/gpu-tests.xml"
    stage decode 140 "$PY" benches/gpu_decode.py --kernel-only --budget-s 100 --out "$OUT_DIR/h200_decode.json"
    stage prefill 80 "$PY" benches/gpu_prefill.py --budget-s 55 --out "$OUT_DIR/h200_prefill.json"
fi

echo "== summary ($((SECONDS - started)) s of ${TOTAL_S} s; stage limits add up to ${planned} s)"
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
exit "$failed"
