#!/usr/bin/env bash
# The single-group cost gate: instruction counts (callgrind) of the `instructions` bench scenarios
# (rust/pagedkv/benches/instructions.rs) against committed baseline counts, each within +3 %.
#
#   scripts/callgrind_gate.sh                  # measure this tree, compare, exit 1 on a regression
#   scripts/callgrind_gate.sh --record [REV]   # measure REV (default HEAD) in a scratch worktree and
#                                              # write the baseline file
#
# The baseline file (benches/results/callgrind-baseline.txt) names the commit it was measured at
# and the rustc that built it. Instruction counts depend on the compiler, not on the machine's
# load: when this machine's rustc differs from the baseline's, the gate re-measures the baseline
# commit with this rustc (in a scratch worktree under target/) instead of comparing across
# compilers. valgrind is installed with apt-get where missing (CI runs as root).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASELINE=benches/results/callgrind-baseline.txt
MAX_INCREASE_PCT=3
# scenario and iteration count; units per scenario are printed by the binary.
SCENARIOS=(
    "append_batch_48 2000"
    "add_free 5000"
    "prefix_admit 1000"
    "op_mix 20"
    "prefix_w2 500"
    "prefix_miss 500"
    "prefix_hit_admit 500"
    "prefix_match 500"
)

if ! command -v valgrind >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind) >/dev/null
    else
        echo "callgrind_gate: valgrind is missing and cannot be installed here" >&2
        exit 1
    fi
fi

# Builds the bench binary of the tree at $1 (target dir $2) and prints its path.
build_bench() {
    local tree=$1 target=$2
    (cd "$tree" && CARGO_TARGET_DIR=$target cargo bench -q -p pagedkv --bench instructions --no-run \
        --message-format=json 2>/dev/null) |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "instructions" and m.get("executable"):
        print(m["executable"])'
}

# Prints "scenario instructions_per_unit" for each scenario, measured with binary $1.
measure() {
    local bin=$1 spec name iters out collected units
    for spec in "${SCENARIOS[@]}"; do
        read -r name iters <<<"$spec"
        out=$(valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*scenario_*' \
            --callgrind-out-file=/dev/null "$bin" "$name" "$iters" 2>&1)
        collected=$(sed -n 's/.*Collected : \([0-9]*\).*/\1/p' <<<"$out")
        units=$(sed -n "s/^$name: \([0-9]*\) units.*/\1/p" <<<"$out")
        if [ -z "$collected" ] || [ -z "$units" ]; then
            echo "callgrind_gate: scenario $name printed no count:" >&2
            echo "$out" >&2
            exit 1
        fi
        python3 -c "print('$name', round($collected / $units, 2))"
    done
}

# Measures commit $1 in a scratch worktree (its own target dir) and prints the counts.
measure_commit() {
    local rev=$1 tree="$ROOT/target/callgrind-baseline-tree"
    git worktree remove --force "$tree" >/dev/null 2>&1 || rm -rf "$tree"
    git worktree add --detach "$tree" "$rev" >/dev/null 2>&1
    local bin
    bin=$(build_bench "$tree" "$ROOT/target/callgrind-baseline")
    measure "$bin"
    git worktree remove --force "$tree" >/dev/null 2>&1 || true
}

rustc_version=$(rustc --version)

if [ "${1:-}" = "--record" ]; then
    rev=$(git rev-parse --short "${2:-HEAD}")
    counts=$(measure_commit "$rev")
    {
        echo "# Instruction counts per unit of rust/pagedkv/benches/instructions.rs (scripts/callgrind_gate.sh)."
        echo "commit $rev"
        echo "compiler $rustc_version"
        echo "$counts"
    } >"$BASELINE"
    cat "$BASELINE"
    exit 0
fi

base_rev=$(sed -n 's/^commit //p' "$BASELINE")
base_rustc=$(sed -n "s/^compiler //p" "$BASELINE")
if [ "$base_rustc" = "$rustc_version" ]; then
    base_counts=$(grep -v -e '^#' -e '^commit ' -e "^compiler " "$BASELINE")
else
    echo "callgrind_gate: baseline built by '$base_rustc', this is '$rustc_version': re-measuring $base_rev"
    base_counts=$(measure_commit "$base_rev")
fi
bin=$(build_bench "$ROOT" "$ROOT/target")
counts=$(measure "$bin")

python3 - "$MAX_INCREASE_PCT" "$base_rev" <<EOF
import sys
limit, rev = float(sys.argv[1]), sys.argv[2]
base = dict(l.split() for l in """$base_counts""".strip().splitlines())
now = dict(l.split() for l in """$counts""".strip().splitlines())
failed = []
print(f"{'scenario':<18} {'baseline ' + rev:>18} {'this tree':>12} {'change':>8}")
for name, value in now.items():
    b, v = float(base[name]), float(value)
    change = 100.0 * (v - b) / b
    print(f"{name:<18} {b:>18,.1f} {v:>12,.1f} {change:>+7.2f}%")
    if change > limit:
        failed.append(name)
if failed:
    print(f"callgrind_gate: over +{limit:g} % against {rev}: {', '.join(failed)}")
    sys.exit(1)
print(f"callgrind_gate: every scenario within +{limit:g} % of {rev}")
EOF
