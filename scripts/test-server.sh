#!/usr/bin/env bash
# The server against real clients: starts two `lily serve` processes on free loopback ports
# (the built-in demo model, and the test-only scripted backend with an API key), runs the
# Python tests in tests/python against them (the pinned openai and anthropic clients, raw HTTP),
# stops them.
#
# Needs the clients: python3 -m pip install -r tests/python/requirements.txt
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
cargo build --bin lily
LILY="${CARGO_TARGET_DIR:-target}/debug/lily"
LOGS=$(mktemp -d)
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    rm -rf "$LOGS"
}
trap cleanup EXIT

# start NAME ARGS...: runs `lily serve --port 0 ARGS` and waits until it is ready; sets URL.
start() {
    local name=$1
    shift
    "$LILY" serve --port 0 "$@" >"$LOGS/$name.log" 2>&1 &
    PIDS+=($!)
    local addr=""
    for _ in $(seq 1 600); do
        addr=$(sed -n 's/.*listening on http:\/\/\([0-9.:]*\);.*/\1/p' "$LOGS/$name.log" | head -n 1)
        if [[ -n "$addr" ]] && "$PYTHON" -c "import urllib.request,sys; urllib.request.urlopen('http://$addr/health', timeout=1)" 2>/dev/null; then
            URL="http://$addr"
            return 0
        fi
        sleep 0.1
    done
    echo "lily serve ($name) did not become ready:" >&2
    cat "$LOGS/$name.log" >&2
    exit 1
}

start demo
export LILY_DEMO_URL=$URL
start scripted --scripted-tokens tests/python/script.json --api-key test-key --max-body-bytes 65536
export LILY_SCRIPTED_URL=$URL LILY_SCRIPTED_KEY=test-key

status=0
"$PYTHON" -m pytest -q tests/python "$@" || status=$?
if [[ $status -ne 0 ]]; then
    for log in "$LOGS"/*.log; do
        echo "== $log" >&2
        tail -n 50 "$log" >&2
    done
fi
exit $status
