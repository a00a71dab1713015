#!/usr/bin/env bash
# Prepares here (network: PyPI) everything the peers need on the GPU machine, in ignored folders:
#   .peers/carry/       carried in the first peers call (~14 MB): llama.cpp source, Qwen3.6 tokenizer.json.gz,
#                       the small wheels (mlx, mlx-lm, fla-core, flash-linear-attention), mlx-cuda-13's sha256
#   .peers/mlx-cuda-1/  the first 38 MiB of the mlx-cuda-13 wheel (first call)
#   .peers/mlx-cuda-2/  the rest, ~48 MiB (second call): the wheel is 90 MB, over one call's 64 MiB
# Usage: tools/peers/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/peers/versions.sh

dl=.peers/dl/whl
mkdir -p "$dl" .peers/carry/whl .peers/mlx-cuda-1 .peers/mlx-cuda-2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dl" \
    "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION" \
    "fla-core==$FLA_VERSION" "flash-linear-attention==$FLA_VERSION"
rm -f .peers/carry/whl/*.whl .peers/mlx-cuda-1/* .peers/mlx-cuda-2/*
cp "$dl/mlx-$MLX_VERSION-"*.whl "$dl/mlx_lm-$MLX_LM_VERSION-"*.whl \
   "$dl/fla_core-$FLA_VERSION-"*.whl "$dl/flash_linear_attention-$FLA_VERSION-"*.whl .peers/carry/whl/

cuda_whl=$(ls "$dl"/mlx_cuda_13-"$MLX_VERSION"-*.whl)
name=$(basename "$cuda_whl")
(cd "$dl" && sha256sum "$name") > .peers/carry/mlx-cuda.sha256
head -c $((38 << 20)) "$cuda_whl" > .peers/mlx-cuda-1/part1
tail -c +$(((38 << 20) + 1)) "$cuda_whl" > .peers/mlx-cuda-2/part2

tools/peers/export_llama.sh
tools/ci-tokenizer-json.sh
gzip -9 -c target/tokenizer-fixture/tokenizer.json > .peers/carry/tokenizer.json.gz
du -sh .peers/carry .peers/mlx-cuda-1 .peers/mlx-cuda-2
