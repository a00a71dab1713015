#!/usr/bin/env bash
# Everything that runs without a GPU: the CPU test suite, the CUDA kernels' compilation (a kernel
# that does not compile fails here, and so does a GPU test that does not build), and the checks
# against the real mlx / mlx-lm and gguf-py packages, and the server against real clients. GPU tests run on the H200 through scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== tokenizer.json of the real vocabulary (transformers' converter, pinned)"
tools/ci-tokenizer-json.sh

echo "== CPU tests"
cargo test

echo "== CUDA kernels and GPU tests build (nvcc 13.0 from pinned wheels)"
scripts/setup-cuda.sh
cargo build --features cuda --tests --bins

echo "== the CUDA backend's host-side unit tests (launch plans; no GPU needed)"
cargo test --features cuda --lib cuda::

echo "== lily vs mlx / mlx-lm (bit-identical quantisation, logits)"
venv="${LILY_MLX_VENV:-target/mlx-venv}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/pip" install -q -r tools/requirements-mlx.txt
"$venv/bin/python" tools/check_mlx.py

echo "== lily vs gguf-py (GGUF dequantisation bit for bit)"
venv="${LILY_GGUF_VENV:-target/gguf-venv}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/pip" install -q -r tools/requirements-gguf.txt
"$venv/bin/python" tools/check_gguf.py

echo "== the FP8 products' index math, lane by lane (tools/emulate_gemm_fp8.py, numpy from the same venv)"
"$venv/bin/python" tools/emulate_gemm_fp8.py

echo "== peer benchmark scripts: time cap, outputs, collect (stdlib only)"
python3 tools/peers/test_peers.py

echo "== lily serve against the pinned openai client and raw HTTP"
venv="${LILY_CLIENT_VENV:-target/client-venv}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/pip" install -q -r tests/python/requirements.txt
PATH="$PWD/$venv/bin:$PATH" scripts/test-server.sh
