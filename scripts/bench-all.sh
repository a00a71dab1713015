#!/usr/bin/env bash
# lily and its peers (transformers, llama.cpp, MLX-LM) on the same GPU, one after the other, over the
# fewest device calls, and the generated section of bench/RESULTS.md (tools/peers/README.md gives the
# calls).
#
#   scripts/bench-all.sh build [DIR]      here: lily (release, feature cuda, no symbols) and build.json
#                                         (commit, compilers) into DIR (default carry-bench/, ignored);
#                                         then checks that every call's carry fits and prints the calls.
#                                         Needs .peers/ from tools/peers/prepare.sh.
#   bash scripts/bench-all.sh run [ARGS]  the GPU machine, from the repo root, in every call: runs
#                                         tools/peers/bench_all.py (lily's sweep, then each peer whose
#                                         inputs are there, within the call's time budget; ARGS: --help
#                                         there); writes $OUT/bench-all.tar and $OUT/summary.txt.
#   scripts/bench-all.sh collect TAR...   here: unpacks the calls' bench-all.tar files (oldest first)
#                                         into bench/runs/DATE-COMMIT/ (without logs and lily's own
#                                         charts), then writes the generated section of
#                                         bench/RESULTS.md and bench/peers.png (matplotlib, pinned in
#                                         tools/peers/requirements-plot.txt, in target/plot-venv).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
LIMIT=$((64 << 20))  # what one device call carries: the working tree and the carried paths

bytes() {  # total size of the files under the given paths
    find "$@" -type f -printf '%s\n' 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'
}

nvcc_version() {  # the nvcc that build.rs takes, looked for in its order
    local nvcc="${NVCC:-}"
    [[ -z "$nvcc" && -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]] && nvcc="$CUDA_HOME/bin/nvcc"
    [[ -z "$nvcc" ]] && nvcc="$(ls .venv-cuda/lib/*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -1)"
    [[ -z "$nvcc" ]] && nvcc="$(command -v nvcc)"
    [[ -n "$nvcc" ]] && "$nvcc" --version | grep -o 'V[0-9][0-9.]*' | tr -d V || echo unknown
}

case "${1:-}" in
build)
    dir="${2:-carry-bench}"
    cargo build --release --features cuda --bin lily || exit 1
    mkdir -p "$dir"
    objcopy --strip-all "${CARGO_TARGET_DIR:-target}/release/lily" "$dir/lily" || exit 1
    dirty=$(git status --porcelain --untracked-files=no | grep -q . && echo "-dirty")
    python3 - "$dir/build.json" "$(git rev-parse --short=7 HEAD)$dirty" "$(rustc -V | cut -d' ' -f2-)" "$(nvcc_version)" <<'PY'
import json, sys, time
path, commit, rustc, nvcc = sys.argv[1:]
json.dump({"commit": commit, "built": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rustc": rustc,
           "nvcc": nvcc, "profile": "release"}, open(path, "w"), indent=2)
PY
    echo "lily: $(du -h "$dir/lily" | cut -f1), $dir/build.json: $(tr -d '\n' < "$dir/build.json" | tr -s ' ')"
    # What travels in every call: tracked files and untracked ones git does not ignore.
    tree=$(git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
    over=0
    n=0
    for carry in "$dir .peers/carry" ".peers/mlx-cuda-1" ".peers/mlx-cuda-2"; do
        n=$((n + 1))
        for p in $carry; do [[ -e "$p" ]] || { echo "missing: $p (tools/peers/prepare.sh makes .peers/)"; over=1; }; done
        # shellcheck disable=SC2086  # the carry list splits on spaces
        total=$((tree + $(bytes $carry)))
        list=$(printf '"%s", ' $carry)
        echo "call $n: carry [${list%, }]: $(awk "BEGIN { printf \"%.1f\", $total / 1048576 }") MiB of 64"
        ((total <= LIMIT)) || { echo "  over the 64 MiB a call carries"; over=1; }
    done
    cmd="bash scripts/bench-all.sh run$([[ "$dir" == carry-bench ]] || echo " --lily $dir/lily")"
    echo "each call: command '$cmd', timeout_s 600, back to back (tools/peers/README.md)"
    exit $over
    ;;
run)
    shift
    export PYTHONUNBUFFERED=1
    exec python3 tools/peers/bench_all.py "$@"
    ;;
collect)
    shift
    (($# > 0)) || { echo "usage: scripts/bench-all.sh collect TAR... (the calls' bench-all.tar, oldest first)" >&2; exit 2; }
    # One series (DATE-COMMIT/) or several: each series' folder is replaced by its archives, and
    # collect.py takes each job from the first series that ran it.
    names=()
    for tar in "$@"; do
        top=$(tar tf "$tar" | sed -n 1p | cut -d/ -f1) || exit 1  # sed reads to the end: no SIGPIPE under pipefail
        [[ -n "$top" ]] || { echo "$tar: empty archive" >&2; exit 1; }
        if [[ " ${names[*]} " != *" $top "* ]]; then
            names+=("$top")
            rm -rf "bench/runs/$top"
        fi
        tar xf "$tar" -C bench/runs --exclude=log.txt --exclude='*.log' --exclude='*.png' || exit 1
    done
    venv="${LILY_PLOT_VENV:-target/plot-venv}"
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv" || exit 1
    "$venv/bin/pip" install -q -r tools/peers/requirements-plot.txt || exit 1
    "$venv/bin/python" tools/peers/collect.py "${names[@]/#/bench/runs/}" --write bench/RESULTS.md --png bench/peers.png
    ;;
*)
    echo "usage: scripts/bench-all.sh build [DIR] | bash scripts/bench-all.sh run [ARGS] | scripts/bench-all.sh collect TAR..." >&2
    exit 2
    ;;
esac
