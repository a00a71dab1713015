#!/usr/bin/env bash
# All GPU tests (tests/cuda_*.rs) and a quick benchmark, built here and run on the GPU machine in
# one call.
#
#   scripts/gpu-check.sh build [DIR]   on the build machine: builds the GPU test binaries and the
#                                      lily binary (release) with feature `cuda` and packs them, without
#                                      symbols, into DIR/bins.tar.gz (default DIR: carry/, git-ignored;
#                                      ≈ 20 MB, where the binaries themselves are ≈ 57 MB and a call
#                                      carries at most 64 MiB with the working tree), with a copy of
#                                      this script.
#   bash DIR/gpu-check.sh run [DIR]    on the GPU machine, from the repo root: runs every test
#                                      binary in DIR, then `lily bench` and `lily bench --serve` on
#                                      the full-size synthetic Q4 model; writes summary.txt, logs.tar
#                                      and the bench files (with profile.md: the time per op, timeline.md: the
#                                      decode step kernel by kernel in its graph; the plots
#                                      go into logs.tar) under $OUT (or ./gpu-out); exits
#                                      non-zero if a test failed.
#
# Set GPU_CHECK_CONTEXTS (comma-separated) to change the benchmark's contexts, or to "none" to skip
# it; GPU_CHECK_QUANTS (comma-separated, default q4) to sweep other weight formats too (q8: what GGUF
# K-quants and FP8 checkpoints run as); GPU_CHECK_SERVE=none skips the `lily bench --serve` run
# (GPU_CHECK_SERVE_ARGS replaces its stream settings); GPU_CHECK_AGREE=1 adds the full-size
# `lily agree` check (GPU greedy vs the CPU reference, minutes of CPU time; GPU_CHECK_AGREE=4,8,16:
# the full-width model cut to those depths); GPU_CHECK_AB="VAR=VALUE ..."
# reruns the q4 sweep at 4K and 32K with each setting (default: the settings under trial on, one at a
# time, and LILY_EARLY_READS=0; none to skip); GPU_CHECK_TRIALS
# (default: the same settings under trial) reruns cuda_forward under each setting;
# GPU_CHECK_NCU=1 adds Nsight Compute counters of the prefill's heavy kernels and of the decode
# step's (ncu-prefill.txt, ncu-decode.txt in logs.tar, with the other quants' and the A/B runs'
# tables: at most 8 files come back from a call; GPU_CHECK_NCU_KINDS=decode: only the decode step's);
# GPU_CHECK_NCU_SOURCE=REGEX adds the per-instruction (SASS) stall samples of the first
# GPU_CHECK_NCU_SOURCE_COUNT (default 1) launches, after GPU_CHECK_NCU_SOURCE_SKIP (default 0),
# whose kernel names match, in a 4K prefill and 4 decode steps (ncu-source.csv in logs.tar);
# GPU_CHECK_NCU_SOURCE_BENCH replaces that bench's `--contexts 4096` (e.g. "--contexts 1024
# --profile --profile-batch 8" for the kernels of 8-row decode passes);
# GPU_CHECK_DRAFTS (default 1,2,3; none to skip) decodes with that many MTP drafts a pass forced
# right at 0.8 against plain decoding (`bench --forced-drafts`, drafts.md) at GPU_CHECK_DRAFTS_CONTEXTS;
# GPU_CHECK_DRAFTS_AB="VAR=VALUE ..." (default LILY_VERIFY_PASS=span; none to skip) reruns that
# table with each setting;
# GPU_CHECK_SERVE_AB="VAR=VALUE ..." reruns `bench --serve` with each setting;
# GPU_CHECK_SERVE_SAMPLED (sampling flags, default "--temperature 0.7 --top-p 0.95"; none to skip)
# reruns it with sampled requests;
# GPU_CHECK_TESTS=none (or a list of binaries) runs no (or only those) test binaries. The GPU tests are every
# tests/cuda_*.rs (cuda_forward, cuda_prefix_cache, ...), found by name. The binaries need only
# libcuda and libcublas on the GPU machine; they find them in its usual folders by themselves
# (src/cuda/mod.rs), so no LD_LIBRARY_PATH is set here.
# GPU_CHECK_SERVE_SYSTEM (default 8192; none to skip) reruns the serve run's conversation opening
# with a system prompt of that many tokens (`bench --serve --system-tokens`);
# GPU_CHECK_SERVE_SYSTEM_AB="VAR=VALUE ..." (default LILY_ATTN_WGMMA_SPLIT=0 LILY_KEEP_BEFORE_LAST=0
# LILY_WGMMA_NARROW_ROWS=0;
# none to skip) reruns that conversation with each setting; GPU_CHECK_SERVE_SYSTEM_ROUNDS (default 3)
# runs it that many times with the default settings and reports each turn's medians.
# GPU_CHECK_SPANS (default 1,2,3,4; none to skip) times passes of that many tokens of one sequence
# (`bench --span-tokens`, spans.md) at the same contexts.
set -uo pipefail

