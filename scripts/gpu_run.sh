#!/usr/bin/env bash
# The GPU validation run, for a bare GPU machine (an H100 80 GB is what to expect, an H200 at
# times): Python 3.12 with CuPy, PyTorch, pytest, hypothesis, pytest-xdist, NVRTC and
# compute-sanitizer, no package registry, no Rust toolchain, at most 10 minutes per command, and
# only a few files of the output folder come back. Everything fits in 8 minutes: the stages have
# their own time limits inside a 465 s budget (a stage never outlives what is left of it), and a
# failing or timed-out stage does not stop the next. Nothing is installed.
#
#   scripts/gpu_run.sh [--out DIR] [--jobs N]   # on the GPU machine (DIR defaults to $OUT, else gpu_results)
#   scripts/gpu_run.sh --dry-run [--out DIR]    # on a CPU: the same stages, GPU-only work skipped visibly
#
# Output in DIR, two files: gpu_run.json (every stage's status, exit code, time and limit, the tail
# of its log, its JUnit XML folded into counts and failures, its JSON result; rewritten as each
# stage ends, "complete" true at the end) and gpu_run.log (the whole console output, written as it
# comes: Python runs unbuffered). The stages' own files live in a scratch folder outside DIR.
#
# Stages (limit in seconds):
#   setup 30       benches/gpu_env.py: driver, CuPy + device, NVRTC compiling for its sm_XY, pytest,
#                  the GPU's peaks (benches/gpu_specs.py); fails fast: one line, later stages skipped
#   precompile 80  every kernel instance into the cubin cache, in parallel (pagedkv.kernels.precompile;
#                  261 instances with the quantized-cache kernels)
#   probes 35      the mma/ldmatrix/cp.async layout probes (tests/kernels/test_gpu_mma.py) first:
#                  if a fragment layout is wrong, everything after is explained by it
#   gpu-tests 110  the other gpu tests (test_gpu.py, test_gpu_prefill.py, tests/quant/test_gpu_quant.py),
#                  with xdist if present
#   sanitizer 45   compute-sanitizer memcheck over benches/gpu_sanitize.py (small decode + prefill
#                  cases checked against the reference); skipped, saying so, without the tool
#   decode 95      benches/gpu_decode.py --kernel-only, dense baseline beside it (JSON per point)
#   prefill 55     benches/gpu_prefill.py, SDPA flash as the baseline without FlashInfer (JSON per point)
#
# The extension pagedkv._core is not needed (no kernel stage uses it; pagedkv loads it on first
# use); runs with PYTHONPATH=python. docs/decode_kernel.md section 5 has the details.
set -uo pipefail   # no -e: a failing stage must not stop the next
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD

DRY_RUN=0
OUT_DIR=${OUT:-gpu_results}
JOBS=$(nproc 2>/dev/null || echo 4)
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT_DIR=${2:?--out needs a folder}; shift ;;
        --jobs) JOBS=${2:?--jobs needs a number}; shift ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "gpu_run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$JOBS" in ''|*[!0-9]*|0) echo "gpu_run.sh: --jobs must be a positive integer" >&2; exit 2 ;; esac

PY=${PYTHON:-python3}
STAGES=(setup precompile probes gpu-tests sanitizer decode prefill)
# Worst case: every stage runs to its limit, and each killed stage gets KILL_S more to exit; the
# budget caps each stage at what is left of it, so the run ends by BUDGET_S + KILL_S + a few
# seconds of bookkeeping, inside 8 minutes.
BUDGET_S=465
KILL_S=3
# Tests only: a smaller budget, and a cap on every stage's limit (tests/kernels/test_gpu_run_script.py).
BUDGET_S=${PAGEDKV_GPU_RUN_BUDGET_S:-$BUDGET_S}
STAGE_CAP_S=${PAGEDKV_GPU_RUN_STAGE_CAP_S:-}
export PYTHONUNBUFFERED=1

mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
RESULTS=$OUT_DIR/gpu_run.json
LOG=$OUT_DIR/gpu_run.log
: > "$LOG"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-gpu-run.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT

