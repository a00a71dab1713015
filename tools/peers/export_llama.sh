#!/usr/bin/env bash
# Packs the llama.cpp source that the GPU machine builds into .peers/carry/llama.cpp.tar.gz.
#
# The whole llama.cpp repository (1.4 GB with history, 176 MB as a source tree) is far over the 64 MiB
# a device call carries, so we take the source from the llama-cpp-python sdist on PyPI (it vendors
# llama.cpp at a fixed commit, named in its CHANGELOG) and keep only what a CUDA or CPU build of
# llama-bench and gguf-py need: no docs, models, tests, examples, web UI, other GPU backends.
# Usage: tools/peers/export_llama.sh            (downloads the sdist into .peers/dl if missing)
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/peers/versions.sh

dl=.peers/dl
mkdir -p "$dl" .peers/carry
sdist="$dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    # Only this package from source; its build dependencies may be wheels (pip prepares its metadata).
    python3 -m pip download --no-deps --no-binary=llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$dl"
fi
src="$dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
[ -d "$src" ] || tar xzf "$sdist" -C "$dl"
grep -q "ggml-org/llama.cpp@$LLAMA_CPP_COMMIT" "$src/CHANGELOG.md" ||
    { echo "the sdist does not vendor llama.cpp@$LLAMA_CPP_COMMIT (see $src/CHANGELOG.md)" >&2; exit 1; }

# Backends other than CPU and CUDA, and trees the build never reads.
excludes=(docs models media tests examples pocs benches ci .devops .github app skills scripts
    tools/ui tools/server ggml/src/ggml-{cann,et,hexagon,hip,metal,musa,opencl,openvino,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn})
args=()
for e in "${excludes[@]}"; do args+=(--exclude="llama.cpp/$e"); done
tar czf .peers/carry/llama.cpp.tar.gz -C "$src/vendor" "${args[@]}" llama.cpp
ls -l .peers/carry/llama.cpp.tar.gz