cmd="${1:-}"
dir="${2:-carry}"

case "$cmd" in
build)
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    cd "$root" || exit 1
    mkdir -p "$dir"
    rm -f "$dir"/cuda_* "$dir"/lily "$dir"/bins.tar.gz
    # The dev profile (optimised, see Cargo.toml) shares its build with `cargo test`; cargo prints
    # one JSON line per artifact, and test binaries carry "test": true in their profile.
    cargo test --features cuda --no-run --message-format=json-render-diagnostics \
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
    # lily itself in release: the GPU work is the same kernels either way, but `lily agree`'s CPU
    # reference on the full-size model runs ~2.6× faster than at the dev profile's opt-level 1.
    cargo build --release --features cuda || exit 1
    echo "${CARGO_TARGET_DIR:-target}/release/lily" >> "$dir/.binaries"
    while read -r bin; do
        name="$(basename "$bin")"
        name="${name%-*}"  # drop cargo's hash suffix
        objcopy --strip-all "$bin" "$dir/$name" && echo "copied $name ($(du -h "$dir/$name" | cut -f1))"
    done < "$dir/.binaries"
    rm "$dir/.binaries"
    (cd "$dir" && tar czf bins.tar.gz cuda_* lily && rm cuda_* lily) || exit 1
    echo "packed $dir/bins.tar.gz ($(du -h "$dir/bins.tar.gz" | cut -f1))"
    cp "${BASH_SOURCE[0]}" "$dir/gpu-check.sh"
    ;;
