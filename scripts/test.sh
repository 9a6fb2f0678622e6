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
cargo test --workspace --release
python -m pytest -q
