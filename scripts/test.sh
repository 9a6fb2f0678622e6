#!/usr/bin/env bash
# Installs pagedkv with its test extras into a fresh venv (.venv) and runs every test:
# the Rust workspace (cargo test) and the Python suite (pytest) against the installed wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q '.[test]'
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --release
# The lock-free pool under loom's model checker (every interleaving of 2-3 racing threads); its own
# target dir so the cfg change does not invalidate the build above.
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p pagedkv --release --test loom_pool
python -m pytest -q