run)
    # Binaries packed by `build` are unpacked next to a copy of this script in a scratch folder
    # (the carried folder may be read-only); loose binaries in DIR are used as they are.
    if [[ -f "$dir/bins.tar.gz" ]]; then
        unpacked="$(mktemp -d)"
        tar xzf "$dir/bins.tar.gz" -C "$unpacked" 2>/dev/null \
            || python3 -m tarfile -e "$dir/bins.tar.gz" "$unpacked" || exit 1
        dir="$unpacked"
    fi
    out="${OUT:-./gpu-out}"
    logs="$(mktemp -d)"
    mkdir -p "$out"
    summary="$out/summary.txt"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$summary"
    failed=0
    # GPU_CHECK_TESTS=none skips the test binaries, the trials and generate (e.g. a second call
    # that only benchmarks); a list (commas or spaces) runs only those binaries, and a name with no
    # binary is a failure, not a silent skip.
    tests="$(echo "${GPU_CHECK_TESTS:-all}" | tr -s ' ' ',' | sed 's/^,//; s/,$//')"
    if [[ "$tests" != all && "$tests" != none ]]; then
        for name in ${tests//,/ }; do
            if [[ ! -x "$dir/$name" ]]; then
                echo "gpu-check: no test binary $name in $dir" >&2
                echo "$name: FAIL (no such test binary)" >> "$summary"
                failed=1
            fi
        done
    fi
    for bin in "$dir"/cuda_*; do
        [[ -f "$bin" && -x "$bin" ]] || continue
        name="$(basename "$bin")"
        [[ "$tests" == all || ",$tests," == *",$name,"* ]] || continue
        echo "=== $name"
        start=$SECONDS
        timeout 300 "$bin" --test-threads=1 --nocapture > "$logs/$name.log" 2>&1
        rc=$?
        grep -E "^test |test result|panicked|error" "$logs/$name.log" | head -40
        status=$([[ $rc == 0 ]] && echo PASS || echo "FAIL (exit $rc)")
        [[ $rc == 0 ]] || failed=1
        echo "$name: $status in $((SECONDS - start)) s" >> "$summary"
    done
    # Settings under trial (off by default until they pass here): the whole model again with each.
    for trial in ${GPU_CHECK_TRIALS-LILY_WGMMA_STAGED_STORES=0 LILY_GDN_OUT_TF32=1 LILY_ATTN_WGMMA=0 LILY_DENSE_CACHE=0 LILY_WGMMA=0 LILY_FUSED_NORMS=1 LILY_L2_AHEAD=1 LILY_ATTN_MIN_CHUNK=256 LILY_FUSED_TOPK=1 LILY_GATHERED_ROWS=0-0 LILY_ROW_CHUNKS_MAX=0 LILY_GDN_SPLIT_ROWS=0 LILY_CUBLAS_FROM_ROWS=512 LILY_X_EARLY=0 LILY_GEMV_SPREAD=0 LILY_NORM_IN=0}; do
        [[ -x "$dir/cuda_forward" && "$tests" != none && "$trial" != none ]] || break
        echo "=== cuda_forward ($trial)"
        start=$SECONDS
        env "$trial" timeout 300 "$dir/cuda_forward" --test-threads=1 --nocapture > "$logs/cuda_forward-$trial.log" 2>&1
        rc=$?
        grep -E "^test |test result|panicked" "$logs/cuda_forward-$trial.log" | head -20
        [[ $rc == 0 ]] || failed=1
        echo "cuda_forward with $trial: $([[ $rc == 0 ]] && echo PASS || echo "FAIL (exit $rc)") in $((SECONDS - start)) s" >> "$summary"
    done
    if [[ -x "$dir/lily" && "$tests" != none ]]; then
        # The command line end to end on the GPU: a 4-layer model with the real head shapes,
        # greedy `lily generate` on the GPU against the same on the CPU.
        echo "=== generate (cuda vs cpu)"
        model="$(mktemp -d)"
        python3 - "$model/config.json" <<'PY'
import json, sys
layers = ["linear_attention"] * 3 + ["full_attention"]
text = dict(model_type="qwen3_5_moe_text", hidden_size=512, num_hidden_layers=4, layer_types=layers,
            vocab_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=8,
            moe_intermediate_size=256, shared_expert_intermediate_size=256, rms_norm_eps=1e-6,
            max_position_embeddings=4096, eos_token_id=0, mtp_num_hidden_layers=1,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))
