#!/usr/bin/env bash
# The GPU tests (tests/cuda_*.rs), built here and run on the GPU machine.
#
#   scripts/gpu-check.sh build [DIR]   on the build machine: builds the GPU test binaries in release
#                                      mode with feature `cuda` and copies them into DIR (default:
#                                      carry/, git-ignored), with a copy of this script.
#   bash DIR/gpu-check.sh run [DIR]    on the GPU machine, from the repo root: runs every binary in
#                                      DIR, logs under $OUT (or ./gpu-out), exits non-zero if any failed.
#
# The binaries need only libcuda and libcublas on the GPU machine; they find them in its usual
# folders by themselves (src/cuda/mod.rs), so no LD_LIBRARY_PATH is set here.
set -uo pipefail

cmd="${1:-}"
dir="${2:-carry}"

case "$cmd" in
build)
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    cd "$root" || exit 1
    mkdir -p "$dir"
    # cargo prints one JSON line per artifact; test binaries carry "test": true in their profile.
    cargo test --release --features cuda --no-run --message-format=json-render-diagnostics \
        | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") \
            and m.get("executable") and m["target"]["name"].startswith("cuda"):
        print(m["executable"])
' > "$dir/.binaries" || exit 1
    [[ -s "$dir/.binaries" ]] || { echo "gpu-check: no tests/cuda_*.rs binaries were built" >&2; exit 1; }
    while read -r bin; do
        cp "$bin" "$dir/" && echo "copied $(basename "$bin") ($(du -h "$bin" | cut -f1))"
    done < "$dir/.binaries"
    rm "$dir/.binaries"
    cp "${BASH_SOURCE[0]}" "$dir/gpu-check.sh"
    ;;
run)
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$out/gpu.txt"
    failed=0
    summary="$out/summary.txt"
    : > "$summary"
    for bin in "$dir"/*; do
        [[ -f "$bin" && -x "$bin" && "$bin" != *.sh ]] || continue
        name="$(basename "$bin")"
        name="${name%-*}"  # drop cargo's hash suffix
        echo "=== $name"
        start=$SECONDS
        "$bin" --test-threads=1 --nocapture 2>&1 | tee "$out/$name.log"
        rc=${PIPESTATUS[0]}
        status=$([[ $rc == 0 ]] && echo PASS || echo "FAIL (exit $rc)")
        [[ $rc == 0 ]] || failed=1
        echo "$name: $status in $((SECONDS - start)) s" >> "$summary"
    done
    [[ -s "$summary" ]] || { echo "gpu-check: no test binaries in $dir" | tee "$summary"; exit 1; }
    echo "=== summary"
    cat "$summary"
    exit $failed
    ;;
*)
    echo "usage: scripts/gpu-check.sh build [DIR]   |   bash DIR/gpu-check.sh run [DIR]" >&2
    exit 2
    ;;
esac
