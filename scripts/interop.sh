#!/usr/bin/env bash
# Interop proof, run on demand (not in scripts/test.sh): NVIDIA Dynamo's KV router from crates.io
# (dynamo-kv-router, pinned in rust/interop-tests/Cargo.toml) decodes, normalizes and indexes
# pagedkv's KV-event bytes and predicts exactly the prefix pagedkv serves from cache.
# rust/interop-tests is its own cargo workspace: a clean build of the router's ~110 crates costs
# more than the CI budget (docs/events.md, Interop).
set -euo pipefail
cd "$(dirname "$0")/../rust/interop-tests"
cargo test --release "$@"
