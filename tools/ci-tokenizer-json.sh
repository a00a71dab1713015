#!/usr/bin/env bash
# Builds target/tokenizer-fixture/tokenizer.json (about 33 MB, so not committed) from the Qwen3.6
# tiktoken vocabulary with transformers' converter; tests/tokenizer.rs checks it against the
# committed tiktoken fixtures. Needs python3 (3.9+) and network access to PyPI on the first run.
#
# Usage: tools/ci-tokenizer-json.sh   (from anywhere; paths are relative to the repository root)
# Environment: LILY_FIXTURE_VENV  the virtual environment to use or create
#                                 (default: target/tokenizer-fixture-venv)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vocab="$root/../shared/reference/qwen3_6.tiktoken"
out="$root/target/tokenizer-fixture"
venv="${LILY_FIXTURE_VENV:-$root/target/tokenizer-fixture-venv}"

if [[ ! -f "$vocab" ]]; then
    echo "error: $vocab not found (shared/ must sit beside the repository)" >&2
    exit 1
fi
if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$root/tools/requirements-fixtures.txt"
"$venv/bin/python" "$root/tools/make_tokenizer_json.py" --vocab "$vocab" --out "$out"
