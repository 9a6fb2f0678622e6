#!/usr/bin/env bash
# The test command's vLLM stage: the tests that need vLLM 0.33 itself, in the cached vLLM venv
# (scripts/vllm/env.sh), against the pagedkv the test command just installed in the active venv.
#
#   . .venv-test/bin/activate && bash scripts/vllm/stage.sh
#
# 1. pytest over tests/vllm: the differentials that drive vLLM's real KV-cache manager and
#    scheduler beside pagedkv's (no skip allowed here: a skipped vLLM test would prove nothing);
# 2. vLLM's own scheduler and prefix-caching tests (tests/v1/core/test_scheduler.py and
#    test_prefix_caching.py from its source distribution) with pagedkv's KV-cache manager
#    substituted, whose pass sets must contain the recorded floors (scripts/vllm/own_tests.py),
#    once pagedkv.integrations.vllm exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
venv=$(bash scripts/vllm/env.sh)
vpy="$venv/bin/python"

# pagedkv exactly as installed in the active venv, importable from the vLLM venv (its extension is
# abi3 and its Python needs only numpy there).
installed=$(python -c 'import os, pagedkv; print(os.path.dirname(pagedkv.__file__))')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/site" "$work/vllm-cache"
ln -s "$installed" "$work/site/pagedkv"
export PYTHONPATH="$work/site" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_CACHE_ROOT="$work/vllm-cache" PAGEDKV_NO_SKIPS=1

echo "vllm stage: pytest tests/vllm (in $venv)"
# --import-mode=importlib and -p no:cacheprovider: nothing of the repository's is imported from
# the checkout (pagedkv comes from the installed copy) and nothing is written into it.
"$vpy" -m pytest -q -o addopts=-ra -p no:cacheprovider --import-mode=importlib "$repo/tests/vllm"

# The package's presence, not an import: importing it imports vLLM, which only the vLLM venv has.
if [ -f "$installed/integrations/vllm/__init__.py" ]; then
    echo "vllm stage: vLLM's own scheduler and prefix-caching tests on pagedkv's KV-cache manager"
    "$vpy" "$repo/scripts/vllm/own_tests.py" --venv "$venv"
fi
