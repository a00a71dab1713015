#!/usr/bin/env bash
# All tests that run without a GPU, and the CUDA kernels' compilation (a kernel that does not
# compile fails here). GPU tests run on the H200 through scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== tokenizer.json of the real vocabulary (transformers' converter, pinned)"
tools/ci-tokenizer-json.sh

echo "== CPU tests"
cargo test
