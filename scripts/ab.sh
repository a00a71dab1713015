#!/usr/bin/env bash
# Same-call A/B of lily builds (or settings) on the GPU machine: each variant's `lily bench`, in
# alternating runs so that drift between leases and clocks falls on all of them alike.
#
#   scripts/ab.sh build DIR NAME=REF ...   here: builds `lily` (release, feature cuda) at each git
#                                          ref and packs it as DIR/lily-NAME.gz (≈ 7 MB each; a
#                                          call carries at most 64 MiB with the working tree). The
#                                          tree must be clean; the checkout returns to where it was.
#   bash DIR/ab.sh run DIR [SPEC ...]     there, from the repo root: SPEC is NAME (a packed build)
#                                          or NAME:VAR=VALUE (that build with a setting; several
#                                          joined by +: NAME:A=1+B=2); default:
#                                          every packed build as it is. Writes $OUT/ab.md (the
#                                          table: each variant's mean of the runs' medians) and
#                                          $OUT/ab.tar (every run's bench files and log).
#
# AB_CONTEXTS (default 4096,32768), AB_QUANT (q4), AB_RUNS (alternating runs, 2), AB_ROUNDS (rounds
# per run, whose median the bench reports, 3), AB_STEPS (decode steps, 32) and AB_PAUSE_MS (idle ms
# between each round's prefill and its decode, default 200: a change that moves prefill moves the
# clocks of the decode measured after it, bench/NOTES.md v1.70–v1.71; 0: no pause, as for builds
# older than the flag, 4ef5892) set the runs.
# AB_MODE=serve runs `lily bench --serve` instead (gpu-check's settings, or AB_SERVE_ARGS): the
# table then has the 64-stream total tok/s, the per-stream decode among 8 and the last turn's
# cached time to first token.
set -uo pipefail

cmd="${1:-}"
dir="${2:-carry-ab}"

case "$cmd" in
build)
    shift 2
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    cd "$root" || exit 1
    [[ -z "$(git status --porcelain --untracked-files=no)" ]] || { echo "ab: commit or stash first" >&2; exit 1; }
    start="$(git symbolic-ref --quiet --short HEAD || git rev-parse HEAD)"
    mkdir -p "$dir"
    for spec in "$@"; do
        name="${spec%%=*}" ref="${spec#*=}"
        git checkout --quiet "$ref" || exit 1
        if cargo build --release --features cuda; then
            objcopy --strip-all "${CARGO_TARGET_DIR:-target}/release/lily" "$dir/lily-$name"
            gzip -f "$dir/lily-$name" && echo "packed $dir/lily-$name.gz ($ref at $(git rev-parse --short HEAD))"
        else
            git checkout --quiet "$start"
            exit 1
        fi
    done
    git checkout --quiet "$start"
    cp "${BASH_SOURCE[0]}" "$dir/ab.sh"
    ;;
run)
    shift 2
    bins="$(mktemp -d)" res="$(mktemp -d)" out="${OUT:-./ab-out}"
    mkdir -p "$out"
    for f in "$dir"/lily-*.gz; do
        gunzip -c "$f" > "$bins/$(basename "$f" .gz)" && chmod +x "$bins/$(basename "$f" .gz)"
    done
    specs=("$@")
    if [[ ${#specs[@]} -eq 0 ]]; then
        for f in "$bins"/lily-*; do specs+=("${f##*/lily-}"); done
    fi
    for run in $(seq 1 "${AB_RUNS:-2}"); do
        for spec in "${specs[@]}"; do
            name="${spec%%:*}" setting="X_AB_NONE=1"
            [[ "$spec" == *:* ]] && setting="${spec#*:}"
            IFS='+' read -ra setting <<< "$setting"  # NAME:A=1+B=2: both settings
            tag="${spec//[:=]/-}-$run"
            if [[ "${AB_MODE:-sweep}" == serve ]]; then
                # shellcheck disable=SC2086
                env "${setting[@]}" timeout 300 "$bins/lily-$name" bench --serve --synthetic qwen3.6-35b-a3b --device cuda \
                    --quant "${AB_QUANT:-q4}" ${AB_SERVE_ARGS:---batch-steps --streams 64 --prompt-tokens 1024 --output-tokens 128} \
                    --out "$res/$tag" > "$res/$tag.log" 2>&1
            else
                # shellcheck disable=SC2086
                env "${setting[@]}" timeout 300 "$bins/lily-$name" bench --synthetic qwen3.6-35b-a3b --device cuda \
                    --quant "${AB_QUANT:-q4}" --contexts "${AB_CONTEXTS:-4096,32768}" --rounds "${AB_ROUNDS:-3}" \
                    --decode-steps "${AB_STEPS:-32}" $([[ "${AB_PAUSE_MS:-200}" != 0 ]] && echo "--decode-pause-ms ${AB_PAUSE_MS:-200}") \
                    --out "$res/$tag" > "$res/$tag.log" 2>&1
            fi
            echo "$spec run $run: exit $?"
        done
    done
    # The table: per variant (and context), the mean over runs.
    python3 - "$res" "${AB_RUNS:-2}" "${AB_MODE:-sweep}" "${specs[@]}" > "$out/ab.md" <<'PY'
import csv, os, re, sys
res, runs, mode, specs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
def tag(spec, run):
    return os.path.join(res, f"{spec.replace(':', '-').replace('=', '-')}-{run}")
if mode == "serve":
    # serve.md's tables: the first row of each (streams; conversation turns, the last one; decode).
    print("| variant | 64 streams total tok/s | per stream among 8 tok/s | last turn TTFT cached s | runs |")
    print("|---|---:|---:|---:|---:|")
    for spec in specs:
        vals = []
        for run in range(1, runs + 1):
            path = os.path.join(tag(spec, run), "serve.md")
            if not os.path.exists(path):
                continue
            tables, rows = [], None
            for line in open(path):
                if line.startswith("|---"):
                    rows = []
                    tables.append(rows)
                elif line.startswith("|") and rows is not None:
                    rows.append([c.strip() for c in line.strip().strip("|").split("|")])
                elif not line.startswith("|"):
                    rows = None
            try:
                vals.append((float(tables[0][0][3]), float(tables[2][0][1]), float(tables[1][-1][3])))
            except (IndexError, ValueError):
                continue
        if vals:
            mean = [sum(v[i] for v in vals) / len(vals) for i in range(3)]
            print(f"| {spec} | {mean[0]:,.0f} | {mean[1]:.1f} | {mean[2]:.3f} | {len(vals)} |")
    sys.exit()
print("| variant | context | prefill tok/s | decode tok/s | runs |")
print("|---|---:|---:|---:|---:|")
for spec in specs:
    rows = {}
    for run in range(1, runs + 1):
        path = os.path.join(tag(spec, run), "bench.csv")
        if not os.path.exists(path):
            continue
        for r in csv.DictReader(open(path)):
            rows.setdefault(int(r["context"]), []).append((float(r["prefill_tok_s"]), float(r["decode_tok_s"])))
    for ctx, vals in sorted(rows.items()):
        p = sum(v[0] for v in vals) / len(vals)
        d = sum(v[1] for v in vals) / len(vals)
        print(f"| {spec} | {ctx} | {p:,.0f} | {d:.1f} | {len(vals)} |")
PY
    cat "$out/ab.md"
    tar cf "$out/ab.tar" -C "$res" .
    ;;
*)
    echo "usage: scripts/ab.sh build DIR NAME=REF ...   |   bash DIR/ab.sh run DIR [NAME | NAME:VAR=VALUE ...]" >&2
    exit 2
    ;;
esac
