#!/usr/bin/env bash
# Interop proof, a stage of scripts/test.sh: NVIDIA Dynamo's KV router from crates.io
# (dynamo-kv-router, pinned in rust/interop-tests/Cargo.toml and its Cargo.lock) decodes,
# normalizes and indexes pagedkv's KV-event bytes and predicts exactly the prefix pagedkv serves
# from cache. rust/interop-tests is its own cargo workspace with its own lock file; --locked: the
# build uses exactly the locked crates.io versions (it needs crates.io and nothing else: no git
# dependencies, no build script downloads). A clean build costs about 190 CPU-seconds
# (docs/events.md, Interop); later runs reuse rust/interop-tests/target.
set -euo pipefail
cd "$(dirname "$0")/../rust/interop-tests"
cargo test --release --locked "$@"
