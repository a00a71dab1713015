# Pinned versions of every peer (sourced by the other scripts; one place to change them).
# llama.cpp: the commit vendored by llama-cpp-python 0.3.36 (its CHANGELOG says so); it has arch qwen35moe.
LLAMA_CPP_PYTHON_VERSION=0.3.36
LLAMA_CPP_COMMIT=0c1e57098
# MLX with its CUDA 13 backend, and mlx-lm (has models/qwen3_5_moe.py).
MLX_VERSION=0.32.4
MLX_LM_VERSION=0.32.2
# flash-linear-attention: pure Python + Triton; transformers' qwen3_5_moe imports it when present.
FLA_VERSION=0.6.0
# Already on the GPU machine (checked at run time, not installed): torch 2.11.0, transformers 5.17.0.
TORCH_VERSION=2.11.0
TRANSFORMERS_VERSION=5.17.0
# The 10-point sweep: batch 1, prompt = context, one prefill then 64 decode steps.
CONTEXTS="256 512 1024 2048 4096 8192 16384 32768 65536 131072"
DECODE_STEPS=64
ROUNDS=2
