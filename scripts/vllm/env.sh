#!/usr/bin/env bash
# Prints the path of a virtualenv that imports vLLM 0.33's scheduler and KV-cache manager on a CPU,
# offline, building it first when it is missing (once per machine: it is cached outside the clone,
# so CI does not download it on every run), and of vLLM's own unit tests next to it.
#
#   VENV=$(scripts/vllm/env.sh)          # -> ~/.cache/pagedkv/vllm-0.33.0-<pins hash>/venv
#   TESTS=$(dirname "$VENV")/tests        # vLLM 0.33's tests/v1/core (+ the helpers they import)
#
# Every package is installed with --no-deps from the exact pins of scripts/vllm/requirements.txt:
# vLLM declares hundreds of dependencies (CUDA kernels, serving stack) that its scheduler never
# imports. The cache folder's name carries a hash of the pins, so a changed pin builds a new venv.
# $PAGEDKV_VLLM_CACHE overrides the cache root. A build that fails half-way is redone next time.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
req="$here/requirements.txt"
VLLM_VERSION=0.33.0
# The source distribution (for its tests) and its sha256, as PyPI lists them.
SDIST_URL="https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz"
SDIST_SHA256="f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"

root="${PAGEDKV_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedkv}"
pins_hash=$(sha256sum "$req" | cut -c1-12)
dir="$root/vllm-$VLLM_VERSION-$pins_hash"

# One build at a time (two test runs on one machine share the cache).
mkdir -p "$root"
exec 9>"$root/.vllm-env.lock"
flock 9
if [ ! -f "$dir/.complete" ]; then
    echo "vllm env: building $dir (once per machine)" >&2
    rm -rf "$dir"
    mkdir -p "$dir"
    python3 -m venv "$dir/venv"
    "$dir/venv/bin/python" -m pip install -q --no-deps -r "$req" >&2
    # vLLM's tests come from its source distribution (the wheel has none).
    sdist="$root/vllm-$VLLM_VERSION.tar.gz"
    if ! echo "$SDIST_SHA256  $sdist" | sha256sum -c --quiet - >/dev/null 2>&1; then
        curl -sSfL -o "$sdist.part" "$SDIST_URL"
        echo "$SDIST_SHA256  $sdist.part" | sha256sum -c --quiet -
        mv "$sdist.part" "$sdist"
    fi
    tar xzf "$sdist" -C "$dir" \
        "vllm-$VLLM_VERSION/tests/v1/core" \
        "vllm-$VLLM_VERSION/tests/v1/kv_connector/unit/utils.py"
    mv "$dir/vllm-$VLLM_VERSION/tests" "$dir/tests"
    rmdir "$dir/vllm-$VLLM_VERSION"
    # Packages, so that `tests.v1.core.utils` and `tests.v1.kv_connector.unit.utils` import.
    for d in tests tests/v1 tests/v1/kv_connector tests/v1/kv_connector/unit; do
        touch "$dir/$d/__init__.py"
    done
    # Smoke test: the scheduler imports on a CPU. Only then is the folder marked complete (a build
    # that fails half-way is rebuilt from scratch next time).
    VLLM_TARGET_DEVICE=cpu "$dir/venv/bin/python" -c "import vllm.v1.core.sched.scheduler" >&2
    touch "$dir/.complete"
fi
echo "$dir/venv"
