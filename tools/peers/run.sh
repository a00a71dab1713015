#!/usr/bin/env bash
# Runs one peer's context sweep on the GPU machine (tools/peers/README.md gives the call sequence).
#
#   tools/peers/run.sh PEER OUTDIR [TIME_CAP_S]
#   PEER: transformers | transformers-nofla | mlx | llama
#   tools/peers/run.sh setup          only the set-up below
#   tools/peers/run.sh ready PEER     whether PEER can run in this call (after setup): exit 0 yes, 3 yes
#                                     but it first waits for the llama.cpp build, 1 no (it says why)
#
# Every PEER first runs `setup`, which is idempotent and keeps its state in /tmp/peers (it lives as
# long as the machine stays warm between back-to-back calls):
#   - copies whichever mlx-cuda-13 wheel parts this call carried (.peers/mlx-cuda-{1,2}) to /tmp/peers;
#   - installs fla into /tmp/peers/site-fla, and mlx + mlx-cuda-13 + mlx-lm into /tmp/peers/site-mlx once
#     both parts are there (sha256 checked);
#   - unpacks llama.cpp and starts, in the background (setsid: it outlives the call), its CUDA build
#     (llama-bench only, sm_90a, nice 19) and then the full-size GGUF (make_gguf.py).
# OUTDIR gets results.csv, meta.json and log.txt (llama also build.txt).
# PEERS_CONTEXTS (e.g. "65536,131072") limits the sweep to those contexts (collect.py merges runs).
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/peers/versions.sh
peer=${1:?usage: run.sh PEER OUTDIR [TIME_CAP_S]}
out=${2:-}
cap=${3:-480}
state=${PEERS_STATE:-/tmp/peers}
carry=.peers/carry
mkdir -p "$state/parts"
export PYTHONUNBUFFERED=1

log() { echo "[peers $(date +%T)] $*"; }

setup() {
    if [ -d "$carry" ]; then  # keep what later calls need: they may carry less
        mkdir -p "$state/whl" && cp -n "$carry"/whl/*.whl "$state/whl/"
        cp -n "$carry/mlx-cuda.sha256" "$carry/tokenizer.json.gz" "$state/" 2>/dev/null
        if [ ! -d "$state/llama.cpp" ]; then
            tar xzf "$carry/llama.cpp.tar.gz" -C "$state"
            setsid nohup nice -n 19 bash tools/peers/run.sh llama-build > "$state/llama-build.log" 2>&1 < /dev/null &
            log "llama.cpp build and GGUF started in the background (log: $state/llama-build.log)"
        fi
    fi
    for part in .peers/mlx-cuda-1/part1 .peers/mlx-cuda-2/part2; do
        [ -f "$part" ] && cp -n "$part" "$state/parts/"
    done
    if [ ! -d "$state/site-fla" ] && [ -d "$state/whl" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$state/site-fla" \
            "$state"/whl/fla_core-*.whl "$state"/whl/flash_linear_attention-*.whl && log "fla installed"
    fi
    if [ ! -d "$state/site-mlx" ] && [ -f "$state/parts/part1" ] && [ -f "$state/parts/part2" ]; then
        local whl=$state/$(awk '{print $2}' "$state/mlx-cuda.sha256")
        cat "$state/parts/part1" "$state/parts/part2" > "$whl"
        (cd "$state" && sha256sum -c mlx-cuda.sha256) || { log "mlx-cuda wheel checksum failed"; return 1; }
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$state/site-mlx" \
            "$whl" "$state"/whl/mlx-*.whl "$state"/whl/mlx_lm-*.whl && log "mlx installed"
        # libmlx.so looks for the CUDA libraries (cuBLAS, cuDNN, NVRTC, cuFFT, cuSOLVER, NCCL) at
        # $ORIGIN/../../nvidia/*/lib, i.e. beside itself in site-packages: point that at torch's copies.
        ln -sfn "$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')" "$state/site-mlx/nvidia"
    fi
}