# This checkout's Python sources (a dry run in CI may use the installed wheel instead).
if [ "$DRY_RUN" = 0 ] || [ -f python/pagedkv/_core.abi3.so ] || ls python/pagedkv/_core*.so >/dev/null 2>&1; then
    export PYTHONPATH=$REPO/python${PYTHONPATH:+:$PYTHONPATH}
fi
# One cubin cache for every stage (outside DIR: the cubins need not travel back).
export PAGEDKV_CACHE_DIR=${PAGEDKV_CACHE_DIR:-${TMPDIR:-/tmp}/pagedkv-gpu-run-cache}
# pyproject's addopts name pytest-benchmark, which the bare image lacks.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o "addopts=-ra")
FOLD=("$PY" benches/gpu_results.py)

say() { printf '%s\n' "$*" | tee -a "$LOG"; }

for f in benches/gpu_env.py benches/gpu_specs.py benches/gpu_results.py benches/gpu_decode.py \
    benches/gpu_decode_sweep.py benches/gpu_decode_correctness.py \
    benches/gpu_dense_decode.py benches/gpu_prefill.py benches/gpu_timing.py benches/gpu_sanitize.py \
    tests/kernels/test_gpu_mma.py tests/kernels/test_gpu.py tests/kernels/test_gpu_prefill.py \
    tests/quant/test_gpu_quant.py python/pagedkv/kernels/precompile.py; do
    [ -f "$f" ] || { echo "gpu_run.sh: $f is missing" >&2; exit 2; }
done

DRY=()
[ "$DRY_RUN" = 1 ] && DRY=(--dry-run)
"${FOLD[@]}" init --results "$RESULTS" --stages "$(IFS=,; echo "${STAGES[*]}")" --budget-s "$BUDGET_S" \
    --kill-after-s "$KILL_S" "${DRY[@]}" || { echo "gpu_run.sh: cannot write $RESULTS" >&2; exit 2; }

started=$SECONDS
failed=0
# stage NAME LIMIT_S NOTE CMD...: runs CMD with at most LIMIT_S seconds (less if the budget is
# nearly spent), its output to the console, the log and WORK/NAME.log, then folds its files
# (WORK/NAME.xml JUnit, WORK/NAME.json result) into the results file. Sets STAGE_RC.
stage() {
    local name=$1 limit=$2 note=$3
    shift 3
    local left=$((BUDGET_S - (SECONDS - started)))
    [ -n "$STAGE_CAP_S" ] && [ "$limit" -gt "$STAGE_CAP_S" ] && limit=$STAGE_CAP_S
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        skip "$name" "the ${BUDGET_S} s budget is spent"
        failed=1
        STAGE_RC=1
        return
    fi
    say "== $name (limit ${limit} s; $((SECONDS - started)) s so far)${note:+: $note}"
    local t0=$SECONDS rc
    timeout -k "$KILL_S" "$limit" "$@" 2>&1 | tee -a "$LOG" "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    # A dry run collects the gpu tests, which skip without CuPy: "no tests ran" (5) is expected.
    if [ "$DRY_RUN" = 1 ] && [ "$rc" = 5 ] && { [ "$name" = gpu-tests ] || [ "$name" = probes ]; }; then rc=0; fi
    case "$rc" in
        0) ;;
        124|137) say "== $name: timed out after ${limit} s (what it wrote so far is kept)"; failed=1 ;;
        *) failed=1 ;;
    esac
    "${FOLD[@]}" stage --results "$RESULTS" --name "$name" --exit "$rc" --seconds "$((SECONDS - t0))" \
        --limit "$limit" --log "$WORK/$name.log" --junit "$WORK/$name.xml" --json "$WORK/$name.json" \
        --note "$note" || say "gpu_run.sh: could not fold $name into $RESULTS"
    STAGE_RC=$rc
}
skip() {
    say "== $1: skipped ($2)"
    "${FOLD[@]}" skip --results "$RESULTS" --name "$1" --note "$2" || true
}

