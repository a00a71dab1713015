#!/usr/bin/env bash
# Installs the CUDA 13.0 compiler (nvcc) from pinned PyPI wheels into .venv-cuda in the repo root,
# then prints the nvcc path. build.rs finds nvcc there by itself; export NVCC to point elsewhere.
#
# Every companion wheel is pinned: `pip install nvidia-cuda-nvcc==13.0.88` alone pulls unpinned
# runtime/crt/nvvm wheels (13.5.x), whose cicc/crt do not match the 13.0 nvcc, and PTX from a newer
# nvcc cannot be JIT-compiled by the GPU machine's 13.0 driver (spec/TOOLCHAIN.md §3.1, §8).
#
# Idempotent: when the pinned versions are already installed it only prints the path.
# Set WITH_NVRTC=1 to also install the NVRTC wheel (for run-time compilation checks), WITH_SASS=1
# the disassembler (nvdisasm, for tools/sass_stats.py; 13.2.51 is the oldest on PyPI, and reads
# the 13.0 compiler's sm_90a code).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-cuda"
PYTHON="${PYTHON:-python3}"

PINS=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
)
if [[ "${WITH_NVRTC:-0}" == 1 ]]; then
    PINS+=(nvidia-cuda-nvrtc==13.0.88)
fi
if [[ "${WITH_SASS:-0}" == 1 ]]; then
    PINS+=(nvidia-cuda-nvdisasm==13.2.51)
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi

# `pip freeze` is fast (no network); install only if some pin is missing or at another version.
installed="$("$VENV/bin/python" -m pip freeze 2>/dev/null || true)"
missing=0
for pin in "${PINS[@]}"; do
    grep -qixF "$pin" <<<"$installed" || missing=1
done
if [[ "$missing" == 1 ]]; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}"
fi

# The wheels put the toolkit under site-packages/nvidia/cu13 (bin/nvcc, include/, lib/).
NVCC="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13/bin/nvcc"
if [[ ! -x "$NVCC" ]]; then
    echo "setup-cuda: nvcc not found at $NVCC after install" >&2
    exit 1
fi
"$NVCC" --version | grep -q "release 13.0" || { echo "setup-cuda: $NVCC is not CUDA 13.0" >&2; exit 1; }
echo "$NVCC"