json.dump(dict(model_type="qwen3_5_moe", text_config=text), open(sys.argv[1], "w"))
PY
        "$dir/lily" synth --config "$model/config.json" --out "$model" > "$logs/generate.log" 2>&1
        ids=$(seq -s, 1 97 | tr -d '\n')
        gpu=$("$dir/lily" generate --model "$model" --prompt-ids "$ids" --max-tokens 24 --device cuda 2>>"$logs/generate.log")
        cpu=$("$dir/lily" generate --model "$model" --prompt-ids "$ids" --max-tokens 24 --device cpu 2>>"$logs/generate.log")
        echo "cuda: $gpu"; echo "cpu:  $cpu"
        echo "generate cuda vs cpu: $([[ -n "$gpu" && "$gpu" == "$cpu" ]] && echo "identical" || echo "differ (see logs; near-ties possible)")" >> "$summary"
        # The same with 3 MTP drafts a pass (its random head: the drafts are checked, rarely kept):
        # on the CPU exactly plain decoding's output, on the GPU up to near-ties.
        gpu_d=$("$dir/lily" generate --model "$model" --prompt-ids "$ids" --max-tokens 24 --device cuda --draft-tokens 3 2>>"$logs/generate.log")
        cpu_d=$("$dir/lily" generate --model "$model" --prompt-ids "$ids" --max-tokens 24 --device cpu --draft-tokens 3 2>>"$logs/generate.log")
        echo "cuda, 3 drafts: $gpu_d"; echo "cpu, 3 drafts:  $cpu_d"
        echo "generate with drafts: cpu $([[ -n "$cpu_d" && "$cpu_d" == "$cpu" ]] && echo "identical to plain" || echo "DIFFERS from plain (a bug)"), cuda $([[ -n "$gpu_d" && "$gpu_d" == "$gpu" ]] && echo "identical to plain" || echo "differs from plain (see logs; near-ties possible)")" >> "$summary"
        rm -rf "$model"
    fi
    if [[ -n "${GPU_CHECK_AGREE:-}" && -x "$dir/lily" ]]; then
        # The full-size Q4 model, written to disk so that the CPU can load it too: 256 greedy
        # tokens after a 4K prompt on the GPU, the CPU teacher-forced on them (src/agree/).
        # About 20 GB of disk and ~7 minutes in all. GPU_CHECK_AGREE=4,8,16 instead runs the
        # full-width model cut to each depth (64 tokens after the 4K prompt, a minute or two
        # each): how the distance from the CPU grows with depth (agree-<layers>.md).
        # GPU_CHECK_AGREE_STAGE=device|reference|finish splits one depth's comparison over three
        # back-to-back calls (a warm machine keeps /tmp): the model and the device's run, then
        # the f32 reference, then the bf16 pass and the report (GPU_CHECK_AGREE_ARGS must hold
        # the same options each time, e.g. "--device-routing --bf16-bound").
        stage="${GPU_CHECK_AGREE_STAGE:-}"
        keep=/tmp/lily-agree
        for layers in $([[ "$GPU_CHECK_AGREE" == 1 ]] && echo 40 || echo "${GPU_CHECK_AGREE//,/ }"); do
            echo "=== agree ($layers layers, cuda vs cpu${stage:+, stage $stage})"
            tokens=$([[ $layers == 40 ]] && echo 256 || echo 64)
            split=()
            case "$stage" in
            "") full="$(mktemp -d)" ;;
            device) full="$keep/model-$layers"; mkdir -p "$full"; split=(--save-run "$keep/run-$layers") ;;
            reference) full="$keep/model-$layers"; split=(--load-run "$keep/run-$layers" --save-reference "$keep/ref-$layers") ;;
            finish) full="$keep/model-$layers"; split=(--load-run "$keep/run-$layers" --load-reference "$keep/ref-$layers") ;;
            *) echo "GPU_CHECK_AGREE_STAGE=$stage: expected device, reference or finish" | tee -a "$summary"; failed=1; break ;;
            esac
            if [[ -z "$stage" || "$stage" == device ]]; then
                "$dir/lily" synth --config qwen3.6-35b-a3b --layers "$layers" --quant q4 --out "$full" > "$logs/agree-$layers.log" 2>&1
            fi
            # ${GPU_CHECK_AGREE_ARGS} (e.g. --reference-router-bf16) is passed on to `lily agree`.
            # shellcheck disable=SC2086
            timeout 540 "$dir/lily" agree --model "$full" --device cuda --prompt-tokens 4096 --tokens "$tokens" \
                ${GPU_CHECK_AGREE_ARGS:-} "${split[@]}" --out "$out/agree-$layers.md" >> "$logs/agree-$layers.log" 2>&1
            rc=$?
            grep -v '^- position' "$logs/agree-$layers.log" | tail -3
            echo "agree ($layers layers${stage:+, stage $stage}): $([[ $rc == 0 ]] && echo PASS || echo "FAIL (exit $rc)")" >> "$summary"
            [[ $rc == 0 ]] || failed=1
            [[ -n "$stage" && "$stage" != finish ]] || rm -rf "$full"
        done
    fi
    contexts="${GPU_CHECK_CONTEXTS:-256,1024,4096,16384,32768}"
    GPU_CHECK_QUANTS="${GPU_CHECK_QUANTS:-q4}"
    if [[ "$contexts" != none && -x "$dir/lily" ]]; then
        # GPU_CHECK_QUANTS (default q4): the weight formats to sweep; q4 writes to $OUT, the others
        # to <quant>/ in logs.tar.
        for quant in ${GPU_CHECK_QUANTS//,/ }; do
            echo "=== bench ($quant)"
            dest="$out"
            profile=(--profile)  # q4 only: where each op's time goes (profile.md)
            [[ "$quant" == q4 ]] || { dest="$logs/$quant"; profile=(); }
            timeout 400 "$dir/lily" bench --synthetic qwen3.6-35b-a3b --quant "$quant" --device cuda \
                --contexts "$contexts" --decode-steps 64 --rounds 2 "${profile[@]}" --out "$dest" > "$logs/bench-$quant.log" 2>&1
            rc=$?
            tail -15 "$logs/bench-$quant.log"
            echo "bench $quant: $([[ $rc == 0 ]] && echo done || echo "FAIL (exit $rc)")" >> "$summary"
        done
        # Where a decode step's time goes in its CUDA graph, kernel by kernel (timeline.md), from
        # the decode kernels' timeline builds: a run of its own, so the sweep above has the plain ones.
        echo "=== bench --timeline"
        timeout 200 "$dir/lily" bench --synthetic qwen3.6-35b-a3b --quant q4 --device cuda --timeline \
            --contexts "${GPU_CHECK_TIMELINE_CONTEXTS:-4096,32768}" --decode-steps 64 --out "$out" > "$logs/bench-timeline.log" 2>&1
        rc=$?
        grep "^### context" "$logs/bench-timeline.log" | cut -c1-100
        echo "bench --timeline: $([[ $rc == 0 ]] && echo done || echo "FAIL (exit $rc)")" >> "$summary"
        # Decode with the MTP head's drafts, forced right at 0.8 (drafts.md): the head and verify
        # passes as drafting runs them, against plain decoding (GPU_CHECK_DRAFTS=none skips it).
        if [[ "${GPU_CHECK_DRAFTS:-1,2,3}" != none ]]; then
            echo "=== bench --forced-drafts"
            timeout 200 "$dir/lily" bench --synthetic qwen3.6-35b-a3b --quant q4 --device cuda \
                --contexts "${GPU_CHECK_DRAFTS_CONTEXTS:-4096,32768}" --decode-steps 64 \
                --forced-drafts "${GPU_CHECK_DRAFTS:-1,2,3}" --forced-acceptance 0.8 --out "$out" > "$logs/bench-drafts.log" 2>&1
            rc=$?
            grep "^| [0-9]" "$logs/bench-drafts.log"
            echo "bench --forced-drafts: $([[ $rc == 0 ]] && echo done || echo "FAIL (exit $rc)")" >> "$summary"
            # GPU_CHECK_DRAFTS_AB="VAR=VALUE ..." (default: the verify pass as v1.81 ran it; none
            # to skip): the same table with each setting, into drafts-<setting>/ in logs.tar.
            for ab in ${GPU_CHECK_DRAFTS_AB-LILY_VERIFY_PASS=span}; do
                [[ "$ab" != none ]] || break
                echo "=== bench --forced-drafts ($ab)"
                env "$ab" timeout 200 "$dir/lily" bench --synthetic qwen3.6-35b-a3b --quant q4 --device cuda \
                    --contexts "${GPU_CHECK_DRAFTS_CONTEXTS:-4096,32768}" --decode-steps 64 \
                    --forced-drafts "${GPU_CHECK_DRAFTS:-1,2,3}" --forced-acceptance 0.8 \
                    --out "$logs/drafts-${ab//=/-}" > "$logs/bench-drafts-${ab//=/-}.log" 2>&1
                rc=$?
                grep "^| [0-9]" "$logs/bench-drafts-${ab//=/-}.log"
                echo "bench --forced-drafts with $ab: $([[ $rc == 0 ]] && echo done || echo "FAIL (exit $rc)")" >> "$summary"
            done
        fi
        # Passes of k tokens of one sequence (a verify pass's shape) against one token's, as
        # the prompt path runs them (spans.md; GPU_CHECK_SPANS=none skips it).
        if [[ "${GPU_CHECK_SPANS:-1,2,3,4}" != none ]]; then
            echo "=== bench --span-tokens"
            timeout 150 "$dir/lily" bench --synthetic qwen3.6-35b-a3b --quant q4 --device cuda \
                --contexts "${GPU_CHECK_DRAFTS_CONTEXTS:-4096,32768}" --decode-steps 32 \
                --span-tokens "${GPU_CHECK_SPANS:-1,2,3,4}" --out "$out" > "$logs/bench-spans.log" 2>&1
            rc=$?
            grep "^| [0-9]" "$logs/bench-spans.log"
            echo "bench --span-tokens: $([[ $rc == 0 ]] && echo done || echo "FAIL (exit $rc)")" >> "$summary"
        fi
    fi
    # A/B: the q4 sweep again at 4K and 32K (GPU_CHECK_AB_CONTEXTS) with one setting changed, once
    # per setting in GPU_CHECK_AB (default: each setting under trial on, the early reads off), into
    # $OUT/ab-<setting>; GPU_CHECK_AB=none skips it.
    for ab in ${GPU_CHECK_AB-LILY_MOE_PERSISTENT=1 LILY_WGMMA_STAGED_STORES=0 LILY_GDN_OUT_TF32=1 LILY_ATTN_WGMMA=0 LILY_DENSE_CACHE=0 LILY_GEMV_WARPS_PER_SM=8 LILY_L2_AHEAD=1 LILY_WGMMA=0 LILY_FUSED_NORMS=1 LILY_EARLY_READS=0 LILY_ATTN_MIN_CHUNK=256 LILY_FUSED_TOPK=1 LILY_X_EARLY=0 LILY_GEMV_SPREAD=0 LILY_GEMV_DOWN_PER_SM=1 LILY_NORM_IN=0}; do
        [[ "$ab" != none && "$contexts" != none && -x "$dir/lily" ]] || break
        echo "=== bench (q4, $ab)"
        env "$ab" timeout 200 "$dir/lily" bench --synthetic qwen3.6-35b-a3b --quant q4 --device cuda \
            --contexts "${GPU_CHECK_AB_CONTEXTS:-4096,32768}" --decode-steps 64 --rounds 2 --out "$logs/ab-${ab//=/-}" > "$logs/bench-ab-${ab//=/-}.log" 2>&1
        rc=$?
        tail -6 "$logs/bench-ab-${ab//=/-}.log"
        echo "bench q4 with $ab: $([[ $rc == 0 ]] && echo done || echo "FAIL (exit $rc)")" >> "$summary"
    done
    if [[ "${GPU_CHECK_NCU:-}" == 1 && -x "$dir/lily" ]]; then
        # Hardware counters of one 4K-token prefill's heavy kernels (its first layers: the experts'
        # grouped GEMMs, GDN's three chunked kernels, flash attention; ncu-prefill.txt) and of the
        # decode step's kernels after it (each GEMV, GDN step, attention split and combine, norm,
        # top-k; ncu-decode.txt). Each kernel runs alone under ncu: its time without the neighbours
        # that PDL would overlap. Sections print their details too (the warp stall reasons).
        ncu_bin="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
        for what in ${GPU_CHECK_NCU_KINDS:-prefill decode}; do
            echo "=== ncu ($what kernels, 4K)"
            if [[ -z "$ncu_bin" ]]; then echo "ncu: not found" >> "$summary"; break; fi
            if [[ $what == prefill ]]; then
                kernels='gemm_swiglu_q4|gemm_q4|wgmma_|gdn_prefill|attn_prefill' count=24
            else
                kernels='gemv_q4|gemv_q8|gemv_bf16|gdn_decode|attn_decode|attn_combine|attn_prepare|router_topk|residual_rmsnorm'
                count=48
            fi
            timeout 200 "$ncu_bin" --clock-control none --print-details all --kernel-name regex:"$kernels" \
                --launch-skip "$([[ $what == prefill ]] && echo 0 || echo 300)" --launch-count $count \
                --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
                --section SchedulerStats --section InstructionStats --section SourceCounters \
                "$dir/lily" bench --synthetic qwen3.6-35b-a3b --quant q4 --device cuda --contexts 4096 \
                --decode-steps 4 --rounds 1 > "$logs/ncu-$what.txt" 2>&1
            echo "ncu $what: exit $? ($(grep -c 'Section: GPU Speed Of Light' "$logs/ncu-$what.txt") kernels)" >> "$summary"
        done
    fi
    if [[ -n "${GPU_CHECK_NCU_SOURCE:-}" && -x "$dir/lily" ]]; then
        # Where each kernel's warps wait, instruction by instruction: the source page of the
        # SourceCounters section (sampled stall reasons per SASS line), as CSV.
        echo "=== ncu source ($GPU_CHECK_NCU_SOURCE, bench ${GPU_CHECK_NCU_SOURCE_BENCH:---contexts 4096})"
        ncu_bin="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
        if [[ -z "$ncu_bin" ]]; then
            echo "ncu: not found" >> "$summary"
        else
            # shellcheck disable=SC2086
            timeout 300 "$ncu_bin" --clock-control none --kernel-name regex:"$GPU_CHECK_NCU_SOURCE" \
                --launch-skip "${GPU_CHECK_NCU_SOURCE_SKIP:-0}" \
                --launch-count "${GPU_CHECK_NCU_SOURCE_COUNT:-1}" --section SourceCounters --section WarpStateStats \
                --page source --print-source sass --csv \
                "$dir/lily" bench --synthetic qwen3.6-35b-a3b --quant q4 --device cuda \
                ${GPU_CHECK_NCU_SOURCE_BENCH:---contexts 4096} \
                --decode-steps 4 --rounds 1 > "$logs/ncu-source.csv" 2>&1
            echo "ncu source: exit $? ($(wc -l < "$logs/ncu-source.csv") lines)" >> "$summary"
        fi
    fi
    if [[ "${GPU_CHECK_SERVE:-1}" != none && -x "$dir/lily" ]]; then
        # The engine under load (issue 10's settings): 64 streams of 1K-token prompts and 128
        # output tokens, decode steps batched; a 10-turn conversation growing to 32K tokens with
        # and without the prefix cache; decode speed per stream among 8 (serve.md).
        # GPU_CHECK_SERVE_ARGS replaces the stream settings.
        echo "=== bench --serve"
        # The log keeps one line per batch (steps, tokens, µs in the backend).
        # shellcheck disable=SC2086
        RUST_LOG=info,lily::engine::scheduler=debug timeout 400 "$dir/lily" bench --serve --synthetic qwen3.6-35b-a3b --quant q4 --device cuda \
            ${GPU_CHECK_SERVE_ARGS:---batch-steps --streams 64 --prompt-tokens 1024 --output-tokens 128} \
            --out "$out" > "$logs/bench-serve.log" 2>&1
        rc=$?
        tail -30 "$logs/bench-serve.log"
        echo "bench --serve: $([[ $rc == 0 ]] && echo done || echo "FAIL (exit $rc)")" >> "$summary"
        # The same with sampled requests (GPU_CHECK_SERVE_SAMPLED: the sampling flags, default
        # temperature 0.7 and top-p 0.95; none to skip): what a chat UI's requests cost beside
        # greedy ones (serve-sampled/ in logs.tar; its two key numbers in summary.txt).
        if [[ "${GPU_CHECK_SERVE_SAMPLED:-}" != none ]]; then
            echo "=== bench --serve (sampled)"
            # shellcheck disable=SC2086
            timeout 400 "$dir/lily" bench --serve --synthetic qwen3.6-35b-a3b --quant q4 --device cuda \
                ${GPU_CHECK_SERVE_ARGS:---batch-steps --streams 64 --prompt-tokens 1024 --output-tokens 128} \
                ${GPU_CHECK_SERVE_SAMPLED:---temperature 0.7 --top-p 0.95} \
                --out "$logs/serve-sampled" > "$logs/bench-serve-sampled.log" 2>&1
            rc=$?
            tail -12 "$logs/bench-serve-sampled.log"
            key="$(python3 - "$logs/serve-sampled/serve.md" <<'PY' 2>/dev/null
import sys
tables, rows = [], None
for line in open(sys.argv[1]):
    if line.startswith("|---"):
        rows = []
        tables.append(rows)
    elif line.startswith("|") and rows is not None:
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    elif not line.startswith("|"):
        rows = None
print(f"total {tables[0][0][3]} tok/s, per stream among 8 {tables[2][0][2]} tok/s while all decode")
PY
)"
            echo "bench --serve sampled: $([[ $rc == 0 ]] && echo "done ($key)" || echo "FAIL (exit $rc)")" >> "$summary"
        fi
        # The conversation again, opening with a system prompt of GPU_CHECK_SERVE_SYSTEM tokens
        # (default 8192: an agent's instructions and tool schemas; none to skip) and its turns
        # sharing the rest of the 32K (serve-system/ in logs.tar; the 10th turn in summary.txt).
        # GPU_CHECK_SERVE_SYSTEM_AB reruns it with each setting (serve-system-<setting>/).
        if [[ "${GPU_CHECK_SERVE_SYSTEM:-8192}" != none ]]; then
            ab_list="${GPU_CHECK_SERVE_SYSTEM_AB-LILY_ATTN_WGMMA_SPLIT=0 LILY_KEEP_BEFORE_LAST=0 LILY_WGMMA_NARROW_ROWS=0}"
            [[ "$ab_list" == none ]] && ab_list=""
            for ab in "" $ab_list; do
                name="serve-system${ab:+-${ab//=/-}}"
                echo "=== bench --serve (system prompt of ${GPU_CHECK_SERVE_SYSTEM:-8192} tokens${ab:+, $ab})"
                # The default settings' times are medians of GPU_CHECK_SERVE_SYSTEM_ROUNDS runs
                # (default 3); each A/B setting runs once.
                rounds=1
                [[ -z "$ab" ]] && rounds="${GPU_CHECK_SERVE_SYSTEM_ROUNDS:-3}"
                env ${ab:+"$ab"} timeout 300 "$dir/lily" bench --serve --synthetic qwen3.6-35b-a3b --quant q4 --device cuda \
                    --streams 1 --decode-streams 1 --system-tokens "${GPU_CHECK_SERVE_SYSTEM:-8192}" \
                    --conversation-rounds "$rounds" --out "$logs/$name" > "$logs/bench-$name.log" 2>&1
                rc=$?
                last="$(grep '^turn 10:' "$logs/bench-$name.log" | head -1)"
                echo "$last"
                echo "bench --serve with a system prompt${ab:+ ($ab)}: $([[ $rc == 0 ]] && echo "done (${last:-no 10th turn})" || echo "FAIL (exit $rc)")" >> "$summary"
            done
        fi
        # GPU_CHECK_SERVE_AB="VAR=VALUE ...": the same again with each setting, into serve-<setting>/
        # in logs.tar.
        for ab in ${GPU_CHECK_SERVE_AB:-}; do
            echo "=== bench --serve ($ab)"
            # shellcheck disable=SC2086
            env "$ab" timeout 300 "$dir/lily" bench --serve --synthetic qwen3.6-35b-a3b --quant q4 --device cuda \
                ${GPU_CHECK_SERVE_ARGS:---batch-steps --streams 64 --prompt-tokens 1024 --output-tokens 128} \
                --out "$logs/serve-${ab//=/-}" > "$logs/bench-serve-${ab//=/-}.log" 2>&1
            rc=$?
            tail -12 "$logs/bench-serve-${ab//=/-}.log"
            echo "bench --serve with $ab: $([[ $rc == 0 ]] && echo done || echo "FAIL (exit $rc)")" >> "$summary"
        done
    fi
    # At most 8 files come back from a device call: the plots (made from bench.csv) travel in
    # logs.tar, so that summary.txt, timeline.md and the tables always come back.
    mv "$out"/*.png "$logs"/ 2>/dev/null
    tar cf "$out/logs.tar" -C "$logs" .
    echo "=== summary"
    cat "$summary"
    exit $failed
    ;;
*)
    echo "usage: scripts/gpu-check.sh build [DIR]   |   bash DIR/gpu-check.sh run [DIR]" >&2
    exit 2
    ;;
esac