if [ "$DRY_RUN" = 1 ]; then
    stage setup 30 "dry run: GPU pieces optional" "$PY" benches/gpu_env.py --dry-run --out "$WORK/setup.json"
else
    stage setup 30 "" "$PY" benches/gpu_env.py --out "$WORK/setup.json"
fi
if [ "$STAGE_RC" != 0 ]; then
    # Fail fast: without a driver, CuPy or NVRTC every later stage would fail the same way.
    say "gpu_run.sh: $(grep -E '^SETUP FAILED' "$WORK/setup.log" | tail -1 || true)"
    for name in "${STAGES[@]:1}"; do skip "$name" "setup failed"; done
else
    ARCH=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['arch'])" "$WORK/setup.json" 2>/dev/null || echo sm_90)
    SANITIZER=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['compute_sanitizer'] or '')" "$WORK/setup.json" 2>/dev/null || true)
    if [ "$DRY_RUN" = 1 ]; then
        stage precompile 80 "dry run: lists the instances" "$PY" -m pagedkv.kernels.precompile --dry-run --jobs "$JOBS"
        stage probes 35 "dry run: collected, not run" "${PYTEST[@]}" --collect-only -m gpu \
            tests/kernels/test_gpu_mma.py --junitxml="$WORK/probes.xml"
        stage gpu-tests 110 "dry run: collected, not run" "${PYTEST[@]}" --collect-only -m gpu \
            tests/kernels/test_gpu.py tests/kernels/test_gpu_prefill.py tests/quant/test_gpu_quant.py \
            --junitxml="$WORK/gpu-tests.xml"
        stage sanitizer 45 "dry run: the cases on the NumPy reference, compute-sanitizer not run" \
            "$PY" benches/gpu_sanitize.py --backend numpy --out "$WORK/sanitizer.json"
        stage decode 95 "dry run: plans, accounting, correctness on NumPy" "$PY" benches/gpu_decode.py \
            --dry-run --kernel-only --budget-s 68 --backend numpy --out "$WORK/decode.json"
        stage prefill 55 "dry run: accounting, correctness on NumPy" "$PY" benches/gpu_prefill.py \
            --dry-run --budget-s 36 --backend numpy --out "$WORK/prefill.json"
    else
        stage precompile 80 "$ARCH, $JOBS threads" "$PY" -m pagedkv.kernels.precompile --arch "$ARCH" --jobs "$JOBS"
        XDIST=()
        "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
        stage probes 35 "" "${PYTEST[@]}" -m gpu tests/kernels/test_gpu_mma.py --junitxml="$WORK/probes.xml"
        stage gpu-tests 110 "${XDIST[*]}" "${PYTEST[@]}" -m gpu "${XDIST[@]}" tests/kernels/test_gpu.py \
            tests/kernels/test_gpu_prefill.py tests/quant/test_gpu_quant.py --junitxml="$WORK/gpu-tests.xml"
        if [ -n "$SANITIZER" ]; then
            export PAGEDKV_SANITIZER_TOOL=memcheck
            stage sanitizer 45 "compute-sanitizer memcheck" "$SANITIZER" --tool memcheck \
                --error-exitcode 86 --print-limit 20 "$PY" benches/gpu_sanitize.py --out "$WORK/sanitizer.json"
            unset PAGEDKV_SANITIZER_TOOL
        else
            skip sanitizer "compute-sanitizer not found (PATH, /usr/local/cuda/bin): no memcheck this run"
        fi
        stage decode 95 "" "$PY" benches/gpu_decode.py --kernel-only --budget-s 68 --out "$WORK/decode.json"
        stage prefill 55 "" "$PY" benches/gpu_prefill.py --budget-s 36 --out "$WORK/prefill.json"
    fi
fi

"${FOLD[@]}" finish --results "$RESULTS" --seconds "$((SECONDS - started))" || true
say "== summary ($((SECONDS - started)) s of a ${BUDGET_S} s budget; results in $RESULTS, log in $LOG)"
"${FOLD[@]}" show --results "$RESULTS" 2>&1 | tee -a "$LOG"
exit "$failed"