ready() {  # the inputs each peer needs, as set-up leaves them (scripts/bench-all.sh asks before each peer)
    case "$1" in
        transformers) [ -d "$state/site-fla" ] || { log "fla is not installed: carry .peers/carry"; return 1; } ;;
        transformers-nofla) ;;
        mlx) [ -d "$state/site-mlx" ] ||
            { log "mlx is not installed: carry .peers/mlx-cuda-1 and then .peers/mlx-cuda-2 in back-to-back calls"; return 1; } ;;
        llama)
            [ -d "$state/llama.cpp" ] || { log "no llama.cpp source in $state: carry .peers/carry (a fresh machine lost it)"; return 1; }
            if grep -q "FAILED" "$state/llama-build.log" 2>/dev/null; then
                tail -30 "$state/llama-build.log"; return 1
            fi
            [ -f "$state/model.gguf" ] || { log "the llama.cpp build or the GGUF is still running"; return 3; } ;;
        *) echo "unknown peer '$1': transformers | transformers-nofla | mlx | llama" >&2; return 2 ;;
    esac
}

llama_build() {  # background job started by setup: build, then the GGUF
    local t0=$SECONDS
    cmake -S "$state/llama.cpp" -B "$state/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT="$LLAMA_CPP_COMMIT" &&
    ninja -C "$state/build" -j "$(nproc)" llama-bench || { echo "BUILD FAILED"; return 1; }
    echo "llama-bench built in $((SECONDS - t0)) s" | tee "$state/build-time.txt"
    t0=$SECONDS
    python3 tools/peers/make_gguf.py --gguf-py "$state/llama.cpp/gguf-py" --tokenizer "$state/tokenizer.json.gz" \
        --out "$state/model.gguf.partial" && mv "$state/model.gguf.partial" "$state/model.gguf" &&
    echo "GGUF written in $((SECONDS - t0)) s" | tee -a "$state/build-time.txt"
}

case "$peer" in
    llama-build) llama_build; exit ;;
    setup) setup; exit ;;
    ready) ready "$out"; exit ;;
esac
[ -n "$out" ] || { echo "usage: run.sh PEER OUTDIR [TIME_CAP_S]" >&2; exit 2; }
mkdir -p "$out"
start=$SECONDS
setup 2>&1 | tee "$out/log.txt"
left() { echo $((cap - (SECONDS - start))); }
contexts=(${PEERS_CONTEXTS:+--contexts "$PEERS_CONTEXTS"})

case "$peer" in
    transformers)
        PYTHONPATH=$state/site-fla python3 tools/peers/bench_transformers.py --out "$out" --time-cap "$(left)" "${contexts[@]}" ;;
    transformers-nofla)
        python3 tools/peers/bench_transformers.py --no-fla --out "$out" --time-cap "$(left)" "${contexts[@]}" ;;
    mlx)
        ready mlx || exit 1
        # NVRTC (MLX's JIT kernels) needs the CUDA headers; the library path is a fallback to the RPATH link.
        nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
        export CUDA_PATH=${CUDA_PATH:-${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}}
        export LD_LIBRARY_PATH=$(ls -d "$state"/site-mlx/nvidia/*/lib | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        log "CUDA_PATH=$CUDA_PATH"
        PYTHONPATH=$state/site-mlx python3 tools/peers/bench_mlx.py --out "$out" --time-cap "$(left)" "${contexts[@]}" ;;
    llama)
        log "waiting for the llama.cpp build and the GGUF"
        while ready llama > /dev/null; rc=$?; [ $rc = 3 ] && [ "$(left)" -gt 0 ]; do sleep 5; done
        if [ $rc != 0 ]; then
            ready llama; [ $rc = 3 ] && tail -30 "$state/llama-build.log"; exit 1
        fi
        cp "$state/build-time.txt" "$out/build.txt"
        python3 tools/peers/bench_llama.py --llama-bench "$state/build/bin/llama-bench" --model "$state/model.gguf" \
            --out "$out" --time-cap "$(left)" "${contexts[@]}" ${LLAMA_BENCH_EXTRA:+--extra "$LLAMA_BENCH_EXTRA"} ;;
    *) echo "unknown peer '$peer': transformers | transformers-nofla | mlx | llama | setup" >&2; exit 2 ;;
esac 2>&1 | tee -a "$out/log.txt"
